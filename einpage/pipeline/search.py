"""What compiles: the automatic partitions `einpage.compile` tries, and the search for
the smallest budget that compiles (so that the budget an error names compiles when typed
back), each figure computed once per compile (`Budgets`); the caps on how many tasks a
partition may make (`MAX_AUTO_BLOCKS`, and what the host's memory allows: `task_cap`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from einpage.pipeline.refusals import too_many_blocks
from einpage_core.host import available_memory
from einpage_core.units import format_bytes, format_exact
from memgraph import PlanOptions
from memgraph.budgets import BudgetReading, min_budget
from runtime.workspace import declare_workspaces
from taskgraph.graph import TaskGraph
from taskgraph.partition import (
    TooManyTasksError,
    budget_block_limit,
    estimate_tasks,
    finest_block,
)
from taskgraph.partition import partition as partition_graph

__all__ = [
    "MAX_AUTO_BLOCKS",
    "PLANNER_BYTES_PER_TASK",
    "Budgets",
    "Trial",
    "estimated_blocks",
    "check_block_count",
    "explicit_partition",
    "task_cap",
]

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


# -- what compiles -----------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    """The automatic partition at one block limit: the graph, its `min_budget` and the
    task that needs it – or, when it would make too many tasks, no graph and the
    `TooManyTasksError` that stopped it."""

    limit: int
    graph: TaskGraph | None
    needed: int = 0
    task: int | None = None
    refused: TooManyTasksError | None = None


class Budgets:
    """What `compile` knows of one program (its kernels' workspaces declared: see
    `einpage.pipeline.compiler`) under one set of options, each figure
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
        self._trials: dict[tuple[int, int | None], Trial] = {}

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

    def trial(self, limit: int, search: bool = False) -> Trial:
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
                parted = partition_graph(self.tg, limit, alignment=self.alignment, max_tasks=stop)
                graph = declare_workspaces(parted)  # blocks are new tasks
            except TooManyTasksError as err:
                self._trials[limit, cap] = Trial(limit, None, refused=err)
            else:
                needed, task = min_budget(graph, self.alignment, self.inputs)
                self._trials[limit, cap] = Trial(limit, graph, needed, task)
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
    budgets = Budgets(declare_workspaces(tg), PlanOptions(alignment=alignment), max_blocks)
    budgets.cap = (max_blocks, why)  # as given, whatever the host's memory says
    usable = budget // alignment * alignment
    if usable >= budgets.needed or usable < budgets.finest[0]:
        return  # nothing to split, or nothing to count: no block fits
    trial = budgets.trial(budgets.limit(usable))
    if trial.graph is None:
        raise too_many_blocks(budgets, BudgetReading(budget, budget), trial)


def explicit_partition(tg: TaskGraph, limit: int, alignment: int = 256) -> TaskGraph:
    """`taskgraph.partition` at a block limit the user chose (no `max_blocks` cap: the
    limit says what is wanted), refused before any block is made when it would make more
    tasks than the host memory available can plan (`task_cap`); with its kernels'
    workspaces declared (blocks are new tasks)."""
    cap, why = task_cap(None)
    try:
        parted = partition_graph(tg, limit, alignment=alignment, max_tasks=cap)
    except TooManyTasksError as err:
        raise err.because(why) from None
    return declare_workspaces(parted)


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
