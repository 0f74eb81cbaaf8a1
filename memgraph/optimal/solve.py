"""The transfer problem as a MILP (HiGHS, through `scipy.optimize.milp`), and its LP bound.

Variables: `x_k` in {0, 1} per gap (1: kept), `o_i` in [0, 1] per tensor that may need
an offload, and `f_t` >= 0 per step, the bytes of kept gaps resident at step t. Kept
gaps are intervals of steps, so the capacity is written as a flow along the steps
(FOO's min-cost-flow view of offline caching, Berger et al. SIGMETRICS'18): `f_t =
f_{t-1} + sizes of gaps opening at t - sizes of gaps that closed before t`, with
`f_t <= budget - working_t`. That keeps the matrix sparse – two entries per gap
instead of one per step it spans – so the LP relaxation solves on graphs of tens of
thousands of steps. The objective is bytes moved:

    fixed + sum_k reload_k * nbytes_k * (1 - x_k) + sum_i nbytes_i * o_i
    o_i >= 1 - x_k            for each gap k of a computed tensor i that needs a copy
    o_i >= x_start(i) - x_k   for a device input i (no offload if it started on the host)

`o_i` need not be declared integral: for integral `x` its optimum is. With recompute
(`transfer_problem(..., recompute=True)`), a gap k whose tensor may be recomputed has
a binary `r_k` (1: closed by a recompute): `x_k + r_k <= 1`, its reload term becomes
`nbytes_k * (1 - x_k - r_k) + rebuild_k * r_k`, and its copy constraint `o_i >= 1 -
x_k - r_k` (a recomputed tensor needs no host copy). Each visit v (an operand's
optional stay in a step's recompute phase) has a binary `z_v`, which stands for the 1
of a use in the terms of the gaps around it:

    r_k <= z_v                for each visit v the recompute of gap k needs
    x_k <= z_v                for each gap k that opens or closes at v
    nbytes_k * (z_v - x_k)    the reload of a gap k closing at v (o_i >= z_v - x_k)

and each step s with visits has a second capacity row, its recompute phase (its output
not yet placed; a gap opening at a visit is counted by `f_s` and by its visit once):

    f_s + sum_(v at s) size_v z_v - sum_(k opening at a visit of s) size_k x_k
        <= budget - working_s + output_s

Bytes are scaled by a power of two (exact in floating point) so coefficients stay near
1..1000.

`optimal_transfers` solves the MILP (exact on the small graphs of the tests; with a
time limit, it reports the best plan found and HiGHS's proven lower bound);
`lp_transfer_bound` solves the LP relaxation, a sound lower bound in seconds on graphs
far too large for the MILP.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from einpage_core.errors import EinpageError, InfeasibleBudgetError
from einpage_core.units import format_bytes
from memgraph.optimal.problem import Gap, Origin, TransferProblem, Visit

__all__ = [
    "OptimalTransfers",
    "solve_problem",
    "lp_bound_of",
    "check_feasible",
    "bound_from",
    "scale_unit",
    "scipy_milp",
    "SolverMissingError",
]

LP_MARGIN = 1e-6
"""Relative margin taken off a solver's objective before it is reported as a lower bound
(HiGHS's tolerances are about 1e-7): what is reported is then a bound, not an estimate.
Every plan moves a whole number of bytes, so the bound is then rounded up."""


class SolverMissingError(EinpageError):
    """scipy (with HiGHS, scipy >= 1.9) is not installed."""


def scipy_milp():
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import csr_array
    except ImportError as err:  # pragma: no cover - the test extra installs scipy
        raise SolverMissingError(
            "memgraph.optimal needs scipy >= 1.9 (HiGHS): pip install 'einpage[test]' "
            "or pip install scipy"
        ) from err
    return Bounds, LinearConstraint, milp, csr_array


@dataclass(frozen=True)
class OptimalTransfers:
    """The fewest bytes a plan of the problem's steps can move, as far as solved.

    `status` is "optimal" (`moved_bytes` is the optimum) or why the solver stopped
    ("time limit": `moved_bytes` is the best plan found, `lower_bound` what is proven);
    `offload_bytes` and `reload_bytes` split `moved_bytes`; `dropped` are the gaps the
    plan drops (not one that closes at a visit the plan does not make: the tensor
    is not needed there); `lower_bound` is sound for every plan of the steps (in bytes, floored).

    With recompute (`transfer_problem(..., recompute=True)`) the objective is
    `cost_bytes`: `moved_bytes` plus `rebuild_bytes`, the recomputes' price in bytes
    (`memgraph.optimal.problem.rebuild_bytes`) of the gaps in `rebuilt`; `lower_bound`
    then bounds a plan's bytes moved plus `plan_rebuild_bytes`; `visited` are the operand
    stays those recomputes made (their reloads are in `reload_bytes`). Without, 0/().
    """

    status: str
    moved_bytes: int
    offload_bytes: int
    reload_bytes: int
    lower_bound: int
    dropped: tuple[Gap, ...]
    gaps: int
    steps: int
    seconds: float
    rebuild_bytes: int = 0
    rebuilt: tuple[Gap, ...] = ()
    visited: tuple[Visit, ...] = ()

    @property
    def optimal(self) -> bool:
        return self.status == "optimal"

    @property
    def cost_bytes(self) -> int:
        """The objective: bytes moved plus the recomputes' bytes-equivalent."""
        return self.moved_bytes + self.rebuild_bytes

    def __str__(self) -> str:
        rebuilt = (
            f", {len(self.rebuilt)} recomputes worth {format_bytes(self.rebuild_bytes)}"
            if self.rebuilt
            else ""
        )
        return (
            f"{self.status}: {format_bytes(self.moved_bytes)} moved "
            f"({format_bytes(self.offload_bytes)} offloaded, "
            f"{format_bytes(self.reload_bytes)} reloaded{rebuilt}), lower bound "
            f"{format_bytes(self.lower_bound)}; {self.gaps} gaps, {self.steps} steps, "
            f"{self.seconds:.2f} s"
        )


@dataclass
class _Model:
    """The MILP's arrays: objective, integrality, bounds, and the constraint matrix."""

    cost: np.ndarray
    integral: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    rows: list[int]
    cols: list[int]
    values: list[float]
    row_lower: list[float]
    row_upper: list[float]
    constant: float
    unit: int
    copies: dict[int, int]  # tensor -> column of its o_i
    rebuilds: dict[int, int]  # gap index -> column of its r_k
    visits: dict[Visit, int]  # visit -> column of its z_v


def scale_unit(problem: TransferProblem) -> int:
    largest = max([problem.budget, *(t.size for t in problem.tensors.values())])
    return 1 << max(0, largest.bit_length() - 11)


def _model(problem: TransferProblem) -> _Model:
    gaps, tensors = problem.gaps, problem.tensors
    steps = len(problem.steps)
    unit = scale_unit(problem)
    n_gaps = len(gaps)
    copies: dict[int, int] = {}
    for gap in gaps:
        if gap.copy and tensors[gap.tensor].needs_offload and gap.tensor not in copies:
            copies[gap.tensor] = n_gaps + len(copies)
    rebuilds: dict[int, int] = {}
    for k, gap in enumerate(gaps):
        if problem.rebuildable(gap):
            rebuilds[k] = n_gaps + len(copies) + len(rebuilds)
    first_visit = n_gaps + len(copies) + len(rebuilds)
    visits = {v: first_visit + n for n, v in enumerate(problem.visits)}
    flow0 = first_visit + len(visits)
    size = flow0 + steps
    cost = np.zeros(size)
    lower = np.zeros(size)
    upper = np.ones(size)
    integral = np.zeros(size)
    integral[:n_gaps] = 1
    integral[first_visit:flow0] = 1
    constant = problem.fixed_bytes / unit
    for k, gap in enumerate(gaps):
        tensor = tensors[gap.tensor]
        if gap.reload and gap.before_visit:  # nbytes * (z_v - x_k)
            cost[visits[Visit(gap.tensor, gap.before)]] += tensor.nbytes / unit
            cost[k] -= tensor.nbytes / unit
        elif gap.reload:  # nbytes * (1 - x_k)
            constant += tensor.nbytes / unit
            cost[k] -= tensor.nbytes / unit
        if not gap.keepable:
            upper[k] = 0
    for t, column in copies.items():
        cost[column] = tensors[t].nbytes / unit
    for k, column in rebuilds.items():  # nbytes * (1 - x_k - r_k) + rebuild * r_k
        tensor = tensors[gaps[k].tensor]
        cost[column] = (tensor.rebuild_bytes - tensor.nbytes) / unit
        integral[column] = 1
    for t in range(steps):
        upper[flow0 + t] = (problem.budget - problem.working[t]) / unit
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    row_lower: list[float] = []
    row_upper: list[float] = []

    def add(entries: list[tuple[int, float]], low: float, high: float) -> None:
        row = len(row_lower)
        for col, value in entries:
            rows.append(row)
            cols.append(col)
            values.append(value)
        row_lower.append(low)
        row_upper.append(high)

    opening: list[list[tuple[int, float]]] = [[] for _ in range(steps + 1)]
    for k, gap in enumerate(gaps):
        if gap.spans:
            s = tensors[gap.tensor].size / unit
            opening[gap.first].append((k, -s))
            opening[gap.last + 1].append((k, s))
    for t in range(steps):  # f_t - f_{t-1} - opened + closed = 0
        entries = [(flow0 + t, 1.0), *opening[t]]
        if t:
            entries.append((flow0 + t - 1, -1.0))
        add(entries, 0.0, 0.0)
    for k, column in rebuilds.items():  # x_k + r_k <= 1
        add([(k, 1.0), (column, 1.0)], -np.inf, 1.0)
        for visit in problem.needs(gaps[k]):  # r_k <= z_v
            add([(column, 1.0), (visits[visit], -1.0)], -np.inf, 0.0)
    phase: dict[int, list[tuple[int, float]]] = {}  # step -> its recompute phase's terms
    for visit, column in visits.items():
        phase.setdefault(visit.step, []).append((column, tensors[visit.tensor].size / unit))
    for k, gap in enumerate(gaps):  # x_k <= z_v
        if gap.after_visit:
            add([(k, 1.0), (visits[Visit(gap.tensor, gap.after)], -1.0)], -np.inf, 0.0)
            phase[gap.after].append((k, -tensors[gap.tensor].size / unit))
        if gap.before_visit:
            add([(k, 1.0), (visits[Visit(gap.tensor, gap.before)], -1.0)], -np.inf, 0.0)
    for t, entries in phase.items():  # the recompute phase of step t
        room = problem.budget - problem.working[t] + problem.making[t]
        add([(flow0 + t, 1.0), *entries], -np.inf, room / unit)
    starts = {g.tensor: k for k, g in enumerate(gaps) if g.is_start}
    for k, gap in enumerate(gaps):
        if not (gap.copy and gap.tensor in copies):
            continue
        column = copies[gap.tensor]
        # a gap closing at a visit needs the copy only if the visit is made: z_v for 1
        needed = [(visits[Visit(gap.tensor, gap.before)], -1.0)] if gap.before_visit else []
        low = 0.0 if needed else 1.0
        if tensors[gap.tensor].origin is Origin.DEVICE_INPUT:  # o - x_start + x_k >= 0
            entries = [(column, 1.0), (starts[gap.tensor], -1.0), (k, 1.0), *needed]
            add(entries, low - 1.0, np.inf)
        else:  # o + x_k (+ r_k) >= 1
            rebuilt = [(rebuilds[k], 1.0)] if k in rebuilds else []
            add([(column, 1.0), (k, 1.0), *rebuilt, *needed], low, np.inf)
    return _Model(
        cost, integral, lower, upper, rows, cols, values, row_lower, row_upper, constant,
        unit, copies, rebuilds, visits,
    )  # fmt: skip


def check_feasible(problem: TransferProblem) -> None:
    """Raise `InfeasibleBudgetError` when some step alone exceeds the budget."""
    if problem.over_budget is not None:
        raise InfeasibleBudgetError(
            f"task %{problem.over_budget} alone needs more than the budget "
            f"{format_bytes(problem.budget)} ({problem.budget} B)",
            problem.budget,
            max(problem.working),
            problem.over_budget,
        )


def _solve(problem: TransferProblem, relax: bool, time_limit: float | None, gap: float):
    check_feasible(problem)
    Bounds, LinearConstraint, milp, csr_array = scipy_milp()
    model = _model(problem)
    matrix = csr_array(
        (model.values, (model.rows, model.cols)), shape=(len(model.row_lower), len(model.cost))
    )
    options = {"mip_rel_gap": gap, "presolve": True}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    constraints = (
        [LinearConstraint(matrix, model.row_lower, model.row_upper)] if model.row_lower else []
    )
    result = milp(
        model.cost,
        integrality=np.zeros_like(model.integral) if relax else model.integral,
        bounds=Bounds(model.lower, model.upper),
        constraints=constraints,
        options=options,
    )
    return model, result


def solve_problem(
    problem: TransferProblem, time_limit: float | None = 60.0, mip_rel_gap: float = 0.0
) -> OptimalTransfers:
    """Solve the MILP of `problem` (see `memgraph.optimal.optimal_transfers`)."""
    started = time.perf_counter()
    if not problem.steps:  # nothing to decide (and nothing for HiGHS to solve)
        offload, reload = problem.cost([])
        return OptimalTransfers("optimal", offload + reload, offload, reload, offload + reload,
                                (), 0, 0, time.perf_counter() - started)  # fmt: skip
    model, result = _solve(problem, relax=False, time_limit=time_limit, gap=mip_rel_gap)
    if result.x is None:
        raise EinpageError(f"the MILP found no plan: {result.message}")
    kept = [bool(round(v)) for v in result.x[: len(problem.gaps)]]
    rebuilt = [False] * len(kept)
    for k, column in model.rebuilds.items():
        rebuilt[k] = bool(round(result.x[column]))
    if not problem.fits(kept, rebuilt):  # pragma: no cover - HiGHS's solutions are integral
        raise EinpageError("the MILP's solution does not fit the budget once rounded")
    offload, reload = problem.cost(kept, rebuilt)
    rebuild = problem.rebuild_cost(kept, rebuilt)
    made = problem.visited(kept, rebuilt)
    visited = [v for v, m in zip(problem.visits, made, strict=True) if m]
    dropped = [
        g for g, keep in zip(problem.gaps, kept, strict=True)
        if not keep and (not g.before_visit or Visit(g.tensor, g.before) in visited)
    ]  # fmt: skip
    total = offload + reload + rebuild
    dual = getattr(result, "mip_dual_bound", None)
    if result.status == 0:
        status = "optimal"
    else:
        status = "time limit" if result.status == 1 else str(result.message)
    proven = (dual if dual is not None and math.isfinite(dual) else 0.0) + model.constant
    lower = min(total, bound_from(proven * model.unit))
    if status == "optimal" and mip_rel_gap == 0.0:
        lower = max(lower, bound_from((result.fun + model.constant) * model.unit))
    return OptimalTransfers(
        status=status,
        moved_bytes=offload + reload,
        offload_bytes=offload,
        reload_bytes=reload,
        lower_bound=lower,
        dropped=tuple(dropped),
        gaps=len(problem.gaps),
        steps=len(problem.steps),
        seconds=time.perf_counter() - started,
        rebuild_bytes=rebuild,
        rebuilt=tuple(g for g, r in zip(problem.gaps, rebuilt, strict=True) if r),
        visited=tuple(visited),
    )


def lp_bound_of(problem: TransferProblem, time_limit: float | None = None) -> int:
    """The LP relaxation's optimum, floored with a margin: bytes every plan moves at least."""
    if not problem.steps:
        return sum(problem.cost([]))
    model, result = _solve(problem, relax=True, time_limit=time_limit, gap=0.0)
    if result.status != 0:  # pragma: no cover - the LP is feasible when the MILP is
        raise EinpageError(f"the LP relaxation was not solved: {result.message}")
    return bound_from((result.fun + model.constant) * model.unit)


def bound_from(value: float) -> int:
    """The whole bytes a plan moves at least when a solver says at least `value`."""
    return max(0, math.ceil(value - LP_MARGIN * max(1.0, abs(value))))
