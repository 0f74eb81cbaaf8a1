"""Why a budget is refused, in words: the errors of partitioning for a budget and the
messages `einpage.compile` raises them with (each names the budget that compiles, rounded
up with its exact bytes, and the task that needs it). The CLI rewords the options they
name in its own flags (`einpage.cli.CLI_SPELLINGS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from einpage_core.errors import InfeasibleBudgetError
from einpage_core.units import format_bytes, format_exact
from memgraph.budgets import BudgetReading, holds_at_once
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input
from taskgraph.partition import working_set

if TYPE_CHECKING:
    from einpage.pipeline.search import Budgets, Trial

__all__ = ["PartitionInfeasibleError", "TooManyBlocksError"]


# -- errors ------------------------------------------------------------------------------


class PartitionInfeasibleError(InfeasibleBudgetError):
    """The budget is too small even for the partitioned graph.

    `budget` and `needed` are bytes: `needed` is the smallest budget above `budget` that
    compiles with the same options and cap (it compiles, one byte less does not; see
    `Budgets.smallest`); `task` the id (in the graph given to `compile`) of a task that
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


# -- errors of partitioning for a budget -------------------------------------------------


def exact_size(nbytes: int, rounding: str = "nearest") -> str:
    """`12.0 MiB (12582912 B)`, or `768 B` where that says it all (`format_exact`)."""
    return format_exact(nbytes, rounding)


def brief(line: str, width: int = 160) -> str:
    """A task's line, cut short (a Concat of many blocks lists them all)."""
    return line if len(line) <= width else line[: width - 4] + " ..."


def assembly_floor(tg: TaskGraph, limit: int, alignment: int) -> tuple[int, str | None]:
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


def searched_note(budgets: Budgets) -> str:
    """` (searched within 100,000 tasks: ...)` when the smallest budget was searched under
    a smaller cap than `compile` applies (`Budgets.search_cap`), else ""."""
    if not budgets.search_bounded:
        return ""
    return (
        f" (searched within {budgets.search_cap[0]:,} tasks: with no cap, max_blocks=None, "
        f"a smaller budget may compile into more)"
    )


def a_byte_less(smallest: int, reason: str | None) -> str:
    """`; with a byte less (18,431 B), automatic partitioning would make ...`, or ""."""
    return "" if reason is None else f"; with a byte less ({smallest - 1:,} B), {reason}"


def too_many_blocks(
    budgets: Budgets, reading: BudgetReading, trial: Trial
) -> TooManyBlocksError:
    """The error for a budget whose automatic partition would make too many tasks."""
    cap, why = budgets.cap
    refused = trial.refused
    count = refused.counted if refused is not None and refused.counted is not None else cap + 1
    usable = reading.nbytes // budgets.alignment * budgets.alignment
    needed, _ = budgets.smallest(usable + budgets.alignment)
    name, searched = budgets.tg.name, searched_note(budgets)
    return TooManyBlocksError(
        name, reading.nbytes, needed, count, trial.limit, cap, why=why, searched=searched
    )


def no_block_fits(budgets: Budgets, reading: BudgetReading) -> PartitionInfeasibleError:
    """The error for a budget below even the finest block of some task; its `needed` is
    the smallest budget that compiles (under the `max_blocks` cap too)."""
    tg, alignment, needed, task_id = budgets.tg, budgets.alignment, budgets.needed, budgets.task
    floor, floor_task = budgets.finest
    assembly, output = assembly_floor(tg, floor, alignment)
    bound = min(needed, max(floor, assembly))  # no budget below it can work
    smallest, reason = budgets.smallest(bound)
    culprit = brief(tg[floor_task].line()) if floor_task is not None else "none"
    unsplit = (
        f"{holds_at_once(tg, task_id, alignment)} ({exact_size(needed)})"
        if task_id is not None
        else f"the program needs {exact_size(needed)}"
    )
    head = (
        f"budget {reading.asked}{exact_size(reading.nbytes)} is below the smallest budget that "
        f"compiles, {exact_size(smallest, 'up')}{searched_note(budgets)}"
    )
    if bound == needed:  # partitioning cannot go below the program as it is
        text = (
            f"{head}: the program unsplit. There, {unsplit}; split as finely as allowed, "
            f"task %{floor_task} needs {exact_size(floor)} ({culprit}), so partitioning cannot help"
        )
        return PartitionInfeasibleError(
            text + ".", reading.nbytes, smallest, task_id, floor, floor_task
        )
    text = (
        f"{head}. Unsplit, {unsplit}; partitioning brings that down to the smallest block "
        f"limit that works, {exact_size(floor)}, what task %{floor_task} needs even split as "
        f"finely as allowed ({culprit})"
    )
    if output is not None and assembly > floor:
        text += (
            f", and program output {output!r}, split, is rebuilt from its blocks by a "
            f"Concat that needs at least {exact_size(assembly)}"
        )
    text += f". No budget below {exact_size(bound, 'down')} can work{a_byte_less(smallest, reason)}"
    return PartitionInfeasibleError(
        text + ".", reading.nbytes, smallest, floor_task, floor, floor_task
    )


def partition_too_large(
    budgets: Budgets,
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
    far it was searched for, as `searched_note` says)."""
    tg = budgets.tg
    floor, floor_task = budgets.finest
    task = graph[task_id]
    original = task.block.of if task.block is not None else task_id
    head = (
        f"budget {reading.asked}{exact_size(reading.nbytes)} is below the smallest feasible "
        f"budget {exact_size(needed)} of {tg.name!r} partitioned at block "
        f"limit {exact_size(limit)} ({len(graph)} tasks from {len(tg)}): task {brief(task.line())}"
    )
    if task.block is not None and task.block.kind == "output":
        names = [name for name, t in tg.outputs.items() if t == original]
        text = (
            f"{head} rebuilds program output {names[0] if names else original!r} "
            f"({format_bytes(tg[original].nbytes)}) from its blocks, and needs the blocks "
            f"and the whole output on the device at once (other tasks read the blocks too, "
            f"so it cannot be assembled on the host). Only a budget of at least "
            f"{exact_size(needed, 'down')} can hold it, whatever the block limit (any from "
            f"{format_bytes(floor)} up works for the other tasks); or make the output "
            f"smaller (LLM prefill: logits='last')"
        )
    else:
        text = (
            f"{head} needs {format_bytes(needed)} at once. The smallest block limit that "
            f"works is {exact_size(floor)} (task %{floor_task})"
        )
    smallest_text = exact_size(smallest, "up")
    text += f". The smallest budget above it that compiles is {smallest_text}{searched}."
    return PartitionInfeasibleError(text, reading.nbytes, smallest, original, floor, floor_task)
