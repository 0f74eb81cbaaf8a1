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
    the furthest t with C(e, t) < H(e, t): a step whose reloads are already covered
    by the compute before it can be prepared later and still be hidden, and holding
    its memory early would only crowd out other prefetches. Only steps with pending
    transfers can be that furthest t, so the scan visits just those.
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

Fragmentation: when a request fails although enough bytes are free, the window
search already handles it (it may evict neighbours of free blocks to join them); such
requests are counted in `info["fragmentation_events"]`. When no window exists
because step e's own tensors split the arena, the planner *resets the arena*: it
evicts everything resident (step e's operands included; nothing is applied yet) and
places step e's tensors back to back from offset 0. So a budget of at least
`min_budget` always succeeds (counted in `info["arena_resets"]`); there is never a
compaction copy.

Lifetimes and ends
------------------
* A tensor is freed as soon as the apply of its last reader is emitted.
* Inputs: weights start in host storage (`Input.location`). Device-located inputs
  are allocated at the start, in id order, while they fit without evicting; the rest
  start on the host (`inputs="host"` puts every input there; an input that nothing
  reads is always left on the host unless it is a device-side output).
* Outputs (`outputs="device"`, the default) stay resident to the end and get a device
  `output` node; one evicted on the way is reloaded at the end if it fits without
  evicting, else it is output from its host copy (`info["outputs_on_host"]`). With
  `outputs="host"` each output is offloaded as soon as it is computed (the copy
  overlaps later compute) and freed after its last reader.

Dependencies are exactly the verifier's rules: an alloc waits for the frees of the
bytes it reuses (the allocator's `Block.deps`); a reload for its alloc and for the
node that wrote its host storage; an apply for its output's alloc and for the writer
of each operand; an offload for the writer; a free for every reader and offload of
the residency (which imply the writer and the alloc). Nothing else, so transfers can
overlap compute.

>>> import einpage as ep
>>> prog = ep.Program("mlp")
>>> x = prog.input("x", (256, 256))
>>> w = prog.input("w", (256, 256), role="weight")
>>> prog.output(ep.relu(x @ w) @ w, "y")
>>> tg = prog.build()
>>> min_budget(tg)
(786432, 3)
>>> mg = plan(tg, "768KiB")
>>> mg.stats.reload_count, mg.stats.offload_count
(2, 1)
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from einpage.errors import InfeasibleBudgetError, PlanError
from einpage.units import BudgetFormatError, format_bytes, parse_bytes
from memgraph.allocator import DEFAULT_ALIGNMENT, Allocator, Block
from memgraph.cost import CostModel, get_cost_model
from memgraph.eviction import NEVER, Segment, choose_window, get_policy
from memgraph.graph import MemGraph, MemGraphBuilder
from memgraph.nodes import Region
from memgraph.orders import check_order, get_order, is_compute
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input

__all__ = [
    "PlanOptions",
    "plan",
    "min_budget",
    "no_offload_peak",
    "resolve_budget",
    "OUTPUTS",
    "INPUTS",
]

OUTPUTS = ("device", "host")
"""Where program outputs end: resident on the device, or offloaded to host storage."""
INPUTS = ("auto", "host")
"""Where inputs start: "auto" follows each `Input.location` (device ones while they fit)."""

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
            "allocator": "best_fit",
        }


def _is_nonnegative_number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


# --------------------------------------------------------------------------- public API


def plan(tg: TaskGraph, budget: int | str, **options: Any) -> MemGraph:
    """Plan `tg` to run in a device arena of `budget` bytes; returns the MemGraph.

    `budget`: bytes (int), a size string (`"8GiB"`), or a percentage of the no-offload
    peak (`"50%"`, see `no_offload_peak`). Options (all keyword):

    * `order`: a name in `memgraph.orders.ORDERS` ("program", "memory"), or a
      topological order as a sequence of task ids;
    * `eviction`: a name in `memgraph.eviction.POLICIES` ("belady", "lru");
    * `lookahead`: the most steps the allocation horizon runs ahead (default 64);
    * `lookahead_seconds`: "auto" (hide the pending transfers, the default), seconds
      of estimated compute, or None (only `lookahead` limits prefetching);
    * `cost_model`: a `memgraph.cost.PRESETS` name or a `CostModel` (for the lookahead);
    * `alignment`: arena alignment in bytes (default 256);
    * `outputs`: "device" (the default) or "host"; `inputs`: "auto" or "host".

    Raises `InfeasibleBudgetError` (with `needed` = `min_budget`) when the budget is
    too small, `BudgetFormatError` for a malformed budget, `PlanError` for a bad option.
    """
    opts = PlanOptions(**options)
    request = budget
    budget = resolve_budget(tg, budget, opts)
    planner = _Planner(tg, budget, opts)
    planner.run()
    info = {
        "planner": "memgraph.planner",
        **opts.info(),
        "budget_request": request if isinstance(request, int) else str(request),
        **planner.counters(),
    }
    return planner.builder.build(info)


def min_budget(tg: TaskGraph, alignment: int = DEFAULT_ALIGNMENT) -> tuple[int, int | None]:
    """The smallest budget any plan needs, and the task that needs it.

    A compute task runs only with its distinct operands (views resolved to their bases)
    and its output resident at once, each rounded up to `alignment`; the bound is the
    largest such sum (ties: the first task). The planner always succeeds at or above
    it. A graph without compute tasks needs one alignment unit (task None).

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (100,))
    >>> prog.output(x * x, "y")
    >>> min_budget(prog.build())
    (512, 1)
    """
    best, best_task = alignment, None
    for task in tg:
        if not is_compute(tg, task.id):
            continue
        roots = dict.fromkeys(tg.storage_root(i) for i in task.inputs)
        need = _round_up(task.nbytes, alignment)
        need += sum(_round_up(tg[r].nbytes, alignment) for r in roots)
        if need > best or best_task is None and need >= best:
            best, best_task = need, task.id
    return best, best_task


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
    opts = PlanOptions(
        order=order, alignment=alignment, outputs=outputs, inputs=inputs, lookahead=0
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
    opts = options or PlanOptions()
    text = budget if isinstance(budget, str) else None
    match = _PERCENT.match(text) if text is not None else None
    if match is not None:
        percent = float(match.group(1))
        peak = no_offload_peak(tg, opts.order, opts.alignment, opts.outputs, opts.inputs)
        resolved = int(peak * percent / 100)
    else:
        if text is not None and "%" in text:
            raise BudgetFormatError(f"cannot parse budget {budget!r}: expected e.g. '50%'")
        resolved = parse_bytes(budget)
    needed, task_id = min_budget(tg, opts.alignment)
    if resolved // opts.alignment * opts.alignment < needed:
        raise InfeasibleBudgetError(
            _infeasible_message(tg, budget, resolved, needed, task_id, opts.alignment),
            resolved,
            needed,
            task_id,
        )
    return resolved


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

    @property
    def next_use(self) -> int:
        return self.uses[self.ptr] if self.ptr < len(self.uses) else NEVER


@dataclass(frozen=True, slots=True)
class _Step:
    """One compute task of the order: its id, distinct operand roots, and reads."""

    task: int
    roots: tuple[int, ...]
    reads: tuple[int, ...]  # the storage root of each operand, in operand order


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
        ids = get_order(order)(tg) if isinstance(order, str) else check_order(tg, order)
        root = [tg.storage_root(t.id) for t in tg]
        self.root = root
        self.steps = [
            _Step(
                t,
                tuple(dict.fromkeys(root[i] for i in tg[t].inputs)),
                tuple(root[i] for i in tg[t].inputs),
            )
            for t in ids
            if is_compute(tg, t)
        ]
        self.tensors: dict[int, _Tensor] = {
            t.id: _Tensor(t.id, t.nbytes, self.alloc.round_up(t.nbytes))
            for t in tg
            if root[t.id] == t.id
        }
        for position, step in enumerate(self.steps):
            for r in step.roots:
                self.tensors[r].uses.append(position)
        self.output_roots = dict.fromkeys(root[t] for t in tg.outputs.values())
        if opts.outputs == "device":
            for r in self.output_roots:
                self.tensors[r].uses.append(len(self.steps))
        self.owner: dict[int, int] = {}  # offset of a live block -> its tensor
        # Compute seconds before each step (prefix sums) and pending H2D seconds by step.
        self.before = [0.0]
        for step in self.steps:
            self.before.append(self.before[-1] + self.cost.task_seconds(tg, step.task))
        self.pending: dict[int, float] = {}
        self.pending_at: list[int] = []  # sorted positions with pending transfers
        self.horizon = 0  # the allocation horizon a
        self.storages = 0
        self.high_water = 0
        # Counters reported in info.
        self.evictions = self.offloads = self.drops = 0
        self.fragmentation_events = self.arena_resets = 0
        self.prefetched = self.reloads = self.max_ahead = 0
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
            "prefetched_reloads": self.prefetched,
            "max_steps_ahead": self.max_ahead,
            "fragmentation_events": self.fragmentation_events,
            "arena_resets": self.arena_resets,
            "high_water": self.high_water,
            "min_budget": min_budget(self.tg, self.opts.alignment)[0],
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
            on_device = self.opts.inputs == "auto" and op.location == "device" and bool(tensor.uses)
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

    def advance_horizon(self, e: int) -> None:
        """Prepare steps from the allocation horizon up to the target, without evicting."""
        target = self.horizon_target(e)
        while self.horizon <= target:
            if not self.prepare_fitting(self.horizon, ahead=self.horizon > e):
                return
            self.horizon += 1

    def horizon_target(self, e: int) -> int:
        """The furthest step the allocation horizon should reach before step e's apply."""
        limit = min(len(self.steps) - 1, e + self.opts.lookahead)
        seconds = self.opts.lookahead_seconds
        if seconds is None:
            return limit
        if seconds != "auto":
            reach = bisect.bisect_left(self.before, self.before[e] + seconds) - 1
            return max(e, min(limit, reach))
        target, backlog = e, 0.0
        i = bisect.bisect_left(self.pending_at, e)
        while i < len(self.pending_at) and self.pending_at[i] <= limit:
            t = self.pending_at[i]
            backlog += self.pending[t]
            if self.before[t] - self.before[e] < backlog:
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
        token = self.alloc.checkpoint()
        blocks = []
        for tensor in needed:
            block = self.alloc.try_allocate(tensor.size)
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
        """Prepare step e at the execution horizon, evicting as needed (the horizon is empty)."""
        if self.prepare_fitting(e, ahead=False):
            return
        step = self.steps[e]
        needed = self.missing(e)
        pinned = [self.tensors[r] for r in step.roots if self.tensors[r].region is not None]
        for tensor in pinned:
            tensor.pins += 1
        for tensor in sorted(needed, key=lambda t: -t.size):
            block = self.alloc.try_allocate(tensor.size) or self.make_room(tensor.size)
            if block is None:
                for held in [*pinned, *(t for t in needed if t.region is not None)]:
                    held.pins -= 1
                self.reset_arena(e)
                return
            self.place(tensor, block, e, ahead=False)
            tensor.pins += 1

    def make_room(self, nbytes: int) -> Block | None:
        """Evict the best window for `nbytes` (see `memgraph.eviction`) and allocate there."""
        if self.alloc.bytes_free >= nbytes:
            self.fragmentation_events += 1
        window = choose_window(self.segments(), nbytes)
        if window is None:
            return None
        for victim in window.victims:
            self.evict(self.tensors[victim])
        return self.alloc.allocate_at(window.offset, nbytes)

    def segments(self) -> list[Segment]:
        """The arena as live tensors and free blocks in offset order, ranked by the policy."""
        pieces = []
        for block in self.alloc.live():
            tensor = self.tensors[self.owner[block.offset]]
            pieces.append(
                Segment(
                    block.offset,
                    block.size,
                    tensor.id,
                    self.rank(tensor.next_use, tensor.last_use),
                    0 if tensor.storage is not None else tensor.nbytes,
                    tensor.pins == 0 and tensor.writer is not None,
                )
            )
        pieces.extend(Segment(b.offset, b.size) for b in self.alloc.free_intervals())
        pieces.sort(key=lambda s: s.offset)
        return pieces

    def reset_arena(self, e: int) -> None:
        """Evict everything (step e's tensors included) and place step e's tensors from 0."""
        self.arena_resets += 1
        output = self.tensors[self.steps[e].task]
        if output.region is not None:  # allocated for step e but never written
            self.release(output)
        for block in self.alloc.live():
            self.evict(self.tensors[self.owner[block.offset]])
        for tensor in self.missing(e):
            block = self.alloc.try_allocate(tensor.size)
            if block is None:  # pragma: no cover - guaranteed by min_budget
                raise PlanError(f"step %{self.steps[e].task} does not fit an empty arena")
            self.place(tensor, block, e, ahead=False)
        self.pin(e, +1)

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
        self.owner[block.offset] = tensor.id
        self.high_water = max(self.high_water, region.end)
        return region

    def place(self, tensor: _Tensor, block: Block, position: int, ahead: bool) -> None:
        """Allocate `tensor` at `block`; reload it unless it is step `position`'s output."""
        region = self.bind(tensor, block)
        if tensor.id == self.steps[position].task:
            return
        if tensor.storage is None:  # pragma: no cover - a non-resident tensor has a host copy
            raise PlanError(f"%{tensor.id} is needed but is neither resident nor on the host")
        tensor.writer = self.builder.reload(
            tensor.id, tensor.storage, region, deps=[tensor.alloc, tensor.storage_writer]
        )
        tensor.last_use = position
        self.reloads += 1
        self.prefetched += ahead

    def execute(self, e: int) -> None:
        """Emit step e's apply, then free what it was the last reader of."""
        step = self.steps[e]
        out = self.tensors[step.task]
        operands = [self.tensors[r] for r in step.reads]
        deps = [out.alloc, *(t.writer for t in operands)]
        node = self.builder.apply(step.task, [t.region for t in operands], out.region, deps)
        out.writer, out.last_use = node, e
        self.pin(e, -1)
        for r in step.roots:
            tensor = self.tensors[r]
            tensor.users.append(node)
            tensor.last_use = e
            tensor.ptr += 1
        if self.opts.outputs == "host" and step.task in self.output_roots:
            self.offload(out)
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

    def release(self, tensor: _Tensor) -> None:
        """Emit the free of `tensor`'s residency and return its bytes to the allocator."""
        if (
            tensor.storage is None
            and tensor.id in self.output_roots
            and self.opts.outputs == "host"
        ):
            self.offload(tensor)  # e.g. a device input that is also an output
        deps = tensor.users or [tensor.writer if tensor.writer is not None else tensor.alloc]
        node = self.builder.free(tensor.id, tensor.region, deps=deps)
        self.alloc.free(tensor.region.offset, freed_by=node)
        del self.owner[tensor.region.offset]
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
            tensor = self.tensors[self.root[task_id]]
            if self.opts.outputs == "device" and tensor.region is None:
                block = self.alloc.try_allocate(tensor.size)
                if block is not None:
                    region = self.bind(tensor, block)
                    tensor.writer = self.builder.reload(
                        tensor.id,
                        tensor.storage,
                        region,
                        deps=[tensor.alloc, tensor.storage_writer],
                    )
                    self.reloads += 1
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
