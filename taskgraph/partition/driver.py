"""The partition passes: `partition(tg, limit)` (steps 1-7: size, materialize, check,
repeat, order, build) and `partition_for_budget(tg, budget)`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from einpage_core.errors import GraphError, InfeasibleBudgetError, PlanError, expect_graph
from einpage_core.units import format_bytes, parse_bytes
from taskgraph import dtypes
from taskgraph.builder import GraphBuilder
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Concat, Input, Slice, Task, is_input_slice, with_blocks
from taskgraph.partition.estimate import count_from_sizes
from taskgraph.partition.feasibility import feasible_limit, tasks_over
from taskgraph.partition.geometry import aligned
from taskgraph.partition.materializing import Materializer, NewTask, TaskCapReached
from taskgraph.partition.rules import geometries
from taskgraph.partition.sizing import block_sizes

__all__ = [
    "partition",
    "partition_for_budget",
    "BudgetPartition",
    "blocks_of",
    "build_blocks",
    "budget_block_limit",
    "TooManyTasksError",
    "DEFAULT_BUDGET_FRACTION",
]

DEFAULT_BUDGET_FRACTION = 0.25
"""`partition_for_budget`'s block limit as a fraction of the budget (see there)."""

MAX_ROUNDS = 64
"""Rounds of step 6 (split the tasks whose new tasks are too large, again) at most."""


# -- checking, ordering, building ------------------------------------------------------


def _violations(new: Sequence[NewTask], limit: int, alignment: int) -> set[int]:
    """Original tasks to split, or split finer, because a new task's working set exceeds
    the limit (step 6): the task whose block it is, or for a copy, the reader whose
    region is too large and, for a Slice, the task it slices."""
    nbytes = [aligned(math.prod(n.shape) * dtypes.itemsize(n.dtype), alignment) for n in new]
    culprits: set[int] = set()
    for v, n in enumerate(new):
        if isinstance(n.op, Input) or n.block.kind == "output":
            continue
        source = new[n.inputs[0]].op if n.inputs else None
        input_slice = is_input_slice(n.op, source)
        alias = n.op.aliases_input or input_slice
        ws = nbytes[v] + (0 if alias else sum(nbytes[u] for u in dict.fromkeys(n.inputs)))
        if ws <= limit:
            continue
        if not isinstance(n.op, Slice | Concat):
            culprits.add(n.block.of)
            continue
        culprits.add(n.block.of if n.block.kind == "block" else n.made_for)
        if isinstance(n.op, Slice) and not input_slice:
            culprits.add(new[n.inputs[0]].block.of)
    return culprits


def _reads_weight(task: Task, tasks: Sequence[Task]) -> bool:
    return any(isinstance(tasks[i].op, Input) and tasks[i].op.role == "weight" for i in task.inputs)


def _schedule(tg: TaskGraph, new: Sequence[NewTask], outputs: Sequence[int]) -> list[int]:
    """Inputs first; then, for each original task that reads a weight (in topological
    order), all its blocks, each pulling what it needs depth first; then the outputs and
    the rest likewise (step 7)."""
    order = [v for v, n in enumerate(new) if isinstance(n.op, Input)]
    done = set(order)
    weighty = {t.id for t in tg.tasks if _reads_weight(t, tg.tasks)}
    roots = [v for v, n in enumerate(new) if n.made_for in weighty and n.block.of == n.made_for]
    roots.sort(key=lambda v: new[v].made_for)  # stable: blocks of a task in the order made
    for root in [*roots, *outputs, *range(len(new))]:
        if root in done:
            continue
        stack = [(root, 0)]
        while stack:
            v, i = stack[-1]
            inputs = new[v].inputs
            if i < len(inputs):
                stack[-1] = (v, i + 1)
                if inputs[i] not in done:
                    stack.append((inputs[i], 0))
            else:
                stack.pop()
                if v not in done:
                    done.add(v)
                    order.append(v)
    return order


