"""The planner: `plan(tg, budget) -> MemGraph`, by simulated execution in a bounded arena.

The planner walks a topological order of the TaskGraph (`memgraph.orders`) and
simulates running it in a device arena of `budget` bytes, managed by
`memgraph.allocator.Allocator` (best fit, aligned, with precise free provenance).
Only compute tasks are *steps*; inputs are placed up front and views occupy no
memory (a view's readers read its base's region, and a view keeps its base alive).

Two horizons
------------
* The **execution horizon** `e` is the next step whose apply is emitted.
* The **allocation horizon** `a >= e`: steps `[e, a)` are *prepared* – their output
  is allocated and their operands are resident (host-resident ones reloaded). Before
  each apply the allocation horizon advances greedily, preparing step `a` with
  allocations that must fit **without evicting** (all or nothing, through an
  allocator checkpoint), up to a target:

  - never more than `lookahead` steps ahead of `e` (0: no prefetch at all);
  - `lookahead_seconds="auto"` (the default): far enough to hide the transfers, not
    further. With C(e, t) the estimated compute seconds of steps e..t-1 (the cost
    model's roofline) and H(e, t) the seconds of host-to-device transfers that steps
    e..t need (counting those already issued, as if none had started), the target is
    the furthest t with C(e + 1, t) < H(e, t): t is prepared now if preparing it at
    the next chance, before step e + 1, would leave too little compute to hide its
    transfers behind. A step whose reloads are covered even then can wait, and
    holding its memory early would only crowd out other prefetches. (Comparing with
    C(e, t) instead would wait one step too long: with one large step before t –
    LLaMA's gate projection before the up projection – "later" is already too late.)
    Only steps with pending transfers can be that furthest t, so the scan visits just
    those.
  - `lookahead_seconds=<float>`: the furthest t with C(e, t) below that many seconds;
    `None`: only the step limit.

  If step `e` is not prepared when its turn comes (the horizon stalled at it for lack
  of memory), it is prepared *at the execution horizon*, where allocation may evict.
  Then the horizon is empty (a == e), so nothing prefetched for a later step is live:
  the only pinned tensors are step e's own operands and output.

Victim choice
-------------
An allocation that does not fit at the execution horizon asks `memgraph.eviction`
for the best contiguous window of the arena (see there): by default the window whose
soonest-needed occupant is needed furthest in the future (Belady, from next-use
positions precomputed per tensor as sorted lists with a moving pointer), ties to
fewer bytes that need a transfer (a tensor with a valid host copy – a weight, or
anything offloaded before, as tensors are immutable – is dropped with no transfer),
then to fewer bytes evicted. Step e's operands and output are never victims. The
`"lru"` policy uses the same machinery with last-use positions.

Placement and fragmentation
---------------------------
Allocations without eviction use the allocator's best fit, unless that would leave no
room for the next step that reads the tensor (`placement="room"`, the default): that
step must hold its whole working set at once, so between its tensors already on the
device there must stay one gap as large as the rest of it; otherwise the tensor goes
to the smallest free block, at whichever end, that keeps such a gap (best fit if none
does). A big activation placed mid-arena would otherwise force its reader to move it
through the host.

When a request at the execution horizon fails although enough bytes are free, the
window search handles it (it evicts the cheapest neighbours of free blocks to join
them); such requests are counted in `info["fragmentation_events"]`. If some tensor of
step e finds no window at all (step e's own tensors split the arena), the missing
tensors are packed into one window of their total size, keeping step e's resident
operands in place (`info["packed_steps"]`); failing that, into one window that also
has room for those operands, which may then be moved through the host
(`info["operand_moves"]`). That window always exists when the budget is at least
`min_budget`: everything is evictable then, and the arena holds all of step e's
tensors. There is never a compaction copy (the MemGraph has no copy node).

Lifetimes and ends
------------------
* A tensor is freed as soon as the apply of its last reader is emitted.
* Inputs: weights start in host storage (`Input.location`). Device-located inputs
  are allocated at the start, in id order, while they fit without evicting; the rest
  start on the host (`inputs="host"` puts every input there; an input that nothing
  reads is always left on the host unless it is a device-side output).
* Outputs (`outputs="device"`, the default) stay resident to the end and get a device
  `output` node (except split outputs assembled on the host, see "Host assembly");
  one evicted on the way is reloaded at the end if it fits without evicting, else it
  is output from its host copy (`info["outputs_on_host"]`). With `outputs="host"`
  each output is offloaded as soon as it is computed (the copy overlaps later
  compute) and freed after its last reader.

Sliced reloads
--------------
A Slice that reads an input held in host storage (`sliced_reloads` says which) is not
computed on the device. Like a weight, it is a tensor with a host copy from the start –
a box of the input's storage: whenever a reader needs it, a *sliced reload* copies just
that box, and evicting it is a drop. So an input larger than the arena (a weight that a
partitioned graph reads block by block, see `taskgraph.partition`) is streamed in
slices and never resident whole, and `min_budget` counts a slice's readers with the
slice alone. A device-located input read only through such slices starts on the host.
A slice that nothing reads is made once, by a sliced reload at its place in the order,
and freed.

Partitioning
------------
When some task cannot run even alone in the arena (`min_budget` above the budget),
`plan(..., partition="auto")` (the default) plans `taskgraph.partition_for_budget(tg,
budget)` instead: the graph split into block tasks whose working sets fit a block
limit of a quarter of the budget (room for the running block, the next one's prefetched
operands and outputs waiting to leave), or the smallest limit the graph allows if that
is more. Weights larger than a block are then read through slices of the input, which
sliced reloads stream. A graph that fits is planned as it is: partitioning it would
only add tasks. `partition="off"` never partitions; `partition="64MiB"` always does, at
that limit.

A split program output is rebuilt by Concats of kind "output", the one exception to the
block limit. They never run on the device when `taskgraph.assembly.output_assemblies`
allows (nothing but the Concats reads the blocks): the output is *assembled on the
host* (below). Otherwise a Concat rebuilds it on the device and holds its blocks and
the whole output at once (twice the output); if that cannot fit,
`PartitionInfeasibleError` says so and names the budget it needs (for LLM prefill,
`logits="last"` keeps the output small). It also reports, when no block limit can fit,
the smallest budget that could work and the smallest block limit, with the task that
needs it.

Host assembly
-------------
Whether `plan` partitioned the graph or was given a partitioned one, for an output
assembled on the host each piece (a block, or the base of a View of one) is copied,
right after its apply, by a *sliced offload* (`MemNode.into`) into its box of the
output's host storage, and freed once that copy is done (the free depends on it).
The tree's Concats are not steps and `min_budget` does not count them. The
output ends on the host whatever `outputs` says, its `output` node depending on every
sliced offload that fills it; with `outputs="device"` its name is listed in
`info["outputs_on_host"]`, and `info["sliced_offloads"]` counts the copies.

Speed: everything per step is O(operands) plus O(log n) allocator work, except a
victim search, which activates tensors only until a window forms (see
`memgraph.eviction`). `benchmarks/plan_bench.py` measures ~50-65 us per task, linear
in size: a 62k-task transformer-like graph with 4,250 evictions plans in 3-4 s.
Partitioned LLaMA prefill (`benchmarks/feasibility.py`): `plan` takes 7 s for 7B at
batch 32 x 8192 under 16 GiB (61k block tasks) and 16 s for 65B under 32 GiB (153k),
partitioning included (about half of it).

Dependencies are exactly the verifier's rules: an alloc waits for the frees of the
bytes it reuses (the allocator's `Block.deps`); a reload for its alloc and for the
node that wrote its host storage; an apply for its output's alloc and for the writer
of each operand; an offload for the writer; a free for every reader and offload of
the residency (which imply the writer and the alloc). Nothing else, so transfers can
overlap compute.

>>> import einpage as ep
>>> prog = ep.Program("drop")
>>> x = prog.input("x", (256, 256))  # 256 KiB each
>>> w = prog.input("w", (256, 256), role="weight")
>>> v = prog.input("v", (256, 256), role="weight")
>>> prog.output((x @ w) @ v @ w, "y")
>>> tg = prog.build()
>>> min_budget(tg)  # three 256 KiB tensors at once, first needed by task %3
(786432, 3)
>>> mg = plan(tg, "768KiB")  # w is dropped for v's step and reloaded for the last
>>> s = mg.stats
>>> s.reload_count, s.drop_count, s.offload_count
(3, 1, 0)
"""

