"""memgraph: the MemGraph IR (memory plans), the planner, the verifier and the simulator.

`plan(tg, budget)` makes a plan of a TaskGraph as it is (no partitioning inside: that is
`einpage.compile`'s), `verify(mg)` checks any plan, `simulate(mg)` times it
on a cost model; baselines (`layer_streaming_plan`, `no_offload_peak`, LRU via
`plan(..., eviction="lru")`) and `transfer_lower_bounds` are the comparison points, and
`memgraph.optimal` the exact optimum of bytes moved (`optimal_transfers`, a MILP solved
by HiGHS: needs scipy) and its LP bound (`lp_transfer_bound`).
Pictures: `render_memgraph`, and `memgraph.plots` (imported lazily: matplotlib).
"""

from memgraph.allocator import Allocator
from memgraph.baselines import layer_streaming_plan
from memgraph.bounds import TransferBounds, transfer_lower_bounds
from memgraph.budgets import BudgetReading, read_budget
from memgraph.cost import PRESETS as COST_MODELS
from memgraph.cost import CostModel, get_cost_model, register_cost_model
from memgraph.eviction import POLICIES, EvictionContext, Rank, register_policy
from memgraph.graph import MemGraph, MemGraphBuilder, PlanStats
from memgraph.nodes import NODE_FIELDS, HostBox, HostStorage, MemNode, NodeKind, Region
from memgraph.optimal import OptimalTransfers, lp_transfer_bound, optimal_transfers
from memgraph.orders import ORDERS, register_order
from memgraph.planner import (
    PlanOptions,
    min_budget,
    no_offload_peak,
    plan,
    resolve_budget,
    sliced_reloads,
)
from memgraph.render import render_memgraph
from memgraph.residency import Residencies, Residency
from memgraph.simulate import SimResult, simulate
from memgraph.trace import StreamEvent
from memgraph.verify import VerifyReport, verify

__all__ = [
    "MemGraph",
    "MemGraphBuilder",
    "MemNode",
    "NodeKind",
    "PlanStats",
    "Region",
    "HostBox",
    "HostStorage",
    "NODE_FIELDS",
    "Residency",
    "Residencies",
    "plan",
    "PlanOptions",
    "min_budget",
    "no_offload_peak",
    "resolve_budget",
    "read_budget",
    "BudgetReading",
    "sliced_reloads",
    "ORDERS",
    "register_order",
    "POLICIES",
    "EvictionContext",
    "Rank",
    "register_policy",
    "verify",
    "VerifyReport",
    "simulate",
    "SimResult",
    "CostModel",
    "COST_MODELS",
    "get_cost_model",
    "register_cost_model",
    "layer_streaming_plan",
    "transfer_lower_bounds",
    "TransferBounds",
    "optimal_transfers",
    "OptimalTransfers",
    "lp_transfer_bound",
    "render_memgraph",
    "StreamEvent",
    "Allocator",
]
