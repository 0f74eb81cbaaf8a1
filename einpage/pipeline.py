"""The pipeline: `einpage.compile(program, budget)` partitions when needed, plans, verifies.

Each pass is a pure function of its IR (`taskgraph.partition(tg, limit)`,
`memgraph.plan(tg, budget)`, `memgraph.verify(mg)`); this module chains them and keeps
what a user wants to know beside the plan (`Compiled`): the TaskGraph given and the
one actually planned, how the budget was read, and how the block limit was chosen.

Partitioning (`partition=`):

* `"auto"` (the default): when some task cannot run even alone in the budget
  (`memgraph.min_budget` of the program above it), plan
  `taskgraph.partition_for_budget(tg, budget)` instead – the graph split into block
  tasks whose working sets fit a block limit of `DEFAULT_BUDGET_FRACTION` (a quarter)
  of the budget (room for the running block, the next one's prefetched operands and
  outputs waiting to leave), or the smallest limit the graph allows if that is more.
  Weights larger than a block are then read through slices, which sliced reloads
  stream. A program that fits is planned as it is: partitioning it would only add
  tasks. With `max_blocks`, a budget whose partition would have more tasks than that is
  refused with `TooManyBlocksError` (the CLI's guard, `MAX_AUTO_BLOCKS`): counted from
  the block sizes before any block is made when that count is already over, else by
  making them, stopping past the cap.
* `"off"`: never partition (an infeasible budget raises `memgraph.plan`'s error);
* a block limit (bytes or a size string, `"64MiB"`): partition at that limit.

A split program output is rebuilt by Concats of kind "output", the one exception to
the block limit; it is assembled on the host when nothing else reads its blocks
(`memgraph.host_assembly`). Otherwise a Concat rebuilds it on the device, holding its
blocks and the whole output at once; if that cannot fit, `PartitionInfeasibleError`
says so and names the budget it needs (for LLM prefill, `logits="last"` keeps the
output small). It also reports, when no block limit can fit, the smallest budget that
could work and the smallest block limit, with the task that needs it.

The smallest budget an error names (`InfeasibleBudgetError.needed`) is one that compiles
with the same options and cap, found by trying what `compile` would do (`_Budgets`):
it compiles, and one byte less does not. Messages print it rounded up, with its bytes.

>>> import einpage as ep
>>> prog = ep.Program("smx")
>>> x = prog.input("x", (64, 256))
>>> w = prog.input("w", (256, 256), role="weight")
>>> prog.output(ep.softmax(x @ w), "y")
>>> compiled = ep.compile(prog, "200KiB")  # the matmul alone needs 384 KiB
>>> compiled.block_limit, len(compiled.program) < len(compiled.graph)
(51200, True)
>>> compiled.partitioning.how
'auto: 25% of the budget'
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any

import memgraph
from einpage.program.program import Program
from einpage_core.errors import InfeasibleBudgetError, InputError, PlanError
from einpage_core.host import available_memory
from einpage_core.progress import ProgressCallback, ProgressReport
from einpage_core.units import (
    BudgetFormatError,
    format_bytes,
    format_count,
    format_exact,
    parse_bytes,
)
from memgraph import MemGraph, NodeKind, PlanOptions, VerifyReport
from memgraph.budgets import BudgetReading, holds_at_once, min_budget, read_budget
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input
from taskgraph.partition import (
    DEFAULT_BUDGET_FRACTION,
    TooManyTasksError,
    budget_block_limit,
    estimate_tasks,
    finest_block,
    working_set,
)
from taskgraph.partition import partition as partition_graph

__all__ = [
    "compile",
    "Compiled",
    "Partitioning",
    "PARTITION_MODES",
    "MAX_AUTO_BLOCKS",
    "PartitionInfeasibleError",
    "TooManyBlocksError",
    "partition_mode",
    "parse_partition",
    "parse_block_size",
    "estimated_blocks",
    "check_block_count",
    "task_cap",
    "explicit_partition",
    "PLANNER_BYTES_PER_TASK",
    "COMPILE_KEYWORDS",
    "bytes_by_dtype",
    "main_dtype",
]

PARTITION_MODES = ("auto", "off")
"""`compile(..., partition=)` besides a block limit: split only what does not fit, or never."""

COMPILE_KEYWORDS = ("budget", "partition", "verify", "max_blocks", "progress")
"""`compile`'s own keywords; the others are the planner's (`memgraph.PlanOptions`)."""

STAGE_SHARES = {"reading the budget": 1, "partitioning": 1, "planning": 6, "verifying": 2}
"""The stages of `compile` in order, and the share of a progress bar each takes."""

PLANNER_BYTES_PER_TASK = 4096
"""About the host memory partitioning, planning and verifying take per task of the graph
planned (measured: 3.2 KiB a task for the `mlp` preset split into 71,081 tasks and
414,635 plan nodes, verified). `compile` refuses an automatic partition whose estimated
tasks would need more than the host memory available, whatever `max_blocks` says."""

MAX_AUTO_BLOCKS = 100_000
"""`einpage.compile` (and so the CLI) refuses budgets whose automatic partition would
have more tasks than this (refused before any block is made when the estimate is already
over, else stopped while making them): such a graph takes minutes and gigabytes to build
and plan, and is rarely meant (`max_blocks=` changes it; None removes the cap)."""


# -- errors ------------------------------------------------------------------------------


class PartitionInfeasibleError(InfeasibleBudgetError):
    """The budget is too small even for the partitioned graph.

    `budget` and `needed` are bytes: `needed` is the smallest budget above `budget` that
    compiles with the same options and cap (it compiles, one byte less does not; see
    `_Budgets.smallest`); `task` the id (in the graph given to `compile`) of a task that
    needs more than `budget`; `block_limit` is the smallest block limit
    `taskgraph.partition` accepts and `block_task` the task that needs that limit.
    """

    def __init__(
        self,
        message: str,
        budget: int,
        needed: int,
        task: int | None,
        block_limit: int,
        block_task: int | None,
    ):
        super().__init__(message, budget, needed, task)
        self.block_limit = block_limit
        self.block_task = block_task


class TooManyBlocksError(InfeasibleBudgetError):
    """Automatic partitioning would cut the program into more than `max_blocks` tasks:
    `count` at least (blocks of at most `limit` bytes); `needed` is the smallest budget
    above `budget` that compiles under the cap. `why` says why the cap is what it is
    (empty: `max_blocks` as given), `searched` how far that budget was searched for
    (empty: exactly). `spelled` rewords the options it names."""

    def __init__(
        self,
        name: str,
        budget: int,
        needed: int,
        count: int,
        limit: int,
        max_blocks: int,
        auto: str = "partition='auto'",
        explicit: str = "a block limit (partition=SIZE)",
        why: str = "",
        cap: str = "max_blocks=",
        searched: str = "",
    ):
        # Raising the cap is a way out only when the cap, not the host's memory, set it.
        raise_cap = "" if why else f", raise the cap ({cap})"
        message = (
            f"budget {format_bytes(budget)} would cut {name!r} into at least {count:,} tasks "
            f"(blocks of at most {format_bytes(limit)}); {auto} stops at {max_blocks:,}{why}. "
            f"The smallest budget above it that compiles is {format_exact(needed)}{searched}. "
            f"Give a larger budget{raise_cap}, or split explicitly with {explicit}"
        )
        super().__init__(message, budget, needed)
        self.name, self.count, self.limit, self.max_blocks = name, count, limit, max_blocks
        self.why, self.searched = why, searched

    def spelled(self, auto: str, explicit: str, cap: str) -> TooManyBlocksError:
        """The same error, naming the options as `auto`, `explicit` and `cap`."""
        return TooManyBlocksError(
            self.name, self.budget, self.needed, self.count, self.limit, self.max_blocks,
            auto, explicit, self.why, cap, self.searched,
        )  # fmt: skip


# -- reading the partition argument ----------------------------------------------------


def partition_mode(partition: Any) -> str | int:
    """What `compile`'s `partition` asks for: "auto" (also True), "off" (also False and
    None) or a block limit in bytes (a positive int or a size string)."""
    if partition is True or partition == "auto":
        return "auto"
    if partition is False or partition is None or partition == "off":
        return "off"
    if isinstance(partition, int | str):
        try:
            limit = parse_bytes(partition)
        except BudgetFormatError:
            limit = -1
        if limit > 0:
            return limit
    raise PlanError(
        f"partition must be 'auto', 'off', True, False or a positive block limit (bytes or "
        f"a size string such as '64MiB'), got {partition!r}"
    )


def parse_partition(value: str) -> str | int:
    """The CLI's `--partition`: "auto", "off", or a block size in bytes."""
    if value in PARTITION_MODES:
        return value
    try:
        return parse_bytes(value)
    except BudgetFormatError:
        raise BudgetFormatError(
            f"--partition must be auto, off or a block size such as 64MiB, got {value!r}"
        ) from None


