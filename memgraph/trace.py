"""Stream events and Chrome traces: the common timeline format of simulator, runtime and plots.

A `StreamEvent` says that a stream (compute, h2d, d2h) was busy from `start` to `end`
seconds with one MemGraph node. The simulator produces them, the runtime records
them, `memgraph.plots.stream_timeline` draws them, and `to_chrome_trace` /
`read_chrome_trace` convert to and from the Chrome trace JSON that Perfetto and
chrome://tracing display (one track per stream).

A plan with a host tier (`MemGraph.tier`) has two more lanes, its disk's reads and
writes (`DISK_STREAMS`), shown after the others.

`STREAMS` is the one definition of the lane names; `node_event` is the one way a
node's event is named and annotated. The simulator (`memgraph.simulate`) and the
runtime (`runtime.Session`, `einpage run --trace`) both use them, so a simulated and a
measured trace of one plan have the same lanes and, node by node, the same event
names: `combine_chrome_traces` puts them in one file, one process each, to compare
side by side in https://ui.perfetto.dev.

A plan for several devices (`memgraph.multi`) has one timeline per device on one clock
(`memgraph.simulate_multi(..., timeline=True)`): `devices_chrome_trace` puts them in one
trace, a process per device, each with its "peer" lane (`PEER_STREAM`) of direct copies,
and an arrow (a flow event) from each link's send to its receive.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from einpage_core.errors import TraceError
from memgraph.nodes import MemNode, NodeKind

if TYPE_CHECKING:
    from memgraph.graph import MemGraph

__all__ = [
    "StreamEvent",
    "STREAMS",
    "DISK_STREAMS",
    "PEER_STREAM",
    "node_event",
    "event_name",
    "to_chrome_trace",
    "devices_chrome_trace",
    "combine_chrome_traces",
    "read_chrome_trace",
    "write_chrome_trace",
    "lane_name",
    "ordered_lanes",
    "busy",
    "overlap",
    "makespan",
]

STREAMS = ("compute", "h2d", "d2h")
"""The lanes of a timeline, in display order: the compute stream (applies), host to device
copies (reloads, inputs placed on the device) and device to host copies (offloads,
outputs copied out). The runtime's streams (`runtime.schedule.STREAMS`) are these."""

PEER_STREAM = "peer"
"""The lane of copies between devices (the sends and receives of a plan for several
devices, `memgraph.multi`): only such plans have it, shown after `STREAMS`."""

DISK_STREAMS = ("disk_read", "disk_write")
"""The lanes of copies between disk and host memory (the reads and writes of a plan with a
host tier, `memgraph.tiers`): only such plans have them, shown after `STREAMS`."""
_STREAM_ALIASES = {
    "htod": "h2d",
    "hosttodevice": "h2d",
    "copyh2d": "h2d",
    "memcpyhtod": "h2d",
    "dtoh": "d2h",
    "devicetohost": "d2h",
    "copyd2h": "d2h",
    "memcpydtoh": "d2h",
    "kernel": "compute",
    "kernels": "compute",
}


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """Work on one stream: `stream` ("compute", "h2d", "d2h", or any other lane name)
    busy from `start` to `end` seconds, doing `label` for MemGraph node `node` of kind
    `kind` ("apply", "reload", ...); `args` are extra JSON-ready details for the trace."""

    stream: str
    start: float
    end: float
    label: str = ""
    node: int | None = None
    kind: str = ""
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


def event_name(mg: MemGraph, node: MemNode) -> str:
    """How a node's event is named in traces: its task's scope, then for an apply the task
    id, its op and label, for a copy the node kind, the task id and the input's name or
    the task's label, and for a direct copy between devices (a send or a receive) the
    link it carries (`link#3`).

    >>> import einpage as ep
    >>> from memgraph import MemGraphBuilder, Region
    >>> prog = ep.Program("tiny")
    >>> w = prog.input("w", (64,), role="weight")
    >>> with prog.scope("layers.0"):
    ...     prog.output(ep.exp(w), "y")
    >>> b = MemGraphBuilder(prog.build(), budget=512)
    >>> host = b.input("w", 0, storage=0)
    >>> r = b.reload(0, 0, Region(0, 256), deps=[b.alloc(0, Region(0, 256)), host])
    >>> y = b.apply(1, [Region(0, 256)], Region(256, 256), deps=[b.alloc(1, Region(256, 256)), r])
    >>> mg = b.build()
    >>> event_name(mg, mg[r]), event_name(mg, mg[y])
    ('reload %0 w', 'layers.0: %1 einsum["A->A", join="exp(a)"]')
    """
    task = mg.taskgraph[node.tensor]
    if node.kind is NodeKind.APPLY:
        what = f"%{task.id} {task.op.describe()}" + (f" {task.label}" if task.label else "")
        what = f"recompute {what}" if node.recompute else what
    else:
        hint = getattr(task.op, "name", "") or task.label
        what = f"{node.kind} %{task.id}" + (f" {hint}" if hint else "")
        if node.link is not None:
            what += f" link#{node.link}"
    return f"{task.scope}: {what}" if task.scope else what