from __future__ import annotations

import bisect
import heapq
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from einpage_core.errors import InfeasibleBudgetError, PlanError
from einpage_core.units import BudgetFormatError, format_bytes, parse_bytes
from memgraph.allocator import DEFAULT_ALIGNMENT, Allocator, Block
from memgraph.cost import CostModel, get_cost_model
from memgraph.eviction import NEVER, EvictionContext, Segment, choose_window_ranked, get_policy
from memgraph.graph import MemGraph, MemGraphBuilder
from memgraph.nodes import Region
from memgraph.orders import check_order, get_order, is_compute
from taskgraph.assembly import assembly_tasks, output_assemblies
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input, Slice
from taskgraph.partition import finest_block, partition_for_budget, working_set
from taskgraph.partition import partition as partition_graph

__all__ = [
    "PlanOptions",
    "plan",
    "min_budget",
    "no_offload_peak",
    "resolve_budget",
    "storage_roots",
    "sliced_reloads",
    "OUTPUTS",
    "INPUTS",
    "PLACEMENTS",
    "PARTITION_MODES",
    "PartitionInfeasibleError",
]

OUTPUTS = ("device", "host")
"""Where program outputs end: resident on the device, or offloaded to host storage."""
INPUTS = ("auto", "host")
"""Where inputs start: "auto" follows each `Input.location` (device ones while they fit)."""

PLACEMENTS = ("room", "best_fit")
"""Where allocations without eviction go: "room" (best fit, unless that leaves no room
for the next step that reads the tensor, see `_Planner.keeps_room`) or plain "best_fit"."""
PARTITION_MODES = ("auto", "off")
"""`plan(..., partition=)`: "auto" partitions a graph with a task that cannot fit the
budget, "off" never partitions; an explicit block limit (bytes or a size string) always
partitions at that limit."""

_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


@dataclass(frozen=True)
class PlanOptions:
    """The planner's options (see `plan`), validated; `info()` is their JSON form."""

    order: str | tuple[int, ...] = "program"
    eviction: str = "belady"
    lookahead: int = 64
    lookahead_seconds: float | str | None = "auto"
    cost_model: str | CostModel = "h100-pcie5"
    alignment: int = DEFAULT_ALIGNMENT
    outputs: str = "device"
    inputs: str = "auto"
    placement: str = "room"

    def __post_init__(self) -> None:
        if not isinstance(self.order, str):
            object.__setattr__(self, "order", tuple(self.order))
        else:
            get_order(self.order)
        get_policy(self.eviction)
        get_cost_model(self.cost_model)
        if isinstance(self.lookahead, bool) or not isinstance(self.lookahead, int):
            raise PlanError(f"lookahead must be a number of steps >= 0, got {self.lookahead!r}")
        if self.lookahead < 0:
            raise PlanError(f"lookahead must be a number of steps >= 0, got {self.lookahead}")
        seconds = self.lookahead_seconds
        if not (seconds is None or seconds == "auto" or _is_nonnegative_number(seconds)):
            raise PlanError(
                f"lookahead_seconds must be 'auto', None or seconds >= 0, got {seconds!r}"
            )
        if isinstance(self.alignment, bool) or not isinstance(self.alignment, int):
            raise PlanError(f"alignment must be a positive int, got {self.alignment!r}")
        if self.alignment <= 0:
            raise PlanError(f"alignment must be a positive int, got {self.alignment}")
        if self.outputs not in OUTPUTS:
            raise PlanError(f"outputs must be one of {OUTPUTS}, got {self.outputs!r}")
        if self.inputs not in INPUTS:
            raise PlanError(f"inputs must be one of {INPUTS}, got {self.inputs!r}")
        if self.placement not in PLACEMENTS:
            raise PlanError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")

    def info(self) -> dict[str, Any]:
        cost = get_cost_model(self.cost_model)
        return {
            "order": self.order if isinstance(self.order, str) else "custom",
            "eviction": self.eviction,
            "lookahead": self.lookahead,
            "lookahead_seconds": self.lookahead_seconds,
            "cost_model": cost.name,
            "alignment": self.alignment,
            "outputs": self.outputs,
            "inputs": self.inputs,
            "placement": self.placement,
        }


def _is_nonnegative_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


# --------------------------------------------------------------------------- public API


