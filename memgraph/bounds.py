"""Lower bounds on the bytes any valid plan must move between host and device.

`transfer_lower_bounds(tg, budget, order)` returns what every MemGraph that verifies
(`memgraph.verify`) within `budget` bytes, applying the tasks in `order`, must at
least transfer. Two arguments, both counting tensor bytes (`Task.nbytes`, as
`PlanStats` does):

Compulsory reloads (any order)
    An input on the host is on the device only after a `reload` writes it there (an
    `input` node to host storage writes no device region), and an `apply` reads only
    resident operands. So every host input that some task reads is reloaded at least
    once before its first use: `compulsory_reload_bytes` is the sum of their bytes.

Where inputs start is the plan's choice (`Input.location` is the default, and a
planner may start a device input on the host when it does not fit), so the bounds
are stated for plans that start in host storage exactly the inputs `host_inputs`
names ("host inputs" below).

A Slice read straight from a host input can be made by *sliced reloads* of its box,
without the input on the device. The bounds hold for plans that do so and for plans
that compute it from the whole input: such a slice counts as a host tensor of its own
(used from its first reader on; its own step needs no memory), and an input read only
through slices contributes the smaller of its bytes and its slices' bytes to the
compulsory reloads.

Likewise, the Concats that rebuild a split program output may be assembled on the host
by *sliced offloads* (`taskgraph.assembly.output_assemblies` says which): for a bound
that holds either way, such a Concat needs no memory at its step (and may be left out
of the order), and its pieces are live only at their own step.

Capacity (for the order)
    Take the moment of the apply of the task at step s. The tensors that must then be
    *somewhere* are its working set W_s (its operands' storage roots and its output,
    which must be allocated) and the live set L_s: every tensor that exists before step
    s (a computed tensor produced earlier; an input first used earlier – an input not
    yet used may legitimately be brought in later) and is read again after step s.
    Allocated regions are at least as large as their tensors and never exceed the
    budget in total, so the tensors of L_s that are *not* allocated at that moment, the
    set S_s, hold at least e_s = bytes(L_s ∪ W_s) - budget bytes. Each of them is read
    after step s, so each is reloaded after step s (a tensor is computed once and an
    input node writes once, before its first use: only a reload can bring it back).
    Those reloads are distinct events from the compulsory ones, which happen before
    the first use of their host inputs: a host input in S_s was used before step s,
    so its compulsory reload lies before s and its reload after s is another. Hence

        reload bytes >= compulsory_reload_bytes + max_s e_s.

    The non-host tensors of S_s (computed ones and device inputs) exist on the host
    only if an offload copied them there, and at most the host inputs of L_s outside
    W_s can be dropped without one, so

        offload bytes >= max_s (e_s - bytes(host inputs in L_s \\ W_s)).

    (The maxima may come from different steps; each inequality holds on its own.)

Both bounds are sound, not tight: alignment padding, fragmentation and transfers
forced at several steps at once are ignored. The capacity part holds only for plans
that apply the tasks in `order` (their apply nodes in that order); the compulsory
part holds for every plan. A step whose working set alone exceeds the budget admits
no plan at all: that raises `InfeasibleBudgetError`.

>>> import einpage as ep
>>> prog = ep.Program()
>>> x = prog.input("x", (256,))                   # 1 KiB, on the device
>>> w = prog.input("w", (256,), role="weight")    # 1 KiB, on the host
>>> a = ep.exp(x); b = ep.exp(a); c = ep.exp(ep.exp(b))
>>> prog.output((a + c) * b * w, "y")            # a and b wait while c is computed
>>> bounds = transfer_lower_bounds(prog.build(), "3KiB")
>>> bounds.compulsory_reload_bytes, bounds.excess_bytes, bounds.offload_bytes
(1024, 1024, 1024)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from einpage_core.errors import GraphError, InfeasibleBudgetError
from einpage_core.units import format_bytes, parse_bytes
from memgraph.graph import MemGraph
from memgraph.nodes import NodeKind
from taskgraph.assembly import assembly_tasks
from taskgraph.facts import chosen_ids, first_needing
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input, Slice

__all__ = [
    "TransferBounds",
    "transfer_lower_bounds",
    "host_inputs_of",
    "StepTimeBound",
    "GenerationTimeBound",
    "generation_time_bound",
]


@dataclass(frozen=True, slots=True)
class TransferBounds:
    """Lower bounds on a plan's transfers, in bytes, with their parts (module docstring).

    * `compulsory_reload_bytes`: host inputs that some task reads (any order);
    * `peak_live_bytes`: the most bytes that must exist at one step of the order
      (max_s bytes(L_s ∪ W_s)), at step `peak_task`;
    * `excess_bytes`: max_s e_s, how far that exceeds the budget (0 if it fits), at
      task `excess_task`: bytes that are off the device at that step and reloaded later;
    * `offload_bytes`: max_s of e_s minus the host inputs that could be dropped, at
      task `offload_task`: bytes that must have been offloaded.
    """

    budget: int
    compulsory_reload_bytes: int
    peak_live_bytes: int
    peak_task: int | None
    excess_bytes: int
    excess_task: int | None
    offload_bytes: int
    offload_task: int | None

    @property
    def reload_bytes(self) -> int:
        """Reload bytes at least: the compulsory reloads plus the capacity excess."""
        return self.compulsory_reload_bytes + self.excess_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes moved in both directions at least: reload_bytes + offload_bytes."""
        return self.reload_bytes + self.offload_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "reload_bytes": self.reload_bytes,
            "total_bytes": self.total_bytes,
        }

    def __str__(self) -> str:
        return (
            f"reloads >= {format_bytes(self.reload_bytes)} "
            f"({format_bytes(self.compulsory_reload_bytes)} compulsory + "
            f"{format_bytes(self.excess_bytes)} over the budget), offloads >= "
            f"{format_bytes(self.offload_bytes)}"
        )


