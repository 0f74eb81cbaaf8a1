"""Budgets: how a budget is read, and the reference points a TaskGraph's budgets are read against.

A budget is bytes (an int), a size string (`"8GiB"`) or a percentage of a reference
point, named after the `%` or not (then the resident peak):

* the **resident peak** (`"50%"`, `"50%resident"`; `resident_peak`): the arena of a plan
  in which everything that ever reaches the device stays there while it is needed, and
  every tensor loaded from host storage (the weights) stays until the end, nothing
  prepared early – all the weights plus the activation peak, what "the program needs".
  At 100% nothing moves: no offload, no drop of anything needed again, each weight
  loaded once (`memgraph.plan` takes a resident run's plan when its own run would move
  something there).
* the **streaming minimum** (`"150%streaming"`; `streaming_minimum`, formerly the
  "no-offload peak"): the arena when weights are loaded just in time and dropped after
  use, and nothing is ever written back – for an LLM, about one layer's weights and
  activations.
* `min_budget`: the smallest budget any plan needs (the largest single task's working
  set); below it `memgraph.plan` refuses with an `InfeasibleBudgetError` naming the
  task, and the way out: partitioning (`einpage.compile` does it when needed, or
  `taskgraph.partition_for_budget`).

`read_budget` reads a budget into a `BudgetReading` (what was given, the bytes, and the
reference point of a percentage); this is the one place percentages are parsed.
`budget_references` computes all three points for tables (`einpage show`, `plan`).
A percentage is read against the larger reference point of the program and memory
orders (and the plan's own order: `reference_point`), so `--order` does not change it.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from weakref import WeakKeyDictionary

from einpage_core.errors import InfeasibleBudgetError, PlanError
from einpage_core.units import BudgetFormatError, format_bytes, format_exact, parse_bytes
from memgraph.allocator import DEFAULT_ALIGNMENT
from memgraph.horizon import HorizonPlanner
from memgraph.options import PlanOptions
from memgraph.steps import sliced_reloads, storage_roots
from taskgraph.assembly import assembly_tasks
from taskgraph.graph import TaskGraph

__all__ = [
    "PERCENT",
    "RESIDENT_PEAK",
    "STREAMING_MINIMUM",
    "NO_OFFLOAD_PEAK",
    "REFERENCES",
    "BudgetReading",
    "BudgetReferences",
    "read_budget",
    "resolve_budget",
    "min_budget",
    "resident_peak",
    "resident_run",
    "streaming_minimum",
    "budget_references",
    "reference_point",
    "REFERENCE_ORDERS",
    "check_budget",
    "infeasible_error",
    "holds_at_once",
    "infeasible_message",
]

PERCENT = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+)\s*%\s*([A-Za-z_-]*)\s*$")
"""A percentage budget: `"50%"`, `"12.5 %"`, `"50%resident"`, `"150% streaming"`."""

RESIDENT_PEAK = "resident peak"
"""The reference point of `"50%"` and `"50%resident"` (`resident_peak`)."""

STREAMING_MINIMUM = "streaming minimum"
"""The reference point of `"50%streaming"` (`streaming_minimum`)."""

NO_OFFLOAD_PEAK = STREAMING_MINIMUM
"""The streaming minimum's former name (percentages meant it before the resident peak)."""

REFERENCES = {"resident": RESIDENT_PEAK, "streaming": STREAMING_MINIMUM}
"""The words a percentage may name after its `%` (none: "resident")."""

REFERENCE_ORDERS = ("program", "memory")
"""A reference point is the larger of these orders' (and the plan's own order's), so that
choosing an order (`--order memory`) does not change what a percentage means."""

WAY_OUT = (
    "Partition the graph so that its tasks fit: einpage.compile(program, budget) does it "
    "when needed, or plan taskgraph.partition_for_budget(tg, budget).graph"
)
"""What an infeasible budget's message suggests when a task is too large."""


@dataclass(frozen=True)
class BudgetReading:
    """How a budget was read: `request` as given, `nbytes` the bytes it means; for a
    percentage, `percent` of the `reference` point, whose value is `reference_bytes`.

    >>> str(BudgetReading("50%", 4096, 50.0, RESIDENT_PEAK, 8192))
    '50% of the resident peak 8.0 KiB = 4.0 KiB'
    >>> str(BudgetReading("8KiB", 8192))
    '8.0 KiB'
    """

    request: int | str
    nbytes: int
    percent: float | None = None
    reference: str | None = None
    reference_bytes: int | None = None

    def __str__(self) -> str:
        if self.percent is None:
            return format_bytes(self.nbytes)
        return (
            f"{self.percent:g}% of the {self.reference} {format_bytes(self.reference_bytes)} "
            f"= {format_bytes(self.nbytes)}"
        )

    @property
    def asked(self) -> str:
        """`'50%' = ` when the request was text (for messages), else ""."""
        return f"{self.request!r} = " if isinstance(self.request, str) else ""