def build_blocks(
    tg: TaskGraph, new: Sequence[NewTask], outputs: dict[str, int], whole: dict[int, int]
) -> TaskGraph:
    """The partitioned graph of the new tasks `new` (a `Materializer`'s) in `_schedule`'s
    order; `outputs` the outputs' new tasks. Each new task carries the facts of
    the original task it holds part of, with the tasks they name renumbered to the new
    tasks that hold those whole (`whole`: original -> new); a fact naming a task that
    was split, or that comes later in the new order, is dropped."""
    builder = GraphBuilder(tg.name)
    number: dict[int, int] = {}
    renumber: dict[int, int] = {}  # original id -> final id, as the wholes are added
    holds = {v: original for original, v in whole.items()}
    blocks = []
    for v in _schedule(tg, new, list(outputs.values())):
        n = new[v]
        inputs = [number[u] for u in n.inputs]
        facts = [fact.renumbered(renumber) for fact in n.facts]
        number[v] = builder.add(
            n.op,
            inputs,
            n.shape,
            n.dtype,
            n.scope,
            n.label,
            [fact for fact in facts if fact is not None],
        )
        if v in holds:
            renumber[holds[v]] = number[v]
        blocks.append(n.block)
    for name, v in outputs.items():
        builder.output(number[v], name)
    built = builder.build()
    return TaskGraph(with_blocks(built.tasks, blocks), built.outputs, built.name)


# -- the passes ---------------------------------------------------------------------------


def _check_alignment(alignment: Any) -> int:
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise GraphError(f"alignment must be a positive int (bytes), got {alignment!r}")
    return alignment


def partition(
    tg: TaskGraph,
    max_block_bytes: int | str,
    *,
    alignment: int = 1,
    absorb: bool = True,
    max_tasks: int | None = None,
) -> TaskGraph:
    """Split the tasks of `tg` so that every working set is at most `max_block_bytes`.

    `max_block_bytes` is bytes or a size string (`"1GiB"`); each tensor counts rounded up
    to `alignment` bytes. With `absorb` (the default), tasks that fit but read a split task,
    or feed only split tasks, are split with them (see the package docstring). A graph
    in which every task fits is returned as is; otherwise every task of the result
    carries a `Block` naming its original task and region, and the outputs keep their
    names and shapes.

    Raises `BlockLimitError` (an `InfeasibleBudgetError`) when the limit is below
    `smallest_feasible_block_limit(tg)`, and `TooManyTasksError` when it would make more
    than `max_tasks` tasks (None: no cap): before making any when `estimate_tasks`'s
    count (a lower bound) is already over, else as soon as it has made that many, so
    that a tiny limit never runs away.
    """
    expect_graph(tg, TaskGraph, "taskgraph.partition")
    limit = parse_bytes(max_block_bytes)
    alignment = _check_alignment(alignment)
    geoms = geometries(tg)
    forced = tasks_over(tg, geoms, limit, alignment)
    if not forced:
        return tg
    factors: dict[int, float] = {}
    for _ in range(MAX_ROUNDS):
        sizes = block_sizes(tg, geoms, forced, factors, limit, alignment, absorb)
        if max_tasks is not None:
            counted = count_from_sizes(tg, geoms, sizes, limit, alignment).tasks
            if counted > max_tasks:
                raise TooManyTasksError(tg.name, limit, max_tasks, counted)
        m = Materializer(tg, geoms, sizes, limit, alignment, max_tasks)
        try:
            outputs = m.run()
        except TaskCapReached:
            raise TooManyTasksError(tg.name, limit, max_tasks or 0) from None
        culprits = _violations(m.new, limit, alignment)
        if not culprits:
            return build_blocks(tg, m.new, outputs, m.whole())
        for t in culprits:
            if t in sizes:  # split already: split finer
                factors[t] = factors.get(t, 1.0) / 2
            else:
                forced.add(t)
    raise PlanError(
        f"partition found no split of {tg.name!r} within {format_bytes(limit)} after "
        f"{MAX_ROUNDS} rounds (tasks still over the limit: {sorted(culprits)[:10]})"
    )