def node_event(mg: MemGraph, node: MemNode, stream: str, start: float, end: float) -> StreamEvent:
    """The event of `node` busy on `stream` from `start` to `end` seconds, as the simulator
    and the runtime both record it: named by `event_name`, its kind as category, and as
    args the task id, the bytes it moves or writes, an apply's FLOPs, the task's scope
    and label, a send's or receive's link (its index in `MultiPlan.links`), and the node
    itself (`MemNode.describe`: regions, host storage, box). A read's or write's bytes
    are its host storage's (what moves between disk and the host arena)."""
    task = mg.taskgraph[node.tensor]
    nbytes = task.nbytes
    if node.kind in (NodeKind.READ, NodeKind.WRITE):  # a whole host storage (an assembly's)
        nbytes = mg.storages[node.storage].nbytes
    args: dict[str, Any] = {"tensor": node.tensor, "bytes": nbytes}
    if node.kind is NodeKind.APPLY:
        args["flops"] = task.flops
    if task.scope:
        args["scope"] = task.scope
    if task.label:
        args["label"] = task.label
    if node.link is not None:
        args["link"] = node.link
    args["step"] = node.describe()
    return StreamEvent(stream, start, end, event_name(mg, node), node.id, node.kind.value, args)


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of `[start, end)` intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def busy(events: Iterable[StreamEvent], stream: str) -> float:
    """Seconds during which `stream` was running something (overlapping events count once)."""
    return sum(
        end - start
        for start, end in _merged((e.start, e.end) for e in events if e.stream == stream)
    )


def overlap(events: Iterable[StreamEvent], a: str, b: str) -> float:
    """Seconds during which streams `a` and `b` were both running something."""
    events = list(events)
    first = _merged((e.start, e.end) for e in events if e.stream == a)
    second = _merged((e.start, e.end) for e in events if e.stream == b)
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        total += max(0.0, min(first[i][1], second[j][1]) - max(first[i][0], second[j][0]))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return total


def makespan(events: Iterable[StreamEvent]) -> float:
    """Seconds from the first event's start to the last event's end (0 when empty)."""
    events = list(events)
    if not events:
        return 0.0
    return max(e.end for e in events) - min(e.start for e in events)


def lane_name(name: Any) -> str:
    """A stream name normalised: `HtoD` -> `h2d`, `DtoH` -> `d2h`, `kernel` -> `compute`."""
    text = str(name)
    key = "".join(c for c in text.lower() if c.isalnum())
    if key in STREAMS:
        return key
    return _STREAM_ALIASES.get(key, text)


def to_chrome_trace(
    events: Iterable[StreamEvent], title: str = "einpage", metadata: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Events as a Chrome trace document (`chrome://tracing`, https://ui.perfetto.dev).

    One process named `title`, one track (thread) per stream in display order, one
    complete event (`"ph": "X"`, `ts`/`dur` in microseconds from the first event's
    start) per StreamEvent; `cat` is the node kind and `args.node` the MemGraph node.
    `metadata` goes to `otherData`.
    """
    events = list(events)
    origin = min((e.start for e in events), default=0.0)
    trace = _process_records(events, 1, title, origin)
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def devices_chrome_trace(
    per_device: Sequence[Iterable[StreamEvent]],
    title: str = "einpage",
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The timelines of a plan's devices (one clock) as one Chrome trace document.

    Device d is process d + 1, named `"{title} device {d}"`, its lanes as
    `to_chrome_trace` makes them (the "peer" lane of its sends and receives among them);
    all devices share one time origin, the first event's start. Each link that a send
    and a receive carry (their events' `args["link"]`, as `node_event` records them) gets
    an arrow from the send to the receive: a flow start (`"ph": "s"`) on the source's
    peer lane and a flow end (`"ph": "f"`) on the target's, with the link's index as id
    (category "link"). `metadata` goes to `otherData`.

    >>> send = StreamEvent("peer", 1e-6, 3e-6, "send %4 link#0", 7, "send", {"link": 0})
    >>> recv = StreamEvent("peer", 1e-6, 3e-6, "recv %0 link#0", 2, "recv", {"link": 0})
    >>> doc = devices_chrome_trace([[send], [recv]], "two")
    >>> [(r["ph"], r["pid"]) for r in doc["traceEvents"] if r.get("cat") == "link"]
    [('s', 1), ('f', 2)]
    """
    timelines = [list(events) for events in per_device]
    origin = min((e.start for events in timelines for e in events), default=0.0)
    trace: list[dict[str, Any]] = []
    ends: dict[int, dict[str, dict[str, Any]]] = {}  # link -> "send"/"recv" -> its record
    for device, events in enumerate(timelines):
        pid = device + 1
        records = _process_records(events, pid, f"{title} device {device}", origin)
        trace.extend(records)
        trace.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
        )
        for record in records:
            link = record.get("args", {}).get("link")
            if record["ph"] == "X" and record.get("cat") in ("send", "recv") and link is not None:
                ends.setdefault(link, {})[record["cat"]] = record
    for link in sorted(ends):
        pair = ends[link]
        if set(pair) != {"send", "recv"}:
            continue  # one end only (a timeline of some of the devices)
        for phase, end in (("s", pair["send"]), ("f", pair["recv"])):
            flow = {
                "name": f"link#{link}",
                "cat": "link",
                "ph": phase,
                "id": link,
                "pid": end["pid"],
                "tid": end["tid"],
                "ts": end["ts"],
            }
            if phase == "f":
                flow["bp"] = "e"  # bound to the receive's slice, which starts then
            trace.append(flow)
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def _process_records(
    events: list[StreamEvent], pid: int, title: str, origin: float
) -> list[dict[str, Any]]:
    """The records of one process of a Chrome trace: its name, a track per stream in
    display order, a complete event per StreamEvent (times from `origin`)."""
    events = sorted(events, key=lambda e: (e.start, -1 if e.node is None else e.node))
    tids = {lane: k for k, lane in enumerate(ordered_lanes(e.stream for e in events), 1)}
    trace: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": title}}
    ]
    for lane, tid in tids.items():
        trace.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}}
        )
        trace.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    for e in events:
        args = dict(e.args)
        if e.node is not None:
            args["node"] = e.node
        record: dict[str, Any] = {
            "name": e.label or e.stream,
            "ph": "X",
            "pid": pid,
            "tid": tids[e.stream],
            "ts": round((e.start - origin) * 1e6, 3),
            "dur": round(max(e.duration, 0.0) * 1e6, 3),
            "args": args,
        }
        if e.kind:
            record["cat"] = e.kind
        trace.append(record)
    return trace