def read_budget(
    tg: TaskGraph, budget: int | str, options: PlanOptions | None = None
) -> BudgetReading:
    """Read `budget` (bytes, a size string, or a percentage of `tg`'s resident peak or,
    as `"50%streaming"`, its streaming minimum, under `options`); raises
    `BudgetFormatError` for a malformed one.

    >>> import einpage as ep
    >>> prog = ep.Program(); x = prog.input("x", (1024,)); prog.output(ep.exp(x), "y")
    >>> read_budget(prog.build(), "50%").nbytes
    4096
    """
    if isinstance(budget, BudgetReading):
        return budget
    match = PERCENT.match(budget) if isinstance(budget, str) else None
    if match is None:
        if isinstance(budget, str) and "%" in budget:
            raise BudgetFormatError(
                f"cannot parse budget {budget!r}: expected e.g. '50%' (of the resident peak) "
                "or '150%streaming' (of the streaming minimum)"
            )
        return BudgetReading(budget, parse_bytes(budget, "budget"))
    percent, word = float(match.group(1)), match.group(2).lower() or "resident"
    if percent < 0:  # "0%" is zero bytes: refused as any budget below the minimum is
        raise BudgetFormatError(f"budget {budget!r} must not be a negative percentage")
    if word not in REFERENCES:
        raise BudgetFormatError(
            f"budget {budget!r} names no reference point {word!r}: a percentage is of the "
            f"{RESIDENT_PEAK} ('{match.group(1)}%' or '{match.group(1)}%resident') or of the "
            f"{STREAMING_MINIMUM} ('{match.group(1)}%streaming')"
        )
    peak = reference_point(tg, word, options or PlanOptions())
    return BudgetReading(budget, int(peak * percent / 100), percent, REFERENCES[word], peak)


def reference_point(tg: TaskGraph, word: str, options: PlanOptions) -> int:
    """The resident peak (`word` "resident") or streaming minimum ("streaming") a
    percentage is read against: the larger over `REFERENCE_ORDERS` and `options.order`."""
    peaks = []
    for order in dict.fromkeys([*REFERENCE_ORDERS, options.order]):
        opts = replace(options, order=order)
        if word == "resident":
            peaks.append(resident_peak(tg, opts))
        else:
            peaks.append(streaming_minimum(tg, order, opts.alignment, opts.outputs, opts.inputs))
    return max(peaks)


def resolve_budget(tg: TaskGraph, budget: int | str, options: PlanOptions | None = None) -> int:
    """`budget` in bytes: an int, a size string, or a percentage (see `read_budget`).

    Raises `BudgetFormatError` for a malformed budget and `InfeasibleBudgetError` when
    it is below `min_budget`.
    """
    opts = options or PlanOptions()
    reading = read_budget(tg, budget, opts)
    check_budget(tg, reading, opts)
    return reading.nbytes


def check_budget(tg: TaskGraph, reading: BudgetReading, options: PlanOptions) -> int:
    """`tg`'s `min_budget`, after checking the budget holds it (else the error of
    `infeasible_error`)."""
    needed, task_id = min_budget(tg, options.alignment, options.inputs)
    if reading.nbytes // options.alignment * options.alignment < needed:
        raise infeasible_error(tg, reading, needed, task_id, options.alignment)
    return needed


def min_budget(
    tg: TaskGraph, alignment: int = DEFAULT_ALIGNMENT, inputs: str = "auto"
) -> tuple[int, int | None]:
    """The smallest budget any plan needs, and the task that needs it.

    A compute task runs only with its distinct operands (views resolved to their bases),
    its output and its kernel's workspace (`Task.workspace`) resident at once, each
    rounded up to `alignment`; the bound is the
    largest such sum (ties: the first task). A Slice produced by a sliced reload
    (`memgraph.steps.sliced_reloads`; `inputs` is the planner's option) needs only
    itself, and the Concats of an output assembled on the host (`taskgraph.assembly`)
    nothing. The planner always succeeds at or above it. A graph without compute tasks
    needs one alignment unit (task None).

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (100,))
    >>> prog.output(x * x, "y")
    >>> min_budget(prog.build())  # x (400 B) and x * x, each rounded up to 512 B
    (1024, 1)

    A TaskGraph never changes, so each graph's figure is computed once per `alignment`
    and `inputs` and remembered while the graph lives (`einpage.compile` and
    `memgraph.plan` both ask for it).
    """
    known = _MIN_BUDGETS.setdefault(tg, {})
    if (alignment, inputs) not in known:
        known[alignment, inputs] = _min_budget(tg, alignment, inputs)
    return known[alignment, inputs]