def _host_flags(tg: TaskGraph, names: set[str] | None) -> list[bool]:
    """Per task: an input that starts in host storage (`names`, or by `Input.location`)."""
    if names is None:
        return [isinstance(t.op, Input) and t.op.location == "host" for t in tg]
    unknown = sorted(names - set(tg.inputs))
    if unknown:
        raise GraphError(f"host_inputs names unknown input(s) {unknown}")
    return [isinstance(t.op, Input) and t.op.name in names for t in tg]


def _is_input_slice(tg: TaskGraph, t: int, host: list[bool]) -> bool:
    """Whether task `t` is a Slice read straight from a host input (sliced reloads can make it)."""
    task = tg[t]
    return isinstance(task.op, Slice) and host[task.inputs[0]]


def _check_order(tg: TaskGraph, order: Sequence[int] | None, host: list[bool]) -> list[int]:
    """The computed tasks in `order` (program order by default), checked. Slices of host
    inputs and the Concats of outputs that may be assembled on the host may be left out:
    a plan that makes them by sliced reloads, or by sliced offloads, applies none."""
    computed = [t.id for t in tg if t.is_compute]
    if order is None:
        return computed
    order = [int(t) for t in order]
    on_host = assembly_tasks(tg)
    optional = {t for t in computed if _is_input_slice(tg, t, host) or t in on_host}
    if sorted(set(order) | optional) != sorted(set(computed)) or len(order) != len(set(order)):
        missing = sorted(set(computed) - set(order) - optional)[:5]
        extra = sorted(set(order) - set(computed))[:5]
        repeated = len(order) != len(set(order))
        raise GraphError(
            "order must list every computed task (not inputs or views) exactly once"
            + (f"; missing %{', %'.join(map(str, missing))}" if missing else "")
            + (f"; not computed tasks: %{', %'.join(map(str, extra))}" if extra else "")
            + ("; some tasks repeat" if repeated else "")
        )
    done = {t.id for t in tg if isinstance(t.op, Input)} | optional
    for t in order:
        for operand in tg[t].inputs:
            root = tg.storage_root(operand)
            if root not in done:
                raise GraphError(f"order runs %{t} before its operand %{root}")
        done.add(t)
    return order


def transfer_lower_bounds(
    tg: TaskGraph,
    budget: int | str,
    order: Sequence[int] | None = None,
    host_inputs: Iterable[str] | None = None,
) -> TransferBounds:
    """Lower bounds on the transfers of any valid plan of `tg` within `budget` that applies
    the computed tasks in `order` (default: program order) and starts in host storage
    exactly the inputs named in `host_inputs` (default: those whose `Input.location` is
    "host"; `host_inputs_of(mg)` reads them off a plan). See the module docstring."""
    budget = parse_bytes(budget)
    host_names = None if host_inputs is None else set(host_inputs)
    order = _check_order(tg, order, _host_flags(tg, host_names))
    uses = _Uses.of(tg, order, _host_flags(tg, host_names))
    return _sweep(tg, order, budget, uses)


