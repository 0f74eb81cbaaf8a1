"""How the CLI and the demo print: a console with progress per stage, tables, summaries.

`Console` writes results to stdout (unless quiet) and shows a progress bar per stage on
stderr; `format_table` lays out (label, value) rows; `program_rows` and `plan_report`
summarize a TaskGraph and a plan.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import memgraph
from einpage_core.progress import Progress
from einpage_core.units import format_bytes, format_count
from memgraph import MemGraph
from memgraph.tiers import SLOT_ALIGNMENT
from taskgraph import TaskGraph
from taskgraph.nodes import Input

__all__ = ["Console", "format_table", "program_rows", "plan_report", "plan_title"]


class Console:
    """Where the CLI writes: results to stdout (unless quiet), per-stage progress to stderr.

    `stage(name)` is a context manager; with progress on, a tqdm bar on stderr names the
    running stage and counts finished ones; `report` is an `einpage.compile(progress=)`
    callback that shows how far the stage's own work is (planning 45%).
    """

    def __init__(self, quiet: bool = False, progress: bool | None = None, out=None, err=None):
        self.quiet = quiet
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        if progress is None:
            progress = not quiet and _is_tty(self.out) and _is_tty(self.err)
        self.progress = progress
        self._bar: Any = None
        self.timings: dict[str, float] = {}
        self.out_closed = False

    def print(self, text: str = "") -> None:
        """Print a result line; once the reader of stdout has gone (a closed pipe), the
        rest is dropped quietly and the work goes on (files still get written)."""
        if self.quiet or self.out_closed:
            return
        self._clear_bar()
        try:
            print(text, file=self.out, flush=True)
        except BrokenPipeError:
            self.out_closed = True
            _silence(self.out)

    @contextmanager
    def stages(self, total: int) -> Iterator[None]:
        """A progress bar for `total` stages (none when progress is off)."""
        if self.progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                file=self.err,
                leave=False,
                bar_format="{desc:<24} {bar:20} {n_fmt}/{total_fmt} stages [{elapsed}] {postfix}",
            )
        try:
            yield
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage (in `timings`) and show it on the progress bar."""
        if self._bar is not None:
            self._bar.set_description_str(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = time.perf_counter() - started
            if self._bar is not None:
                self._bar.update(1)

    def report(self, event: Progress) -> None:
        """Show a library `Progress` event beside the running stage (nothing without a bar)."""
        if self._bar is not None:
            self._bar.set_postfix_str(f"{event.stage} {event.fraction:.0%}", refresh=True)

    def _clear_bar(self) -> None:
        if self._bar is not None:
            self._bar.clear()


def _silence(stream: Any) -> None:
    """Point a closed stdout's file descriptor at /dev/null, so that the interpreter's
    final flush does not report the broken pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file: nothing to flush
        pass


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def format_table(rows: Sequence[tuple[str, str]], title: str | None = None) -> str:
    """Rows of (label, value) as aligned text, under an optional title.

    >>> print(format_table([("budget", "4.0 MiB"), ("peak allocated", "3.5 MiB")], "plan"))
    plan
      budget          4.0 MiB
      peak allocated  3.5 MiB
    """
    width = max((len(label) for label, _ in rows), default=0)
    lines = [title] if title else []
    lines += [f"  {label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)


def program_rows(tg: TaskGraph) -> list[tuple[str, str]]:
    """Sizes of a TaskGraph and its memory needs (its budget reference points), as rows."""

    weights = sum(t.nbytes for t in tg if isinstance(t.op, Input) and t.op.location == "host")
    refs = memgraph.budget_references(tg)
    task = refs.min_task
    at = "" if task is None else f" (task %{task}{', ' + tg[task].scope if tg[task].scope else ''})"
    return [
        (
            "tasks",
            f"{len(tg)} ({_plural(len(tg.inputs), 'input')}, {_plural(len(tg.outputs), 'output')})",
        ),
        ("dtypes", dtype_summary(tg)),
        ("compute", format_count(tg.total_flops, "FLOP")),
        ("inputs", f"{format_bytes(tg.input_bytes)} ({format_bytes(weights)} start on the host)"),
        *refs.rows()[:2],  # the resident peak and the streaming minimum
        ("smallest budget", f"{format_bytes(refs.min_budget)}{at}, without partitioning"),
        *tier_rows(tg),
    ]


def tier_rows(tg: TaskGraph) -> list[tuple[str, str]]:
    """What the program needs of host memory and disk: with two tiers, every weight in
    host memory; with a host tier (`--host-budget`), at least its largest weight (in a
    page-aligned slot: the rest is read from disk as it is needed); on disk, the weights
    as a checkpoint, read where they are."""
    weights = [t.nbytes for t in tg if isinstance(t.op, Input) and t.op.role in ("weight", "state")]
    if not weights:
        return []
    total, largest = sum(weights), max(weights)
    page = SLOT_ALIGNMENT
    return [
        ("host, two tiers", f"{format_bytes(total)}: every weight, and what a plan offloads"),
        (
            "host, with a tier",
            f"at least {format_bytes(-(-largest // page) * page)}: the largest weight, in a "
            f"slot of whole pages; the rest read from disk (--host-budget, --checkpoint)",
        ),
        ("disk", f"{format_bytes(total)} of weights in a checkpoint, read where they are"),
    ]


def dtype_summary(tg: TaskGraph) -> str:
    """The element types of a program's tensors, most bytes first: `float16 (31.2 GiB),
    int64 (16.0 KiB)` – so a table always says which precision its numbers are for."""
    return ", ".join(f"{d} ({format_bytes(n)})" for d, n in tg.bytes_by_dtype().items())


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def plan_title(mg: MemGraph) -> str:
    info = mg.info
    words = {"order": "order", "eviction": "eviction", "cost_model": "cost model"}
    options = ", ".join(f"{word} {info[key]}" for key, word in words.items() if key in info)
    tg = mg.taskgraph
    return f"plan of {tg.name!r} ({tg.main_dtype()}): {len(mg)} nodes, {len(tg)} tasks" + (
        f" ({options})" if options else ""
    )


def plan_report(mg: MemGraph, cost_model: str | None = None) -> str:
    """The PlanStats table and the simulator's summary of `mg`."""

    sim = memgraph.simulate(mg, cost_model or mg.info.get("cost_model") or None)
    return "\n\n".join(
        [
            format_table(mg.stats.rows(), "memory"),
            format_table(sim.rows(), f"simulated on {sim.cost_model.name}"),
        ]
    )
