"""Progress of long passes: what `einpage.compile(..., progress=callback)` reports.

A pass that walks many items (the planner its steps, the verifier its nodes) takes a
`tick(done, total)` function and calls it about a hundred times at most; a `Progress`
event splits one call (`einpage.compile`) into stages of fixed shares of the whole, so
`fraction` never decreases and ends at exactly 1.0. The CLI draws it as a bar; a
notebook can print it. This module is a leaf: it imports nothing of the project.

>>> events = []
>>> report = ProgressReport(events.append, {"planning": 3.0, "verifying": 1.0})
>>> tick = report.stage("planning", 200)
>>> tick(100, 200)
>>> report.stage("verifying", 1)(1, 1)
>>> report.finish()
>>> [(e.stage, e.done, round(e.fraction, 3)) for e in events]  # doctest: +NORMALIZE_WHITESPACE
[('planning', 0, 0.0), ('planning', 100, 0.375), ('verifying', 0, 0.75),
 ('verifying', 1, 1.0), ('done', 1, 1.0)]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["Progress", "ProgressCallback", "ProgressReport", "Tick", "ticks", "TICKS"]

TICKS = 100
"""About how many times a pass reports its progress (each report costs a call)."""


@dataclass(frozen=True)
class Progress:
    """One report: `stage` is running, `done` of its `total` items are done, and the
    whole call is `fraction` done (0 to 1; the last event is stage "done", 1.0)."""

    stage: str
    done: int
    total: int
    fraction: float

    def __str__(self) -> str:
        return f"{self.stage} {self.done}/{self.total} ({self.fraction:.0%})"


ProgressCallback = Callable[[Progress], None]
Tick = Callable[[int, int], None]
"""What a pass calls: `tick(done, total)`."""


def ticks(total: int) -> int:
    """Report every this many items of `total` (at most `TICKS` reports, and the last)."""
    return max(1, -(-total // TICKS))


class ProgressReport:
    """Turns the ticks of one call's stages into `Progress` events for `callback`.

    `shares` gives each stage its share of the whole (normalized); stages run in that
    order, a stage not run is skipped, and `finish()` reports 1.0.
    """

    def __init__(self, callback: ProgressCallback | None, shares: Mapping[str, float]):
        if callback is not None and not callable(callback):
            raise TypeError(f"progress must be a callable taking a Progress, got {callback!r}")
        total = sum(shares.values())
        self.callback = callback
        self.start: dict[str, float] = {}
        self.share: dict[str, float] = {}
        cursor = 0.0
        for name, share in shares.items():
            self.start[name], self.share[name] = cursor, share / total
            cursor += share / total
        self.last = 0.0

    def stage(self, name: str, total: int) -> Tick:
        """Begin stage `name` of `total` items; its `tick(done, total)`."""
        self._emit(name, 0, total, self.start[name])

        def tick(done: int, total: int) -> None:
            part = min(done / total, 1.0) if total else 1.0
            self._emit(name, done, total, self.start[name] + part * self.share[name])

        return tick

    def finish(self) -> None:
        """The last event: stage "done", fraction 1.0."""
        self._emit("done", 1, 1, 1.0)

    def _emit(self, name: str, done: int, total: int, fraction: float) -> None:
        self.last = max(self.last, min(fraction, 1.0))
        if self.callback is not None:
            self.callback(Progress(name, done, total, self.last))