_MIN_BUDGETS: WeakKeyDictionary[TaskGraph, dict[tuple[int, str], tuple[int, int | None]]] = (
    WeakKeyDictionary()
)
"""`min_budget`'s figures by graph, then by (alignment, inputs)."""


def _min_budget(tg: TaskGraph, alignment: int, inputs: str) -> tuple[int, int | None]:
    """`min_budget`, computed."""
    root = storage_roots(tg)
    sliced = sliced_reloads(tg, inputs)
    on_host = assembly_tasks(tg)
    size = [_round_up(t.nbytes, alignment) for t in tg]
    best, best_task = alignment, None
    for task in tg:
        if not task.is_compute or task.id in on_host:
            continue
        need = size[task.id]
        if task.id not in sliced:
            need += sum(size[r] for r in {root[i] for i in task.inputs})
            need += _round_up(task.workspace, alignment)
        if need > best or best_task is None and need >= best:
            best, best_task = need, task.id
    return best, best_task


def streaming_minimum(
    tg: TaskGraph,
    order: str | Sequence[int] = "program",
    alignment: int = DEFAULT_ALIGNMENT,
    outputs: str = "device",
    inputs: str = "auto",
) -> int:
    """The smallest arena the planner needs when nothing may be written back to the host
    and weights are loaded just in time (`no_offload_peak`, its former name, is a
    deprecated alias).

    It plans with an arena large enough for every tensor at once and without any
    prefetching (`lookahead=0`: each reload just before its step, so nothing is held
    early), and returns the arena high-water mark (`"50%streaming"` budgets are relative
    to it). At that budget a plan with prefetching may still evict a little, as
    prefetching holds memory earlier and the layout differs.
    """
    opts = PlanOptions(  # in an arena this large, "room" placement is plain best fit
        order=order,
        alignment=alignment,
        outputs=outputs,
        inputs=inputs,
        lookahead=0,
        placement="best_fit",
    )
    planner = HorizonPlanner(tg, _everything(tg, alignment), opts)
    planner.run()
    if planner.counts.evictions:  # pragma: no cover - the arena holds every tensor at once
        raise PlanError("streaming_minimum: the unbounded arena had to evict")
    return max(planner.high_water, alignment)


DEPRECATED_NAMES = {"no_offload_peak": "streaming_minimum"}
"""Former names still importable from `memgraph` (and here), with a DeprecationWarning."""


def deprecated(module: str, name: str, stacklevel: int = 3) -> Any:
    """What the deprecated alias `name` of `DEPRECATED_NAMES` stands for, after a
    `DeprecationWarning` naming the new name; `AttributeError` for any other name
    (a module's `__getattr__`)."""
    if name not in DEPRECATED_NAMES:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = DEPRECATED_NAMES[name]
    warnings.warn(
        f"memgraph.{name} is deprecated: use memgraph.{new}", DeprecationWarning, stacklevel
    )
    return globals()[new]


def __getattr__(name: str) -> Any:
    return deprecated(__name__, name)


def resident_run(
    tg: TaskGraph, budget: int, options: PlanOptions, prefetch: bool = False
) -> HorizonPlanner:
    """The resident run, done: `tg` planned with `options` in an arena that holds every
    tensor at once, keeping each tensor loaded from host storage until the end, its
    MemGraph recording `budget`. Placement is best fit and, unless `prefetch`, nothing is
    prepared ahead (`lookahead=0`: each tensor allocated at its step). It moves nothing;
    without `prefetch` its high-water mark is the resident peak."""
    opts = replace(options, placement="best_fit", lookahead=options.lookahead if prefetch else 0)
    planner = HorizonPlanner(
        tg, budget, opts, arena=_everything(tg, opts.alignment), keep_loaded=True
    )
    planner.run()
    if planner.moved():  # pragma: no cover - the arena holds every tensor at once
        raise PlanError("resident_run: the unbounded arena had to evict")
    return planner


