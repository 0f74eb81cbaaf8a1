"""Exact optima and LP bounds: the fewest bytes a plan of a fixed order can move.

Offline caching with variable sizes is NP-hard, so the honest way to judge the
planner's bytes moved (offloads + reloads) is against the optimum where it can be
computed and against a sound bound where it cannot. For a fixed order and budget:

* `transfer_problem(tg, budget, order, ...)`: the model (`memgraph.optimal.problem`):
  one decision per *gap* between two uses of a tensor – keep it resident, or drop it
  (reload later; offload once first if it is an activation) – under the budget at
  every step, fragmentation ignored;
* `optimal_transfers(...)`: that model's optimum as a MILP solved by HiGHS
  (`scipy.optimize.milp`): a lower bound for plans in a contiguous arena, and exact for
  a relaxed one. Every `memgraph.plan` of the same order moves at least its bytes.
  With `recompute=True` (the default, as the planner's) a gap may instead be closed by
  recomputing its tensor, priced in bytes (its compute time at the link's bandwidth),
  its operands resident for it (reloaded, and held in memory, where the step does not
  read them itself): the optimum `cost_bytes` then bounds a plan's bytes moved plus
  `plan_rebuild_bytes(mg)`, and is exact for the planner's kind of recompute in a
  relaxed arena (what it still relaxes: `memgraph.optimal.problem`);
* `lp_transfer_bound(...)`: its LP relaxation, a sound lower bound in seconds on
  graphs too large for the MILP (tens of thousands of steps);
* `optimal_transfers_with_offsets(...)`: a second MILP with an offset per residency
  (OLLA/TelaMalloc-style), the optimum in a contiguous arena, for tiny graphs only;
* `sharpest_lower_bound(...)`: the largest of the LP bound and
  `memgraph.transfer_lower_bounds` (and, when it is solved, the MILP's proven bound);
  `plan_lp_bound(mg)`: the LP bound for the order and options a plan was made with.

Needs scipy >= 1.9 (the `test` extra installs it); without it the functions raise
`SolverMissingError` naming the package.

>>> import einpage as ep
>>> prog = ep.Program()
>>> x = prog.input("x", (256,))                 # 1 KiB each
>>> a = ep.exp(x); d = ep.exp(ep.exp(ep.exp(a)))
>>> prog.output(prog.einsum("i,i->", a, d), "y")  # a waits while b, c, d are computed
>>> best = optimal_transfers(prog.build(), "2.5KiB", alignment=8, recompute=False)
>>> best.status, best.offload_bytes, best.reload_bytes  # a goes to the host and back
('optimal', 1024, 1024)
>>> best = optimal_transfers(prog.build(), "2.5KiB", alignment=8)  # rebuilding a would
>>> best.moved_bytes, best.rebuilt  # need x back beside a and d: 3 KiB, over the budget
(2048, ())
>>> prog = ep.Program()
>>> u = prog.input("u", (256,), role="weight")
>>> v = prog.input("v", (256,), role="weight")
>>> x = prog.input("x", (256, 256))             # 256 KiB
>>> h = prog.einsum("i,j->ij", u, v)           # 256 KiB, rebuilt from 2 KiB of weights
>>> prog.output(((x @ h) @ x) @ h, "y")
>>> best = optimal_transfers(prog.build(), "772KiB")
>>> [g.tensor for g in best.rebuilt], [v.tensor for v in best.visited]  # u, v held for it
([3], [0, 1])
>>> best.moved_bytes, best.rebuild_bytes  # u and v loaded once; h never moves
(2048, 256604)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from memgraph.allocator import DEFAULT_ALIGNMENT
from memgraph.cost import CostModel
from memgraph.graph import MemGraph
from memgraph.optimal.offsets import optimal_transfers_with_offsets
from memgraph.optimal.problem import (
    Gap,
    ModelTensor,
    Origin,
    TransferProblem,
    Visit,
    plan_rebuild_bytes,
    rebuild_bytes,
    transfer_problem,
)
from memgraph.optimal.solve import (
    OptimalTransfers,
    SolverMissingError,
    lp_bound_of,
    solve_problem,
)
from memgraph.orders import ORDERS
from taskgraph.graph import TaskGraph

__all__ = [
    "transfer_problem",
    "rebuild_bytes",
    "plan_rebuild_bytes",
    "TransferProblem",
    "Gap",
    "Visit",
    "ModelTensor",
    "Origin",
    "optimal_transfers",
    "OptimalTransfers",
    "lp_transfer_bound",
    "optimal_transfers_with_offsets",
    "sharpest_lower_bound",
    "SharpestBound",
    "plan_lp_bound",
    "SolverMissingError",
]


def optimal_transfers(
    tg: TaskGraph,
    budget: int | str,
    order: str | Sequence[int] = "program",
    *,
    inputs: str = "auto",
    outputs: str = "device",
    alignment: int = DEFAULT_ALIGNMENT,
    time_limit: float | None = 60.0,
    mip_rel_gap: float = 0.0,
    recompute: bool = True,
    cost_model: str | CostModel = "h100-pcie5",
) -> OptimalTransfers:
    """The fewest bytes any plan of `tg` in `order` within `budget` moves, fragmentation
    ignored (see the module docstring); options as `memgraph.plan`'s. With `time_limit`
    (seconds; None: none) the result may be the best plan found and a proven bound.

    `recompute` (default on, as the planner's `recompute="auto"`): a tensor the planner
    may recompute may be rebuilt at a step that reads it instead of reloaded, priced at
    its compute time on `cost_model` in bytes (`memgraph.cost.rebuild_bytes`), its
    operands resident for it (`memgraph.optimal.problem`); the optimum is then
    `cost_bytes`, a lower bound on a plan's bytes moved plus `plan_rebuild_bytes(mg)`.
    `recompute=False`: the optimum of plans that never recompute (`moved_bytes`)."""
    problem = transfer_problem(
        tg, budget, order, inputs=inputs, outputs=outputs, alignment=alignment,
        recompute=recompute, cost_model=cost_model,
    )  # fmt: skip
    return solve_problem(problem, time_limit, mip_rel_gap)


def lp_transfer_bound(
    tg: TaskGraph,
    budget: int | str,
    order: str | Sequence[int] = "program",
    *,
    inputs: str = "auto",
    outputs: str = "device",
    alignment: int = DEFAULT_ALIGNMENT,
) -> int:
    """Bytes every plan of `tg` in `order` within `budget` moves at least: the optimum of
    the LP relaxation of `optimal_transfers`' MILP (floored with a margin)."""
    problem = transfer_problem(
        tg, budget, order, inputs=inputs, outputs=outputs, alignment=alignment
    )
    return lp_bound_of(problem)


@dataclass(frozen=True)
class SharpestBound:
    """The best sound lower bound on bytes moved, and its parts: `lp` (the LP relaxation),
    `capacity` (`memgraph.transfer_lower_bounds`' total), `milp` (the MILP's proven bound
    when it was solved, else None), `optimum` (the MILP's optimum when proven)."""

    bytes: int
    lp: int
    capacity: int
    milp: int | None = None
    optimum: int | None = None

    @property
    def source(self) -> str:
        """Which bound is the sharpest ("optimum", "milp", "lp" or "capacity")."""
        if self.optimum is not None and self.optimum == self.bytes:
            return "optimum"
        if self.milp is not None and self.milp == self.bytes:
            return "milp"
        return "lp" if self.lp >= self.capacity else "capacity"


def sharpest_lower_bound(
    tg: TaskGraph,
    budget: int | str,
    order: str | Sequence[int] = "program",
    *,
    inputs: str = "auto",
    outputs: str = "device",
    alignment: int = DEFAULT_ALIGNMENT,
    host_inputs: Iterable[str] | None = None,
    milp_time_limit: float | None = None,
) -> SharpestBound:
    """The largest of the LP bound, `memgraph.transfer_lower_bounds` and, with
    `milp_time_limit` seconds, the MILP's proven bound. The capacity bound holds for plans
    that start in host storage exactly the inputs `host_inputs` names (for one plan:
    `memgraph.bounds.host_inputs_of(mg)`; default: by `Input.location`, or all of them
    with `inputs="host"`)."""
    from memgraph.bounds import transfer_lower_bounds

    problem = transfer_problem(
        tg, budget, order, inputs=inputs, outputs=outputs, alignment=alignment
    )
    lp = lp_bound_of(problem)
    if host_inputs is None and inputs == "host":
        host_inputs = list(tg.inputs)
    capacity = transfer_lower_bounds(tg, problem.budget, problem.steps, host_inputs).total_bytes
    milp = optimum = None
    if milp_time_limit is not None:
        solved = solve_problem(problem, milp_time_limit)
        milp = solved.lower_bound
        optimum = solved.moved_bytes if solved.optimal else None
    best = max(lp, capacity, milp or 0, optimum or 0)
    return SharpestBound(best, lp, capacity, milp, optimum)


def plan_lp_bound(mg: MemGraph) -> int | None:
    """`lp_transfer_bound` for the TaskGraph, budget, order and options a plan of
    `memgraph.plan` was made with (read from its `info`): bytes that plan, and any other
    of the same steps, moves at least. None for a plan of another planner or of a custom
    order (the model is the planner's steps of a named order)."""
    info = mg.info
    if info.get("planner") != "memgraph.planner" or info.get("order") not in ORDERS:
        return None
    return lp_transfer_bound(
        mg.taskgraph,
        mg.budget,
        info["order"],
        inputs=info["inputs"],
        outputs=info["outputs"],
        alignment=mg.alignment,
    )
