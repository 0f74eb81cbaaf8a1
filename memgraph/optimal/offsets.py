"""The optimum in a contiguous arena: the transfer MILP with an offset per residency.

`memgraph.optimal.problem`'s model ignores fragmentation: a tensor fits wherever enough
bytes are free. A plan in a real arena gives each residency one region for its whole
life (`memgraph.plan` never moves a tensor in place: a move is an eviction and a
reload). This formulation adds that, in the style of OLLA (Steiner et al. 2022) and
TelaMalloc (Sankaranarayanan et al. 2023):

* an offset `y_(i,u)` in [0, budget - size_i] per use of tensor i at step u;
* a kept gap ties the offsets of the uses around it (`|y_(i,u) - y_(i,v)| <= M (1 - x)`,
  with M the budget): the tensor does not move while it stays;
* two blocks resident at a common step do not overlap: one is below the other, as an
  ordering binary chooses (big-M), relaxed when a kept gap that holds one is dropped.

Every gap is a decision here, also those with no step inside (`transfer_problem(...,
complete=True)`): dropping one moves the tensor through the host, which may be what a
fragmented arena needs. The optimum is then a lower bound for every plan of the steps
whose tensors keep their region while resident (every `memgraph.plan`), and at least
the relaxed optimum. Big-M formulations grow as the square of the blocks live at once:
for tiny graphs (tens of steps) only.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import numpy as np

from einpage_core.errors import EinpageError
from memgraph.allocator import DEFAULT_ALIGNMENT
from memgraph.optimal.problem import Origin, TransferProblem, transfer_problem
from memgraph.optimal.solve import (
    OptimalTransfers,
    bound_from,
    check_feasible,
    scale_unit,
    scipy_milp,
    solve_problem,
)
from taskgraph.graph import TaskGraph

__all__ = ["optimal_transfers_with_offsets"]


def optimal_transfers_with_offsets(
    tg: TaskGraph,
    budget: int | str,
    order: str | Sequence[int] = "program",
    *,
    inputs: str = "auto",
    outputs: str = "device",
    alignment: int = DEFAULT_ALIGNMENT,
    time_limit: float | None = 60.0,
) -> OptimalTransfers:
    """The fewest bytes a plan of `tg` in `order` within `budget` moves when each
    residency keeps one region of a contiguous arena (see the module docstring)."""
    problem = transfer_problem(
        tg, budget, order, inputs=inputs, outputs=outputs, alignment=alignment, complete=True
    )
    if not problem.steps:  # nothing to place
        return solve_problem(problem, time_limit)
    return _solve_with_offsets(problem, time_limit)


class _Columns:
    """Column bookkeeping of the offsets MILP: kinds, bounds, costs, integrality."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.upper: list[float] = []
        self.integral: list[int] = []

    def add(self, cost: float, upper: float, integral: bool) -> int:
        self.cost.append(cost)
        self.upper.append(upper)
        self.integral.append(int(integral))
        return len(self.cost) - 1