@dataclass
class _Uses:
    """Where each storage root is used in the order (module docstring).

    `first` and `last`: the steps at which each root is produced or first read, and last
    read; `host`: per task, whether it is a host tensor (a host input, or a Slice of one
    that sliced reloads may make); `sliced`: per task, such a Slice; `on_host`: the
    Concats of outputs that may be assembled on the host; `compulsory`: the bytes of the
    compulsory reloads.
    """

    first: dict[int, int]
    last: dict[int, int]
    host: list[bool]
    sliced: list[bool]
    on_host: frozenset[int]
    compulsory: int

    @classmethod
    def of(cls, tg: TaskGraph, order: list[int], host: list[bool]) -> _Uses:
        nbytes = [t.nbytes for t in tg]
        # A Slice read straight from a host input may be made by sliced reloads of its
        # box (never needing the input on the device): for a bound that holds either way
        # it is a host tensor of its own, used from its first reader on, and its own step
        # needs nothing.
        sliced = [_is_input_slice(tg, t.id, host) for t in tg]
        # The Concats of an output that may be assembled on the host need nothing at
        # their step either, and do not keep their pieces alive.
        on_host = frozenset(assembly_tasks(tg))
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for s, t in enumerate(order):
            if sliced[t] or t in on_host:
                continue
            first[t] = last[t] = s  # produced here
            for operand in tg[t].inputs:
                root = tg.storage_root(operand)
                first.setdefault(root, s)  # an input's first use (computed roots come earlier)
                last[root] = s
        compulsory = sum(nbytes[x] for x in first if host[x])
        # An input read only through slices arrives whole once or slice by slice: the
        # smaller of the two is compulsory.
        through_slices: dict[int, int] = {}
        for x in first:
            if sliced[x] and tg[x].inputs[0] not in first:
                source = tg[x].inputs[0]
                through_slices[source] = through_slices.get(source, 0) + nbytes[x]
        compulsory += sum(min(nbytes[i], total) for i, total in through_slices.items())
        host = [h or c for h, c in zip(host, sliced, strict=True)]
        return cls(first, last, host, sliced, on_host, compulsory)

    def live_deltas(self, tg: TaskGraph, order: list[int]) -> tuple[list[int], list[int]]:
        """Per step, the change in bytes of the tensors that must exist, and in those of
        the host tensors among them. A computed tensor exists from its step; an input
        from its first use."""
        step = {t: s for s, t in enumerate(order)}
        delta = [0] * (len(order) + 1)
        host_delta = [0] * (len(order) + 1)
        for x, begin in self.first.items():
            begin = begin if self.sliced[x] else step.get(x, begin)
            nbytes = tg[x].nbytes
            delta[begin] += nbytes
            delta[self.last[x] + 1] -= nbytes
            if self.host[x]:
                host_delta[begin] += nbytes
                host_delta[self.last[x] + 1] -= nbytes
        return delta, host_delta


def _sweep(tg: TaskGraph, order: list[int], budget: int, uses: _Uses) -> TransferBounds:
    """The capacity bounds of the module docstring, step by step."""
    delta, host_delta = uses.live_deltas(tg, order)
    nbytes = [t.nbytes for t in tg]
    live = host_live = 0
    peak = excess = offload = 0
    peak_task = excess_task = offload_task = None
    for s, t in enumerate(order):
        live += delta[s]
        host_live += host_delta[s]
        skip = uses.sliced[t] or t in uses.on_host
        working = set() if skip else {t, *(tg.storage_root(i) for i in tg[t].inputs)}
        working_bytes = sum(nbytes[x] for x in working)
        if working_bytes > budget:
            raise InfeasibleBudgetError(
                f"task %{t} alone needs {format_bytes(working_bytes)} ({working_bytes} B) "
                f"for its operands and output; the budget is {format_bytes(budget)} "
                f"({budget} B)",
                budget,
                working_bytes,
                t,
            )
        if live > peak or peak_task is None:
            peak, peak_task = live, t
        over = live - budget
        if over > excess:
            excess, excess_task = over, t
        droppable = host_live - sum(nbytes[x] for x in working if uses.host[x])
        if over - droppable > offload:
            offload, offload_task = over - droppable, t
    return TransferBounds(
        budget=budget,
        compulsory_reload_bytes=uses.compulsory,
        peak_live_bytes=peak,
        peak_task=peak_task,
        excess_bytes=excess,
        excess_task=excess_task,
        offload_bytes=offload,
        offload_task=offload_task,
    )


