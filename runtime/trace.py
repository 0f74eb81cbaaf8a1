"""Timing traces of a run: one event per node on the stream that ran it.

A `Trace` is backend-neutral: the NumPy backend fills it from wall-clock timestamps
taken on its worker threads, the CuPy backend from CUDA events. Its events are
`memgraph.trace.StreamEvent`s – the timeline format the simulator and the plots
share – so `write()` gives the same Chrome trace (open the JSON in
https://ui.perfetto.dev or chrome://tracing: one track per stream).

>>> from memgraph.trace import StreamEvent
>>> t = Trace([StreamEvent("compute", 0.0, 2e-3, "apply %2", 5, "apply"),
...            StreamEvent("h2d", 1e-3, 3e-3, "reload %1", 4, "reload")], clock="wall")
>>> round(t.overlap("compute", "h2d") * 1e3, 3), round(t.busy("h2d") * 1e3, 3)
(1.0, 2.0)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from memgraph import trace as timeline
from memgraph.trace import StreamEvent

__all__ = ["Trace"]


@dataclass
class Trace:
    """The events of one run. `clock` says where times came from: "wall" or "cuda"."""

    events: list[StreamEvent]
    clock: str = "wall"
    title: str = "einpage run"
    metadata: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return (
            f"<Trace {self.title!r} events={len(self.events)} streams={list(self.streams)} "
            f"makespan={self.makespan * 1e3:.3f}ms clock={self.clock}>"
        )

    @property
    def streams(self) -> tuple[str, ...]:
        """Streams that have events, in display order."""
        return tuple(timeline.ordered_lanes(e.stream for e in self.events))

    @property
    def makespan(self) -> float:
        """Seconds from the first event's start to the last event's end."""
        return timeline.makespan(self.events)

    def on(self, stream: str) -> list[StreamEvent]:
        """The events of one stream, by start time."""
        return sorted((e for e in self.events if e.stream == stream), key=lambda e: e.start)

    def busy(self, stream: str) -> float:
        """Seconds during which `stream` was running something."""
        return timeline.busy(self.events, stream)

    def overlap(self, a: str, b: str) -> float:
        """Seconds during which streams `a` and `b` were both running something."""
        return timeline.overlap(self.events, a, b)

    def to_chrome(self) -> dict[str, Any]:
        """The trace as a Chrome trace-event document (a JSON-ready dict)."""
        return timeline.to_chrome_trace(
            self.events, self.title, {"clock": self.clock, **self.metadata}
        )

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_chrome(), indent=indent)

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the Chrome trace JSON to `path`."""
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.to_json())
