"""The transfer problem of a fixed order: tensors, their uses, and the gaps a plan may drop.

Any plan that walks the same steps as `memgraph.plan` (the compute tasks of one order,
with the same sliced reloads and host assembly, see `memgraph.steps`) decides, for
every tensor and every *gap* between two consecutive uses of it, whether the tensor
stays resident through the gap or leaves the device and comes back. Fragmentation
aside (the arena is *relaxed*: a tensor fits wherever enough bytes are free), nothing
else matters: a tensor that leaves during a gap may as well leave right after the use
that opens it and come back right before the use that closes it – that frees the
most memory for the same bytes moved. So the decisions are one binary per gap, and
`TransferProblem` lists them with what each costs.

The model, for a budget `B` (the usable arena: rounded down to the alignment) and each
tensor's size in the arena (rounded up to the alignment):

* **Steps.** At step t the operands (storage roots: views alias their base) and the
  output of its task are resident; so is every tensor whose gap spanning t is kept.
  Their sizes add up to at most `B`.
* **Computed tensors** exist from the step that makes them. A kept gap costs memory;
  a dropped one a reload of the tensor's bytes, and a host copy: an offload, paid once
  (tensors are immutable, so one copy serves every later reload).
* **Host tensors** – inputs in host storage (weights by default), and the Slices that
  *sliced reloads* copy from a host input's box – have a host copy from the start:
  their first load is compulsory (a constant) and dropping a gap costs a reload only.
* **Device inputs** (`Input.location == "device"`, with `inputs="auto"`) may start on
  the device, or on the host like a host tensor (a plan does that when they do not
  fit): their *start gap*, before the first use, is kept (resident from the start) or
  dropped (loaded at the first use: a reload, and a host copy for free). Dropping a
  later gap of one that started on the device needs an offload, once.
* **Outputs.** With `outputs="device"` an output's *end gap*, after its last use, is
  kept (resident to the end) or dropped (the output is then read from a host copy,
  which a computed tensor must be offloaded to get). With `outputs="host"` every output
  needs a host copy. The pieces of an output assembled on the host are each offloaded
  once, into their box (a constant).

Every plan of those steps that fits the budget (`memgraph.verify`) induces a choice of
kept gaps that satisfies these constraints and moves at least the bytes they cost; so
the optimum (`memgraph.optimal.optimal_transfers`) is a lower bound on the bytes any
such plan moves, contiguous arena or not, and it is exact for the relaxed arena (a plan
that places each tensor anywhere free). Alignment counts as the planner's does: a plan
whose regions are not multiples of it is bounded with the smallest alignment a plan may
have, `alignment=8` (`memgraph.allocator.MIN_ALIGNMENT`).

**Recompute** (`recompute=True`; `memgraph.recompute`): a dropped gap of a tensor the
planner may recompute (made by a step, no program output, no kernel workspace) may
instead be closed by applying its task again at the step that ends the gap – no reload,
and no host copy needed for it – priced in bytes by `memgraph.cost.rebuild_bytes` (its
compute time, net of the transfer latencies it saves, at the link's bandwidth: the
planner's own comparison, in bytes). A tensor priced at twice its bytes or more is not
offered the choice: an offload and a reload cost no more and need no operand, so that
leaves the optimum as it is and keeps the MILP small. The recompute is modelled as the
planner emits it:

* it runs in the step's *recompute phase*, before the step's apply: resident then are
  the step's operands (not its output, which is placed after), every kept gap spanning
  the step, and the recompute's operands;
* each operand of the recomputed task (by storage root) must be resident in that phase.
  One the step reads anyway is; any other is a *visit* (`Visit`): an optional stay at
  that phase, which splits the operand's gap around the step in two. Visited, the
  operand is charged its size in the phase's memory, and comes from a kept gap before
  it or is reloaded there (bytes moved, and a host copy: an offload once, for a computed
  tensor); the gap after the visit may be kept (it then stays on through the step's
  apply) or dropped. Not visited, both halves are dropped (and cost what the unsplit gap
  cost);
* a visit is never itself a recompute: chained recomputes (an operand rebuilt only to
  rebuild another tensor) are not modelled. The planner never makes them (it recomputes
  only from operands with host copies), so the model still holds every plan of the
  planner. A tensor rebuilt at a step that reads it may be an operand of another
  recompute of the same step (applied first), and a tensor visited may be rebuilt at a
  later step that reads it.

So the model with recompute is exact for the recomputes the planner makes, in a relaxed
arena: each recompute reads resident operands, and pays for their reloads and memory.
What it still relaxes, and why the optimum (`cost_bytes`) is a lower bound on a plan's
bytes moved plus `plan_rebuild_bytes`, not always attained by `memgraph.plan`:
fragmentation (as without recompute); an operand needs a host copy only if it is
reloaded for the recompute (the planner asks one of every operand, resident or not);
the step's output need not be placed during its recompute phase (the planner places it
there unless the step's operands are moved into one window); and kernel workspaces are
not counted (as without recompute).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from functools import cached_property

from einpage_core.errors import GraphError
from memgraph.allocator import DEFAULT_ALIGNMENT
from memgraph.budgets import read_budget
from memgraph.cost import CostModel, get_cost_model, rebuild_bytes
from memgraph.host_assembly import HostAssembly
from memgraph.options import PlanOptions
from memgraph.orders import check_order, get_order
from memgraph.steps import plan_steps, sliced_reloads, storage_roots
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input

__all__ = [
    "Origin",
    "ModelTensor",
    "Gap",
    "Visit",
    "TransferProblem",
    "transfer_problem",
    "rebuild_bytes",
    "plan_rebuild_bytes",
]


class Origin(Enum):
    """Where a tensor of the model comes from, which decides what its gaps cost."""

    COMPUTED = "computed"  # made by a step; a host copy costs an offload
    HOST = "host"  # a host input or a sliced-reload Slice: a host copy from the start
    DEVICE_INPUT = "device input"  # may start on the device or on the host


@dataclass(frozen=True, slots=True)
class ModelTensor:
    """A storage root of the model: its bytes (what a transfer moves), its `size` in the
    arena (aligned), its `origin`, and `forced_copy`: it is offloaded whatever the plan
    (a piece of an output assembled on the host, or an output with `outputs="host"`).
    `rebuild_bytes`: what recomputing it costs in the model's unit, bytes
    (`memgraph.cost.rebuild_bytes`), or
    None when it may not be recomputed (the problem was built without recompute, or the
    planner never recomputes it: not computed by a step, an output, or a task with a
    kernel workspace; or recomputing it never pays, priced at twice its bytes or more);
    `operands`: then the storage roots its task reads, which a
    recompute needs resident."""

    id: int
    nbytes: int
    size: int
    origin: Origin
    forced_copy: bool = False
    rebuild_bytes: int | None = None
    operands: tuple[int, ...] = ()

    @property
    def needs_offload(self) -> bool:
        """Whether dropping one of its gaps may cost an offload (the model's `o_i`)."""
        return self.origin is not Origin.HOST and not self.forced_copy


@dataclass(frozen=True, slots=True)
class Visit:
    """An optional stay of tensor `tensor` in the recompute phase of step `step` (before
    its apply), to be read by a recompute there: that step does not read the tensor
    itself, but a tensor it reads may be rebuilt from it (see the module docstring)."""

    tensor: int
    step: int


@dataclass(frozen=True, slots=True)
class Gap:
    """The stretch between two consecutive uses of a tensor: after the use at step
    `after` (-1: the start of the plan) until the use at step `before` (the number of
    steps: the end, for an output). Kept, the tensor is resident at every step strictly
    between them (`first`..`last`, possibly none); dropped, `reload` says whether it
    is loaded again at `before`, `copy` whether it needs a host copy by then, and
    `keepable` is False for an end gap that must be dropped (`outputs="host"`).

    With recompute, an end may be a `Visit` instead of a use: `after_visit` (the gap
    opens at the visit of step `after`: kept, the tensor stays from that visit on,
    through the step's apply, so `first` is `after`) and `before_visit` (it closes at
    the visit of step `before`: dropped, the tensor is reloaded there only if the visit
    is made). Keeping such a gap makes the visit."""

    tensor: int
    after: int
    before: int
    reload: bool
    copy: bool
    keepable: bool = True
    after_visit: bool = False
    before_visit: bool = False

    @property
    def first(self) -> int:
        return self.after if self.after_visit else self.after + 1

    @property
    def last(self) -> int:
        return self.before - 1

    @property
    def spans(self) -> bool:
        """Whether keeping it holds memory at some step."""
        return self.first <= self.last

    @property
    def is_start(self) -> bool:
        return self.after < 0


@dataclass(frozen=True)
class TransferProblem:
    """The gaps of one order and budget, with their costs (see the module docstring).

    `steps` are the task ids of the steps in order, `working` the aligned bytes each
    step holds whatever the plan (its operands and output), `uses` the steps at which
    each tensor is resident whatever the plan (made, loaded or read), `gaps` the decisions,
    `fixed_reload_bytes` / `fixed_offload_bytes` what every plan moves whatever it
    decides (first loads of host tensors; pieces and host outputs offloaded).
    `over_budget` is the first step whose working set alone exceeds `budget` (no plan
    exists), or None. With recompute, `visits` are the operand stays recomputes may need
    (`Visit`), and `making` the aligned bytes of each step's output (absent from its
    recompute phase).
    """

    budget: int
    alignment: int
    order: tuple[int, ...]
    steps: tuple[int, ...]
    working: tuple[int, ...]
    tensors: dict[int, ModelTensor]
    uses: dict[int, tuple[int, ...]]
    gaps: tuple[Gap, ...]
    fixed_reload_bytes: int
    fixed_offload_bytes: int
    over_budget: int | None
    visits: tuple[Visit, ...] = ()
    making: tuple[int, ...] = ()

    @property
    def fixed_bytes(self) -> int:
        return self.fixed_reload_bytes + self.fixed_offload_bytes

    def cost(self, kept: Iterable[bool], rebuilt: Iterable[bool] | None = None) -> tuple[int, int]:
        """(offload bytes, reload bytes) of keeping the gaps flagged in `kept` (one flag per
        gap, in order) and closing those flagged in `rebuilt` with a recompute instead of a
        reload (default: none; see `rebuild_cost`), fixed bytes included; the capacity is
        not checked (`fits`)."""
        kept = list(kept)
        rebuilt = self._rebuilt(kept, rebuilt)
        if len(kept) != len(self.gaps):
            raise GraphError(f"{len(kept)} flags for {len(self.gaps)} gaps")
        reload = self.fixed_reload_bytes
        offloaded: set[int] = set()
        started_on_device = {
            g.tensor: keep for g, keep in zip(self.gaps, kept, strict=True) if g.is_start
        }
        visited = dict(zip(self.visits, self.visited(kept, rebuilt), strict=True))
        for gap, keep, rebuild in zip(self.gaps, kept, rebuilt, strict=True):
            if keep or rebuild:  # a recomputed tensor needs neither a reload nor a copy
                continue
            if gap.before_visit and not visited[Visit(gap.tensor, gap.before)]:
                continue  # not needed at the end of the gap: no reload, no copy
            tensor = self.tensors[gap.tensor]
            if gap.reload:
                reload += tensor.nbytes
            if gap.copy and tensor.needs_offload and started_on_device.get(gap.tensor, True):
                offloaded.add(gap.tensor)
        offload = self.fixed_offload_bytes + sum(self.tensors[t].nbytes for t in offloaded)
        return offload, reload

    def rebuildable(self, gap: Gap) -> bool:
        """Whether `gap` may be closed by recomputing its tensor instead of reloading it
        (at a step that reads it: a visit is never a recompute)."""
        rebuild = self.tensors[gap.tensor].rebuild_bytes
        return gap.reload and not gap.is_start and not gap.before_visit and rebuild is not None

    def needs(self, gap: Gap) -> list[Visit]:
        """The visits a recompute closing `gap` needs: its task's operands that the step
        at the end of the gap does not read itself."""
        wanted = (Visit(j, gap.before) for j in self.tensors[gap.tensor].operands)
        return [v for v in wanted if v in self.visit_set]

    @cached_property
    def visit_set(self) -> frozenset[Visit]:
        return frozenset(self.visits)

    def visited(self, kept: Iterable[bool], rebuilt: Iterable[bool] | None = None) -> list[bool]:
        """Which `visits` are made when the gaps flagged in `kept` are kept and those in
        `rebuilt` recomputed: the ones a recompute needs, or a kept gap opens or closes."""
        kept = list(kept)
        rebuilt = self._rebuilt(kept, rebuilt)
        made: set[Visit] = set()
        for gap, keep, rebuild in zip(self.gaps, kept, rebuilt, strict=True):
            if rebuild:
                made.update(self.needs(gap))
            if keep and gap.after_visit:
                made.add(Visit(gap.tensor, gap.after))
            if keep and gap.before_visit:
                made.add(Visit(gap.tensor, gap.before))
        return [v in made for v in self.visits]

    def rebuild_cost(self, kept: Iterable[bool], rebuilt: Iterable[bool] | None = None) -> int:
        """The recompute bytes-equivalent (`ModelTensor.rebuild_bytes`) of closing the gaps
        flagged in `rebuilt` with a recompute (they must be dropped and `rebuildable`)."""
        kept = list(kept)
        rebuilt = self._rebuilt(kept, rebuilt)
        return sum(
            self.tensors[g.tensor].rebuild_bytes or 0
            for g, r in zip(self.gaps, rebuilt, strict=True)
            if r
        )

    def _rebuilt(self, kept: list[bool], rebuilt: Iterable[bool] | None) -> list[bool]:
        rebuilt = [False] * len(kept) if rebuilt is None else list(rebuilt)
        if len(rebuilt) != len(self.gaps):
            raise GraphError(f"{len(rebuilt)} recompute flags for {len(self.gaps)} gaps")
        for gap, keep, rebuild in zip(self.gaps, kept, rebuilt, strict=True):
            if rebuild and (keep or not self.rebuildable(gap)):
                raise GraphError(
                    f"gap of %{gap.tensor} after step {gap.after} cannot be recomputed "
                    "(kept, or its tensor may not be recomputed)"
                )
        return rebuilt

    def usage(self, kept: Iterable[bool]) -> list[int]:
        """The aligned bytes resident at each step when the gaps flagged in `kept` are kept."""
        delta = [0] * (len(self.steps) + 1)
        for gap, keep in zip(self.gaps, kept, strict=True):
            if keep and gap.spans:
                size = self.tensors[gap.tensor].size
                delta[gap.first] += size
                delta[gap.last + 1] -= size
        used, running = [], 0
        for t, base in enumerate(self.working):
            running += delta[t]
            used.append(base + running)
        return used

    def recompute_usage(
        self, kept: Iterable[bool], rebuilt: Iterable[bool] | None = None
    ) -> list[int]:
        """The aligned bytes resident in each step's recompute phase (before its apply:
        its output not yet placed, the visits made there resident), with the gaps flagged
        in `kept` kept and those in `rebuilt` recomputed."""
        kept = list(kept)
        used = [u - m for u, m in zip(self.usage(kept), self.making, strict=True)]
        for visit, made in zip(self.visits, self.visited(kept, rebuilt), strict=True):
            if made:
                used[visit.step] += self.tensors[visit.tensor].size
        for gap, keep in zip(self.gaps, kept, strict=True):
            if keep and gap.after_visit:  # counted by `usage` at that step, and by its visit
                used[gap.after] -= self.tensors[gap.tensor].size
        return used

    def fits(self, kept: Iterable[bool], rebuilt: Iterable[bool] | None = None) -> bool:
        """Whether keeping the gaps flagged in `kept` (and recomputing those in `rebuilt`)
        respects the budget at every step and in every recompute phase (and keeps no gap
        that must be dropped)."""
        kept = list(kept)
        if any(k and not g.keepable for g, k in zip(self.gaps, kept, strict=True)):
            return False
        if any(used > self.budget for used in self.usage(kept)):
            return False
        return not self.visits or all(
            used <= self.budget for used in self.recompute_usage(kept, rebuilt)
        )


def transfer_problem(
    tg: TaskGraph,
    budget: int | str,
    order: str | Sequence[int] = "program",
    *,
    inputs: str = "auto",
    outputs: str = "device",
    alignment: int = DEFAULT_ALIGNMENT,
    complete: bool = False,
    recompute: bool = False,
    cost_model: str | CostModel = "h100-pcie5",
) -> TransferProblem:
    """The transfer problem of `tg` planned in `order` (an `ORDERS` name or a topological
    order of all tasks) within `budget` (bytes, a size, or a percentage of the no-offload
    peak) with the planner's `inputs`, `outputs` and `alignment` options.

    `complete`: also list the gaps that cost nothing to keep (no step strictly inside):
    in a contiguous arena dropping one may still pay, to move the tensor elsewhere
    (`memgraph.optimal.offsets`).

    `recompute`: a dropped gap of a tensor the planner may recompute (made by a step, no
    output, no kernel workspace: `memgraph.recompute`) may be closed by a recompute
    instead of a reload, priced by `rebuild_bytes` on `cost_model` (the planner's).

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (256,))
    >>> a = ep.exp(x); d = ep.exp(ep.exp(ep.exp(a)))
    >>> prog.output(prog.einsum("i,i->", a, d), "y")
    >>> problem = transfer_problem(prog.build(), "2.5KiB", alignment=8)
    >>> [(g.tensor, g.after, g.before) for g in problem.gaps if g.spans]
    [(1, 1, 4)]
    """
    opts = PlanOptions(
        order=order, inputs=inputs, outputs=outputs, alignment=alignment, lookahead=0
    )
    nbytes_budget = read_budget(tg, budget, opts).nbytes
    usable = nbytes_budget // alignment * alignment
    ids = check_order(tg, get_order(order)(tg) if isinstance(order, str) else order)
    root = storage_roots(tg)
    sliced = sliced_reloads(tg, inputs)
    assembly = HostAssembly(tg)
    steps = plan_steps(tg, ids, root, sliced, assembly.tasks)
    builder = _Builder(tg, usable, alignment, inputs, outputs, root, sliced, assembly, complete)
    if recompute:
        builder.cost = get_cost_model(cost_model)
    return builder.build(tuple(ids), steps)


def operand_count(tg: TaskGraph, task_id: int, root: Sequence[int]) -> int:
    """The distinct storage roots task `task_id` reads (`memgraph.recompute.operands`)."""
    return len({root[i] for i in tg[task_id].inputs})


def plan_rebuild_bytes(mg, cost_model: str | CostModel | None = None) -> int:
    """`rebuild_bytes` of every recompute in plan `mg`, on `cost_model`: by default the
    one it was made with, by name (`mg.info["cost_model"]`, else the planner's default);
    pass a `CostModel` the plan was made with that is not registered by its name."""
    cost = get_cost_model(cost_model or mg.info.get("cost_model", "h100-pcie5"))
    tg = mg.taskgraph
    root = storage_roots(tg)
    return sum(
        rebuild_bytes(cost, tg, n.tensor, operand_count(tg, n.tensor, root))
        for n in mg.nodes
        if n.recompute
    )


class _Builder:
    """Collects the tensors, uses and gaps of `transfer_problem`."""

    def __init__(self, tg, budget, alignment, inputs, outputs, root, sliced, assembly, complete):
        self.complete = complete
        self.tg = tg
        self.budget = budget
        self.alignment = alignment
        self.inputs = inputs
        self.outputs = outputs
        self.root = root
        self.sliced = sliced
        self.assembly = assembly
        self.cost: CostModel | None = None  # set: recompute is a choice

    def rebuild(self, r: int, origin: Origin, output: bool) -> int | None:
        """`ModelTensor.rebuild_bytes` of storage root `r`: None also where recomputing
        never pays, priced at twice its bytes or more – an offload and a reload cost no
        more, and hold no operand – so that the MILP does not weigh it."""
        if self.cost is None or origin is not Origin.COMPUTED or output:
            return None
        if self.tg[r].workspace:
            return None
        price = rebuild_bytes(self.cost, self.tg, r, operand_count(self.tg, r, self.root))
        return price if price < 2 * self.tg[r].nbytes else None

    def operands(self, r: int) -> tuple[int, ...]:
        """The distinct storage roots task `r` reads (`memgraph.recompute.operands`)."""
        return tuple(dict.fromkeys(self.root[i] for i in self.tg[r].inputs))

    def visits(self, tensors: dict[int, ModelTensor], uses: dict[int, list[int]]) -> list[Visit]:
        """The operand stays a recompute may need: for each use that may end a
        rebuildable gap (every use after the first, unless it follows the previous one
        at once and gaps are not `complete`), each operand of the tensor that the step
        does not read itself."""
        found: dict[Visit, None] = {}
        used = {r: set(points) for r, points in uses.items()}
        for tensor in tensors.values():
            if tensor.rebuild_bytes is None:
                continue
            points = uses[tensor.id]
            for after, before in zip(points, points[1:], strict=False):
                if before - after > 1 or self.complete:
                    for j in tensor.operands:
                        if before not in used[j]:
                            found[Visit(j, before)] = None
        return sorted(found, key=lambda v: (v.tensor, v.step))

    def size(self, task_id: int) -> int:
        return -(-self.tg[task_id].nbytes // self.alignment) * self.alignment

    def origin(self, task_id: int) -> Origin:
        op = self.tg[task_id].op
        if task_id in self.sliced:
            return Origin.HOST
        if isinstance(op, Input):
            on_host = self.inputs == "host" or op.location == "host"
            return Origin.HOST if on_host else Origin.DEVICE_INPUT
        return Origin.COMPUTED

    def build(self, order: tuple[int, ...], steps) -> TransferProblem:
        tg = self.tg
        uses: dict[int, list[int]] = {}
        working, over = [], None
        for position, step in enumerate(steps):
            uses.setdefault(step.task, []).append(position)  # made (or, sliced, loaded) here
            for r in step.roots:
                uses.setdefault(r, []).append(position)
            need = self.size(step.task) + sum(self.size(r) for r in step.roots)
            working.append(need)
            if over is None and need > self.budget:
                over = step.task
        end = len(steps)
        ends: dict[int, bool] = {}  # output root -> may it stay resident to the end
        for task_id in tg.outputs.values():
            if task_id in self.assembly:
                continue
            r = self.root[task_id]
            ends[r] = self.outputs == "device"
            uses.setdefault(r, [])
        pieces = {p for p in self.assembly.piece_of if p in uses}
        tensors: dict[int, ModelTensor] = {}
        gaps: list[Gap] = []
        fixed_reload = fixed_offload = 0
        for r in sorted(uses):
            origin = self.origin(r)
            forced = r in pieces or (r in ends and not ends[r] and origin is Origin.COMPUTED)
            rebuild = self.rebuild(r, origin, r in ends)
            operands = self.operands(r) if rebuild is not None else ()
            tensors[r] = ModelTensor(
                r, tg[r].nbytes, self.size(r), origin, forced, rebuild, operands
            )
        visits = self.visits(tensors, uses)
        visited_at: dict[int, list[int]] = {}
        for visit in visits:
            visited_at.setdefault(visit.tensor, []).append(visit.step)
        for r, tensor in tensors.items():
            fixed_offload += tensor.nbytes if tensor.forced_copy else 0
            points = uses[r]
            if tensor.origin is Origin.HOST and points:
                fixed_reload += tensor.nbytes  # the first load
            gaps += self.gaps_of(
                tensor, points, visited_at.get(r, []), ends.get(r), end, self.complete
            )
        return TransferProblem(
            budget=self.budget,
            alignment=self.alignment,
            order=order,
            steps=tuple(s.task for s in steps),
            working=tuple(working),
            tensors=tensors,
            uses={r: tuple(points) for r, points in uses.items()},
            gaps=tuple(gaps),
            fixed_reload_bytes=fixed_reload,
            fixed_offload_bytes=fixed_offload,
            over_budget=over,
            visits=tuple(visits),
            making=tuple(self.size(s.task) for s in steps),
        )

    @staticmethod
    def gaps_of(
        tensor: ModelTensor,
        points: list[int],
        visits: list[int],
        end: bool | None,
        steps: int,
        complete: bool,
    ) -> list[Gap]:
        """The gaps of one tensor: a device input's start gap, one between each two uses
        or visits (the steps in `visits`, after its first use), and an output's end gap.
        Unless `complete`, gaps between two uses that cost nothing to keep (no step
        strictly inside) and would cost to drop are left out: a plan keeps them. A gap
        at a visit is always listed: keeping it makes the visit."""
        found = []
        device_input = tensor.origin is Origin.DEVICE_INPUT
        copy = tensor.needs_offload
        if device_input and points:  # one that nothing reads may as well start on the host
            found.append(Gap(tensor.id, -1, points[0], reload=True, copy=False))
        timeline = sorted([(p, False) for p in points] + [(s, True) for s in visits])
        assert not visits or (points and points[0] < min(visits)), "a visit before its first use"
        for (after, after_visit), (before, before_visit) in zip(
            timeline, timeline[1:], strict=False
        ):
            if before - after > 1 or complete or after_visit or before_visit:
                ends = {"after_visit": after_visit, "before_visit": before_visit}
                found.append(Gap(tensor.id, after, before, reload=True, copy=copy, **ends))
        if end is None or not points or tensor.origin is Origin.HOST:
            return found  # a host tensor is output from its host copy, for free
        last, last_visit = timeline[-1]
        if end and (
            steps - last > 1 or complete or last_visit
        ):  # may stay resident to the end, holding memory
            found.append(
                Gap(tensor.id, last, steps, reload=False, copy=copy, after_visit=last_visit)
            )
        elif not end and copy:  # outputs="host": must get a host copy
            gap = Gap(tensor.id, last, steps, reload=False, copy=True, keepable=False)
            found.append(replace(gap, after_visit=last_visit))
        return found