class TooManyTasksError(PlanError):
    """`partition` stopped: the block limit would make more than `max_tasks` tasks
    (`counted`: at least that many by `estimate_tasks`, when known before making any);
    `why` says why the cap is what it is (empty: as the caller gave it)."""

    def __init__(
        self, name: str, limit: int, max_tasks: int, counted: int | None = None, why: str = ""
    ):
        made = (
            f"makes more than {max_tasks:,} tasks{why}; stopped"
            if counted is None
            else f"makes at least {counted:,} tasks, more than {max_tasks:,}{why}; refused "
            f"before making any"
        )
        super().__init__(
            f"partitioning {name!r} to blocks of {format_bytes(limit)} {made} (use a "
            f"larger block limit or budget)"
        )
        self.name, self.limit, self.max_tasks, self.counted = name, limit, max_tasks, counted

    def because(self, why: str) -> TooManyTasksError:
        """The same error, saying why the cap is what it is."""
        return TooManyTasksError(self.name, self.limit, self.max_tasks, self.counted, why)


@dataclass(frozen=True, slots=True)
class BudgetPartition:
    """What `partition_for_budget` chose: the graph, its block limit, and the smallest
    block limit the graph allows (all in bytes)."""

    graph: TaskGraph
    limit: int
    needed: int

    def __repr__(self) -> str:
        return (
            f"<BudgetPartition tasks={len(self.graph)} limit={format_bytes(self.limit)} "
            f"needed={format_bytes(self.needed)}>"
        )


def partition_for_budget(
    tg: TaskGraph,
    budget: int | str,
    alignment: int = 256,
    fraction: float = DEFAULT_BUDGET_FRACTION,
    max_tasks: int | None = None,
) -> BudgetPartition:
    """Partition `tg` for a device of `budget` bytes: what a planner calls when a task
    cannot fit.

    The block limit is `fraction * budget` (a quarter by default: the running task's
    block, the next one's operands being prefetched, and the outputs waiting to be
    offloaded fit together), rounded down to `alignment`, but never below the smallest
    limit the graph allows – so a budget that can hold one finest block always works,
    if with little room to overlap transfers. Raises `InfeasibleBudgetError` when even
    that does not fit the budget (`needed` is the smallest budget that could work).

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (256, 1024))
    >>> prog.output(ep.softmax(x), "p")
    >>> chosen = partition_for_budget(prog.build(), "1MiB")
    >>> chosen.limit, len(chosen.graph) > 5
    (262144, True)
    """
    budget_bytes = parse_bytes(budget)
    alignment = _check_alignment(alignment)
    if not 0 < fraction <= 1:
        raise GraphError(f"fraction must be in (0, 1], got {fraction!r}")
    needed, culprit = feasible_limit(tg, geometries(tg), alignment)
    if needed > budget_bytes:
        raise InfeasibleBudgetError(
            f"budget {format_bytes(budget_bytes)} ({budget_bytes} B) cannot hold even the "
            f"finest block of task %{culprit}, which needs {format_bytes(needed)} "
            f"({needed} B): {tg[culprit].line()}",
            budget_bytes,
            needed,
            culprit,
        )
    limit = budget_block_limit(budget_bytes, needed, alignment, fraction)
    graph = partition(tg, limit, alignment=alignment, max_tasks=max_tasks)
    return BudgetPartition(graph, limit, needed)


def budget_block_limit(
    budget: int, finest: int, alignment: int = 256, fraction: float = DEFAULT_BUDGET_FRACTION
) -> int:
    """The block limit `partition_for_budget` uses for `budget` bytes: `fraction` of it,
    rounded down to `alignment`, but at least `finest` (the graph's smallest limit)."""
    return max(finest, int(budget * fraction) // alignment * alignment)


def blocks_of(tg: TaskGraph) -> dict[int, tuple[int, ...]]:
    """For a partitioned graph: each original task id -> the ids of its blocks (the tasks
    with `block.kind == "block"`), which tile its output exactly once."""
    result: dict[int, list[int]] = {}
    for task in tg.tasks:
        if task.block is not None and task.block.kind == "block":
            result.setdefault(task.block.of, []).append(task.id)
    return {of: tuple(ids) for of, ids in result.items()}