def resident_peak(tg: TaskGraph, options: PlanOptions | None = None) -> int:
    """The arena a plan needs when everything stays on the device while needed and every
    weight stays once loaded, nothing prepared early: the high-water mark of
    `resident_run` under `options`. A budget of at least this moves nothing (see
    `memgraph.plan`).

    >>> import einpage as ep
    >>> prog = ep.Program(); x = prog.input("x", (64,)); w = prog.input("w", (64,), role="weight")
    >>> prog.output(ep.exp(x * w), "y")
    >>> resident_peak(prog.build())  # w (it stays), x * w and exp(...): 256 B each
    768
    """
    opts = options or PlanOptions()
    return max(resident_run(tg, opts.alignment, opts).high_water, opts.alignment)


@dataclass(frozen=True)
class BudgetReferences:
    """A TaskGraph's budget reference points in bytes (see the module docstring), and the
    task that needs `min_budget` (None: no compute task)."""

    resident_peak: int
    streaming_minimum: int
    min_budget: int
    min_task: int | None

    def rows(self) -> list[tuple[str, str]]:
        """Table rows: each point, what it means and how to ask for it."""
        task = "" if self.min_task is None else f", task %{self.min_task}"
        return [
            (RESIDENT_PEAK, f"{format_bytes(self.resident_peak)} (all weights stay; = 100%)"),
            (
                STREAMING_MINIMUM,
                f"{format_bytes(self.streaming_minimum)} (weights streamed; = 100%streaming)",
            ),
            ("smallest budget", f"{format_bytes(self.min_budget)} (unpartitioned{task})"),
        ]


def budget_references(tg: TaskGraph, options: PlanOptions | None = None) -> BudgetReferences:
    """The resident peak, streaming minimum (as percentages read them: `reference_point`)
    and `min_budget` of `tg` under `options`."""
    opts = options or PlanOptions()
    needed, task = min_budget(tg, opts.alignment, opts.inputs)
    return BudgetReferences(
        reference_point(tg, "resident", opts), reference_point(tg, "streaming", opts), needed, task
    )


def infeasible_message(
    tg: TaskGraph, reading: BudgetReading, needed: int, task_id: int | None, alignment: int
) -> str:
    """Why `reading` is below `needed` (`min_budget`): the task and what it holds at once.
    `needed` is printed rounded up with its bytes (`format_exact`): typed back, it plans."""
    head = (
        f"budget {reading.asked}{format_exact(reading.nbytes, 'nearest')} is below the "
        f"smallest feasible budget {format_exact(needed)}"
    )
    if task_id is None:
        return f"{head}: the arena needs at least one alignment unit ({alignment} B)"
    return f"{head}: {holds_at_once(tg, task_id, alignment)}"


def holds_at_once(tg: TaskGraph, task_id: int, alignment: int) -> str:
    """What task `task_id` needs on the device at once (its line, operands and output)."""
    task = tg[task_id]
    roots = dict.fromkeys(tg.storage_root(i) for i in task.inputs)
    operands = ", ".join(f"%{r} ({format_bytes(tg[r].nbytes)})" for r in roots) or "none"
    scope = f" in scope {task.scope!r}" if task.scope else ""
    held = f"its operands [{operands}] and its output ({format_bytes(task.nbytes)})"
    if task.workspace:
        held = (
            f"its operands [{operands}], its output ({format_bytes(task.nbytes)}) and its "
            f"kernel's workspace ({format_bytes(task.workspace)})"
        )
    return f"task {task.line()}{scope} needs {held} resident at once, each aligned to {alignment} B"


def infeasible_error(
    tg: TaskGraph, reading: BudgetReading, needed: int, task_id: int | None, alignment: int
) -> InfeasibleBudgetError:
    """The error for a budget below `min_budget`: `infeasible_message`, and the way out
    (partitioning) when a task is too large."""
    text = infeasible_message(tg, reading, needed, task_id, alignment)
    if task_id is not None:
        text = f"{text}. {WAY_OUT}."
    return InfeasibleBudgetError(text, reading.nbytes, needed, task_id)


def _everything(tg: TaskGraph, alignment: int) -> int:
    """An arena holding every tensor and kernel workspace of `tg` at once, plus one
    alignment unit."""
    held = sum(_round_up(t.nbytes, alignment) + _round_up(t.workspace, alignment) for t in tg)
    return held + alignment


def _round_up(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment
