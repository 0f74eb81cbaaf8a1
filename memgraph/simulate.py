"""The simulator: how long a MemGraph takes on three streams, from a cost model.

The model
---------
A plan runs on three in-order streams, like CUDA streams:

* `compute` runs the `apply` nodes (a task takes `CostModel.task_seconds`),
* `h2d` (host to device) runs the `reload` nodes and the `input` nodes that put an
  input on the device (a copy of the tensor's bytes at the h2d bandwidth),
* `d2h` (device to host) runs the `offload` nodes;

and a plan with a host tier (`MemGraph.tier`) two more, the lanes of its disk
(`memgraph.trace.DISK_STREAMS`):

* `disk_read` runs the `read` nodes (a host storage from disk into its host slot),
* `disk_write` runs the `write` nodes (a host storage from its slot to the spill file),

each taking the storage's bytes at the disk's read or write bandwidth
(`CostModel.disk_seconds`; a cost model that states no disk is taken over
`memgraph.cost.DEFAULT_DISK`, and the result is named so: `h100-pcie5+nvme-pcie4`).
A `release` is bookkeeping, as a `free` is.

Each stream executes its nodes in insertion order: a node starts when its stream has
finished the stream's previous node *and* every node it depends on has finished, and
ends its duration later. The bookkeeping nodes (`alloc`, `free`, `output`, `release`) and the
`input` nodes to host storage (the data is already in host memory) take no time on
no stream: they complete as soon as all their dependencies have. Dependencies are
honoured exactly as listed, nothing else orders the streams, so a plan that forgets a
dependency simulates faster than it could run (the verifier catches that, not this).

Reported: the makespan (when the last node ends); the compute time (the sum of the
apply times: the makespan with infinitely fast transfers, since one compute stream
runs every apply); the stall that transfers add (makespan - compute time); each
stream's busy time; the bytes each direction moves (the disk lanes only for a plan
with a tier: a plan without one gives what it gave before tiers existed); and
optionally the timeline as `memgraph.trace.StreamEvent`s (for
`memgraph.plots.stream_timeline` and Chrome traces) with every node's (start, end).
One pass over the nodes: O(nodes + deps).

>>> from memgraph.cost import CostModel
>>> import einpage as ep
>>> from memgraph import MemGraphBuilder, Region
>>> prog = ep.Program("tiny")
>>> w = prog.input("w", (256,), role="weight")       # 1 KiB on the host
>>> prog.output(ep.exp(w), "y")
>>> tg = prog.build()
>>> b = MemGraphBuilder(tg, budget=2048)
>>> host = b.input("w", 0, storage=0)
>>> a = b.alloc(0, Region(0, 1024))
>>> r = b.reload(0, 0, Region(0, 1024), deps=[a, host])
>>> a2 = b.alloc(1, Region(1024, 1024))
>>> y = b.apply(1, [Region(0, 1024)], Region(1024, 1024), deps=[a2, r])
>>> _ = b.output("y", 1, region=Region(1024, 1024), deps=[y])
>>> machine = CostModel("toy", flops_per_s=256.0, device_bytes_per_s=1e30,
...                     h2d_bytes_per_s=512.0, d2h_bytes_per_s=512.0)
>>> result = simulate(b.build(), machine)
>>> result.makespan, result.compute_seconds, result.stall_seconds
(3.0, 1.0, 2.0)
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from einpage_core.errors import EinpageError, GraphError, PlanError, expect_graph
from einpage_core.units import format_bytes
from memgraph.cost import DEFAULT_DISK, CostModel, Disk, get_cost_model
from memgraph.graph import MemGraph
from memgraph.nodes import MemNode, NodeKind
from memgraph.trace import (
    DISK_STREAMS,
    STREAMS,
    StreamEvent,
    node_event,
    to_chrome_trace,
    write_chrome_trace,
)

__all__ = ["SimResult", "simulate", "resolve_cost_model", "NodeDurations", "DEFAULT_COST_MODEL"]

DEFAULT_COST_MODEL = "h100-pcie5"
"""The machine `simulate` assumes when given neither a cost model nor rates."""


@dataclass(frozen=True, eq=False)
class SimResult:
    """What `simulate` found (seconds and bytes).

    `busy` and `bytes_moved` are keyed by stream ("compute", "h2d", "d2h"; no bytes
    on compute; and for a plan with a host tier "disk_read", "disk_write": `lanes`).
    `events` (one per node that occupies a stream, in insertion order, named and
    annotated as the runtime's traces are: `memgraph.trace.node_event`) and `node_times`
    (every node's (start, end), indexed by node id) are present when
    `simulate(..., timeline=True)`, else None. `program` is the name of the plan's
    TaskGraph (for trace titles).
    """

    makespan: float
    compute_seconds: float
    busy: Mapping[str, float]
    bytes_moved: Mapping[str, int]
    cost_model: CostModel
    node_count: int
    events: tuple[StreamEvent, ...] | None = None
    node_times: tuple[tuple[float, float], ...] | None = None
    program: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "busy", MappingProxyType(dict(self.busy)))
        object.__setattr__(self, "bytes_moved", MappingProxyType(dict(self.bytes_moved)))

    @property
    def stall_seconds(self) -> float:
        """Time the transfers add to the pure compute time: makespan - compute time."""
        return self.makespan - self.compute_seconds

    @property
    def compute_utilization(self) -> float:
        """The fraction of the makespan the compute stream is busy (1.0 for an empty plan)."""
        return self.compute_seconds / self.makespan if self.makespan > 0 else 1.0

    @property
    def h2d_bytes(self) -> int:
        return self.bytes_moved["h2d"]

    @property
    def d2h_bytes(self) -> int:
        return self.bytes_moved["d2h"]

    @property
    def lanes(self) -> tuple[str, ...]:
        """The streams simulated: `STREAMS`, then `DISK_STREAMS` for a plan with a tier."""
        return tuple(self.busy)

    @property
    def disk_read_bytes(self) -> int:
        """Bytes read from disk into host memory (0 without a tier)."""
        return self.bytes_moved.get("disk_read", 0)

    @property
    def disk_write_bytes(self) -> int:
        """Bytes written from host memory to disk (0 without a tier)."""
        return self.bytes_moved.get("disk_write", 0)

    @property
    def times(self) -> dict[int, tuple[float, float]]:
        """Node id -> (start, end), the `times=` argument of `memgraph.plots` functions."""
        return dict(enumerate(self._need_timeline("times")[1]))

    def _need_timeline(
        self, what: str
    ) -> tuple[tuple[StreamEvent, ...], tuple[tuple[float, float], ...]]:
        if self.events is None or self.node_times is None:
            raise EinpageError(f"{what} needs the timeline: simulate(..., timeline=True)")
        return self.events, self.node_times

    # -- the timeline elsewhere -----------------------------------------------------

    @property
    def trace_title(self) -> str:
        """The process name of the simulated trace: `einpage mlp (simulated, h100-pcie5)`."""
        name = f"einpage {self.program}" if self.program else "einpage"
        return f"{name} (simulated, {self.cost_model.name})"

    @property
    def trace_metadata(self) -> dict[str, Any]:
        """The trace's `otherData`: the clock ("simulated"), the machine and the totals."""
        return {
            "clock": "simulated",
            "cost_model": self.cost_model.name,
            "makespan_s": self.makespan,
            "busy_s": dict(self.busy),
            "bytes_moved": dict(self.bytes_moved),
        }

    def to_chrome_trace(self) -> dict[str, Any]:
        """The timeline as a Chrome trace (`memgraph.trace.to_chrome_trace`): one process,
        a lane per stream named as the runtime's traces name them (`memgraph.trace.STREAMS`),
        one complete event per node that occupies a stream (microseconds)."""
        events = self._need_timeline("a trace")[0]
        return to_chrome_trace(events, self.trace_title, self.trace_metadata)

    def write_chrome_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write the timeline as Chrome trace JSON (Perfetto, chrome://tracing)."""
        events = self._need_timeline("a trace")[0]
        return write_chrome_trace(events, path, self.trace_title, self.trace_metadata)

    def plot(self, path: str | os.PathLike[str] | None = None, **options: Any) -> Any:
        """The stream lanes (`memgraph.plots.stream_timeline`), saved to `path` if given."""
        from memgraph.plots import stream_timeline

        return stream_timeline(self._need_timeline("a plot")[0], path, **options)

    # -- printing ---------------------------------------------------------------------

    def rows(self) -> list[tuple[str, str]]:
        """(label, human-readable value) pairs, for tables."""

        def ms(seconds: float) -> str:
            return f"{seconds * 1e3:.3f} ms"

        span = self.makespan or 1.0
        rows = [
            ("cost model", self.cost_model.name),
            ("makespan", ms(self.makespan)),
            ("compute", f"{ms(self.compute_seconds)} ({100 * self.compute_utilization:.1f}%)"),
            ("stall from transfers", ms(self.stall_seconds)),
        ]
        for stream in self.lanes:
            moved = f", {format_bytes(self.bytes_moved[stream])}" if stream != "compute" else ""
            busy = self.busy[stream]
            rows.append((f"{stream} busy", f"{ms(busy)} ({100 * busy / span:.1f}%){moved}"))
        return rows

    def __str__(self) -> str:
        width = max(len(label) for label, _ in self.rows())
        return "\n".join(f"{label:<{width}}  {value}" for label, value in self.rows())

    def __repr__(self) -> str:
        disk = "".join(
            f" {lane.removeprefix('disk_')}={format_bytes(self.bytes_moved[lane])}"
            for lane in DISK_STREAMS
            if lane in self.bytes_moved
        )
        return (
            f"<SimResult {self.cost_model.name} makespan={self.makespan * 1e3:.3f}ms "
            f"compute={self.compute_seconds * 1e3:.3f}ms stall={self.stall_seconds * 1e3:.3f}ms "
            f"h2d={format_bytes(self.h2d_bytes)} d2h={format_bytes(self.d2h_bytes)}{disk}>"
        )


def resolve_cost_model(
    cost_model: str | CostModel | None = None,
    *,
    flops_per_s: float | None = None,
    h2d_bytes_per_s: float | None = None,
    d2h_bytes_per_s: float | None = None,
    device_bytes_per_s: float | None = None,
) -> CostModel:
    """The machine meant by a cost model (a `PRESETS` name or a `CostModel`) and/or rates.

    * no rates: `cost_model` (default `DEFAULT_COST_MODEL`);
    * rates and a `cost_model`: that model with the given rates replaced;
    * rates alone: a model with exactly those rates and nothing else – no latencies and
      no device-memory roofline (`device_bytes_per_s` infinite unless given), so a task
      takes FLOPs / `flops_per_s`. `flops_per_s` and `h2d_bytes_per_s` are then
      required; `d2h_bytes_per_s` defaults to `h2d_bytes_per_s` (a symmetric link).

    >>> resolve_cost_model(flops_per_s=1e12, h2d_bytes_per_s=1e9).d2h_bytes_per_s
    1000000000.0
    """
    rates = {
        "flops_per_s": flops_per_s,
        "h2d_bytes_per_s": h2d_bytes_per_s,
        "d2h_bytes_per_s": d2h_bytes_per_s,
        "device_bytes_per_s": device_bytes_per_s,
    }
    given = {name: float(value) for name, value in rates.items() if value is not None}
    if not given:
        return get_cost_model(DEFAULT_COST_MODEL if cost_model is None else cost_model)
    if cost_model is not None:
        base = get_cost_model(cost_model)
        return dataclasses.replace(base, name=f"{base.name} (custom rates)", **given)
    missing = [name for name in ("flops_per_s", "h2d_bytes_per_s") if name not in given]
    if missing:
        raise EinpageError(
            f"explicit rates need {' and '.join(missing)} (d2h_bytes_per_s defaults to "
            f"h2d_bytes_per_s), or a cost_model whose other rates to keep "
            f"(presets: {', '.join(_preset_names())})"
        )
    given.setdefault("d2h_bytes_per_s", given["h2d_bytes_per_s"])
    given.setdefault("device_bytes_per_s", math.inf)
    return CostModel(name="rates", **given)


def _preset_names() -> list[str]:
    from memgraph.cost import PRESETS

    return list(PRESETS)


def simulate(
    mg: MemGraph,
    cost_model: str | CostModel | None = None,
    *,
    timeline: bool = False,
    flops_per_s: float | None = None,
    h2d_bytes_per_s: float | None = None,
    d2h_bytes_per_s: float | None = None,
    device_bytes_per_s: float | None = None,
    disk: str | Disk | None = None,
) -> SimResult:
    """Simulate `mg` on compute / h2d / d2h streams, and its disk's two lanes for a plan
    with a host tier (the model is in the module docstring).

    `cost_model`: a `memgraph.cost.PRESETS` name or a `CostModel` (default
    "h100-pcie5"); explicit rates override it or, alone, define the machine (see
    `resolve_cost_model`). `disk`: the drive below a host tier (a `memgraph.cost.DISKS`
    name or a `Disk`), for a plan with one: default the cost model's own disk rates, else
    `DEFAULT_DISK`. `timeline=True` also records the events and node times.

    Raises `PlanError` for a device's plan with a `send` or `recv` (a direct copy between
    devices takes both devices at once: `memgraph.simulate_multi` of the `MultiPlan`),
    and for a `read` or `write` in a plan without a host tier.
    """
    expect_graph(mg, MemGraph, "memgraph.simulate")
    _refuse_direct_copies(mg)
    model = resolve_cost_model(
        cost_model,
        flops_per_s=flops_per_s,
        h2d_bytes_per_s=h2d_bytes_per_s,
        d2h_bytes_per_s=d2h_bytes_per_s,
        device_bytes_per_s=device_bytes_per_s,
    )
    if mg.tier is not None and (disk is not None or not model.has_disk):
        model = model.with_disk(DEFAULT_DISK if disk is None else disk)
    replay = _Replay(mg, model, timeline)
    for node in mg.nodes:
        replay.step(node)
    return replay.result()


def _refuse_direct_copies(mg: MemGraph) -> None:
    """A `PlanError` naming the first send or receive of `mg`, if it has one, or its first
    read or write from or to disk if it has no host tier."""
    for node in mg.nodes:
        if mg.tier is None and node.kind in (NodeKind.READ, NodeKind.WRITE):
            raise PlanError(
                f"memgraph.simulate: plan {mg.taskgraph.name!r} n{node.id} ({node.describe()}) "
                f"moves data between disk and host memory, but the plan has no host tier "
                f"(MemGraph.tier): memgraph.verify names what is wrong with it"
            )
        if node.kind in (NodeKind.SEND, NodeKind.RECV):
            raise PlanError(
                f"memgraph.simulate: plan {mg.taskgraph.name!r} n{node.id} ({node.describe()}) "
                f"is one end of a direct copy between devices (link {node.link}), which "
                f"starts when the other device's end is ready: simulate the plan with its "
                f"devices, memgraph.simulate_multi(multi_plan)"
            )


class NodeDurations:
    """How long each node of one plan takes on a cost model – the rule `simulate` uses,
    shared with `memgraph.simulate_multi` – as (stream, seconds, bytes copied).

    An apply runs on "compute" for `CostModel.task_seconds` (memoized per task: a
    recomputed task costs what it cost the first time); a copy between host and device
    (`MemNode.copies`) runs on its direction's stream ("h2d" or "d2h") for
    `CostModel.transfer_seconds` of the tensor's bytes; a read or a write (a plan with a
    host tier) runs on "disk_read" or "disk_write" for `CostModel.disk_seconds` of its
    host storage's bytes; any other node (alloc, free, output, release, an input to host
    storage) occupies no stream: (None, 0.0, 0).
    """

    def __init__(self, mg: MemGraph, model: CostModel):
        self.tg = mg.taskgraph
        self.storages = mg.storages
        self.model = model
        self.apply_time: dict[int, float] = {}

    def __call__(self, node: MemNode) -> tuple[str | None, float, int]:
        if node.kind is NodeKind.APPLY:
            seconds = self.apply_time.get(node.tensor)
            if seconds is None:
                seconds = self.apply_time[node.tensor] = self.model.task_seconds(
                    self.tg, node.tensor
                )
            return "compute", seconds, 0
        if node.kind in (NodeKind.READ, NodeKind.WRITE):  # on its disk lane (STREAM_OF)
            nbytes = self.storages[node.storage].nbytes
            return node.stream, self.model.disk_seconds(nbytes, node.kind.value), nbytes
        direction = node.copies
        if direction is None:
            return None, 0.0, 0
        nbytes = self.tg[node.tensor].nbytes
        return direction, self.model.transfer_seconds(nbytes, direction), nbytes


class _Replay:
    """The streams (three, five with a host tier) as `simulate` runs the nodes through
    them, one node at a time."""

    def __init__(self, mg: MemGraph, model: CostModel, timeline: bool):
        self.mg = mg
        self.model = model
        n = len(mg.nodes)
        self.end = [0.0] * n
        self.start = [0.0] * n if timeline else None
        lanes = STREAMS if mg.tier is None else (*STREAMS, *DISK_STREAMS)
        self.free_at = dict.fromkeys(lanes, 0.0)  # when each stream finishes its last node
        self.busy = dict.fromkeys(lanes, 0.0)
        self.moved = dict.fromkeys(lanes, 0)
        self.events: list[StreamEvent] = []
        self.durations = NodeDurations(mg, model)

    def duration(self, node: MemNode) -> tuple[str | None, float]:
        """The stream a node occupies (None: bookkeeping, no time) and for how long
        (`NodeDurations`), counting the bytes a copy moves."""
        stream, seconds, nbytes = self.durations(node)
        if stream is not None and stream != "compute":
            self.moved[stream] += nbytes
        return stream, seconds

    def step(self, node: MemNode) -> None:
        i = node.id
        ready = 0.0
        for d in node.deps:
            if d >= i:
                raise GraphError(f"n{i} ({node.kind}): dependency n{d} is not an earlier node")
            ready = max(ready, self.end[d])
        stream, seconds = self.duration(node)
        if stream is None:  # alloc, free, output, release, input to host: done with the deps
            self.end[i] = ready
            if self.start is not None:
                self.start[i] = ready
            return
        begin = max(ready, self.free_at[stream])
        self.end[i] = self.free_at[stream] = begin + seconds
        self.busy[stream] += seconds
        if self.start is not None:
            self.start[i] = begin
            self.events.append(node_event(self.mg, node, stream, begin, begin + seconds))

    def result(self) -> SimResult:
        start = self.start
        return SimResult(
            makespan=max(self.end, default=0.0),
            compute_seconds=self.busy["compute"],
            busy=self.busy,
            bytes_moved=self.moved,
            cost_model=self.model,
            node_count=len(self.end),
            events=tuple(self.events) if start is not None else None,
            node_times=tuple(zip(start, self.end, strict=True)) if start is not None else None,
            program=self.mg.taskgraph.name,
        )