class PartitionInfeasibleError(InfeasibleBudgetError):
    """The budget is too small even for the partitioned graph.

    `budget` and `needed` (the smallest budget that could work: none below it does) are
    bytes, `task` the id (in the graph given to `plan`) of a task that needs it;
    `block_limit` is the smallest block limit `taskgraph.partition` accepts and
    `block_task` the task that needs that limit.
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


def plan(
    tg: TaskGraph, budget: int | str, *, partition: bool | int | str = "auto", **options: Any
) -> MemGraph:
    """Plan `tg` to run in a device arena of `budget` bytes; returns the MemGraph.

    `budget`: bytes (int), a size string (`"8GiB"`), or a percentage of the no-offload
    peak (`"50%"`, see `no_offload_peak`).

    `partition` (fine-grained paging, see "Partitioning" in the module docstring):

    * "auto" (or True, the default): if some task cannot fit the budget even alone
      (`min_budget` above it), plan `taskgraph.partition_for_budget(tg, budget)`
      instead – the graph split into blocks of at most a quarter of the budget, or of
      the smallest block limit the graph allows if that is more; otherwise plan `tg`;
    * "off" (or False): never partition;
    * a block limit (bytes or a size string, `"64MiB"`): partition at that limit.

    The MemGraph then holds the partitioned TaskGraph (same input and output names, so
    `runtime.run(mg, inputs)` takes the inputs of `tg`), and `info` records the choice:
    "partition", "block_limit" (None when not partitioned), "original_tasks",
    "original_min_budget" and "finest_block_limit".

    Options (all keyword):

    * `order`: a name in `memgraph.orders.ORDERS` ("program", "memory"), or a
      topological order as a sequence of task ids;
    * `eviction`: a name in `memgraph.eviction.POLICIES` ("belady", "lru");
    * `lookahead`: the most steps the allocation horizon runs ahead (default 64);
    * `lookahead_seconds`: "auto" (hide the pending transfers, the default), seconds
      of estimated compute, or None (only `lookahead` limits prefetching);
    * `cost_model`: a `memgraph.cost.PRESETS` name or a `CostModel` (for the lookahead);
    * `alignment`: arena alignment in bytes (default 256);
    * `outputs`: "device" (the default) or "host"; `inputs`: "auto" or "host".

    Raises `InfeasibleBudgetError` when the budget is too small: with `needed` =
    `min_budget` when not partitioning, else a `PartitionInfeasibleError` that also
    names the smallest block limit; `BudgetFormatError` for a malformed budget,
    `PlanError` for a bad option.
    """
    opts = PlanOptions(**options)
    mode = _partition_mode(partition)
    resolved = _budget_bytes(tg, budget, opts)
    graph, paging = _choose_partition(tg, budget, resolved, mode, opts)
    needed = paging.pop("min_budget")
    planner = _Planner(graph, resolved, opts)
    planner.run()
    info = {
        "planner": "memgraph.planner",
        **opts.info(),
        "budget_request": budget if isinstance(budget, int) else str(budget),
        "min_budget": needed,
        **paging,
        **planner.counters(),
    }
    return planner.builder.build(info)


def min_budget(
    tg: TaskGraph, alignment: int = DEFAULT_ALIGNMENT, inputs: str = "auto"
) -> tuple[int, int | None]:
    """The smallest budget any plan needs, and the task that needs it.

    A compute task runs only with its distinct operands (views resolved to their bases)
    and its output resident at once, each rounded up to `alignment`; the bound is the
    largest such sum (ties: the first task). A Slice produced by a sliced reload
    (`sliced_reloads`; `inputs` is the planner's option) needs only itself, and the
    Concats of an output assembled on the host (`taskgraph.assembly`) nothing. The planner
    always succeeds at or above it. A graph without compute tasks needs one alignment
    unit (task None).

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (100,))
    >>> prog.output(x * x, "y")
    >>> min_budget(prog.build())  # x (400 B) and x * x, each rounded up to 512 B
    (1024, 1)
    """
    root = storage_roots(tg)
    sliced = sliced_reloads(tg, inputs)
    on_host = assembly_tasks(tg)
    size = [_round_up(t.nbytes, alignment) for t in tg]
    best, best_task = alignment, None
    for task in tg:
        if not is_compute(tg, task.id) or task.id in on_host:
            continue
        need = size[task.id]
        if task.id not in sliced:
            need += sum(size[r] for r in {root[i] for i in task.inputs})
        if need > best or best_task is None and need >= best:
            best, best_task = need, task.id
    return best, best_task


def storage_roots(tg: TaskGraph) -> list[int]:
    """`tg.storage_root` of every task, in one pass (a view's input comes before it)."""
    root = list(range(len(tg)))
    for task in tg:
        if task.op.aliases_input:
            root[task.id] = root[task.inputs[0]]
    return root


def sliced_reloads(tg: TaskGraph, inputs: str = "auto") -> dict[int, int]:
    """The Slice tasks a plan produces by *sliced reloads*: slice id -> the input it reads.

    A Slice that reads an Input directly qualifies when that input starts on the host –
    a host-located input, any input with `inputs="host"`, or a device-located one read
    only by qualifying Slices (the planner then leaves it on the host) – unless the
    slice holds a program output (an output needs a host copy of its own). Such a slice
    is never computed from its input: each time a reader needs it, the planner copies
    just its box from the input's host storage (see "Sliced reloads" in the module
    docstring), so the input need never be on the device whole.

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> w = prog.input("w", (64, 8), role="weight")
    >>> prog.output(ep.exp(prog.slice(w, (16, 0), (8, 8))), "y")
    >>> sliced_reloads(prog.build())
    {1: 0}
    """
    root = storage_roots(tg)
    outputs = {root[t] for t in tg.outputs.values()}
    candidates = {
        t.id: t.inputs[0]
        for t in tg
        if isinstance(t.op, Slice) and isinstance(tg[t.inputs[0]].op, Input) and t.id not in outputs
    }
    slices_of: dict[int, list[int]] = {}
    for s, i in candidates.items():
        slices_of.setdefault(i, []).append(s)
    sliced: dict[int, int] = {}
    for i, slices in slices_of.items():
        op = tg[i].op
        on_host = (
            inputs == "host"
            or op.location == "host"
            or all(c in candidates for c in tg.consumers[i])
        )
        if on_host:
            sliced.update((s, i) for s in slices)
    return sliced


def no_offload_peak(
    tg: TaskGraph,
    order: str | Sequence[int] = "program",
    alignment: int = DEFAULT_ALIGNMENT,
    outputs: str = "device",
    inputs: str = "auto",
) -> int:
    """The smallest arena the planner needs when nothing may leave the device.

    It plans with an arena large enough for every tensor at once and without any
    prefetching (`lookahead=0`: each reload just before its step, so nothing is held
    early), and returns the arena high-water mark. Percentage budgets ("50%") are
    relative to it. At that budget a plan with prefetching may still evict a little,
    as prefetching holds memory earlier and the layout differs.
    """
    opts = PlanOptions(  # in an arena this large, "room" placement is plain best fit
        order=order,
        alignment=alignment,
        outputs=outputs,
        inputs=inputs,
        lookahead=0,
        placement="best_fit",
    )
    everything = sum(_round_up(t.nbytes, alignment) for t in tg) + alignment
    planner = _Planner(tg, everything, opts)
    planner.run()
    if planner.evictions:  # pragma: no cover - the arena holds every tensor at once
        raise PlanError("no_offload_peak: the unbounded arena had to evict")
    return max(planner.high_water, alignment)


def resolve_budget(tg: TaskGraph, budget: int | str, options: PlanOptions | None = None) -> int:
    """`budget` in bytes: an int, a size string, or a percentage of `no_offload_peak`.

    Raises `BudgetFormatError` for a malformed budget and `InfeasibleBudgetError` when
    it is below `min_budget`.
    """
    return _resolve_budget(tg, budget, options or PlanOptions())[0]


def _budget_bytes(tg: TaskGraph, budget: int | str, opts: PlanOptions) -> int:
    """`budget` in bytes: an int, a size string, or a percentage of `no_offload_peak`."""
    text = budget if isinstance(budget, str) else None
    match = _PERCENT.match(text) if text is not None else None
    if match is not None:
        percent = float(match.group(1))
        peak = no_offload_peak(tg, opts.order, opts.alignment, opts.outputs, opts.inputs)
        return int(peak * percent / 100)
    if text is not None and "%" in text:
        raise BudgetFormatError(f"cannot parse budget {budget!r}: expected e.g. '50%'")
    return parse_bytes(budget)


def _resolve_budget(tg: TaskGraph, budget: int | str, opts: PlanOptions) -> tuple[int, int]:
    """(budget in bytes, min_budget), or the errors of `resolve_budget`."""
    resolved = _budget_bytes(tg, budget, opts)
    needed, task_id = min_budget(tg, opts.alignment, opts.inputs)
    if resolved // opts.alignment * opts.alignment < needed:
        raise InfeasibleBudgetError(
            _infeasible_message(tg, budget, resolved, needed, task_id, opts.alignment),
            resolved,
            needed,
            task_id,
        )
    return resolved, needed


def _infeasible_message(
    tg: TaskGraph, request: Any, budget: int, needed: int, task_id: int | None, alignment: int
) -> str:
    asked = f"{request!r} = " if isinstance(request, str) else ""
    head = (
        f"budget {asked}{format_bytes(budget)} ({budget} B) is below the smallest feasible "
        f"budget {format_bytes(needed)} ({needed} B)"
    )
    if task_id is None:
        return f"{head}: the arena needs at least one alignment unit ({alignment} B)"
    task = tg[task_id]
    roots = dict.fromkeys(tg.storage_root(i) for i in task.inputs)
    operands = ", ".join(f"%{r} ({format_bytes(tg[r].nbytes)})" for r in roots) or "none"
    scope = f" in scope {task.scope!r}" if task.scope else ""
    return (
        f"{head}: task {task.line()}{scope} needs its operands [{operands}] and its "
        f"output ({format_bytes(task.nbytes)}) resident at once, each aligned to {alignment} B"
    )


def _round_up(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


# --------------------------------------------------------------------------- partitioning


def _partition_mode(partition: Any) -> str | int:
    """The mode `plan`'s `partition` argument asks for: "auto", "off" or a block limit."""
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


def _choose_partition(
    tg: TaskGraph, request: Any, budget: int, mode: str | int, opts: PlanOptions
) -> tuple[TaskGraph, dict[str, Any]]:
    """The graph to plan (`tg` or its partition) and what `info` records of the choice,
    with "min_budget" (the graph's); raises when the budget is infeasible."""
    alignment = opts.alignment
    usable = budget // alignment * alignment
    needed, task_id = min_budget(tg, alignment, opts.inputs)
    paging: dict[str, Any] = {
        "partition": mode if isinstance(mode, str) else "limit",
        "block_limit": None,
        "original_tasks": len(tg),
        "min_budget": needed,
    }
    if mode == "off" or (mode == "auto" and (usable >= needed or task_id is None)):
        if usable < needed:
            raise InfeasibleBudgetError(
                _infeasible_message(tg, request, budget, needed, task_id, alignment),
                budget,
                needed,
                task_id,
            )
        return tg, paging
    floor, floor_task = finest_block(tg, alignment)
    if isinstance(mode, int):
        graph, limit = partition_graph(tg, mode, alignment=alignment), mode
    else:
        if floor > usable:
            raise _no_block_fits(tg, request, budget, needed, task_id, floor, floor_task, opts)
        chosen = partition_for_budget(tg, usable, alignment=alignment)
        graph, limit = chosen.graph, chosen.limit
    part_needed, part_task = min_budget(graph, alignment, opts.inputs)
    if usable < part_needed:
        raise _partition_too_large(
            tg, graph, request, budget, limit, part_needed, part_task, floor, floor_task
        )
    paging.update(
        block_limit=limit,
        original_min_budget=needed,
        finest_block_limit=floor,
        min_budget=part_needed,
    )
    return graph, paging


def _size(nbytes: int) -> str:
    """`12.0 MiB (12582912 B)`, or `768 B` where that says it all."""
    text = format_bytes(nbytes)
    return text if text == f"{nbytes} B" else f"{text} ({nbytes} B)"


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
        need = 2 * _round_up(task.nbytes, alignment)
        if need > best:
            best, name = need, output
    return best, name


def _no_block_fits(
    tg: TaskGraph,
    request: Any,
    budget: int,
    needed: int,
    task_id: int | None,
    floor: int,
    floor_task: int | None,
    opts: PlanOptions,
) -> PartitionInfeasibleError:
    """The error for a budget below even the finest block of some task."""
    assembly, output = _assembly_floor(tg, floor, opts.alignment)
    smallest = max(floor, assembly)
    head = _infeasible_message(tg, request, budget, needed, task_id, opts.alignment)
    culprit = _brief(tg[floor_task].line()) if floor_task is not None else "none"
    text = (
        f"{head}. Partitioning cannot bring it within the budget: the smallest block limit "
        f"that works is {_size(floor)}, what task %{floor_task} needs "
        f"even split as finely as allowed ({culprit})"
    )
    if output is not None and assembly > floor:
        text += (
            f", and program output {output!r}, split, is rebuilt from its blocks by a "
            f"Concat that needs at least {_size(assembly)}"
        )
    text += f". No budget below {_size(smallest)} can work."
    return PartitionInfeasibleError(text, budget, smallest, floor_task, floor, floor_task)


def _partition_too_large(
    tg: TaskGraph,
    graph: TaskGraph,
    request: Any,
    budget: int,
    limit: int,
    needed: int,
    task_id: int | None,
    floor: int,
    floor_task: int | None,
) -> PartitionInfeasibleError:
    """The error for a partitioned graph with a task that still does not fit: the
    Concat that rebuilds a split program output on the device (the one exception to the
    block limit, when the output cannot be assembled on the host), or a task over the
    limit."""
    asked = f"{request!r} = " if isinstance(request, str) else ""
    task = graph[task_id]
    original = task.block.of if task.block is not None else task_id
    head = (
        f"budget {asked}{_size(budget)} is below the smallest feasible "
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
            f"{format_bytes(needed)} can hold it, whatever the block limit (any from "
            f"{format_bytes(floor)} up works for the other tasks); or make the output "
            f"smaller (LLM prefill: logits='last')."
        )
    else:
        text = (
            f"{head} needs {format_bytes(needed)} at once. The smallest block limit that "
            f"works is {format_bytes(floor)} ({floor} B, task %{floor_task}); a budget of "
            f"{format_bytes(needed)} or a smaller block limit may work."
        )
    return PartitionInfeasibleError(text, budget, needed, original, floor, floor_task)


# --------------------------------------------------------------------------- state


@dataclass(slots=True, eq=False)
class _Tensor:
    """The planner's view of one storage root (a non-view task): where its bytes are.

    `uses` are the step positions that read it (plus `len(steps)` for a device output),
    `ptr` indexes the next one. On the device: `region`, its `alloc` node, the node
    that wrote it (`writer`: apply, reload or input; None while an output is allocated
    but not yet computed) and `users` (readers, offloads, outputs of this residency).
    On the host: `storage` and the node that wrote it (`storage_writer`).
    """

    id: int
    nbytes: int
    size: int  # aligned
    uses: list[int] = field(default_factory=list)
    ptr: int = 0
    region: Region | None = None
    alloc: int | None = None
    writer: int | None = None
    users: list[int] = field(default_factory=list)
    storage: int | None = None
    storage_writer: int | None = None
    pins: int = 0
    last_use: int = -1
    version: int = 0  # bumped whenever its rank or residency changes (stale heap entries)
    rank: int = 0  # the eviction rank of its current heap entry

    @property
    def next_use(self) -> int:
        return self.uses[self.ptr] if self.ptr < len(self.uses) else NEVER


@dataclass(frozen=True, slots=True)
class _Step:
    """One compute task of the order: its id, distinct operand roots, and reads.

    `sliced`: a Slice that nothing reads, produced by a sliced reload (and then freed)
    instead of an apply, so that it is computed at all.
    """

    task: int
    roots: tuple[int, ...]
    reads: tuple[int, ...]  # the storage root of each operand, in operand order
    sliced: bool = False


def _context(tensor: _Tensor) -> EvictionContext:
    """What the eviction policy sees of a live tensor."""
    transfer = 0 if tensor.storage is not None else tensor.nbytes
    return EvictionContext(tensor.next_use, tensor.last_use, tensor.size, transfer)


class _Residents:
    """The live tensors of the arena: by offset, and by eviction rank for victim search.

    Implements `memgraph.eviction.Arena`. Ranks change only when a tensor is used or
    placed (`touch`), so a max-heap of (rank, id, version) entries with lazy deletion
    enumerates evictable tensors in decreasing rank; entries popped during a search
    are pushed back by `restore`.
    """

    def __init__(self, size: int, rank: Any, tensors: dict[int, _Tensor]):
        self.size = size
        self.rank = rank
        self.tensors = tensors
        self.at: dict[int, _Tensor] = {}  # offset -> live tensor
        self.offsets: list[int] = []  # sorted live offsets
        self.heap: list[tuple[int, int, int]] = []  # (-rank, tensor id, version)
        self.popped: list[tuple[int, int, int]] = []

    def __len__(self) -> int:
        return len(self.offsets)

    def add(self, tensor: _Tensor) -> None:
        offset = tensor.region.offset
        bisect.insort(self.offsets, offset)
        self.at[offset] = tensor
        self.touch(tensor, placed=True)

    def remove(self, tensor: _Tensor) -> None:
        offset = tensor.region.offset
        del self.offsets[bisect.bisect_left(self.offsets, offset)]
        del self.at[offset]
        tensor.version += 1

    def touch(self, tensor: _Tensor, placed: bool = False) -> None:
        """Re-rank a live tensor after its next or last use changed (or it was `placed`)."""
        rank = self.rank(_context(tensor))
        if rank == tensor.rank and not placed:
            return  # its heap entry is still valid
        tensor.rank = rank
        tensor.version += 1
        heapq.heappush(self.heap, (-rank, tensor.id, tensor.version))
        if len(self.heap) > 4 * len(self.offsets) + 1024:
            self.heap = [(-self.rank(_context(t)), t.id, t.version) for t in self.at.values()]
            heapq.heapify(self.heap)

    def segment(self, tensor: _Tensor) -> Segment:
        return Segment(
            tensor.region.offset,
            tensor.region.size,
            tensor.id,
            self.rank(_context(tensor)),
            0 if tensor.storage is not None else tensor.nbytes,
            tensor.pins == 0 and tensor.writer is not None,
        )

    def ranked_groups(self) -> Iterator[list[Segment]]:
        """Evictable live tensors as segments, in groups of equal rank, decreasing."""
        heap, popped = self.heap, self.popped
        group: list[Segment] = []
        group_key = None
        while heap:
            entry = heapq.heappop(heap)
            key, tensor_id, version = entry
            tensor = self.tensors[tensor_id]
            if tensor.version != version or tensor.region is None:
                continue  # stale
            popped.append(entry)
            if tensor.pins or tensor.writer is None:
                continue
            if group and key != group_key:
                yield group
                group = []
            group_key = key
            group.append(self.segment(tensor))
        if group:
            yield group

    def restore(self) -> None:
        """Push back the entries a search popped (they are still valid)."""
        for entry in self.popped:
            heapq.heappush(self.heap, entry)
        self.popped = []

    def neighbours(self, offset: int) -> tuple[int, int]:
        offsets = self.offsets
        i = bisect.bisect_left(offsets, offset)
        before = self.at[offsets[i - 1]].region.end if i else 0
        after = offsets[i + 1] if i + 1 < len(offsets) else self.size
        return before, after

    def segments(self, start: int = 0, end: int | None = None) -> list[Segment]:
        end = self.size if end is None else end
        offsets = self.offsets
        found = []
        cursor = start
        for i in range(bisect.bisect_left(offsets, start), len(offsets)):
            offset = offsets[i]
            if offset >= end:
                break
            if offset > cursor:
                found.append(Segment(cursor, offset - cursor))
            tensor = self.at[offset]
            found.append(self.segment(tensor))
            cursor = tensor.region.end
        if cursor < end:
            found.append(Segment(cursor, end - cursor))
        return found


class _Planner:
    """One planning run: the simulated arena, the tensors' state, and the emitted nodes."""

    def __init__(self, tg: TaskGraph, budget: int, opts: PlanOptions):
        self.tg = tg
        self.opts = opts
        self.cost = get_cost_model(opts.cost_model)
        self.rank = get_policy(opts.eviction)
        self.alloc = Allocator(budget, opts.alignment)
        self.builder = MemGraphBuilder(tg, budget, opts.alignment)
        order = opts.order
        ids = check_order(tg, get_order(order)(tg) if isinstance(order, str) else order)
        root = storage_roots(tg)
        self.root = root
        # Slices produced by sliced reloads are host-resident tensors, not steps (unless
        # nothing reads them: then a step makes them once).
        self.sliced = sliced_reloads(tg, opts.inputs)
        self.slices_of: dict[int, list[int]] = {}
        for s, i in self.sliced.items():
            self.slices_of.setdefault(i, []).append(s)
        # Outputs assembled on the host: their Concats are not steps; each piece's base
        # is offloaded into its box of the output's storage as soon as it is computed.
        self.assembled = output_assemblies(tg)
        on_host = assembly_tasks(tg)
        self.piece_of = {p.base: root for root, ps in self.assembled.items() for p in ps}
        self.assembly_storage: dict[int, int] = {}  # root -> its host storage
        self.assembly_fills: dict[int, list[int]] = {}  # root -> its sliced offloads
        read = {
            root[i] for t in ids if is_compute(tg, t) and t not in on_host for i in tg[t].inputs
        }
        self.steps: list[_Step] = []
        for t in ids:
            if not is_compute(tg, t) or t in on_host:
                continue
            if t in self.sliced:
                if t not in read:
                    self.steps.append(_Step(t, (), (), sliced=True))
                continue
            reads = tuple([root[i] for i in tg[t].inputs])
            self.steps.append(_Step(t, tuple(dict.fromkeys(reads)), reads))
        round_up = self.alloc.round_up
        self.tensors: dict[int, _Tensor] = {}
        for t in tg:
            if root[t.id] == t.id:
                nbytes = t.nbytes
                self.tensors[t.id] = _Tensor(t.id, nbytes, round_up(nbytes))
        self.working_set = []  # aligned bytes each step needs resident at once
        for position, step in enumerate(self.steps):
            need = self.tensors[step.task].size
            for r in step.roots:
                tensor = self.tensors[r]
                tensor.uses.append(position)
                need += tensor.size
            self.working_set.append(need)
        self.output_roots = dict.fromkeys(
            root[t] for t in tg.outputs.values() if t not in self.assembled
        )
        if opts.outputs == "device":
            for r in self.output_roots:
                self.tensors[r].uses.append(len(self.steps))
        self.residents = _Residents(self.alloc.size, self.rank, self.tensors)
        # Compute seconds before each step (prefix sums), for the lookahead in seconds.
        self.before = [0.0]
        if opts.lookahead and opts.lookahead_seconds is not None:
            for step in self.steps:
                self.before.append(self.before[-1] + self.cost.task_seconds(tg, step.task))
        self.pending: dict[int, float] = {}
        self.pending_at: list[int] = []  # sorted positions with pending transfers
        self.horizon = 0  # the allocation horizon a
        self.frees = 0  # frees so far, to retry a stalled step only when memory was freed
        self.stalled: tuple[int, int] | None = None  # (step, frees) of the last failed try
        self.storages = 0
        self.high_water = 0
        # Counters reported in info.
        self.evictions = self.offloads = self.drops = 0
        self.fragmentation_events = self.packed_steps = self.operand_moves = 0
        self.prefetched = self.reloads = self.max_ahead = self.sliced_reloads = 0
        self.sliced_offloads = 0
        self.inputs_on_host_for_room: list[str] = []
        self.outputs_on_host: list[str] = []

    # -- the walk -----------------------------------------------------------------

    def run(self) -> None:
        self.place_inputs()
        for e in range(len(self.steps)):
            self.advance_horizon(e)
            if self.horizon == e:
                self.prepare_evicting(e)
                self.horizon = e + 1
            self.max_ahead = max(self.max_ahead, self.horizon - e - 1)
            self.execute(e)
        self.finish_outputs()

    def counters(self) -> dict[str, Any]:
        return {
            "steps": len(self.steps),
            "evictions": self.evictions,
            "offloads": self.offloads,
            "drops": self.drops,
            "reloads": self.reloads,
            "sliced_reloads": self.sliced_reloads,
            "sliced_offloads": self.sliced_offloads,
            "prefetched_reloads": self.prefetched,
            "max_steps_ahead": self.max_ahead,
            "fragmentation_events": self.fragmentation_events,
            "packed_steps": self.packed_steps,
            "operand_moves": self.operand_moves,
            "high_water": self.high_water,
            "inputs_on_host_for_room": self.inputs_on_host_for_room,
            "outputs_on_host": self.outputs_on_host,
        }

    def place_inputs(self) -> None:
        """Input nodes: on the host (a storage) or in a freshly allocated device region."""
        for task in self.tg:
            op = task.op
            if not isinstance(op, Input) or self.root[task.id] != task.id:
                continue
            tensor = self.tensors[task.id]
            on_device = (
                self.opts.inputs == "auto"
                and op.location == "device"
                and bool(tensor.uses)
                and task.id not in self.slices_of  # read only through sliced reloads
            )
            block = self.alloc.try_allocate(tensor.size) if on_device else None
            if block is not None:
                region = self.bind(tensor, block)
                tensor.writer = self.builder.input(
                    op.name, task.id, region=region, deps=[tensor.alloc]
                )
                continue
            if on_device:
                self.inputs_on_host_for_room.append(op.name)
            tensor.storage = self.new_storage()
            tensor.storage_writer = self.builder.input(op.name, task.id, storage=tensor.storage)
            self.expect_reload(tensor)
            for s in self.slices_of.get(task.id, ()):  # their boxes are in the same storage
                part = self.tensors[s]
                part.storage, part.storage_writer = tensor.storage, tensor.storage_writer
                self.expect_reload(part)

    def advance_horizon(self, e: int) -> None:
        """Prepare steps from the allocation horizon up to the target, without evicting.

        A step that did not fit is retried only once something was freed since.
        """
        target = self.horizon_target(e)
        while self.horizon <= target:
            if self.stalled == (self.horizon, self.frees):
                return
            if not self.prepare_fitting(self.horizon, ahead=self.horizon > e):
                self.stalled = (self.horizon, self.frees)
                return
            self.horizon += 1

    def horizon_target(self, e: int) -> int:
        """The furthest step the allocation horizon should reach before step e's apply."""
        limit = min(len(self.steps) - 1, e + self.opts.lookahead)
        seconds = self.opts.lookahead_seconds
        if seconds is None or limit == e:
            return limit
        if seconds != "auto":
            reach = bisect.bisect_left(self.before, self.before[e] + seconds) - 1
            return max(e, min(limit, reach))
        target, backlog = e, 0.0
        i = bisect.bisect_left(self.pending_at, e)
        while i < len(self.pending_at) and self.pending_at[i] <= limit:
            t = self.pending_at[i]
            backlog += self.pending[t]
            if self.before[t] - self.before[e + 1] < backlog:
                target = t
            i += 1
        return target

    # -- preparing a step -----------------------------------------------------------

    def missing(self, position: int) -> list[_Tensor]:
        """The tensors step `position` still needs placed: absent operands, then its output."""
        step = self.steps[position]
        needed = [self.tensors[r] for r in step.roots if self.tensors[r].region is None]
        return [*needed, self.tensors[step.task]]

    def prepare_fitting(self, position: int, ahead: bool) -> bool:
        """Prepare a step using free memory only (all or nothing); False if it does not fit."""
        needed = self.missing(position)
        if len(needed) == 1:  # the common case, no checkpoint needed
            block = self.fit(needed[0])
            if block is None:
                return False
            blocks = [block]
        else:
            token = self.alloc.checkpoint()
            blocks = []
            for tensor in needed:
                block = self.fit(tensor)
                if block is None:
                    self.alloc.rollback(token)
                    return False
                blocks.append(block)
            self.alloc.release(token)
        for tensor, block in zip(needed, blocks, strict=True):
            self.place(tensor, block, position, ahead)
        self.pin(position, +1)
        return True

    def prepare_evicting(self, e: int) -> None:
        """Prepare step e at the execution horizon, evicting as needed (the horizon is empty).

        First each missing tensor, largest first, goes to the best window for it. If some
        tensor finds no window (the arena is split by step e's own tensors), the missing
        tensors are packed into one window of their total size, with step e's resident
        operands kept in place; failing that, into one window that may also take those
        operands (they are moved: evicted, then placed in the window). That last window
        always exists at a budget of at least `min_budget`, since then everything is
        evictable and the arena holds all of step e's tensors.
        """
        if self.prepare_fitting(e, ahead=False) or self.place_evicting(e):
            return
        self.unprepare(e)
        self.packed_steps += 1
        if self.place_packed(e, move_operands=False):
            return
        self.operand_moves += 1
        if not self.place_packed(e, move_operands=True):  # pragma: no cover - see above
            raise PlanError(f"step %{self.steps[e].task} found no window of its size")

    def place_evicting(self, e: int) -> bool:
        """Place step e's missing tensors, largest first, evicting the best window for each;
        if one finds no window, unpin what was pinned and return False."""
        step = self.steps[e]
        held = [self.tensors[r] for r in step.roots if self.tensors[r].region is not None]
        for tensor in held:
            tensor.pins += 1
        for tensor in sorted(self.missing(e), key=lambda t: -t.size):
            block = self.fit(tensor) or self.make_room(tensor.size)
            if block is None:
                for pinned in held:
                    pinned.pins -= 1
                return False
            self.place(tensor, block, e, ahead=False)
            tensor.pins += 1
            held.append(tensor)
        return True

    def place_packed(self, e: int, move_operands: bool) -> bool:
        """Clear one window for all of step e's missing tensors (and, with `move_operands`,
        room for its resident operands too, which may then be evicted) and place them
        there back to back, largest first."""
        step = self.steps[e]
        held = [self.tensors[r] for r in step.roots if self.tensors[r].region is not None]
        total = sum(t.size for t in self.missing(e))
        if move_operands:
            total += sum(t.size for t in held)
        else:
            for tensor in held:
                tensor.pins += 1
        offset = self.clear_window(total)
        if not move_operands:
            for tensor in held:
                tensor.pins -= 1
        if offset is None:
            return False
        for tensor in sorted(self.missing(e), key=lambda t: -t.size):
            self.place(tensor, self.alloc.allocate_at(offset, tensor.size), e, ahead=False)
            offset += tensor.size
        self.pin(e, +1)
        return True

    def unprepare(self, e: int) -> None:
        """Undo a failed preparation of step e: free its output if allocated, unwritten."""
        output = self.tensors[self.steps[e].task]
        if output.region is not None:
            self.release(output)

    def fit(self, tensor: _Tensor) -> Block | None:
        """A free block for `tensor` without evicting (see `keeps_room`)."""
        largest = self.alloc.largest_free
        if largest < tensor.size:
            return None
        reader = tensor.next_use
        if (
            self.opts.placement == "best_fit"
            or reader >= len(self.steps)
            or largest >= self.working_set[reader]
        ):  # wherever best fit puts it, a free gap as large as that step's needs remains
            return self.alloc.try_allocate(tensor.size)
        token = self.alloc.checkpoint()
        block = self.alloc.try_allocate(tensor.size)
        if block is None or self.keeps_room(tensor, block.offset):
            self.alloc.release(token)
            return block
        self.alloc.rollback(token)
        best = None
        for free in self.alloc.free_intervals():
            if free.size < tensor.size:
                continue
            for offset in (free.offset, free.end - tensor.size):
                if self.keeps_room(tensor, offset) and (best is None or free.size < best[0]):
                    best = (free.size, offset)
        if best is None:
            return self.alloc.try_allocate(tensor.size)
        return self.alloc.allocate_at(best[1], tensor.size)

    def keeps_room(self, tensor: _Tensor, offset: int) -> bool:
        """Whether placing `tensor` at `offset` leaves room for the next step that reads it:
        between that step's tensors already on the device (and this one), one gap as large
        as the rest of the step's working set, so the step can clear one window there
        instead of moving a tensor through the host."""
        position = tensor.next_use
        if position >= len(self.steps):
            return True
        step = self.steps[position]
        placed = [(offset, offset + tensor.size)]
        for r in (*step.roots, step.task):
            other = self.tensors[r]
            if other is not tensor and other.region is not None:
                placed.append((other.region.offset, other.region.end))
        need = self.working_set[position] - sum(end - start for start, end in placed)
        placed.sort()
        cursor = 0
        for start, end in placed:
            if start - cursor >= need:
                return True
            cursor = max(cursor, end)
        return self.alloc.size - cursor >= need

    def make_room(self, nbytes: int) -> Block | None:
        """Evict the best window for `nbytes` (see `memgraph.eviction`) and allocate there."""
        if self.alloc.bytes_free >= nbytes:
            self.fragmentation_events += 1
        offset = self.clear_window(nbytes)
        return None if offset is None else self.alloc.allocate_at(offset, nbytes)

    def clear_window(self, nbytes: int) -> int | None:
        """Evict the occupants of the best window of `nbytes`; its offset, or None."""
        if self.alloc.largest_free >= nbytes:  # a free block is the best window
            fitting = [f for f in self.alloc.free_intervals() if f.size >= nbytes]
            return min(fitting, key=lambda f: (f.size, f.offset)).offset
        window = choose_window_ranked(self.residents, self.residents.ranked_groups(), nbytes)
        self.residents.restore()
        if window is None:
            return None
        for victim in window.victims:
            self.evict(self.tensors[victim])
        return window.offset

    def pin(self, position: int, delta: int) -> None:
        step = self.steps[position]
        for r in step.roots:
            self.tensors[r].pins += delta
        self.tensors[step.task].pins += delta

    # -- node emission --------------------------------------------------------------

    def bind(self, tensor: _Tensor, block: Block) -> Region:
        """Emit the alloc node of `block` for `tensor` and record the residency."""
        region = Region(block.offset, block.size)
        tensor.alloc = self.builder.alloc(tensor.id, region, deps=block.deps)
        tensor.region, tensor.writer, tensor.users = region, None, []
        self.residents.add(tensor)
        self.high_water = max(self.high_water, region.end)
        return region

    def place(self, tensor: _Tensor, block: Block, position: int, ahead: bool) -> None:
        """Allocate `tensor` at `block`; reload it unless it is step `position`'s output."""
        if tensor.id == self.steps[position].task:
            self.bind(tensor, block)
            return
        self.reload(tensor, block)
        tensor.last_use = position
        self.residents.touch(tensor)
        self.prefetched += ahead

    def reload(self, tensor: _Tensor, block: Block) -> None:
        """Allocate `block` for a host-resident tensor and copy it there."""
        if tensor.storage is None:  # pragma: no cover - a non-resident tensor has a host copy
            raise PlanError(f"%{tensor.id} is needed but is neither resident nor on the host")
        region = self.bind(tensor, block)
        tensor.writer = self.builder.reload(
            tensor.id, tensor.storage, region, deps=[tensor.alloc, tensor.storage_writer]
        )
        self.reloads += 1
        self.sliced_reloads += tensor.id in self.sliced

    def execute(self, e: int) -> None:
        """Emit step e's apply, then free what it was the last reader of."""
        step = self.steps[e]
        out = self.tensors[step.task]
        operands = [self.tensors[r] for r in step.reads]
        if step.sliced:
            node = self.builder.reload(
                out.id, out.storage, out.region, deps=[out.alloc, out.storage_writer]
            )
            self.reloads += 1
            self.sliced_reloads += 1
        else:
            deps = [out.alloc, *(t.writer for t in operands)]
            node = self.builder.apply(step.task, [t.region for t in operands], out.region, deps)
        out.writer, out.last_use = node, e
        self.residents.touch(out)
        self.pin(e, -1)
        for r in step.roots:
            tensor = self.tensors[r]
            tensor.users.append(node)
            tensor.last_use = e
            tensor.ptr += 1
            self.residents.touch(tensor)
        if self.opts.outputs == "host" and step.task in self.output_roots:
            self.offload(out)
        if step.task in self.piece_of:
            self.offload_piece(out, self.piece_of[step.task])
        for r in (*step.roots, step.task):
            tensor = self.tensors[r]
            if tensor.next_use == NEVER and tensor.region is not None:
                self.release(tensor)

    def offload(self, tensor: _Tensor) -> None:
        tensor.storage = self.new_storage()
        node = self.builder.offload(tensor.id, tensor.region, tensor.storage, deps=[tensor.writer])
        tensor.storage_writer = node
        tensor.users.append(node)
        self.offloads += 1
        self.residents.touch(tensor)  # a host copy makes it free to drop

    def offload_piece(self, tensor: _Tensor, root: int) -> None:
        """Copy a just-computed piece into its box of output `root`'s host storage (a
        sliced offload); nothing else reads it, so its free follows."""
        if root not in self.assembly_storage:
            self.assembly_storage[root] = self.new_storage()
        node = self.builder.offload(
            tensor.id,
            tensor.region,
            self.assembly_storage[root],
            deps=[tensor.writer],
            into=root,
        )
        tensor.users.append(node)
        self.assembly_fills.setdefault(root, []).append(node)
        self.offloads += 1
        self.sliced_offloads += 1

    def release(self, tensor: _Tensor) -> None:
        """Emit the free of `tensor`'s residency and return its bytes to the allocator."""
        host_output = tensor.id in self.output_roots and self.opts.outputs == "host"
        if host_output and tensor.storage is None and tensor.writer is not None:
            self.offload(tensor)  # e.g. a device input that is also an output
        deps = tensor.users or [tensor.writer if tensor.writer is not None else tensor.alloc]
        node = self.builder.free(tensor.id, tensor.region, deps=deps)
        self.frees += 1
        self.alloc.free(tensor.region.offset, freed_by=node)
        self.residents.remove(tensor)
        tensor.region = tensor.alloc = tensor.writer = None
        tensor.users = []

    def evict(self, tensor: _Tensor) -> None:
        """Move a live tensor off the device: offload it unless a host copy exists."""
        self.evictions += 1
        if tensor.storage is None:
            self.offload(tensor)
        else:
            self.drops += 1
        self.release(tensor)
        self.expect_reload(tensor)

    def expect_reload(self, tensor: _Tensor) -> None:
        """Record the H2D seconds a host-resident tensor costs at its next step."""
        position = tensor.next_use
        if position >= len(self.steps):
            return
        if position not in self.pending:
            bisect.insort(self.pending_at, position)
            self.pending[position] = 0.0
        self.pending[position] += self.cost.transfer_seconds(tensor.nbytes, "h2d")

    def new_storage(self) -> int:
        self.storages += 1
        return self.storages - 1

    def finish_outputs(self) -> None:
        """Output nodes: device outputs in place (reloaded if they fit), else from the host."""
        for name, task_id in self.tg.outputs.items():
            if task_id in self.assembled:  # on the host, filled by sliced offloads
                if self.opts.outputs == "device":
                    self.outputs_on_host.append(name)
                self.builder.output(
                    name,
                    task_id,
                    storage=self.assembly_storage[task_id],
                    deps=self.assembly_fills[task_id],
                )
                continue
            tensor = self.tensors[self.root[task_id]]
            if self.opts.outputs == "device" and tensor.region is None:
                block = self.alloc.try_allocate(tensor.size)
                if block is not None:
                    self.reload(tensor, block)
            if self.opts.outputs == "device" and tensor.region is not None:
                node = self.builder.output(
                    name, tensor.id, region=tensor.region, deps=[tensor.writer]
                )
                tensor.users.append(node)
                continue
            if tensor.storage is None:
                self.offload(tensor)
            if self.opts.outputs == "device":
                self.outputs_on_host.append(name)
            self.builder.output(
                name, tensor.id, storage=tensor.storage, deps=[tensor.storage_writer]
            )