def parse_block_size(value: str) -> int:
    """The CLI's `show --partition`: a block size in bytes."""
    try:
        return parse_bytes(value)
    except BudgetFormatError:
        raise BudgetFormatError(
            f"--partition must be a block size such as 64MiB, got {value!r}"
        ) from None


# -- the record --------------------------------------------------------------------------


@dataclass(frozen=True)
class Partitioning:
    """How `compile` chose the graph it planned.

    `mode` is the `partition` argument read ("auto", "off" or "limit": an explicit block
    limit); `block_limit` the limit the program was split at (None: planned as given),
    and `how` says how it was chosen ("none", "explicit", or "auto: 25% of the budget" /
    "auto: the finest block" when that share was too small); `fraction` is the budget
    fraction of "auto"; `finest_block` the smallest block limit the program allows
    (when split); `program_min_budget` the program's `min_budget` unsplit.
    """

    mode: str
    block_limit: int | None = None
    how: str = "none"
    fraction: float | None = None
    finest_block: int | None = None
    program_min_budget: int = 0

    def describe(self) -> str:
        """`block limit 50.0 KiB (auto: 25% of the budget)`, or `not partitioned (...)`."""
        if self.block_limit is None:
            why = "partition off" if self.mode == "off" else "the program fits unsplit"
            return f"not partitioned ({why})"
        return f"block limit {format_bytes(self.block_limit)} ({self.how})"


