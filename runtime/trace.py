"""Timing traces of a run: one span per node on the stream that ran it, as a Chrome trace.

A `Trace` is backend-neutral: the NumPy backend fills it from wall-clock timestamps
taken on its worker threads, the CuPy backend from CUDA events. `to_chrome()` gives
the Chrome trace-event format (open the JSON in https://ui.perfetto.dev or
chrome://tracing): one process, one track (thread) per stream, one complete event
("ph": "X") per node, times in microseconds from the start of the run.

>>> t = Trace([Span("compute", "apply %2", 0.0, 2e-3, 5, "apply"),
...            Span("h2d", "reload %1", 1e-3, 3e-3, 4, "reload")], clock="wall")
>>> round(t.overlap("compute", "h2d") * 1e3, 3), round(t.busy("h2d") * 1e3, 3)
(1.0, 2.0)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Span", "Trace", "STREAM_ORDER"]

STREAM_ORDER = ("compute", "h2d", "d2h")
"""Tracks in display order; streams with other names follow, sorted."""


@dataclass(frozen=True, slots=True)
class Span:
    """One node's execution: on `stream`, from `start` to `end` seconds after the run began."""

    stream: str
    name: str
    start: float
    end: float
    node: int
    kind: str
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


def _merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of `[start, end)` intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


@dataclass
class Trace:
    """The spans of one run. `clock` says where times came from: "wall" or "cuda"."""

    spans: list[Span]
    clock: str = "wall"
    title: str = "einpage run"
    metadata: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return (
            f"<Trace {self.title!r} spans={len(self.spans)} streams={list(self.streams)} "
            f"makespan={self.makespan * 1e3:.3f}ms clock={self.clock}>"
        )

    @property
    def streams(self) -> tuple[str, ...]:
        """Streams that have spans, in display order."""
        present = {s.stream for s in self.spans}
        known = [s for s in STREAM_ORDER if s in present]
        return (*known, *sorted(present - set(STREAM_ORDER)))

    @property
    def makespan(self) -> float:
        """Seconds from the first span's start to the last span's end."""
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)

    def on(self, stream: str) -> list[Span]:
        """The spans of one stream, by start time."""
        return sorted((s for s in self.spans if s.stream == stream), key=lambda s: s.start)

    def busy(self, stream: str) -> float:
        """Seconds during which `stream` was running something."""
        return sum(end - start for start, end in _merged((s.start, s.end) for s in self.on(stream)))

    def overlap(self, a: str, b: str) -> float:
        """Seconds during which streams `a` and `b` were both running something."""
        first = _merged((s.start, s.end) for s in self.on(a))
        second = _merged((s.start, s.end) for s in self.on(b))
        total, i, j = 0.0, 0, 0
        while i < len(first) and j < len(second):
            lo = max(first[i][0], second[j][0])
            hi = min(first[i][1], second[j][1])
            total += max(0.0, hi - lo)
            if first[i][1] < second[j][1]:
                i += 1
            else:
                j += 1
        return total

    # -- Chrome trace-event format -------------------------------------------------

    def to_chrome(self) -> dict[str, Any]:
        """The trace as a Chrome trace-event document (a JSON-ready dict)."""
        pid = 1
        tids = {name: number for number, name in enumerate(self.streams, start=1)}
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": self.title}}
        ]
        for name, tid in tids.items():
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            )
            events.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        origin = min((s.start for s in self.spans), default=0.0)
        for span in sorted(self.spans, key=lambda s: (s.start, s.node)):
            events.append(
                {
                    "name": span.name,
                    "cat": span.kind,
                    "ph": "X",
                    "pid": pid,
                    "tid": tids[span.stream],
                    "ts": round((span.start - origin) * 1e6, 3),
                    "dur": round(max(span.duration, 0.0) * 1e6, 3),
                    "args": {"node": span.node, **span.args},
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"clock": self.clock, **self.metadata},
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_chrome(), indent=indent)

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the Chrome trace JSON to `path`."""
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.to_json())