def host_inputs_of(mg: MemGraph) -> list[str]:
    """The names of the inputs a plan starts in host storage (its `input` nodes without a
    device region) – what `transfer_lower_bounds(..., host_inputs=)` needs for that plan."""
    return [n.name for n in mg.nodes if n.kind is NodeKind.INPUT and n.storage is not None]


# -- a lower bound on a generation's time ----------------------------------------------


@dataclass(frozen=True, slots=True)
class StepTimeBound:
    """The part of `generation_time_bound` of one step's interval (see there): `compute_s`
    the compute that must run in it, `load_bytes` the bytes that must cross host to
    device in it, `pipeline_s` the loads that must precede a step's bottleneck plus the
    compute after it, and `seconds`, the largest of the three readings."""

    step: int
    compute_s: float
    load_bytes: int
    pipeline_s: float
    seconds: float


@dataclass(frozen=True)
class GenerationTimeBound:
    """A lower bound on the simulated seconds of any plan of an unrolled generation
    (`generation_time_bound`): `steps`, one per interval; `floating_s`, compute not tied
    to one interval; `last_choice_s`, the last choice's own apply; `seconds`, the bound."""

    budget: int
    steps: tuple[StepTimeBound, ...]
    floating_s: float
    last_choice_s: float
    seconds: float


def generation_time_bound(tg: TaskGraph, budget: int | str, cost_model: Any) -> GenerationTimeBound:
    """A lower bound on the makespan `memgraph.simulate` gives any plan of the unrolled
    generation `tg` (its choices of ids marked `taskgraph.facts.ChosenIds`) that verifies
    within `budget`, on `cost_model` (a `memgraph.cost` name or `CostModel`).

    Intervals. Let Z_0 .. Z_N be the tasks that choose the ids of steps 0 (the prefill)
    .. N. Each Z_t depends on Z_{t-1}, so their applies start in order; interval t is
    [start of Z_{t-1}, start of Z_t) (interval 0 starts at time 0). Step t's tasks D_t
    are the ancestors of Z_t that are not ancestors of Z_{t-1} and descend from Z_{t-1}
    (for t = 0: every ancestor of Z_0): each runs after Z_{t-1} ends and before Z_t
    starts, so inside interval t; Z_{t-1} itself runs at its start. The ancestors of
    some Z_t that descend from no Z_{t-1} (position tables, masks: nothing that needs the
    previous ids) are *floating*: they run somewhere before Z_N. Slices read straight
    from an input are left out everywhere (a plan may start any input on the host and
    make them by sliced reloads, no apply at all), and so is what only the outputs read.

    In each interval, with B the budget and R_t the tensors that D_t reads and that exist
    before the interval (inputs, and tensors made by D_{t'} for t' < t), each counted
    by its bytes:

    * compute: the applies of D_t (less Z_t) and of Z_{t-1}, one at a time on the compute
      stream: c_t seconds (`CostModel.task_seconds`);
    * loads: at the start of Z_{t-1}'s apply its operands and output are resident, so at
      most C_t = B - bytes(those not in R_t) of R_t is (for t = 0: only device-located
      inputs can be resident at time 0, C_0 = min(B, their bytes in R_0)); every other
      tensor of R_t is reloaded before D_t reads it: at least |R_t| - C_t bytes cross in
      the interval (the old bound, `benchmarks/generation.py`'s, had weights + KV - B);
    * the step's own working memory: take a *bottleneck* a of D_t (every other task of
      D_t is its ancestor or its descendant, so D_t's tasks with smaller ids than a run
      before it, the rest after). While a runs, its operands and output are resident, and
      so must be – or be reloaded later in the interval – every tensor read after a: of
      R_t, and made by D_t before a. With need(a) those bytes (a's working set included),
      at least need(a) - B of them cross after a starts. Before a starts, of the tensors
      R_t that a or its ancestors read, A(a), at most C_t were resident at the start:
      at least (|A(a)| - C_t)^+ bytes crossed before. Both in the interval, so loads_t >=
      need(a) - B + (|A(a)| - C_t)^+: the bytes a step needs at once while much of the
      cache is still to be read reduce what can stay cached from the step before;
    * pipeline: those (|A(a)| - C_t)^+ bytes cross before a starts, and a and what
      follows it in D_t (less Z_t) compute after: (|A(a)| - C_t)^+ / h2d + c(a..).

    Interval t lasts at least T_t = max(c_t, loads_t / h2d, pipeline) (one host-to-device
    stream at `h2d_bytes_per_s`; latencies left out). The floating compute F adds to the
    intervals only beyond their slack T_t - c_t, and the generation ends after Z_N's own
    apply: makespan >= sum_t T_t + max(0, F - sum_t (T_t - c_t)) + c(Z_N).

    Only a bottleneck gives a working-memory or pipeline reading (for another task the
    order of the step's reads is the plan's choice); in a decoder step the residual adds
    and norms are bottlenecks. The bound is at least the step-by-step reading of
    `benchmarks/generation.py` up to its compute of floating tasks, and at most every
    plan's simulated makespan (`tests/memgraph/test_generation_bound.py` checks both).
    """
    from memgraph.cost import get_cost_model  # a leaf, imported here to keep bounds light

    cost = get_cost_model(cost_model)
    budget = parse_bytes(budget)
    chosen = chosen_ids(tg)
    if not chosen:
        raise GraphError(
            f"{tg.name!r} chooses no ids (no task has the ChosenIds fact): "
            "generation_time_bound needs an unrolled generation program"
        )
    z = [task_id for _, task_id in chosen]
    host = _host_flags(tg, None)
    skipped = [tg.is_input_slice(t.id) for t in tg]  # any input may start on the host
    step = first_needing(tg, enumerate(z))  # the first choice Z_t each task serves
    # after[i]: the latest choice Z_k that task i descends from (-1: none)
    after = [-1] * len(tg)
    position = {task_id: k for k, task_id in enumerate(z)}
    for task in tg:
        latest = max((after[i] for i in task.inputs), default=-1)
        after[task.id] = max(latest, position.get(task.id, -1))
    seconds = [
        cost.task_seconds(tg, t.id) if t.is_compute and not skipped[t.id] else 0.0 for t in tg
    ]
    members: list[list[int]] = [[] for _ in z]
    floating = 0.0
    for task in tg:
        t = step[task.id]
        if t is None or not task.is_compute or skipped[task.id] or task.op.aliases_input:
            continue
        if t == 0 or after[task.id] >= t - 1:
            members[t].append(task.id)
        else:
            floating += seconds[task.id]
    made_in = {i: t for t, ids in enumerate(members) for i in ids}
    parts = []
    for t, ids in enumerate(members):
        parts.append(_interval_bound(tg, t, ids, z, made_in, skipped, host, budget, seconds, cost))
    slack = sum(p.seconds - p.compute_s for p in parts)
    last = seconds[z[-1]]
    total = sum(p.seconds for p in parts) + max(0.0, floating - slack) + last
    return GenerationTimeBound(budget, tuple(parts), floating, last, total)