def _solve_with_offsets(problem: TransferProblem, time_limit: float | None) -> OptimalTransfers:
    started = time.perf_counter()
    check_feasible(problem)
    Bounds, LinearConstraint, milp, csr_array = scipy_milp()
    unit = scale_unit(problem)
    big = problem.budget / unit
    tensors, gaps = problem.tensors, problem.gaps
    cols = _Columns()
    constant = problem.fixed_bytes / unit
    x = []
    for gap in gaps:
        nbytes = tensors[gap.tensor].nbytes / unit
        if gap.reload:
            constant += nbytes
        x.append(cols.add(-nbytes if gap.reload else 0.0, 1.0 if gap.keepable else 0.0, True))
    copies = {}
    for gap in gaps:
        if gap.copy and tensors[gap.tensor].needs_offload and gap.tensor not in copies:
            copies[gap.tensor] = cols.add(tensors[gap.tensor].nbytes / unit, 1.0, False)
    offset: dict[tuple[int, int], int] = {}  # (tensor, step) -> its offset's column
    for r, positions in problem.uses.items():
        for u in positions:
            offset[r, u] = cols.add(0.0, (problem.budget - tensors[r].size) / unit, False)
    rows: list[tuple[list[tuple[int, float]], float, float]] = []
    starts = {g.tensor: k for k, g in enumerate(gaps) if g.is_start}
    for k, gap in enumerate(gaps):
        if gap.copy and gap.tensor in copies:
            column = copies[gap.tensor]
            if tensors[gap.tensor].origin is Origin.DEVICE_INPUT:
                rows.append(
                    ([(column, 1.0), (x[starts[gap.tensor]], -1.0), (x[k], 1.0)], 0, np.inf)
                )
            else:
                rows.append(([(column, 1.0), (x[k], 1.0)], 1.0, np.inf))
        if gap.after >= 0 and gap.before < len(problem.steps):  # kept: no move
            a, b = offset[gap.tensor, gap.after], offset[gap.tensor, gap.before]
            rows.append(([(a, 1.0), (b, -1.0), (x[k], big)], -np.inf, big))
            rows.append(([(b, 1.0), (a, -1.0), (x[k], big)], -np.inf, big))
    for first, second in _pairs(_blocks(problem, offset, x, unit)):
        below = cols.add(0.0, 1.0, True)  # 1: `first` lies below `second`
        present = [p for p in (first[2], second[2]) if p is not None]
        # Each inequality is relaxed by M when `below` says the other order, and by M
        # for each block held by a kept gap that is dropped (its presence column is 0).
        relax = [(p, big) for p in present]
        rows.append(
            (
                [(first[0], 1.0), (second[0], -1.0), (below, big), *relax],
                -np.inf,
                big * (1 + len(present)) - first[1],
            )
        )
        rows.append(
            (
                [(second[0], 1.0), (first[0], -1.0), (below, -big), *relax],
                -np.inf,
                big * len(present) - second[1],
            )
        )
    return _finish(problem, cols, rows, x, constant, unit, time_limit, started)


def _blocks(problem: TransferProblem, offset, x, unit):
    """Per step, the blocks resident there: (offset column, size, presence column or None:
    a use, always there; else the column of the kept gap that holds it)."""
    found: list[list[tuple[int, float, int | None]]] = [[] for _ in problem.steps]
    for r, positions in problem.uses.items():
        size = problem.tensors[r].size / unit
        for u in positions:
            found[u].append((offset[r, u], size, None))
    for k, gap in enumerate(problem.gaps):
        if gap.spans:
            anchor = gap.after if gap.after >= 0 else gap.before
            size = problem.tensors[gap.tensor].size / unit
            for t in range(gap.first, gap.last + 1):
                found[t].append((offset[gap.tensor, anchor], size, x[k]))
    return found


def _pairs(blocks):
    """Each pair of blocks resident at a common step, once."""
    seen = set()
    for present in blocks:
        for first, second in itertools.combinations(present, 2):
            if first[0] == second[0]:
                continue  # the same tensor, same residency
            key = (first, second) if first < second else (second, first)
            if key not in seen:
                seen.add(key)
                yield key


def _finish(problem, cols, rows, x, constant, unit, time_limit, started) -> OptimalTransfers:
    Bounds, LinearConstraint, milp, csr_array = scipy_milp()
    r_idx, c_idx, values, low, high = [], [], [], [], []
    for row, (entries, lo, hi) in enumerate(rows):
        for col, value in entries:
            r_idx.append(row)
            c_idx.append(col)
            values.append(value)
        low.append(lo)
        high.append(hi)
    matrix = csr_array((values, (r_idx, c_idx)), shape=(len(rows), len(cols.cost)))
    options = {"mip_rel_gap": 0.0}
    if time_limit is not None:
        options["time_limit"] = float(time_limit)
    result = milp(
        np.array(cols.cost),
        integrality=np.array(cols.integral),
        bounds=Bounds(np.zeros(len(cols.cost)), np.array(cols.upper)),
        constraints=[LinearConstraint(matrix, low, high)] if rows else [],
        options=options,
    )
    if result.x is None:
        raise EinpageError(f"the offsets MILP found no plan: {result.message}")
    kept = [bool(round(result.x[c])) for c in x]
    offload, reload = problem.cost(kept)
    status = "optimal" if result.status == 0 else "time limit"
    dual = getattr(result, "mip_dual_bound", None) or 0.0
    lower = min(offload + reload, bound_from((dual + constant) * unit))
    return OptimalTransfers(
        status=status,
        moved_bytes=offload + reload,
        offload_bytes=offload,
        reload_bytes=reload,
        lower_bound=lower,
        dropped=tuple(g for g, keep in zip(problem.gaps, kept, strict=True) if not keep),
        gaps=len(problem.gaps),
        steps=len(problem.steps),
        seconds=time.perf_counter() - started,
    )
