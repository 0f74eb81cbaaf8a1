"""The residency analysis: what each stay of a tensor on the device was, from which node to which.

A *residency* is one stay of a tensor in a device region: from its `alloc` node to
its `free` node (or to the end of the plan). `analyze(mg)` finds every one, once, and
says for each

* how its data arrived (`arrival`): "computed" (an apply wrote it), "recomputed" (a
  recompute wrote it: an apply that computed its task again), "reloaded" (a
  reload copied it from host storage, possibly a box of it), "input" (a program input
  put on the device), "received" (a `recv` copied it from another device), or
  "unwritten" (nothing wrote it);
* how it left (`departure`): "offloaded" (an offload copied it to the host, then it
  was freed), "dropped" (freed with no copy out although it is reloaded later: a host
  copy already existed, e.g. a weight), "discarded" (freed with no copy out, and
  recomputed later instead of reloaded), "freed" (freed after its last use, never
  needed again on the device), or "resident" (still on the device at the end);

and the bytes allocated after every node (`live_bytes`), from which the peak. A kernel's
workspace (an apply's `workspace` region) is no residency: it is held while its apply
runs, so it counts in that apply's live bytes only, and is listed in `workspaces`. The
plan's statistics (`MemGraph.stats`), the plots (`memgraph.plots`) and the
verifier's budget check read it from here: drops are detected in this one place.

The analysis trusts the pairing of allocs and frees only as far as it goes: a free
that does not release an open residency of its tensor releases nothing, so on a plan
that `memgraph.verify` rejects the numbers are those of the nodes it accepted.

>>> import einpage as ep
>>> from memgraph import MemGraphBuilder, Region
>>> prog = ep.Program("tiny")
>>> w = prog.input("w", (64,), role="weight")
>>> prog.output(ep.exp(w), "y")
>>> b = MemGraphBuilder(prog.build(), budget=512)
>>> host = b.input("w", 0, storage=0)
>>> a = b.alloc(0, Region(0, 256))
>>> r = b.reload(0, 0, Region(0, 256), deps=[a, host])
>>> a2 = b.alloc(1, Region(256, 256))
>>> y = b.apply(1, [Region(0, 256)], Region(256, 256), deps=[a2, r])
>>> f = b.free(0, Region(0, 256), deps=[y])
>>> _ = b.output("y", 1, region=Region(256, 256), deps=[y])
>>> found = analyze(b.build())
>>> [(s.tensor, s.arrival, s.departure) for s in found.stays], found.peak_bytes
([(0, 'reloaded', 'freed'), (1, 'computed', 'resident')], 512)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from memgraph.nodes import MemNode, NodeKind, Region
from taskgraph.facts import is_kv_page
from taskgraph.nodes import Input

if TYPE_CHECKING:
    from memgraph.graph import MemGraph

__all__ = [
    "Residency",
    "Residencies",
    "Workspace",
    "analyze",
    "residencies",
    "ARRIVALS",
    "DEPARTURES",
]

ARRIVALS = ("computed", "recomputed", "reloaded", "input", "received", "unwritten")
"""How a residency's data got onto the device (see the module docstring)."""

DEPARTURES = ("freed", "dropped", "discarded", "offloaded", "resident")
"""How a residency ended (see the module docstring)."""

_ARRIVAL_OF = {
    NodeKind.APPLY: "computed",
    NodeKind.RELOAD: "reloaded",
    NodeKind.INPUT: "input",
    NodeKind.RECV: "received",
}
_SOURCE_OF = {
    "computed": "apply",
    "recomputed": "recompute",
    "reloaded": "reload",
    "input": "input",
    "received": "recv",
    "unwritten": "none",
}


@dataclass(frozen=True, slots=True)
class Residency:
    """One stay of task `tensor` in device `region`, from node `alloc` to node `free`
    (None: still resident at the end). `writer` is the node that put its data there
    (None if nothing did), `offloads` the offloads that copied it out during the stay,
    `readers` the applies and device outputs that read it; `role` is the tensor's role
    in the program: "weight", "kv" (a KV-cache page: its fact `taskgraph.facts.KVPage`),
    "activation" or "output"."""

    tensor: int
    region: Region
    alloc: int
    free: int | None
    arrival: str
    departure: str
    role: str
    writer: int | None = None
    offloads: tuple[int, ...] = ()
    readers: tuple[int, ...] = ()

    @property
    def dropped(self) -> bool:
        """Freed with no copy out although needed again (a host copy already existed)."""
        return self.departure == "dropped"

    @property
    def offload(self) -> int | None:
        """The last offload of the stay, if any."""
        return self.offloads[-1] if self.offloads else None

    @property
    def source(self) -> str:
        """The writer's kind: "apply", "recompute", "reload", "input" or "none" (as
        `memgraph.plots` had it)."""
        return _SOURCE_OF[self.arrival]

    @property
    def kind(self) -> str:
        """The tensor's role (`role`), the name `memgraph.plots` colours residencies by."""
        return self.role


@dataclass(frozen=True, slots=True)
class Workspace:
    """The workspace `region` of apply node `apply` (of task `tensor`): held while that
    apply runs, and only then."""

    apply: int
    tensor: int
    region: Region