def _derived_groups(
    tg: TaskGraph, derived: list[int], made_in: dict[int, int], skipped: list[bool]
) -> tuple[list[tuple[list[int], int]], dict[int, frozenset[int]]]:
    """The tensors a step reads that a plan may make inside its interval from tensors that
    exist before it (`derived`: made by floating tasks, or Slices of inputs), grouped by
    shared sources, each group with the bytes it brings at least; and each one's sources.

    Such a tensor f is, at the interval's start, resident or on the host (then reloaded)
    – f's bytes –, or made again in the interval from its *sources* (the inputs and
    earlier steps' tensors that its floating ancestors read), which must then be resident
    or reloaded. So a group (connected by shared sources) brings at least the smaller of
    its tensors' bytes and the least bytes of one member's sources; none when a member has
    no sources (a fill)."""
    memo: dict[int, frozenset[int]] = {}

    def sources_of(x: int) -> frozenset[int]:
        if x in memo:
            return memo[x]
        task = tg[x]
        if isinstance(task.op, Input) or (x in made_in and not skipped[x]):
            found = frozenset([x])
        else:
            found = frozenset()
            for i in task.inputs:
                found |= sources_of(tg.storage_root(i))
        memo[x] = found
        return found

    sources = {f: sources_of(f) for f in derived}
    parent = {f: f for f in derived}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[int, int] = {}
    for f in derived:
        for x in sources[f]:
            if x in owner:
                parent[find(f)] = find(owner[x])
            else:
                owner[x] = f
    members: dict[int, list[int]] = {}
    for f in derived:
        members.setdefault(find(f), []).append(f)
    groups = []
    for group in members.values():
        own = sum(tg[f].nbytes for f in group)
        least = min(sum(tg[x].nbytes for x in sources[f]) for f in group)
        groups.append((group, min(own, least)))
    return groups, sources


