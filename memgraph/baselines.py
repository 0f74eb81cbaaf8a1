"""Baseline plans to compare the planner with: layer streaming, as ZeRO-Inference does it.

`layer_streaming_plan(tg, budget)` is the policy of ZeRO-Inference's weight
streaming: every weight stays in host memory; before a layer runs, all the weights
it reads are copied to the device, each is dropped after its last use in that
layer, and activations never leave the device (each is freed after its last use,
outputs stay). With `prefetch=n` the weights of the next n layers are copied while
the current layer computes, whenever memory allows – double buffering.

A *layer* is a maximal run of consecutive tasks (in program order) whose scopes
share the prefix up to the first numeric component: "layers.3.attn" and
"layers.3.mlp" are layer "layers.3"; "embed", "head" or "rope" are layers of their
own; a task without a scope is a layer by itself (`layer_key`, `layer_segments`).
Host-resident inputs (weights, and any input declared on the host) are what gets
streamed; inputs on the device are activations, copied in with the weights of the
first layer that reads them.

The plan is a real MemGraph: regions come from `memgraph.allocator.Allocator` (whose
blocks carry the write-after-read dependencies), activations placed best-fit from the
bottom of the arena and weights from the top, and every node lists the dependencies
`memgraph.verify` requires. Each copy also depends on the last apply before the point
where the policy issues it (for a layer's own weights, the previous layer's last
apply), as a runtime that issues copies when it gets there would run it: without
that, spare memory would let every copy start at once, whatever `prefetch` says, and
the simulator (`memgraph.simulate`) would credit the baseline with overlap it lacks.

When the policy cannot fit, it raises `InfeasibleBudgetError` whose `needed` is the
most device memory the policy holds at once without prefetching (`streaming_peak`): a
layer's weights plus the activations live at that point, each rounded up to the
alignment – the smallest budget the policy can work in with a perfect layout. If the
live bytes fit but the arena fragments, `needed` is instead the next budget (found by
doubling, then bisecting) at which the plan was made.

>>> import einpage as ep
>>> prog = ep.Program("mlp")
>>> x = prog.input("x", (64, 512))
>>> h = x
>>> for i in range(3):
...     with prog.scope(f"layers.{i}"):
...         h = ep.relu(h @ prog.input(f"w{i}", (512, 512), role="weight"))
>>> prog.output(h, "y")
>>> mg = layer_streaming_plan(prog.build(), "2MiB")
>>> mg.stats.reload_count, mg.stats.reload_bytes == 3 * 512 * 512 * 4
(3, True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from einpage_core.errors import AllocationError, InfeasibleBudgetError, PlanError
from einpage_core.units import format_bytes, parse_bytes
from memgraph.allocator import DEFAULT_ALIGNMENT, Allocator, Block, Checkpoint
from memgraph.cost import CostModel, get_cost_model
from memgraph.graph import MemGraph, MemGraphBuilder
from memgraph.nodes import Region
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input, Task

__all__ = [
    "Segment",
    "layer_key",
    "layer_segments",
    "layer_streaming_plan",
    "streaming_peak",
]


def layer_key(scope: str) -> str | None:
    """The layer a scope belongs to: the scope up to and including its first numeric
    component, else the whole scope; None for no scope (the task is a layer alone).

    >>> layer_key("layers.3.attn"), layer_key("encoder.blocks.0.mlp"), layer_key("head")
    ('layers.3', 'encoder.blocks.0', 'head')
    """
    if not scope:
        return None
    parts = scope.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return scope


@dataclass(frozen=True)
class Segment:
    """One layer of the streaming order: consecutive compute tasks with the same key.

    `weights` are the host-resident tensors (storage roots) its tasks read, in order
    of first use; `last_use[w]` is the last of `tasks` that reads weight `w`.
    """

    key: str | None
    tasks: tuple[int, ...]
    weights: tuple[int, ...]
    last_use: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "last_use", MappingProxyType(dict(self.last_use)))


def _is_host_input(task: Task) -> bool:
    return isinstance(task.op, Input) and task.op.location == "host"


def layer_segments(
    tg: TaskGraph, layer_of: Callable[[Task], str | None] | None = None
) -> list[Segment]:
    """The layers of `tg` in program order (see the module docstring).

    `layer_of(task)` overrides how a task's layer is named (default: `layer_key` of
    its scope); tasks named None are layers by themselves.
    """
    key_of = layer_of or (lambda task: layer_key(task.scope))
    runs: list[tuple[str | None, list[int]]] = []
    for task in tg:
        if not task.is_compute:
            continue
        key = key_of(task)
        if key is not None and runs and runs[-1][0] == key:
            runs[-1][1].append(task.id)
        else:
            runs.append((key, [task.id]))
    segments = []
    for key, tasks in runs:
        last_use: dict[int, int] = {}
        for t in tasks:
            for operand in tg[t].inputs:
                root = tg.storage_root(operand)
                if _is_host_input(tg[root]):
                    last_use[root] = t
        segments.append(Segment(key, tuple(tasks), tuple(last_use), last_use))
    return segments


class _OutOfMemory(Exception):
    """An allocation of the streaming schedule does not fit (internal)."""


class _Arena:
    """The device arena as the streamer uses it: activations are placed best-fit from the
    bottom, weights from the top (so a layer's weights come and go like a stack frame)."""

    def __init__(self, size: int, alignment: int):
        self.allocator = Allocator(size, alignment)
        self.capacity = self.allocator.size

    def allocate_low(self, nbytes: int) -> Block | None:
        return self.allocator.try_allocate(nbytes)

    def allocate_high(self, nbytes: int) -> Block | None:
        """`nbytes` at the highest address that fits."""
        allocator = self.allocator
        size = allocator.round_up(nbytes)
        for block in reversed(allocator.free_intervals()):
            offset = (block.end - size) // allocator.alignment * allocator.alignment
            if offset >= block.offset:
                return allocator.allocate_at(offset, nbytes)
        return None

    def free(self, offset: int, freed_by: int | None) -> None:
        self.allocator.free(offset, freed_by)

    def checkpoint(self) -> Checkpoint:
        return self.allocator.checkpoint()

    def rollback(self, token: Checkpoint) -> None:
        self.allocator.rollback(token)


class _CountingArena:
    """An arena that never runs out: the schedule's peak, whatever the layout."""

    capacity = float("inf")

    def __init__(self, alignment: int):
        self.alignment = alignment
        self.next_offset = 0

    def allocate_low(self, nbytes: int) -> Block:
        size = -(-nbytes // self.alignment) * self.alignment
        self.next_offset += size
        return Block(self.next_offset - size, size)

    allocate_high = allocate_low

    def free(self, offset: int, freed_by: int | None) -> None:
        pass


@dataclass
class _Residency:
    """A tensor on the device, with the nodes its free must wait for (real runs only)."""

    alloc: int
    region: Region
    writer: int = -1
    users: list[int] = field(default_factory=list)


class _Streamer:
    """Runs the layer-streaming schedule against an arena; emits nodes unless `dry`.

    The same code makes the real plan, the dry runs that decide whether a prefetch
    fits, and the peak measurement (with `_CountingArena`), so all three agree.
    """

    def __init__(
        self,
        tg: TaskGraph,
        segments: list[Segment],
        arena: _Arena | _CountingArena,
        builder: MemGraphBuilder | None,
        prefetch: int,
    ):
        self.tg = tg
        self.segments = segments
        self.arena = arena
        self.b = builder
        self.prefetch = prefetch
        self.root = [tg.storage_root(t.id) for t in tg]
        self.keep = {self.root[t] for t in tg.output_ids}  # stay on the device to the end
        self.last_use = [-1] * len(tg)  # task id of the last reader of each root
        for task in tg:
            if task.is_compute:
                for operand in task.inputs:
                    self.last_use[self.root[operand]] = task.id
        # The device inputs each segment reads first, placed when its weights are loaded.
        self.first_inputs: list[list[int]] = [[] for _ in segments]
        seen: set[int] = set()
        for j, seg in enumerate(segments):
            for t in seg.tasks:
                for x in (self.root[i] for i in tg[t].inputs):
                    device_input = isinstance(tg[x].op, Input) and not _is_host_input(tg[x])
                    if device_input and x not in seen:
                        seen.add(x)
                        self.first_inputs[j].append(x)
        # Memory state (dry and real): tensor -> (offset, size); placed device inputs.
        self.where: dict[int, tuple[int, int]] = {}
        self.placed: set[int] = set()
        self.next_load = 0  # the first segment whose weights have not been loaded
        # Peak of the schedule, split into weights and the rest, and the task at it.
        self.live = self.live_weights = 0
        self.peak = self.peak_weights = 0
        self.peak_task: int | None = None
        self.current_task: int | None = None
        # Real runs only: residencies and host storages.
        self.res: dict[int, _Residency] = {}
        self.storage: dict[int, tuple[int, int]] = {}  # host input -> (storage id, input node)
        self.prefetched = 0
        self.last_apply: int | None = None

    # -- memory operations ------------------------------------------------------------

    def alloc(self, tensor: int, dry: bool) -> bool:
        nbytes = self.tg[tensor].nbytes
        if _is_host_input(self.tg[tensor]):
            block = self.arena.allocate_high(nbytes)
        else:
            block = self.arena.allocate_low(nbytes)
        if block is None:
            if dry:
                return False
            raise _OutOfMemory(tensor)
        self.where[tensor] = (block.offset, block.size)
        self.live += block.size
        if _is_host_input(self.tg[tensor]):
            self.live_weights += block.size
        if self.live > self.peak:
            self.peak, self.peak_weights = self.live, self.live_weights
            self.peak_task = self.current_task
        if not dry:
            region = Region(block.offset, block.size)
            self.res[tensor] = _Residency(self.b.alloc(tensor, region, deps=block.deps), region)
        return True

    def free(self, tensor: int, dry: bool) -> None:
        offset, size = self.where.pop(tensor)
        self.live -= size
        if _is_host_input(self.tg[tensor]):
            self.live_weights -= size
        if dry:
            self.arena.free(offset, None)
            return
        r = self.res.pop(tensor)
        node = self.b.free(tensor, r.region, deps=[r.alloc, r.writer, *r.users])
        self.arena.free(offset, node)

    def place_input(self, x: int, dry: bool) -> bool:
        """Put device input `x` into a fresh region (its data arrives with an h2d copy)."""
        if not self.alloc(x, dry):
            return False
        self.placed.add(x)
        if not dry:
            r = self.res[x]
            name = self.tg[x].op.name
            deps = [r.alloc, *self.issued_after()]
            r.writer = self.b.input(name, x, region=r.region, deps=deps)
        return True

    def issued_after(self) -> list[int]:
        """The dependency that issues a copy where the policy reaches it: on the last apply
        emitted so far (none before the first)."""
        return [] if self.last_apply is None else [self.last_apply]

    # -- the schedule -----------------------------------------------------------------

    def load_segment(self, j: int, dry: bool) -> bool:
        """Place the device inputs segment `j` reads first, then copy in its weights that
        are not on the device.

        A weight still resident for an earlier layer is skipped: it is dropped after
        its last use there and copied again when segment `j` starts. Regions are taken
        from the top of the arena, the weight used last at the very top, so that the
        weights dropped first border the free middle of the arena; the copies are
        issued in order of first use."""
        for x in self.first_inputs[j]:
            if x not in self.placed and not self.place_input(x, dry):
                return False
        seg = self.segments[j]
        todo = [w for w in seg.weights if w not in self.where]
        for w in sorted(todo, key=lambda w: -seg.last_use[w]):
            if not self.alloc(w, dry):
                return False
        if not dry:
            for w in todo:
                r = self.res[w]
                sid, written = self.storage[w]
                deps = [r.alloc, written, *self.issued_after()]
                r.writer = self.b.reload(w, sid, r.region, deps=deps)
        return True

    def run_segment(self, j: int, start: int, dry: bool) -> bool:
        """Run segment `j` from its task `start` (loading its weights first at 0)."""
        seg = self.segments[j]
        if start == 0:
            self.current_task = seg.tasks[0]
            if self.next_load <= j:
                self.next_load = j + 1
            if not self.load_segment(j, dry):
                return False
        for index in range(start, len(seg.tasks)):
            if not dry and self.prefetch:
                self.try_prefetch(j, index)
            if not self.run_task(j, seg.tasks[index], dry):
                return False
        return True

    def run_task(self, j: int, t: int, dry: bool) -> bool:
        self.current_task = t
        task = self.tg[t]
        roots = list(dict.fromkeys(self.root[i] for i in task.inputs))
        if not self.alloc(t, dry):
            return False
        workspace = self.arena.allocate_low(task.workspace) if task.workspace else None
        if task.workspace:
            if workspace is None:
                if dry:
                    return False
                raise _OutOfMemory(t)
            self.live += workspace.size  # held while the task runs
            if self.live > self.peak:
                self.peak, self.peak_weights = self.live, self.live_weights
                self.peak_task = self.current_task
            self.live -= workspace.size
        if not dry:
            out = self.res[t]
            reads = [self.res[self.root[i]].region for i in task.inputs]
            writers = [self.res[x].writer for x in roots]
            deps = [out.alloc, *writers, *(workspace.deps if workspace else ())]
            held = Region(workspace.offset, workspace.size) if workspace else None
            out.writer = self.b.apply(t, reads, out.region, deps=deps, workspace=held)
            self.last_apply = out.writer
            for x in roots:
                self.res[x].users.append(out.writer)
        if workspace is not None:  # released by the apply itself
            self.arena.free(workspace.offset, None if dry else self.last_apply)
        last_in_segment = self.segments[j].last_use
        for x in roots:
            if _is_host_input(self.tg[x]):
                if last_in_segment[x] == t:
                    self.free(x, dry)
            elif self.last_use[x] == t and x not in self.keep:
                self.free(x, dry)
        if self.last_use[t] < 0 and t not in self.keep:
            self.free(t, dry)
        return True

    def try_prefetch(self, k: int, index: int) -> None:
        """Before task `index` of segment `k`, load the next layers' weights (up to
        `prefetch` layers ahead) if the schedule still fits through the end of each
        such layer – checked by a dry run that is rolled back."""
        while self.next_load < len(self.segments) and self.next_load <= k + self.prefetch:
            j = self.next_load
            alignment = self.b.alignment
            weights = [w for w in self.segments[j].weights if w not in self.where]
            incoming = sum(-(-self.tg[w].nbytes // alignment) * alignment for w in weights)
            if self.live + incoming > self.arena.capacity:
                return  # cannot fit even before the dry run
            saved = (dict(self.where), set(self.placed), self.live, self.live_weights)
            current = self.current_task
            token = self.arena.checkpoint()
            ok = (
                self.load_segment(j, dry=True)
                and self.run_segment(k, index, dry=True)
                and all(self.run_segment(m, 0, dry=True) for m in range(k + 1, j + 1))
            )
            self.arena.rollback(token)
            self.where, self.placed, self.live, self.live_weights = saved
            self.current_task, self.next_load = current, j
            if not ok:
                return
            self.load_segment(j, dry=False)
            self.next_load = j + 1
            self.prefetched += 1

    def run(self, dry: bool) -> None:
        tg = self.tg
        if not dry:
            for task in tg:
                if _is_host_input(task):
                    sid = len(self.storage)
                    node = self.b.input(task.op.name, task.id, storage=sid)
                    self.storage[task.id] = (sid, node)
        for task in tg:  # device inputs nobody reads: placed at once
            is_device_input = isinstance(task.op, Input) and not _is_host_input(task)
            if is_device_input and self.last_use[task.id] < 0:
                self.current_task = task.id
                if not self.place_input(task.id, dry):
                    raise _OutOfMemory(task.id)
                if task.id not in self.keep:
                    self.free(task.id, dry)
        for j in range(len(self.segments)):
            if not self.run_segment(j, 0, dry):
                raise _OutOfMemory(self.current_task)
        if dry:
            return
        for name, t in tg.outputs.items():
            base = self.root[t]
            if _is_host_input(tg[base]):
                sid, written = self.storage[base]
                self.b.output(name, base, storage=sid, deps=[written])
            else:
                r = self.res[base]
                r.users.append(self.b.output(name, base, region=r.region, deps=[r.writer]))


def _attempt(
    tg: TaskGraph, segments: list[Segment], budget: int, alignment: int, prefetch: int
) -> tuple[MemGraph, int] | None:
    """The plan at `budget` with up to `prefetch` layers ahead, or None if it does not fit."""
    builder = MemGraphBuilder(tg, budget, alignment)
    try:
        arena = _Arena(max(budget, alignment), alignment)
    except AllocationError:
        return None
    streamer = _Streamer(tg, segments, arena, builder, prefetch)
    try:
        streamer.run(dry=False)
    except _OutOfMemory:
        return None
    return builder.build(), streamer.prefetched


def streaming_peak(
    tg: TaskGraph,
    alignment: int = DEFAULT_ALIGNMENT,
    layer_of: Callable[[Task], str | None] | None = None,
) -> tuple[int, int, int | None]:
    """The most device bytes layer streaming holds at once without prefetch (each
    tensor rounded up to `alignment`): (peak, weight bytes in it, the task at it)."""
    streamer = _Streamer(tg, layer_segments(tg, layer_of), _CountingArena(alignment), None, 0)
    streamer.run(dry=True)
    return streamer.peak, streamer.peak_weights, streamer.peak_task


def layer_streaming_plan(
    tg: TaskGraph,
    budget: int | str,
    *,
    prefetch: int = 1,
    cost_model: str | CostModel = "h100-pcie5",
    alignment: int = DEFAULT_ALIGNMENT,
    layer_of: Callable[[Task], str | None] | None = None,
) -> MemGraph:
    """The ZeRO-Inference-style plan of `tg` within `budget` bytes (module docstring).

    `prefetch`: how many layers ahead weights are copied while a layer computes (0:
    copy each layer's weights when it starts). A prefetch is issued as early as memory
    allows and only where a dry run shows the schedule still fits; if the finished
    plan would not fit, the plan is made again without prefetching. `cost_model` is
    checked and recorded (the policy itself does not depend on it; it is accepted so
    that every policy is called alike). `layer_of` overrides the layer of a task.

    Raises `InfeasibleBudgetError` when even the no-prefetch schedule does not fit;
    its `needed` is that schedule's peak (see `streaming_peak`), or, when the arena
    fragments, the next budget found at which the plan fits.
    """
    budget = parse_bytes(budget)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise PlanError(f"prefetch must be an int >= 0 (layers ahead), got {prefetch!r}")
    model = get_cost_model(cost_model)
    segments = layer_segments(tg, layer_of)
    peak, peak_weights, peak_task = streaming_peak(tg, alignment, layer_of)
    if peak > budget:
        where = f" at task %{peak_task}" if peak_task is not None else ""
        scope = tg[peak_task].scope if peak_task is not None else ""
        raise InfeasibleBudgetError(
            f"layer streaming needs {format_bytes(peak)} ({peak} B) of device memory{where}"
            + (f" in {scope!r}" if scope else "")
            + f": {format_bytes(peak_weights)} of weights and "
            f"{format_bytes(peak - peak_weights)} of activations live at once; the budget "
            f"is {format_bytes(budget)} ({budget} B)",
            budget,
            peak,
            peak_task,
        )
    made = _attempt(tg, segments, budget, alignment, prefetch)
    if made is None and prefetch:
        made = _attempt(tg, segments, budget, alignment, 0)
    if made is None:
        needed = _smallest_working_budget(tg, segments, budget, alignment)
        raise InfeasibleBudgetError(
            f"layer streaming holds at most {format_bytes(peak)} at once, within the budget "
            f"of {format_bytes(budget)} ({budget} B), but the arena fragments; "
            f"{format_bytes(needed)} ({needed} B) works",
            budget,
            needed,
            peak_task,
        )
    mg, prefetched = made
    info = {
        "planner": "layer_streaming",
        "prefetch": prefetch,
        "prefetched_layers": prefetched,
        "layers": len(segments),
        "streaming_peak": peak,
        "cost_model": model.name,
    }
    return MemGraph(mg.taskgraph, mg.nodes, mg.budget, mg.alignment, info)


def _smallest_working_budget(
    tg: TaskGraph, segments: list[Segment], budget: int, alignment: int
) -> int:
    """A budget above `budget` at which the no-prefetch plan fits, as small as found: grow
    the step until one works, then bisect (in alignment units) below it. Whether a plan
    fits is not quite monotone in the budget, so this is the bisection's answer – one at
    which the plan was made – not a proven minimum."""
    step = alignment
    while _attempt(tg, segments, budget + step, alignment, 0) is None:
        step *= 2
    lo, hi = step // 2 // alignment, step // alignment  # budget + lo * alignment fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _attempt(tg, segments, budget + mid * alignment, alignment, 0) is None:
            lo = mid
        else:
            hi = mid
    return budget + hi * alignment