@dataclass(frozen=True, eq=False)
class Residencies:
    """Every residency of a plan, in order of their allocs, the bytes allocated after
    each node (`live_bytes[i]`, after node i; at an apply with a workspace, during it:
    the workspace included), and the kernels' workspaces, in order."""

    stays: tuple[Residency, ...]
    live_bytes: tuple[int, ...]
    workspaces: tuple[Workspace, ...] = ()

    @property
    def peak_bytes(self) -> int:
        """The most bytes allocated at once."""
        return max(self.live_bytes, default=0)

    @property
    def high_water(self) -> int:
        """The highest arena offset any residency or workspace reaches."""
        ends = [s.region.end for s in self.stays] + [w.region.end for w in self.workspaces]
        return max(ends, default=0)

    def dropped(self) -> list[Residency]:
        """The residencies that ended in a drop."""
        return [s for s in self.stays if s.departure == "dropped"]

    def __len__(self) -> int:
        return len(self.stays)

    def __repr__(self) -> str:
        return f"<Residencies {len(self.stays)} peak={self.peak_bytes}>"


@dataclass
class _Open:
    """A residency being replayed."""

    alloc: int
    region: Region
    writer: int | None = None
    arrival: str = "unwritten"
    offloads: list[int] = field(default_factory=list)
    readers: list[int] = field(default_factory=list)


def _roles(mg: MemGraph) -> list[str]:
    tg = mg.taskgraph
    outputs = {tg.storage_root(i) for i in tg.output_ids}
    roles = []
    for task in tg:
        if isinstance(task.op, Input) and task.op.role == "weight":
            roles.append("weight")
        elif is_kv_page(task):
            roles.append("kv")
        elif task.id in outputs:
            roles.append("output")
        else:
            roles.append("activation")
    return roles


def analyze(mg: MemGraph) -> Residencies:
    """The residencies of `mg` (see the module docstring); `mg.residencies` caches it."""
    roles = _roles(mg)
    last_reload = {n.tensor: n.id for n in mg.nodes if n.kind is NodeKind.RELOAD}
    last_recompute = {n.tensor: n.id for n in mg.nodes if n.recompute}
    open_: dict[int, _Open] = {}
    done: list[Residency] = []
    live: list[int] = []
    workspaces: list[Workspace] = []
    level = 0

    def close(tensor: int, stay: _Open, free: int | None) -> Residency:
        if free is None:
            departure = "resident"
        elif stay.offloads:
            departure = "offloaded"
        elif last_reload.get(tensor, -1) > free:
            departure = "dropped"
        elif last_recompute.get(tensor, -1) > free:
            departure = "discarded"
        else:
            departure = "freed"
        return Residency(
            tensor,
            stay.region,
            stay.alloc,
            free,
            stay.arrival,
            departure,
            roles[tensor],
            stay.writer,
            tuple(stay.offloads),
            tuple(stay.readers),
        )

    for node in mg.nodes:
        kind = node.kind
        if not 0 <= (node.tensor if node.tensor is not None else -1) < len(roles):
            live.append(level)  # a node naming no task (the verifier rejects it)
            continue
        if kind is NodeKind.ALLOC and node.region is not None:
            open_[node.tensor] = _Open(node.id, node.region)
            level += node.region.size
        elif kind is NodeKind.FREE:
            stay = open_.get(node.tensor)
            if stay is not None and stay.region == node.region:
                del open_[node.tensor]
                done.append(close(node.tensor, stay, node.id))
                level -= node.region.size
        elif kind is NodeKind.APPLY:
            _note_reads(mg, node, open_)
        if kind is NodeKind.APPLY and node.workspace is not None:  # held during the apply
            workspaces.append(Workspace(node.id, node.tensor, node.workspace))
            live.append(level + node.workspace.size)
        else:
            live.append(level)
        stay = open_.get(node.tensor)
        if stay is None or node.region is None or node.region != stay.region:
            continue
        if kind in _ARRIVAL_OF:
            stay.writer = node.id
            stay.arrival = "recomputed" if node.recompute else _ARRIVAL_OF[kind]
        elif kind is NodeKind.OFFLOAD:
            stay.offloads.append(node.id)
        elif kind in (NodeKind.OUTPUT, NodeKind.SEND):
            stay.readers.append(node.id)
    done.extend(close(tensor, stay, None) for tensor, stay in open_.items())
    done.sort(key=lambda s: s.alloc)
    return Residencies(tuple(done), tuple(live), tuple(workspaces))


def _note_reads(mg: MemGraph, node: MemNode, open_: dict[int, _Open]) -> None:
    """Record an apply as a reader of the residencies its operands are read from."""
    tg = mg.taskgraph
    task = tg[node.tensor] if node.tensor is not None and 0 <= node.tensor < len(tg) else None
    if task is None:
        return
    for operand, region in zip(task.inputs, node.reads, strict=False):
        stay = open_.get(tg.storage_root(operand))
        if stay is not None and stay.region == region and node.id not in stay.readers:
            stay.readers.append(node.id)


def residencies(mg: MemGraph) -> list[Residency]:
    """Every residency of `mg`, in order of their allocs (one per alloc node)."""
    return list(mg.residencies.stays)