@dataclass(frozen=True)
class Compiled:
    """A program and its plan, with how they were made.

    `program` is the TaskGraph given (built from a `Program`), `graph` the one planned
    (`program` partitioned when `block_limit` is set), `plan` its MemGraph, `budget` how
    the budget was read, `partitioning` how the block limit was chosen, `report` the
    verifier's (None with `verify=False`) and `timings` the seconds of each stage.
    """

    program: TaskGraph
    graph: TaskGraph
    plan: MemGraph
    budget: BudgetReading
    partitioning: Partitioning
    report: VerifyReport | None = None
    timings: Mapping[str, float] = field(default_factory=dict)

    @property
    def block_limit(self) -> int | None:
        return self.partitioning.block_limit

    @property
    def min_budget(self) -> int:
        """The program's `min_budget`, unsplit."""
        return self.partitioning.program_min_budget

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows for a table: program, budget, partition, plan, verify."""
        tg, mg = self.program, self.plan
        rows = [
            (
                "program",
                f"{tg.name!r}: {len(tg)} tasks, {format_count(tg.total_flops, 'FLOP')}, "
                f"{main_dtype(tg)}",
            ),
            ("budget", str(self.budget)),
        ]
        if self.block_limit is not None:
            rows.append(
                (
                    "partition",
                    f"{len(tg)} -> {len(self.graph)} tasks, block limit "
                    f"{format_bytes(self.block_limit)} (the program needs "
                    f"{format_bytes(self.min_budget)} unsplit)",
                )
            )
        s = mg.stats
        seconds = self.timings.get("planning", 0.0)
        rows.append(
            (
                "plan",
                f"{len(mg)} nodes in {seconds:.2f} s: {s.offload_count} offloads "
                f"({format_bytes(s.offload_bytes)}), {s.reload_count} reloads "
                f"({format_bytes(s.reload_bytes)}), {s.drop_count} drops" + _assembled_note(mg),
            )
        )
        if self.report is not None:
            report = self.report
            rows.append(
                (
                    "verify",
                    f"ok: {report.nodes} nodes, {report.dependencies_checked} dependencies checked",
                )
            )
        return rows

    def __repr__(self) -> str:
        verified = "verified" if self.report is not None else "not verified"
        return (
            f"<Compiled {self.program.name!r}: {len(self.program)} tasks -> "
            f"{len(self.graph)}, budget {self.budget}, {self.partitioning.describe()}, "
            f"plan {len(self.plan)} nodes, {verified}>"
        )


def _assembled_note(mg: MemGraph) -> str:
    """`; outputs logits assembled on the host from 26 blocks`, or "" (no sliced offloads)."""
    roots = {n.into for n in mg.nodes if n.kind is NodeKind.OFFLOAD and n.into is not None}
    if not roots:
        return ""
    names = [n.name for n in mg.of_kind(NodeKind.OUTPUT) if n.tensor in roots]
    return (
        f"; outputs {', '.join(names)} assembled on the host from "
        f"{mg.stats.sliced_offload_count} blocks"
    )


# -- the pipeline ------------------------------------------------------------------------


def compile(  # the name shadows the builtin here, as `torch.compile` does
    source: Program | TaskGraph,
    budget: int | str,
    *,
    partition: bool | int | str | None = "auto",
    verify: bool = True,
    max_blocks: int | None = MAX_AUTO_BLOCKS,
    progress: ProgressCallback | None = None,
    **options: Any,
) -> Compiled:
    """Partition `source` when needed, plan it within `budget`, verify; a `Compiled`.

    `source` is a `Program` (built first) or a TaskGraph. `budget` is bytes, a size
    string (`"8GiB"`) or a percentage of the program's resident peak (`"50%"`; at
    `"100%"` nothing moves) or of its streaming minimum (`"150%streaming"`; see
    `memgraph.budgets`). `partition` is "auto", "off" or a block limit (see the
    module docstring); `max_blocks` (default `MAX_AUTO_BLOCKS`; None: no cap but the
    host's memory) refuses automatic partitioning into more tasks than that, or than
    the available host memory can plan (`task_cap`) – counted from the partition's
    arithmetic before any block is made (`taskgraph.partition.estimate_tasks`), and
    stopped while materializing past twice that – with a `TooManyBlocksError` that
    names the smallest budget that compiles under the cap. `verify` runs `memgraph.verify` on the
    plan (raising `VerificationError` if it fails). Other keywords are the planner's
    options (`memgraph.plan`: order, eviction, lookahead, cost_model, alignment, ...).
    `progress`, if given, is called with `einpage_core.progress.Progress` events: the
    stage running (as in `timings`), its items done (the planner's steps, the verifier's
    nodes) and the fraction of the whole call, never decreasing, 1.0 at the end.

    The MemGraph's `info` records the choice too: "partition", "block_limit" (None when
    not partitioned), "original_tasks", and when partitioned "original_min_budget" and
    "finest_block_limit". Raises `InfeasibleBudgetError` (a `PartitionInfeasibleError`
    when even partitioning cannot fit), `BudgetFormatError`, `PlanError`.
    """
    tg = _taskgraph(source)
    opts = PlanOptions.from_keywords(options, "einpage.compile", COMPILE_KEYWORDS)
    mode = partition_mode(partition)
    if max_blocks is not None and (
        isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1
    ):
        raise PlanError(f"max_blocks must be a count >= 1 or None, got {max_blocks!r}")
    report = ProgressReport(progress, STAGE_SHARES)
    timings: dict[str, float] = {}
    with _timed(timings, "reading the budget"):
        report.stage("reading the budget", 1)
        reading = read_budget(tg, budget, opts)
        budgets = _Budgets(tg, opts, max_blocks)
    with _timed(timings, "partitioning"):
        report.stage("partitioning", 1)
        graph, chosen = _choose_graph(budgets, reading, mode)
    with _timed(timings, "planning"):
        tick = report.stage("planning", len(graph))
        mg = memgraph.plan(graph, reading, progress=tick, **options)
    mg = replace(mg, info={**mg.info, **_info(tg, chosen)})
    verified = None
    if verify:
        with _timed(timings, "verifying"):
            verified = memgraph.verify(mg, report.stage("verifying", len(mg)))
    report.finish()
    return Compiled(tg, graph, mg, reading, chosen, verified, MappingProxyType(timings))


def bytes_by_dtype(tg: TaskGraph) -> dict[str, int]:
    """The bytes of a program's tensors per dtype, most first."""
    by_dtype: dict[str, int] = {}
    for task in tg:
        by_dtype[task.dtype] = by_dtype.get(task.dtype, 0) + task.nbytes
    return dict(sorted(by_dtype.items(), key=lambda item: -item[1]))