def combine_chrome_traces(*documents: Mapping[str, Any]) -> dict[str, Any]:
    """Chrome trace documents (`to_chrome_trace`'s) in one, each its own process, in order:
    open a simulated and a measured trace of one plan side by side (their lanes have the
    same names, their events the same names node by node). Each keeps its own time origin;
    `otherData` becomes a list of theirs."""
    events: list[dict[str, Any]] = []
    for pid, document in enumerate(documents, 1):
        for record in document.get("traceEvents", []):
            events.append({**record, "pid": pid})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}
        )
    others = [dict(document.get("otherData", {})) for document in documents]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"traces": others}}


def read_chrome_trace(
    trace: str | os.PathLike[str] | Mapping[str, Any] | Sequence[Mapping[str, Any]],
) -> list[StreamEvent]:
    """StreamEvents from a Chrome trace: a JSON file path, or the loaded object
    (`{"traceEvents": [...]}` or a bare list).

    Complete events (`"ph": "X"`) become events; `ts` and `dur` are microseconds. The
    lane is `args.stream` if given, else the thread name a `thread_name` metadata
    record gives the event's `tid`, else the `tid` itself; common names are
    normalised (`HtoD` -> `h2d`, `DtoH` -> `d2h`, `kernel` -> `compute`).
    """
    if isinstance(trace, str | os.PathLike):
        try:
            trace = json.loads(Path(trace).read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise TraceError(f"{trace}: not a JSON trace ({err})") from None
    records = trace.get("traceEvents", []) if isinstance(trace, Mapping) else trace
    if not isinstance(records, Sequence):
        raise TraceError("a Chrome trace must be a list of events or have 'traceEvents'")
    names: dict[tuple[Any, Any], str] = {}
    for r in records:
        if r.get("ph") == "M" and r.get("name") == "thread_name":
            names[(r.get("pid"), r.get("tid"))] = str(r.get("args", {}).get("name", ""))
    events = []
    for k, r in enumerate(records):
        if r.get("ph") != "X":
            continue
        try:
            ts, dur = float(r["ts"]), float(r.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            raise TraceError(
                f"trace event {k}: a complete event needs numeric 'ts' and 'dur'"
            ) from None
        args = dict(r.get("args") or {})
        lane = args.get("stream") or names.get((r.get("pid"), r.get("tid"))) or r.get("tid", "?")
        node = args.pop("node", None)
        events.append(
            StreamEvent(
                stream=lane_name(lane),
                start=ts * 1e-6,
                end=(ts + dur) * 1e-6,
                label=str(r.get("name", "")),
                node=node if isinstance(node, int) and not isinstance(node, bool) else None,
                kind=str(r.get("cat", "")),
                args=args,
            )
        )
    return events


def ordered_lanes(streams: Iterable[str]) -> list[str]:
    """Lane names in display order: compute, h2d, d2h, peer, disk_read, disk_write, then
    others sorted.

    >>> ordered_lanes(["disk_write", "d2h", "disk_read", "compute"])
    ['compute', 'd2h', 'disk_read', 'disk_write']
    """
    seen = set(streams)
    known = (*STREAMS, PEER_STREAM, *DISK_STREAMS)
    return [s for s in known if s in seen] + sorted(seen - set(known))


def write_chrome_trace(
    events: Iterable[StreamEvent],
    path: str | os.PathLike[str],
    title: str = "einpage",
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write `events` as a Chrome trace JSON file; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(events, title, metadata)), encoding="utf-8")
    return path
