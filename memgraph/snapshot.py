"""A plan's device memory as a PyTorch memory snapshot, for https://pytorch.org/memory_viz.

`memory_snapshot(mg)` is the dictionary `torch.cuda.memory._snapshot()` returns, and
`write_memory_snapshot(mg, path)` pickles it as `torch.cuda.memory._dump_snapshot`
does, so the viewers people know read a plan as if it were a recorded run: drop the
file on https://pytorch.org/memory_viz ("Active Memory Timeline": the allocations over
the plan's steps; "Allocator State History": the arena, block by block), or use
`torch.cuda._memory_viz` (`trace_plot`, `segment_plot`, `segsum`, `trace`).

What is in it (torch's schema, plain dicts and lists; torch is not needed to write it):

* `segments`: one segment, the arena (`address` = `base_address`, `total_size` = the
  budget, as the runtime allocates it), with its blocks at the moment the snapshot is
  taken (`at`: the end of the plan, its peak, or after a given node): an
  `active_allocated` block for every tensor resident then (`size` its region,
  `requested_size` its bytes), `inactive` blocks for the gaps; they tile the arena.
* `device_traces`: for device 0, a `segment_alloc` of the arena, then in plan order up
  to that moment an `alloc` per alloc node and a `free_requested` + `free_completed`
  per free node (the address is the arena's base plus the region's offset, the size
  the region's), all on stream 0 (a plan reserves memory in one order, whatever
  stream uses it).
* `frames` of each block and entry: what a stack trace is to a recorded run, the plan's
  reasons: the node (`n12: alloc %7 [...]`, its id as the line) and the task it is for
  (its scope as the file name, its listing line as the function name).

Replaying the trace gives the plan's live bytes after every node: its peak is
`mg.stats.peak_bytes`.

>>> import einpage as ep, memgraph
>>> prog = ep.Program("mlp")
>>> x = prog.input("x", (64, 128))
>>> w = prog.input("w", (128, 128), role="weight")
>>> prog.output(ep.silu(x @ w), "y")
>>> mg = memgraph.plan(prog.build(), "160KiB")
>>> snap = memory_snapshot(mg)
>>> [e["action"] for e in snap["device_traces"][0][:4]]
['segment_alloc', 'alloc', 'alloc', 'alloc']
>>> replay_peak(snap) == mg.stats.peak_bytes, snap["segments"][0]["total_size"] == mg.budget
(True, True)
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

from einpage_core.errors import EinpageError
from memgraph.nodes import MemNode, NodeKind

if TYPE_CHECKING:
    from memgraph.graph import MemGraph

__all__ = [
    "memory_snapshot",
    "write_memory_snapshot",
    "snapshot_moment",
    "replay_peak",
    "BASE_ADDRESS",
]

BASE_ADDRESS = 0x7F0000000000
"""Where the arena is said to start (a typical CUDA device address; offsets are the plan's)."""


def _frames(mg: MemGraph, node: MemNode) -> list[dict[str, Any]]:
    """The "stack" of a node: the node, then the task it is for (innermost first)."""
    task = mg.taskgraph[node.tensor]
    return [
        {"filename": "memgraph", "line": node.id, "name": node.line()},
        {"filename": task.scope or mg.taskgraph.name, "line": task.id, "name": task.line()},
    ]


def snapshot_moment(mg: MemGraph, at: int | str | None = None) -> int:
    """The node after which a snapshot `at` is taken: None or "end" (the last node),
    "peak" (the first node after which the live bytes are the plan's peak), or a node id."""
    last = len(mg.nodes) - 1
    if at is None or at == "end":
        return last
    if at == "peak":
        live = mg.residencies.live_bytes
        return live.index(max(live)) if live else last
    if isinstance(at, int) and not isinstance(at, bool) and 0 <= at <= last:
        return at
    raise EinpageError(f"a snapshot is taken at 'end', 'peak' or a node id 0..{last}, not {at!r}")


def memory_snapshot(
    mg: MemGraph,
    *,
    at: int | str | None = None,
    base_address: int = BASE_ADDRESS,
) -> dict[str, Any]:
    """The snapshot of `mg`'s device memory (see the module docstring), taken after node
    `at` (`snapshot_moment`: the end by default, "peak", or a node id). The viewers
    order events by position, so the trace has no times: it is in plan order."""
    moment = snapshot_moment(mg, at)
    entries: list[dict[str, Any]] = [
        {
            "action": "segment_alloc",
            "addr": base_address,
            "size": mg.budget,
            "stream": 0,
            "frames": [{"filename": "memgraph", "line": 0, "name": f"arena of {mg!r}"}],
        }
    ]
    live: dict[int, MemNode] = {}  # offset -> the alloc holding it at the end
    for node in mg.nodes[: moment + 1]:
        if node.kind is NodeKind.ALLOC:
            actions = ("alloc",)
            live[node.region.offset] = node
        elif node.kind is NodeKind.FREE:
            actions = ("free_requested", "free_completed")
            live.pop(node.region.offset, None)
        else:
            continue
        for action in actions:
            entry = {
                "action": action,
                "addr": base_address + node.region.offset,
                "size": node.region.size,
                "stream": 0,
                "frames": _frames(mg, node),
            }
            entries.append(entry)
    segment = _segment(mg, base_address, sorted(live.values(), key=lambda n: n.region.offset))
    return {"segments": [segment], "device_traces": [entries]}


def _segment(mg: MemGraph, base_address: int, resident: list[MemNode]) -> dict[str, Any]:
    """The arena as one segment whose blocks tile it: the resident allocs, and gaps."""
    blocks: list[dict[str, Any]] = []

    def gap(start: int, end: int) -> None:
        if end > start:
            blocks.append(
                {
                    "address": base_address + start,
                    "size": end - start,
                    "requested_size": 0,
                    "state": "inactive",
                    "frames": [],
                }
            )

    top = 0
    for alloc in resident:
        region = alloc.region
        gap(top, region.offset)
        blocks.append(
            {
                "address": base_address + region.offset,
                "size": region.size,
                "requested_size": mg.taskgraph[alloc.tensor].nbytes,
                "state": "active_allocated",
                "frames": _frames(mg, alloc),
            }
        )
        top = region.end
    gap(top, mg.budget)
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {
        "device": 0,
        "address": base_address,
        "total_size": mg.budget,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(b["requested_size"] for b in blocks),
        "blocks": blocks,
    }


def write_memory_snapshot(
    mg: MemGraph, path: str | os.PathLike[str], *, at: int | str | None = None
) -> Path:
    """Pickle `memory_snapshot(mg, at=at)` to `path` (what
    `torch.cuda.memory._dump_snapshot` writes); open it at https://pytorch.org/memory_viz.
    Returns the path."""
    path = Path(path)
    with open(path, "wb") as handle:
        pickle.dump(memory_snapshot(mg, at=at), handle)
    return path


def replay_peak(snapshot: dict[str, Any], device: int = 0) -> int:
    """The most bytes allocated at once when a snapshot's trace is replayed (allocs add
    their size, completed frees take it back), as the memory viewer draws it."""
    level = peak = 0
    for entry in snapshot["device_traces"][device]:
        if entry["action"] == "alloc":
            level += entry["size"]
            peak = max(peak, level)
        elif entry["action"] == "free_completed":
            level -= entry["size"]
    return peak