def main_dtype(tg: TaskGraph) -> str:
    """The dtype holding most of a program's bytes (what its figures are in)."""
    return next(iter(bytes_by_dtype(tg)), "no tensors")


def _taskgraph(source: Any) -> TaskGraph:
    if isinstance(source, TaskGraph):
        return source
    if isinstance(source, Program):
        return source.build()
    raise InputError(f"einpage.compile takes a Program or a TaskGraph, got {type(source).__name__}")


@contextmanager
def _timed(timings: dict[str, float], stage: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[stage] = time.perf_counter() - started


def _info(tg: TaskGraph, chosen: Partitioning) -> dict[str, Any]:
    """What the MemGraph's `info` records of the partitioning."""
    info: dict[str, Any] = {
        "partition": chosen.mode,
        "block_limit": chosen.block_limit,
        "original_tasks": len(tg),
    }
    if chosen.block_limit is not None:
        info["original_min_budget"] = chosen.program_min_budget
        info["finest_block_limit"] = chosen.finest_block
    return info


def _choose_graph(
    budgets: _Budgets, reading: BudgetReading, mode: str | int
) -> tuple[TaskGraph, Partitioning]:
    """The graph to plan (the program or its partition) and how it was chosen; raises
    when no partition can fit the budget (`memgraph.plan` raises for "off")."""
    tg, alignment, needed = budgets.tg, budgets.alignment, budgets.needed
    usable = reading.nbytes // alignment * alignment
    label = mode if isinstance(mode, str) else "limit"
    if mode == "off" or (mode == "auto" and (usable >= needed or budgets.task is None)):
        return tg, Partitioning(label, program_min_budget=needed)
    floor, _ = budgets.finest
    if isinstance(mode, int):
        graph = explicit_partition(tg, mode, alignment)
        part_needed, part_task = min_budget(graph, alignment, budgets.inputs)
        if usable < part_needed:  # the partition does not depend on the budget here
            raise _partition_too_large(
                budgets, graph, reading, mode, part_needed, part_task, part_needed
            )
        return graph, Partitioning(label, mode, "explicit", None, floor, needed)
    if usable < floor:
        raise _no_block_fits(budgets, reading)
    trial = budgets.trial(budgets.limit(usable))
    if trial.graph is None:
        raise _too_many_blocks(budgets, reading, trial)
    if usable < trial.needed:
        raise _partition_too_large(
            budgets, trial.graph, reading, trial.limit, trial.needed, trial.task,
            budgets.smallest(usable + alignment)[0], _searched(budgets),
        )  # fmt: skip
    limit, fraction = trial.limit, DEFAULT_BUDGET_FRACTION
    how = "auto: the finest block" if limit == floor else f"auto: {fraction:.0%} of the budget"
    return trial.graph, Partitioning(label, limit, how, fraction, floor, needed)


# -- what compiles -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Trial:
    """The automatic partition at one block limit: the graph, its `min_budget` and the
    task that needs it – or, when it would make too many tasks, no graph and the
    `TooManyTasksError` that stopped it."""

    limit: int
    graph: TaskGraph | None
    needed: int = 0
    task: int | None = None
    refused: TooManyTasksError | None = None


class _Budgets:
    """What `compile` knows of one program under one set of options, each figure
    computed once per compile: the smallest budget unsplit (`min_budget`, and its task),
    the finest block, the cap on tasks (`task_cap`), and each automatic partition tried,
    by block limit. For any budget it tells whether compiling succeeds (`why_not`), and
    it finds the smallest budget that does (`smallest`) by trying budgets as `compile`
    would, so that the budget an error names compiles when typed back.

    Budgets here are *usable* bytes: whole alignment units, as the planner reads a budget
    (`1000` with alignment 256 is `768`)."""

    def __init__(self, tg: TaskGraph, opts: PlanOptions, max_blocks: int | None):
        self.tg = tg
        self.alignment = opts.alignment
        self.inputs = opts.inputs
        self.max_blocks = max_blocks
        self.needed, self.task = min_budget(tg, self.alignment, self.inputs)
        self._estimates: dict[int, int] = {}
        self._trials: dict[tuple[int, int | None], _Trial] = {}

    @cached_property
    def finest(self) -> tuple[int, int | None]:
        """The smallest block limit the program allows, and the task that needs it."""
        return finest_block(self.tg, self.alignment)

    @cached_property
    def cap(self) -> tuple[int | None, str]:
        """The most tasks an automatic partition may have, and why (`task_cap`)."""
        return task_cap(self.max_blocks)

    @cached_property
    def search_cap(self) -> tuple[int | None, str]:
        """The cap `smallest` searches under, and why: `cap`, but without `max_blocks`
        (the host's memory sets the cap: millions of tasks, minutes a try) at most
        `MAX_AUTO_BLOCKS`, so that an error never takes minutes to say which budget
        compiles. A partition within it is within `cap` too."""
        cap, why = self.cap
        if self.max_blocks is None and (cap is None or cap > MAX_AUTO_BLOCKS):
            return MAX_AUTO_BLOCKS, " (as far as the search goes without a cap)"
        return cap, why

    @property
    def search_bounded(self) -> bool:
        """Whether `smallest` searched under a smaller cap than `compile` applies."""
        return self.search_cap[0] != self.cap[0]

    def limit(self, usable: int) -> int:
        """The block limit automatic partitioning picks for `usable` bytes."""
        return budget_block_limit(usable, self.finest[0], self.alignment)

    def estimate(self, limit: int) -> int:
        """`estimated_blocks` at block limit `limit` (milliseconds; counted once)."""
        if limit not in self._estimates:
            self._estimates[limit] = estimated_blocks(self.tg, limit, self.alignment)
        return self._estimates[limit]

    def trial(self, limit: int, search: bool = False) -> _Trial:
        """The automatic partition at block limit `limit` under `cap` (`search_cap` with
        `search`), made once: refused when the estimate is over the cap (before making a
        block), or when making it passes twice the cap (the estimate leaves out
        assembly)."""
        cap, why = self.search_cap if search else self.cap
        if (limit, cap) not in self._trials:
            try:
                if cap is not None and self.estimate(limit) > cap:
                    raise TooManyTasksError(self.tg.name, limit, cap, self.estimate(limit), why)
                stop = None if cap is None else 2 * cap
                graph = partition_graph(self.tg, limit, alignment=self.alignment, max_tasks=stop)
            except TooManyTasksError as err:
                self._trials[limit, cap] = _Trial(limit, None, refused=err)
            else:
                needed, task = min_budget(graph, self.alignment, self.inputs)
                self._trials[limit, cap] = _Trial(limit, graph, needed, task)
        return self._trials[limit, cap]

    def why_not(self, usable: int, make: bool = True, search: bool = False) -> str | None:
        """None when `compile` succeeds with `usable` bytes (partition "auto"; under
        `search_cap` with `search`), else why not, in words. With `make=False` only the
        figures that take milliseconds are looked at (the finest block, the estimate):
        None then means "maybe"."""
        if usable >= self.needed or self.task is None:
            return None  # planned unsplit: the planner succeeds from `min_budget` up
        floor, floor_task = self.finest
        if usable < floor:
            return f"task %{floor_task} needs {format_exact(floor, 'nearest')} even split finest"
        limit = self.limit(usable)
        cap, why = self.search_cap if search else self.cap
        if cap is not None and self.estimate(limit) > cap:
            return (
                f"automatic partitioning would make at least {self.estimate(limit):,} tasks, "
                f"more than {cap:,}{why}"
            )
        if not make:
            return None
        trial = self.trial(limit, search)
        if trial.graph is None:
            return (
                f"automatic partitioning would make more than {2 * cap:,} tasks (twice the "
                f"cap of {cap:,}{why}, counted as they are made)"
            )
        if usable < trial.needed:
            return (
                f"partitioned at block limit {format_bytes(trial.limit)} ({len(trial.graph)} "
                f"tasks), task %{trial.task} of it needs {format_exact(trial.needed, 'nearest')}"
            )
        return None

    def smallest(self, start: int) -> tuple[int, str | None]:
        """The smallest budget from `start` up that compiles, and why one byte less does
        not (None when that is below `start`).

        `start` is a multiple of the alignment, and `start - alignment` must be known not
        to compile. The budget returned compiles, and one byte less does not (under
        `search_cap`: without `max_blocks`, a byte less may compile into more tasks than
        the search makes); budgets further below it were not all tried (more room is
        assumed never to hurt). First the budgets whose partition the estimate refuses
        (milliseconds each) are passed over by bisection; then partitions are made:
        galloping up (1, 2, 4, ... alignment units, as far as the unsplit `min_budget`,
        which always compiles), then bisecting between the last budget that failed and
        the first that compiled. Each block limit is partitioned at most once (`trial`)."""
        unit = self.alignment
        low, high = self._first(start - unit, self.needed, make=False)
        if self.why_not(high, search=True) is None:
            return high, (self.why_not(low, make=False, search=True) if low >= start else None)
        step = unit
        while high < self.needed and self.why_not(high, search=True) is not None:
            low, high, step = high, min(self.needed, high + step), 2 * step
        low, high = self._first(low, high, make=True)
        return high, (self.why_not(low, search=True) if low >= start else None)

    def _first(self, low: int, high: int, make: bool) -> tuple[int, int]:
        """Bisection between `low` (fails) and `high` (compiles, or with `make=False` maybe
        compiles) down to adjacent budgets, one alignment unit apart (under `search_cap`)."""
        unit = self.alignment
        while high - low > unit:
            middle = low + (high - low) // unit // 2 * unit
            if self.why_not(middle, make, search=True) is None:
                high = middle
            else:
                low = middle
        return low, high


# -- how many blocks ---------------------------------------------------------------------


def estimated_blocks(tg: TaskGraph, limit: int, alignment: int = 1) -> int:
    """About how many tasks partitioning `tg` to `limit` bytes makes, counted from the
    partition's block sizes without making a block (`estimate_tasks`: blocks, partial
    sums and their combines, output concats, slices of whole tasks; at least this many)."""
    return estimate_tasks(tg, limit, alignment=alignment).tasks


def check_block_count(
    tg: TaskGraph,
    budget: int,
    max_blocks: int = MAX_AUTO_BLOCKS,
    alignment: int = 256,
    why: str = "",
) -> None:
    """Raise `TooManyBlocksError` when automatic partitioning for `budget` bytes would make
    more than `max_blocks` tasks (refused by the estimate before any block is made, or
    stopped while making them); its `needed` is the smallest budget above `budget` that
    stays under the cap and compiles. `why` says why the cap is what it is (empty:
    `max_blocks` as given)."""
    budgets = _Budgets(tg, PlanOptions(alignment=alignment), max_blocks)
    budgets.cap = (max_blocks, why)  # as given, whatever the host's memory says
    usable = budget // alignment * alignment
    if usable >= budgets.needed or usable < budgets.finest[0]:
        return  # nothing to split, or nothing to count: no block fits
    trial = budgets.trial(budgets.limit(usable))
    if trial.graph is None:
        raise _too_many_blocks(budgets, BudgetReading(budget, budget), trial)


def explicit_partition(tg: TaskGraph, limit: int, alignment: int = 256) -> TaskGraph:
    """`taskgraph.partition` at a block limit the user chose (no `max_blocks` cap: the
    limit says what is wanted), refused before any block is made when it would make more
    tasks than the host memory available can plan (`task_cap`)."""
    cap, why = task_cap(None)
    try:
        return partition_graph(tg, limit, alignment=alignment, max_tasks=cap)
    except TooManyTasksError as err:
        raise err.because(why) from None


def task_cap(max_blocks: int | None) -> tuple[int | None, str]:
    """The most tasks automatic partitioning may make: `max_blocks`, or fewer when planning
    that many would need more host memory than is available (`PLANNER_BYTES_PER_TASK`
    each); and, when memory sets it, why (for the error)."""
    available = available_memory()
    if available is None:
        return max_blocks, ""
    by_memory = max(1, available // PLANNER_BYTES_PER_TASK)
    if max_blocks is not None and max_blocks <= by_memory:
        return max_blocks, ""
    return by_memory, (
        f" here: planning more would take over the {format_bytes(available)} of host memory "
        f"available (about {format_bytes(PLANNER_BYTES_PER_TASK)} a task)"
    )


# -- errors of partitioning for a budget -------------------------------------------------


def _size(nbytes: int, rounding: str = "nearest") -> str:
    """`12.0 MiB (12582912 B)`, or `768 B` where that says it all (`format_exact`)."""
    return format_exact(nbytes, rounding)


def _brief(line: str, width: int = 160) -> str:
    """A task's line, cut short (a Concat of many blocks lists them all)."""
    return line if len(line) <= width else line[: width - 4] + " ..."


def _assembly_floor(tg: TaskGraph, limit: int, alignment: int) -> tuple[int, str | None]:
    """A lower bound on what rebuilding split program outputs needs at block limit
    `limit`: an output whose task does not fit the limit is split; if other tasks read
    it, they read its blocks too, so it cannot be assembled on the host
    (`taskgraph.assembly`) and the Concat that rebuilds it on the device holds its
    blocks and the whole output at once (at least twice its aligned bytes). Returns
    (bytes, the output's name) for the largest such output. Outputs nothing reads are
    assembled on the host (or, if their blocks are views of blocks read elsewhere, may
    not be; no bound is claimed for them)."""
    best, name = 0, None
    for output, task_id in tg.outputs.items():
        task = tg[task_id]
        if isinstance(task.op, Input) or not tg.consumers[task_id]:
            continue
        if working_set(tg, task_id, alignment) <= limit:
            continue
        need = 2 * (-(-task.nbytes // alignment) * alignment)
        if need > best:
            best, name = need, output
    return best, name


def _searched(budgets: _Budgets) -> str:
    """` (searched within 100,000 tasks: ...)` when the smallest budget was searched under
    a smaller cap than `compile` applies (`_Budgets.search_cap`), else ""."""
    if not budgets.search_bounded:
        return ""
    return (
        f" (searched within {budgets.search_cap[0]:,} tasks: with no cap, max_blocks=None, "
        f"a smaller budget may compile into more)"
    )


def _a_byte_less(smallest: int, reason: str | None) -> str:
    """`; with a byte less (18,431 B), automatic partitioning would make ...`, or ""."""
    return "" if reason is None else f"; with a byte less ({smallest - 1:,} B), {reason}"


def _too_many_blocks(
    budgets: _Budgets, reading: BudgetReading, trial: _Trial
) -> TooManyBlocksError:
    """The error for a budget whose automatic partition would make too many tasks."""
    cap, why = budgets.cap
    refused = trial.refused
    count = refused.counted if refused is not None and refused.counted is not None else cap + 1
    usable = reading.nbytes // budgets.alignment * budgets.alignment
    needed, _ = budgets.smallest(usable + budgets.alignment)
    name, searched = budgets.tg.name, _searched(budgets)
    return TooManyBlocksError(
        name, reading.nbytes, needed, count, trial.limit, cap, why=why, searched=searched
    )


def _no_block_fits(budgets: _Budgets, reading: BudgetReading) -> PartitionInfeasibleError:
    """The error for a budget below even the finest block of some task; its `needed` is
    the smallest budget that compiles (under the `max_blocks` cap too)."""
    tg, alignment, needed, task_id = budgets.tg, budgets.alignment, budgets.needed, budgets.task
    floor, floor_task = budgets.finest
    assembly, output = _assembly_floor(tg, floor, alignment)
    bound = min(needed, max(floor, assembly))  # no budget below it can work
    smallest, reason = budgets.smallest(bound)
    culprit = _brief(tg[floor_task].line()) if floor_task is not None else "none"
    unsplit = (
        f"{holds_at_once(tg, task_id, alignment)} ({_size(needed)})"
        if task_id is not None
        else f"the program needs {_size(needed)}"
    )
    head = (
        f"budget {reading.asked}{_size(reading.nbytes)} is below the smallest budget that "
        f"compiles, {_size(smallest, 'up')}{_searched(budgets)}"
    )
    if bound == needed:  # partitioning cannot go below the program as it is
        text = (
            f"{head}: the program unsplit. There, {unsplit}; split as finely as allowed, "
            f"task %{floor_task} needs {_size(floor)} ({culprit}), so partitioning cannot help"
        )
        return PartitionInfeasibleError(
            text + ".", reading.nbytes, smallest, task_id, floor, floor_task
        )
    text = (
        f"{head}. Unsplit, {unsplit}; partitioning brings that down to the smallest block "
        f"limit that works, {_size(floor)}, what task %{floor_task} needs even split as "
        f"finely as allowed ({culprit})"
    )
    if output is not None and assembly > floor:
        text += (
            f", and program output {output!r}, split, is rebuilt from its blocks by a "
            f"Concat that needs at least {_size(assembly)}"
        )
    text += f". No budget below {_size(bound, 'down')} can work{_a_byte_less(smallest, reason)}"
    return PartitionInfeasibleError(
        text + ".", reading.nbytes, smallest, floor_task, floor, floor_task
    )


def _partition_too_large(
    budgets: _Budgets,
    graph: TaskGraph,
    reading: BudgetReading,
    limit: int,
    needed: int,
    task_id: int | None,
    smallest: int,
    searched: str = "",
) -> PartitionInfeasibleError:
    """The error for a partitioned graph with a task that still does not fit: the
    Concat that rebuilds a split program output on the device (the one exception to the
    block limit, when the output cannot be assembled on the host), or a task over the
    limit. `smallest` is the smallest budget above this one that compiles (`searched`: how
    far it was searched for, as `_searched` says)."""
    tg = budgets.tg
    floor, floor_task = budgets.finest
    task = graph[task_id]
    original = task.block.of if task.block is not None else task_id
    head = (
        f"budget {reading.asked}{_size(reading.nbytes)} is below the smallest feasible "
        f"budget {_size(needed)} of {tg.name!r} partitioned at block "
        f"limit {_size(limit)} ({len(graph)} tasks from {len(tg)}): task {_brief(task.line())}"
    )
    if task.block is not None and task.block.kind == "output":
        names = [name for name, t in tg.outputs.items() if t == original]
        text = (
            f"{head} rebuilds program output {names[0] if names else original!r} "
            f"({format_bytes(tg[original].nbytes)}) from its blocks, and needs the blocks "
            f"and the whole output on the device at once (other tasks read the blocks too, "
            f"so it cannot be assembled on the host). Only a budget of at least "
            f"{_size(needed, 'down')} can hold it, whatever the block limit (any from "
            f"{format_bytes(floor)} up works for the other tasks); or make the output "
            f"smaller (LLM prefill: logits='last')"
        )
    else:
        text = (
            f"{head} needs {format_bytes(needed)} at once. The smallest block limit that "
            f"works is {_size(floor)} (task %{floor_task})"
        )
    text += f". The smallest budget above it that compiles is {_size(smallest, 'up')}{searched}."
    return PartitionInfeasibleError(text, reading.nbytes, smallest, original, floor, floor_task)
