"""Stream events and Chrome traces: the common timeline format of simulator, runtime and plots.

A `StreamEvent` says that a stream (compute, h2d, d2h) was busy from `start` to `end`
seconds with one MemGraph node. The simulator produces them, the runtime records
them, `memgraph.plots.stream_timeline` draws them, and `to_chrome_trace` /
`read_chrome_trace` convert to and from the Chrome trace JSON that Perfetto and
chrome://tracing display (one track per stream).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from einpage.errors import TraceError

__all__ = [
    "StreamEvent",
    "STREAMS",
    "to_chrome_trace",
    "read_chrome_trace",
    "write_chrome_trace",
    "lane_name",
    "ordered_lanes",
]

STREAMS = ("compute", "h2d", "d2h")
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
    busy from `start` to `end` seconds, doing `label` (for MemGraph node `node`)."""

    stream: str
    start: float
    end: float
    label: str = ""
    node: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


def lane_name(name: Any) -> str:
    text = str(name)
    key = "".join(c for c in text.lower() if c.isalnum())
    if key in STREAMS:
        return key
    return _STREAM_ALIASES.get(key, text)


def to_chrome_trace(events: Iterable[StreamEvent], pid: int = 0) -> dict[str, Any]:
    """Events as a Chrome trace (`chrome://tracing`, Perfetto): complete events
    (`"ph": "X"`, `ts`/`dur` in microseconds) on one numbered thread per stream,
    named by a `thread_name` record; `args.node` keeps the MemGraph node id."""
    events = list(events)
    tids = {lane: k for k, lane in enumerate(ordered_lanes(e.stream for e in events), 1)}
    trace: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}}
        for lane, tid in tids.items()
    ]
    for e in events:
        record: dict[str, Any] = {
            "name": e.label or e.stream,
            "ph": "X",
            "ts": e.start * 1e6,
            "dur": (e.end - e.start) * 1e6,
            "pid": pid,
            "tid": tids[e.stream],
        }
        if e.node is not None:
            record["args"] = {"node": e.node}
        trace.append(record)
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


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
        args = r.get("args") or {}
        lane = args.get("stream") or names.get((r.get("pid"), r.get("tid"))) or r.get("tid", "?")
        node = args.get("node")
        events.append(
            StreamEvent(
                stream=lane_name(lane),
                start=ts * 1e-6,
                end=(ts + dur) * 1e-6,
                label=str(r.get("name", "")),
                node=int(node) if isinstance(node, int) else None,
            )
        )
    return events


def ordered_lanes(streams: Iterable[str]) -> list[str]:
    seen = set(streams)
    return [s for s in STREAMS if s in seen] + sorted(seen - set(STREAMS))


def write_chrome_trace(events: Iterable[StreamEvent], path: str | os.PathLike[str]) -> Path:
    """Write `events` as a Chrome trace JSON file; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(events)), encoding="utf-8")
    return path