def _interval_bound(
    tg: TaskGraph,
    t: int,
    ids: list[int],
    z: list[int],
    made_in: dict[int, int],
    skipped: list[bool],
    host: list[bool],
    budget: int,
    seconds: list[float],
    cost: Any,
) -> StepTimeBound:
    """The readings of interval t (`generation_time_bound`) for the step's tasks `ids`
    (in id order, a topological order)."""
    nbytes = [task.nbytes for task in tg]
    index = {task_id: k for k, task_id in enumerate(ids)}
    n = len(ids)

    def roots(task_id: int) -> list[int]:
        return list(dict.fromkeys(tg.storage_root(i) for i in tg[task_id].inputs))

    reads = {task_id: roots(task_id) for task_id in ids}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k, task_id in enumerate(ids):
        for r in reads[task_id]:
            first.setdefault(r, k)
            last[r] = k
    # R_t: tensors read by the step that exist before the interval (inputs, earlier steps)
    outside = {
        r: k
        for r, k in first.items()
        if r not in index
        and not skipped[r]
        and (isinstance(tg[r].op, Input) or made_in.get(r, t) < t)
    }
    derived = [r for r in first if r not in index and r not in outside]
    groups, sources = _derived_groups(tg, derived, made_in, skipped)

    def on_device(r: int) -> bool:  # an input that may be resident at time 0
        return isinstance(tg[r].op, Input) and not host[r]

    r_bytes = sum(nbytes[r] for r in outside)
    device = sum(nbytes[r] for r in outside if on_device(r))
    read_by = [0] * (n + 1)
    for members, bytes_in in groups:
        if any(s in outside for s in sources[members[0]]):
            continue  # its sources are counted as read by the step already
        r_bytes += bytes_in
        read_by[max(first[f] for f in members)] += bytes_in
        if any(on_device(s) for f in members for s in sources[f]):
            device += bytes_in
    every_source = {x for found in sources.values() for x in found}
    if t == 0:
        capacity = min(budget, device)
        compute = sum(seconds[i] for i in ids if i != z[0])
    else:
        previous = z[t - 1]
        held = {previous, *roots(previous)}
        capacity = budget - sum(
            nbytes[r] for r in held if r not in outside and r not in every_source
        )
        compute = sum(seconds[i] for i in ids if i != z[t]) + seconds[previous]
    loads = max(0, r_bytes - capacity)
    pipeline = 0.0
    # bottlenecks: every other task of the step an ancestor or a descendant
    ancestors = [0] * n
    for k, task_id in enumerate(ids):
        bits = 0
        for r in reads[task_id]:
            j = index.get(r)
            if j is not None:
                bits |= ancestors[j] | (1 << j)
        ancestors[k] = bits
    descendants = [0] * n
    for k in range(n - 1, -1, -1):
        for r in reads[ids[k]]:
            j = index.get(r)
            if j is not None:
                descendants[j] |= descendants[k] | (1 << k)
    # need(k): bytes resident or reloaded later while task k runs; A(k): R_t read up to k
    live = [0] * (n + 1)
    for r, k in outside.items():
        live[0] += nbytes[r]
        live[last[r] + 1] -= nbytes[r]
        read_by[k] += nbytes[r]
    for k, task_id in enumerate(ids):
        live[k] += nbytes[task_id]
        live[max(k, last.get(task_id, k)) + 1] -= nbytes[task_id]
    after_compute = [0.0] * (n + 1)
    for k in range(n - 1, -1, -1):
        own = seconds[ids[k]] if ids[k] != z[t] else 0.0
        after_compute[k] = after_compute[k + 1] + own
    need = early = 0
    for k in range(n):
        need += live[k]
        early += read_by[k]
        if (ancestors[k] | descendants[k]).bit_count() != n - 1:
            continue
        before = max(0, early - capacity)
        loads = max(loads, need - budget + before)
        pipeline = max(pipeline, before / cost.h2d_bytes_per_s + after_compute[k])
    total = max(compute, loads / cost.h2d_bytes_per_s, pipeline)
    return StepTimeBound(t, compute, loads, pipeline, total)
