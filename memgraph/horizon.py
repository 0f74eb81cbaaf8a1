"""The planner's walk: two horizons over the steps, preparing, evicting and emitting nodes.

`HorizonPlanner` is one planning run (see `memgraph.planner` for what it does and why):
the simulated arena (`memgraph.allocator`), the tensors' state (`memgraph.residents`),
and the MemGraph it emits. `run()` walks the steps of the order; before each apply the
allocation horizon advances as far as free memory and the lookahead target allow
(`advance_horizon`, `horizon_target`); a step the horizon did not reach is prepared at
the execution horizon, evicting the best windows (`prepare_evicting`); the apply is
emitted and what it was the last reader of is freed (`execute`).

A step whose task has a kernel workspace (`Task.workspace`) needs it placed with its
tensors: it is one more tensor of the step (a `TensorState` of its own, keyed past the
task ids), placed as they are – but with no alloc node, never a victim (nothing writes
it), released by the apply itself, which carries its region (`MemNode.workspace`) and
waits for the frees of the bytes it takes.

A tensor evicted with no host copy may be *discarded* instead of offloaded, and
recomputed for the step that next reads it (`memgraph.recompute` decides): preparing
that step also places the recompute's operands (`missing`) and holds them – with, for a
chain, the regions of the operands it applies again first (`Recomputes.rebuild`); the
recomputes, applies marked `recompute` that read them and write the tensors' fresh
regions, are emitted right before the step's apply (`defer_recomputes`, `execute`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from einpage_core.errors import PlanError
from einpage_core.progress import Tick, ticks
from memgraph.allocator import Allocator, Block
from memgraph.cost import get_cost_model
from memgraph.eviction import NEVER, Window, choose_window_ranked, get_policy
from memgraph.graph import MemGraphBuilder
from memgraph.host_assembly import HostAssembly
from memgraph.nodes import NodeKind, Region
from memgraph.options import PlanOptions
from memgraph.orders import check_order, get_order
from memgraph.recompute import Recomputes
from memgraph.residents import Residents, TensorState
from memgraph.steps import Step, plan_steps, sliced_reloads, storage_roots
from memgraph.transfer_schedule import RecentReads, evicts_ahead, hiding_window, released_before
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input

__all__ = ["HorizonPlanner", "PlanCounters"]


@dataclass
class PlanCounters:
    """What a planning run counts that its MemGraph's nodes cannot tell (in `info`).

    Transfers, drops and the high-water mark are `MemGraph.stats`: counted from the
    nodes, not kept twice.
    """

    steps: int = 0  # compute steps walked (applies, and sliced steps)
    evictions: int = 0  # victims moved off the device (offloaded or dropped)
    sliced_reloads: int = 0  # reloads of a Slice's box of its input's host storage
    prefetched_reloads: int = 0  # reloads issued ahead of the execution horizon
    prepared_ahead_evicting: int = 0  # steps ahead of it prepared by evicting (scheduled)
    max_steps_ahead: int = 0  # the furthest the allocation horizon ran ahead
    fragmentation_events: int = 0  # evictions needed although enough bytes were free
    packed_steps: int = 0  # steps whose missing tensors were packed into one window
    operand_moves: int = 0  # steps that also moved resident operands into that window
    inputs_on_host_for_room: list[str] = field(default_factory=list)
    # device inputs started on the host because that run moved fewer bytes (planner.py)
    inputs_on_host_to_move_less: list[str] = field(default_factory=list)
    outputs_on_host: list[str] = field(default_factory=list)


class HorizonPlanner:
    """One planning run: the simulated arena, the tensors' state, and the emitted nodes.

    `arena` (default: the budget) is the allocator's size, `budget` the MemGraph's: the
    resident run (`memgraph.budgets.resident_run`) plans in an arena that holds every
    tensor at once and keeps every tensor loaded from host storage (`keep_loaded`) until
    the end, then records the budget it was asked for. `host_inputs`: ids of device
    inputs to start in host storage all the same (`memgraph.planner` retries a run that
    offloaded device inputs with them there; `offloaded_inputs` lists such inputs).
    `progress` is called as `progress(steps done, steps)` about a hundred times during
    `run`.
    """

    def __init__(
        self,
        tg: TaskGraph,
        budget: int,
        opts: PlanOptions,
        *,
        arena: int | None = None,
        keep_loaded: bool = False,
        host_inputs: frozenset[int] = frozenset(),
        progress: Tick | None = None,
    ):
        self.tg = tg
        self.host_inputs = host_inputs
        self.offloaded_inputs: list[int] = []  # device inputs this run offloaded
        self.progress = progress
        self.opts = opts
        self.keep_loaded = keep_loaded
        self.cost = get_cost_model(opts.cost_model)
        self.alloc = Allocator(budget if arena is None else arena, opts.alignment)
        self.builder = MemGraphBuilder(tg, budget, opts.alignment)
        order = opts.order
        ids = check_order(tg, get_order(order)(tg) if isinstance(order, str) else order)
        self.root = storage_roots(tg)
        # Slices produced by sliced reloads are host-resident tensors, not steps (unless
        # nothing reads them: then a step makes them once).
        self.sliced = sliced_reloads(tg, opts.inputs)
        self.slices_of: dict[int, list[int]] = {}
        for s, i in self.sliced.items():
            self.slices_of.setdefault(i, []).append(s)
        # Outputs assembled on the host: their Concats are not steps; each piece's base
        # is offloaded into its box of the output's storage as soon as it is computed.
        self.assembly = HostAssembly(tg)
        self.steps: list[Step] = plan_steps(tg, ids, self.root, self.sliced, self.assembly.tasks)
        self.tensors = self.make_tensors()
        self.workspaces = self.make_workspaces()  # step position -> its workspace
        self.workspace_deps: dict[int, tuple[int, ...]] = {}  # placed workspace -> its frees
        self.working_set = self.record_uses()  # aligned bytes each step needs at once
        self.output_roots = dict.fromkeys(
            self.root[t] for t in tg.outputs.values() if t not in self.assembly
        )
        if opts.outputs == "device":
            for r in self.output_roots:
                self.tensors[r].uses.append(len(self.steps))
        self.residents = Residents(self.alloc.size, get_policy(opts.eviction), self.tensors)
        self.recomputes = Recomputes(
            tg,
            self.steps,
            self.tensors,
            self.root,
            self.working_set,
            self.alloc.size,
            self.output_roots,
            self.cost,
            opts.recompute,
        )
        self.before = self.compute_before()
        self.pending: dict[int, float] = {}  # position -> H2D seconds its step awaits
        self.pending_at: list[int] = []  # sorted positions with pending transfers
        self.horizon = 0  # the allocation horizon a
        self.now = 0  # the execution horizon e (eviction ranks are compared there)
        self.frees = 0  # frees so far, to retry a stalled step only when memory was freed
        self.stalled: tuple[int, int] | None = None  # (step, frees) of the last failed try
        self.storages = 0
        self.high_water = 0
        self.counts = PlanCounters(steps=len(self.steps))
        # Host outputs whose write-back is in flight -> the estimated end of its copy:
        # their regions are released then, or sooner when memory is needed (`drain`).
        self.draining: dict[int, float] = {}
        self.d2h_end = 0.0  # when the device-to-host copies issued so far end (estimate)
        self.clock = 0.0  # estimated compute time now (when `before` is computed)
        # Bytes released by the applies before each step (`memgraph.transfer_schedule`).
        self.released = released_before(
            ((t.uses[-1], t.size) for t in self.tensors.values() if t.uses), len(self.steps)
        )
        self.ahead_of: int | None = None  # the execution horizon, while evicting ahead
        self.recent = RecentReads(self.before)  # reads too recent to reload into (`hide_reloads`)
        self.moving: int | None = None  # the step whose operands are moved into one window
        # step -> the operands of its recomputes, held until its apply (`defer_recomputes`)
        self.deferred: dict[int, list[TensorState]] = {}

    def make_tensors(self) -> dict[int, TensorState]:
        """A `TensorState` per storage root (views share their base's)."""
        round_up = self.alloc.round_up
        return {
            t.id: TensorState(t.id, t.nbytes, round_up(t.nbytes))
            for t in self.tg
            if self.root[t.id] == t.id
        }

    def make_workspaces(self) -> dict[int, TensorState]:
        """A `TensorState` for the workspace of each step whose task declares one, used at
        that step only; it joins `tensors` under an id past every task's."""
        round_up = self.alloc.round_up
        workspaces = {}
        for position, step in enumerate(self.steps):
            nbytes = self.tg[step.task].workspace
            if nbytes and not step.sliced:
                state = TensorState(len(self.tg) + position, nbytes, round_up(nbytes))
                state.uses.append(position)
                workspaces[position] = self.tensors[state.id] = state
        return workspaces

    def record_uses(self) -> list[int]:
        """Record each tensor's uses (step positions); return each step's working set."""
        working_set = []
        for position, step in enumerate(self.steps):
            need = self.tensors[step.task].size
            if position in self.workspaces:
                need += self.workspaces[position].size
            for r in step.roots:
                tensor = self.tensors[r]
                tensor.uses.append(position)
                need += tensor.size
            working_set.append(need)
        return working_set

    def seconds_before(self, position: int) -> float:
        """Estimated compute seconds before step `position` (0 when not estimated)."""
        return self.before[position] if position < len(self.before) else 0.0

    def compute_before(self) -> list[float]:
        """Estimated compute seconds before each step (prefix sums), for the lookahead in
        seconds; only the first entry when the lookahead does not use them."""
        before = [0.0]
        timed = self.opts.lookahead and self.opts.lookahead_seconds is not None
        # also times write-backs (`drain`) and recent reads (`hide_reloads`)
        if timed or self.opts.outputs == "host" or self.opts.hide_reloads:
            for step in self.steps:
                before.append(before[-1] + self.cost.task_seconds(self.tg, step.task))
        return before

    # -- the walk -----------------------------------------------------------------

    def run(self) -> None:
        """Walk every step: advance the allocation horizon, prepare, apply; then the outputs."""
        counts = self.counts
        self.place_inputs()
        total, every = len(self.steps), ticks(len(self.steps))
        for e in range(total):
            if self.progress is not None and e % every == 0:
                self.progress(e, total)
            self.now = e
            self.clock = self.seconds_before(e)
            self.drain(until=self.clock)
            self.advance_horizon(e)
            if self.horizon == e:
                self.prepare_evicting(e)
                self.horizon = e + 1
            counts.max_steps_ahead = max(counts.max_steps_ahead, self.horizon - e - 1)
            self.execute(e)
        self.finish_outputs()
        if self.progress is not None:
            self.progress(total, total)

    def info(self) -> dict[str, Any]:
        """What `info` records of this run: the counts the nodes cannot tell."""
        return asdict(self.counts)

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
            if on_device and task.id in self.host_inputs:
                on_device = False
                self.counts.inputs_on_host_to_move_less.append(op.name)
            block = self.alloc.try_allocate(tensor.size) if on_device else None
            if block is not None:
                region = self.bind(tensor, block)
                tensor.writer = self.builder.input(
                    op.name, task.id, region=region, deps=[tensor.alloc]
                )
                continue
            if on_device:
                self.counts.inputs_on_host_for_room.append(op.name)
            tensor.storage = self.new_storage()
            tensor.storage_writer = self.builder.input(op.name, task.id, storage=tensor.storage)
            self.expect_reload(tensor)
            self.keep(tensor)
            for s in self.slices_of.get(task.id, ()):  # their boxes are in the same storage
                part = self.tensors[s]
                part.storage, part.storage_writer = tensor.storage, tensor.storage_writer
                self.expect_reload(part)
                self.keep(part)

    def keep(self, tensor: TensorState) -> None:
        """With `keep_loaded`, a host tensor once loaded stays until the end (a last use
        past the final step, as device outputs have)."""
        end = len(self.steps)
        if self.keep_loaded and tensor.uses and tensor.uses[-1] != end:
            tensor.uses.append(end)

    def live_bound(self) -> int:
        """A lower bound on the arena of any run of these steps that moves nothing: the
        most aligned bytes live at one step (each tensor from the step that makes or first
        reads it to its last use; device outputs and tensors kept by `keep_loaded` to the
        end)."""
        end = len(self.steps)
        made = {step.task: p for p, step in enumerate(self.steps)}
        delta = [0] * (end + 2)
        for tensor in self.tensors.values():
            uses = [u for u in tensor.uses if u < end]
            if not uses and tensor.id not in made:
                continue
            first = min([made.get(tensor.id, end), *uses])
            last = end - 1 if tensor.uses and tensor.uses[-1] >= end else max(uses, default=first)
            delta[first] += tensor.size
            delta[last + 1] -= tensor.size
        live = best = 0
        for change in delta:
            live += change
            best = max(best, live)
        return best

    def moved(self) -> bool:
        """Whether this run moved anything it was not asked to: an eviction (offload or
        drop of a tensor needed again) or a device input started on the host."""
        counts = self.counts
        return bool(
            counts.evictions or counts.inputs_on_host_for_room or counts.inputs_on_host_to_move_less
        )

    def moved_bytes(self) -> int:
        """The bytes this run's offload and reload nodes move (what `MemGraph.stats` would
        count as `offload_bytes + reload_bytes`)."""
        moving = (NodeKind.OFFLOAD, NodeKind.RELOAD)
        return sum(self.tg[n.tensor].nbytes for n in self.builder.nodes if n.kind in moving)

    def advance_horizon(self, e: int) -> None:
        """Prepare steps from the allocation horizon up to the target, without evicting.

        A step that did not fit is retried only once something was freed since. With
        `schedule_transfers`, a step ahead of e that does not fit in free memory is
        prepared by evicting, when the steps before it will not free enough
        (`prepare_ahead`).
        """
        target = self.horizon_target(e)
        while self.horizon <= target:
            a = self.horizon
            fitted = self.stalled != (a, self.frees) and self.prepare_fitting(a, ahead=a > e)
            if not fitted:
                self.stalled = (a, self.frees)
                if not self.prepare_ahead(e, a):
                    return
            self.horizon += 1

    def prepare_ahead(self, e: int, a: int) -> bool:
        """Prepare step `a > e` by evicting for it now, if transfers are scheduled and the
        steps `e .. a-1` will not free the bytes it misses (`memgraph.transfer_schedule`):
        its ranks are compared at step a, and every tensor of steps e..a is pinned, so
        each victim's next use is after a. False if it is not prepared: then its output is
        released, and what was already reloaded for it stays (unpinned, still a prefetch)."""
        if not self.opts.schedule_transfers:
            return False
        need = sum(t.size for t in self.missing(a))
        if not evicts_ahead(need, self.alloc.largest_free, self.released, e, a):
            return False
        self.now, self.ahead_of = a, e
        placed = self.place_evicting(a, ahead=True)
        self.now, self.ahead_of = e, None
        if not placed:
            self.unprepare(a)
            return False
        self.counts.prepared_ahead_evicting += 1
        return True

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

    def missing(self, position: int) -> list[TensorState]:
        """The tensors step `position` still needs placed: absent operands, the absent
        operands of the tensors it recomputes, then its output and its workspace (if it
        has one)."""
        step = self.steps[position]
        needed = [self.tensors[r] for r in step.roots if self.tensors[r].region is None]
        if any(t.recompute for t in needed):
            needed.extend(t for t in self.recomputes.extra(position) if t.region is None)
        needed.append(self.tensors[step.task])
        workspace = self.workspaces.get(position)
        if workspace is not None and workspace.region is None:
            needed.append(workspace)
        return needed

    def prepare_fitting(self, position: int, ahead: bool) -> bool:
        """Prepare a step using free memory only (all or nothing); False if it does not fit.
        Memory of outputs still being written back counts as free when nothing else fits
        (their regions are released, the oldest copy first: see `drain`)."""
        while not self.prepare_free(position, ahead):
            if not self.draining:
                return False
            self.drain(count=1)
        return True

    def prepare_free(self, position: int, ahead: bool) -> bool:
        """`prepare_fitting` with the memory free now."""
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
        self.defer_recomputes(position, pinned=False)
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
        self.counts.packed_steps += 1
        if self.place_packed(e, move_operands=False):
            return
        self.counts.operand_moves += 1
        if not self.place_packed(e, move_operands=True):  # pragma: no cover - see above
            raise PlanError(f"step %{self.steps[e].task} found no window of its size")

    def place_evicting(self, e: int, ahead: bool = False) -> bool:
        """Place step e's missing tensors, largest first, evicting the best window for each;
        if one finds no window, unpin what was pinned and return False. (`ahead`: step e
        is ahead of the execution horizon, see `prepare_ahead`.)"""
        held = self.held(e)
        for tensor in held:
            tensor.pins += 1
        workspace = self.workspaces.get(e)
        tensors = sorted((t for t in self.missing(e) if t is not workspace), key=lambda t: -t.size)
        if workspace is not None and workspace.region is None:
            tensors.append(workspace)  # last: a failure leaves no workspace to undo
        for tensor in tensors:
            block = self.fit(tensor) or self.make_room(tensor.size)
            if block is None:
                for pinned in held:
                    pinned.pins -= 1
                return False
            self.place(tensor, block, e, ahead=ahead)
            tensor.pins += 1
            held.append(tensor)
        self.defer_recomputes(e, pinned=True)  # pinned above as held or placed
        return True

    def held(self, e: int) -> list[TensorState]:
        """Step e's resident operands, and the resident operands of what it recomputes."""
        step = self.steps[e]
        held = [self.tensors[r] for r in step.roots if self.tensors[r].region is not None]
        held.extend(t for t in self.recomputes.extra(e) if t.region is not None)
        return held

    def place_packed(self, e: int, move_operands: bool) -> bool:
        """Clear one window for all of step e's missing tensors (and, with `move_operands`,
        room for its resident operands too, which may then be evicted) and place them
        there back to back, largest first, the output last.

        A moved operand may be discarded and recomputed into the window instead of going
        out and back (`Recomputes.chooses` with `moving`): the operands of its recompute
        that are not resident are then placed where the output goes, and given back
        (dropped: they have host copies) once the recomputes are emitted, before the
        output is allocated there."""
        held = self.held(e)
        planned = {t.id for t in self.missing(e)}
        total = sum(self.tensors[t].size for t in planned)
        if move_operands:
            total += sum(t.size for t in held)
            planned.update(t.id for t in held)
            self.moving = e
        else:
            for tensor in held:
                tensor.pins += 1
        offset = self.clear_window(total)
        self.moving = None
        if not move_operands:
            for tensor in held:
                tensor.pins -= 1
        if offset is None:
            return False
        output = self.tensors[self.steps[e].task]
        late = []  # operands of recomputes chosen while clearing the window
        for tensor in sorted(self.missing(e), key=lambda t: -t.size):
            if tensor.id not in planned:
                late.append(tensor)
            elif tensor is not output:
                self.place(tensor, self.alloc.allocate_at(offset, tensor.size), e, ahead=False)
                offset += tensor.size
        if not late:
            self.place(output, self.alloc.allocate_at(offset, output.size), e, ahead=False)
            self.pin(e, +1)
            self.defer_recomputes(e, pinned=False)
            return True
        slot = offset
        for tensor in late:  # in the output's place (`Recomputes.chooses` checked the room)
            self.place(tensor, self.alloc.allocate_at(slot, tensor.size), e, ahead=False)
            slot += tensor.size
        extra = self.emit_recomputes(e)  # now: the output takes their place
        for tensor in late:
            if tensor.next_use == NEVER:
                self.release(tensor)
            else:
                self.evict(tensor)
        self.place(output, self.alloc.allocate_at(offset, output.size), e, ahead=False)
        self.pin(e, +1)
        self.release_unused(extra)
        return True

    def unprepare(self, e: int) -> None:
        """Undo a failed preparation of step e: free its output if allocated, unwritten,
        and so the tensors placed for its recomputes (the discarded operands and the
        members of their chains). (Its workspace is placed last, so it is not placed when
        preparing fails.)"""
        step = self.steps[e]
        bound = self.recomputes.bound
        for tensor in self.recomputes.extra(e):  # chain members placed for this step
            if tensor.region is not None and bound.get(tensor.id) == e and not tensor.pins:
                del bound[tensor.id]
                self.release(tensor)
        for r in (*step.roots, step.task):
            tensor = self.tensors[r]
            # (a discarded operand placed for an earlier step's recompute stays: that
            # step is prepared, and its recompute writes it)
            unwritten = r == step.task or tensor.recompute and bound.get(r) == e
            if unwritten and tensor.region is not None:
                bound.pop(r, None)
                self.release(tensor)

    def fit(self, tensor: TensorState) -> Block | None:
        """A free block for `tensor` without evicting (see `keeps_room`)."""
        largest = self.alloc.largest_free
        if largest < tensor.size:
            return None
        if self.opts.placement == "lifetime":
            return self.fit_by_lifetime(tensor)
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

    def fit_by_lifetime(self, tensor: TensorState) -> Block:
        """The "lifetime" placement: at an end of a free block that fits, next to the
        neighbour whose last use is nearest `tensor`'s (the arena's ends count as never
        freed, as device outputs are), then the smaller block, then the lower offset.

        Neighbours that are freed together leave one free block, not holes: a tensor that
        lives long goes next to long-lived ones (or an arena end), a short-lived one next to
        short-lived ones, so a large request later finds a window without an eviction (the
        "room" rule can put a long-lived output in the one gap beside a tensor about to
        die, splitting the window that gap becomes; `benchmarks/plan_quality.py`)."""
        death, end_of_plan = _last_use(tensor), len(self.steps)
        at, offsets = self.residents.at, self.residents.offsets
        best = None
        for block, offset in self.alloc.fitting_ends(tensor.size):
            if offset == block.offset:  # flush against what ends there
                i = bisect.bisect_left(offsets, offset)
                neighbour = at[offsets[i - 1]] if i else None
                touches = neighbour is not None and neighbour.region.end == offset
                edge = offset == 0
            else:  # flush against what starts at the block's end
                neighbour = at.get(block.end)
                touches = neighbour is not None
                edge = block.end == self.alloc.size
            if edge:
                other = end_of_plan
            elif touches:
                other = _last_use(neighbour)
            else:  # allocated for this step, not yet resident: freed with `tensor`
                other = death
            key = (abs(other - death), block.size, offset)
            if best is None or key < best:
                best = key
        return self.alloc.allocate_at(best[2], tensor.size)

    def keeps_room(self, tensor: TensorState, offset: int) -> bool:
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
            self.counts.fragmentation_events += 1
        offset = self.clear_window(nbytes)
        return None if offset is None else self.alloc.allocate_at(offset, nbytes)

    def clear_window(self, nbytes: int) -> int | None:
        """Evict the occupants of the best window of `nbytes`; its offset, or None."""
        if self.alloc.largest_free >= nbytes:  # a free block is the best window
            fitting = [f for f in self.alloc.free_intervals() if f.size >= nbytes]
            return min(fitting, key=lambda f: (f.size, f.offset)).offset
        window = self.choose_window(nbytes)
        if window is None:
            return None
        if self.ahead_of is not None and not self.drops_only(window.victims):
            return None
        for victim in window.victims:
            self.evict(self.tensors[victim])
        return window.offset

    def choose_window(self, nbytes: int) -> Window | None:
        """The policy's best window of `nbytes` (nothing evicted yet); with `hide_reloads`,
        one whose victims were not read within a copy's time, where that offloads no more
        (`memgraph.transfer_schedule.hiding_window`)."""
        hidden = None
        if self.opts.hide_reloads:
            e = self.now if self.ahead_of is None else self.ahead_of
            held = self.recent.within(e, self.cost.transfer_seconds(nbytes, "h2d"))
            if not held:  # nothing read recently is resident: the policy's window hides it
                return self.ranked_window(nbytes)
            for tensor in held:
                tensor.pins += 1
            hidden = self.ranked_window(nbytes)
            for tensor in held:
                tensor.pins -= 1
            if hidden is not None and hidden.transfer_bytes == 0:
                return hidden
        return hiding_window(hidden, self.ranked_window(nbytes))

    def ranked_window(self, nbytes: int) -> Window | None:
        groups = self.residents.ranked_groups(self.now)
        window = choose_window_ranked(self.residents, groups, nbytes)
        self.residents.restore()
        return window

    def drops_only(self, victims: Iterable[int]) -> bool:
        """Whether evicting `victims` moves nothing off the device: each has a valid host
        copy (a weight, or a tensor offloaded before), so evicting it ahead of its turn
        adds no offload, only its bytes freed sooner."""
        return all(self.tensors[v].storage is not None for v in victims)

    def pin(self, position: int, delta: int) -> None:
        step = self.steps[position]
        for r in step.roots:
            self.tensors[r].pins += delta
        self.tensors[step.task].pins += delta

    # -- node emission --------------------------------------------------------------

    def bind_workspace(self, workspace: TensorState, block: Block) -> None:
        """Hold `block` as a step's workspace: no node yet (its apply will carry the region
        and wait for the frees of its bytes); resident, so the victim search sees the bytes
        taken, but never a victim (nothing writes it)."""
        workspace.region = Region(block.offset, block.size)
        self.workspace_deps[workspace.id] = block.deps
        self.residents.add(workspace)
        self.high_water = max(self.high_water, workspace.region.end)

    def release_workspace(self, workspace: TensorState, apply: int) -> None:
        """The apply `apply` has ended with its workspace: its bytes are free, released by
        that apply (later allocations there wait for it)."""
        self.frees += 1
        self.alloc.free(workspace.region.offset, freed_by=apply)
        self.residents.remove(workspace)
        workspace.region = None
        del self.workspace_deps[workspace.id]

    def bind(self, tensor: TensorState, block: Block) -> Region:
        """Emit the alloc node of `block` for `tensor` and record the residency."""
        region = Region(block.offset, block.size)
        tensor.alloc = self.builder.alloc(tensor.id, region, deps=block.deps)
        tensor.region, tensor.writer, tensor.users = region, None, []
        self.residents.add(tensor)
        self.high_water = max(self.high_water, region.end)
        return region

    def place(self, tensor: TensorState, block: Block, position: int, ahead: bool) -> None:
        """Allocate `tensor` at `block`; reload it unless it is step `position`'s output or
        workspace."""
        if tensor.id == self.steps[position].task:
            self.bind(tensor, block)
            return
        if tensor is self.workspaces.get(position):
            self.bind_workspace(tensor, block)
            return
        if tensor.recompute or tensor.storage is None:
            # written by its recompute, once the step's tensors are placed: discarded, or
            # in the chain of one (`Recomputes.rebuild`)
            self.bind(tensor, block)
            self.recomputes.bound[tensor.id] = position
            return
        self.reload(tensor, block)
        tensor.last_use = position
        self.residents.touch(tensor)
        self.counts.prefetched_reloads += ahead

    def reload(self, tensor: TensorState, block: Block) -> None:
        """Allocate `block` for a host-resident tensor and copy it there."""
        if tensor.storage is None:  # pragma: no cover - a non-resident tensor has a host copy
            raise PlanError(f"%{tensor.id} is needed but is neither resident nor on the host")
        region = self.bind(tensor, block)
        tensor.writer = self.builder.reload(
            tensor.id, tensor.storage, region, deps=[tensor.alloc, tensor.storage_writer]
        )
        self.counts.sliced_reloads += tensor.id in self.sliced

    def defer_recomputes(self, position: int, pinned: bool) -> None:
        """Hold the operands of what step `position` recomputes (`pinned`: already held
        by the preparation) until the step's apply, which its recomputes then come right
        before (`execute`): emitted at the preparation, ahead, a recompute would sit in
        the compute stream waiting for its operands' reloads, and stall applies due
        before it."""
        step = self.steps[position]
        if not any(self.tensors[r].recompute for r in step.roots):
            return
        extra = self.recomputes.extra(position)
        if not pinned:
            for tensor in extra:
                tensor.pins += 1
        self.deferred[position] = extra

    def emit_recomputes(self, position: int) -> list[TensorState]:
        """Emit the recompute of each tensor step `position` recomputes, now that all the
        step's tensors are placed: an apply of its task, marked `recompute`, that reads its
        operands (resident: placed with the step, or written by a recompute before it: a
        chain's tasks come in topological order) and writes its fresh region. Returns the
        tensors the recomputes needed besides the step's own (`Rebuild.extra`)."""
        rebuild = self.recomputes.rebuild(position)
        for r in rebuild.tasks:  # in topological order: a chain's operands first
            tensor = self.tensors[r]
            operands = [self.tensors[self.root[i]] for i in self.tg[r].inputs]
            deps = [tensor.alloc, *(t.writer for t in operands)]
            reads = [t.region for t in operands]
            node = self.builder.apply(r, reads, tensor.region, deps, recompute=True)
            tensor.writer, tensor.recompute = node, False
            self.recomputes.done(tensor)
            self.residents.touch(tensor)
            for operand in dict.fromkeys(operands):
                operand.users.append(node)
                operand.last_use = position
                self.residents.touch(operand)
        return list(rebuild.extra)

    def release_unused(self, tensors: list[TensorState]) -> None:
        """Free those of `tensors` (operands of recomputes) that nothing reads any more."""
        for tensor in tensors:
            if tensor.region is not None and tensor.pins == 0 and tensor.next_use == NEVER:
                self.release(tensor)

    def execute(self, e: int) -> None:
        """Emit step e's recomputes and apply, then free what it was the last reader of."""
        extra = self.deferred.pop(e, None)
        if extra is not None:
            self.emit_recomputes(e)
            for tensor in extra:
                tensor.pins -= 1
            self.release_unused(extra)
        step = self.steps[e]
        out = self.tensors[step.task]
        operands = [self.tensors[r] for r in step.reads]
        if step.sliced:
            node = self.builder.reload(
                out.id, out.storage, out.region, deps=[out.alloc, out.storage_writer]
            )
            self.counts.sliced_reloads += 1
        else:
            deps = [out.alloc, *(t.writer for t in operands)]
            workspace = self.workspaces.get(e)
            region = None
            if workspace is not None:
                deps.extend(self.workspace_deps[workspace.id])
                region = workspace.region
            node = self.builder.apply(
                step.task, [t.region for t in operands], out.region, deps, workspace=region
            )
            if workspace is not None:
                self.release_workspace(workspace, node)
        out.writer, out.last_use = node, e
        self.clock = self.seconds_before(e + 1)
        self.residents.touch(out)
        self.pin(e, -1)
        for r in step.roots:
            tensor = self.tensors[r]
            tensor.users.append(node)
            tensor.last_use = e
            tensor.ptr += 1
            self.residents.touch(tensor)
        if self.opts.hide_reloads:
            self.recent.record(e, (self.tensors[r] for r in step.roots))
        if self.opts.outputs == "host" and step.task in self.output_roots:
            self.offload(out)
        if step.task in self.assembly.piece_of:
            out.users.append(self.assembly.offload_piece(self.builder, out, self.new_storage))
        for r in (*step.roots, step.task):
            tensor = self.tensors[r]
            if tensor.next_use == NEVER and tensor.region is not None and not tensor.pins:
                # (one held for a recompute is freed after it: `release_unused`)
                if self.opts.outputs == "host" and tensor.id in self.output_roots:
                    self.draining[tensor.id] = self.d2h_end  # its write-back is the last copy
                else:
                    self.release(tensor)

    def offload(self, tensor: TensorState) -> None:
        if isinstance(self.tg[tensor.id].op, Input):  # started on the device, no host copy
            self.offloaded_inputs.append(tensor.id)
        copy = self.cost.transfer_seconds(tensor.nbytes, "d2h")
        self.d2h_end = max(self.d2h_end, self.clock) + copy
        tensor.storage = self.new_storage()
        node = self.builder.offload(tensor.id, tensor.region, tensor.storage, deps=[tensor.writer])
        tensor.storage_writer = node
        tensor.users.append(node)
        self.residents.touch(tensor)  # a host copy makes it free to drop

    def drain(self, until: float = -1.0, count: int | None = None) -> None:
        """Release host outputs whose write-back has ended by compute time `until` (the
        copies end in the order issued), or the `count` oldest whatever their end.

        With `outputs="host"` an output is copied to the host as soon as it is computed;
        freeing its region at once would let the next allocation reuse bytes the copy is
        still reading, and that allocation would wait for the copy. So the region stays
        allocated – still a resident, the cheapest victim of an eviction – until the copy
        has ended by the cost model's estimate, or until an allocation finds no other room.
        """
        for tensor_id, end in list(self.draining.items()):
            if count is None and end > until or count is not None and count <= 0:
                break
            if self.tensors[tensor_id].pins:  # held for a recompute (`defer_recomputes`)
                continue
            self.release(self.tensors[tensor_id])
            count = None if count is None else count - 1

    def release(self, tensor: TensorState) -> None:
        """Emit the free of `tensor`'s residency and return its bytes to the allocator."""
        self.draining.pop(tensor.id, None)
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

    def evict(self, tensor: TensorState) -> None:
        """Move a live tensor off the device: offload it unless a host copy exists."""
        if tensor.id in self.draining:  # a written-back output: released, not evicted
            self.release(tensor)
            return
        self.counts.evictions += 1
        if self.recomputes.chooses(tensor, self.now, self.moving):
            tensor.recompute = True  # discarded: no copy out
            self.release(tensor)
            self.expect_seconds(tensor.next_use, self.recomputes.reload_seconds(tensor))
            return
        if tensor.storage is None:
            self.offload(tensor)
        self.release(tensor)
        self.expect_reload(tensor)

    def expect_reload(self, tensor: TensorState) -> None:
        """Record the H2D seconds a host-resident tensor costs at its next step."""
        self.expect_seconds(tensor.next_use, self.cost.transfer_seconds(tensor.nbytes, "h2d"))

    def expect_seconds(self, position: int, seconds: float) -> None:
        """Record `seconds` of H2D transfers that step `position` awaits."""
        if position >= len(self.steps):
            return
        if position not in self.pending:
            bisect.insort(self.pending_at, position)
            self.pending[position] = 0.0
        self.pending[position] += seconds

    def new_storage(self) -> int:
        self.storages += 1
        return self.storages - 1

    def finish_outputs(self) -> None:
        """Output nodes: device outputs in place (reloaded if they fit), else from the host;
        outputs assembled on the host from their storage."""
        self.drain(count=len(self.draining))
        device = self.opts.outputs == "device"
        for name, task_id in self.tg.outputs.items():
            if task_id in self.assembly:  # on the host, filled by sliced offloads
                if device:
                    self.counts.outputs_on_host.append(name)
                self.assembly.output(self.builder, name, task_id)
                continue
            tensor = self.tensors[self.root[task_id]]
            if device and tensor.region is None:
                block = self.alloc.try_allocate(tensor.size)
                if block is not None:
                    self.reload(tensor, block)
            if device and tensor.region is not None:
                node = self.builder.output(
                    name, tensor.id, region=tensor.region, deps=[tensor.writer]
                )
                tensor.users.append(node)
                continue
            if tensor.storage is None:
                self.offload(tensor)
            if device:
                self.counts.outputs_on_host.append(name)
            self.builder.output(
                name, tensor.id, storage=tensor.storage, deps=[tensor.storage_writer]
            )


def _last_use(tensor: TensorState) -> int:
    """The step position after which `tensor` is dead (the number of steps for a device
    output, which the plan keeps to the end; 0 for a tensor nothing reads)."""
    if not tensor.uses:
        return 0
    return tensor.uses[-1]
