"""memgraph: the MemGraph IR (memory plans), the planner, the verifier and the simulator.

`plan(tg, budget)` makes a plan of a TaskGraph as it is (no partitioning inside: that is
`einpage.compile`'s), `verify(mg)` checks any plan, `simulate(mg)` times it
on a cost model (`simulate(mg, timeline=True).write_chrome_trace(path)`: a Perfetto
trace), `write_memory_snapshot(mg, path)` writes its device memory for PyTorch's
memory viewer; baselines (`layer_streaming_plan`, `streaming_minimum`, LRU via
`plan(..., eviction="lru")`) and `transfer_lower_bounds` are the comparison points, and
`memgraph.optimal` the exact optimum of bytes moved (`optimal_transfers`, a MILP solved
by HiGHS: needs scipy) and its LP bound (`lp_transfer_bound`).
Pictures: `render_memgraph`, and `memgraph.plots` (imported lazily: matplotlib).

Where things live:

* the IR – `nodes` (node kinds and the fields each declares, `Region`, `HostBox`,
  `HostStorage`), `graph` (`MemGraph`, `MemGraphBuilder`, `PlanStats`), `serialize`
  (JSON), `residency` (what is resident where, from which node to which: the one
  analysis behind stats, plots and the verifier's budget check);
* the planner – `planner` (the pass), `horizon` (its loop: execution and allocation
  horizons), `budgets` (reading budgets; `resident_peak`, `streaming_minimum`,
  `min_budget`), `steps`, `residents` (victim bookkeeping), `host_assembly`
  (outputs assembled on the host), `options`, `allocator` (best fit), `eviction` and
  `orders` (registries of policies and orders);
* judging plans – `verify` (with `happens_before`, `verify_ranges`), `cost` and
  `simulate`, `baselines`, `bounds`, `optimal/` (the exact optimum and its LP bound);
* pictures – `render`, `plots`, `trace`, `snapshot` (PyTorch memory snapshots);
* several devices – `placement` (`pipeline_placement`, `split`: a TaskGraph per device
  and the links between them), `multi` (the types, `plan_devices`, `verify_multi`);
* the host tier – `tiers` (`place_host`: host memory planned under a host budget, disk
  below it: weights read from their checkpoint, offloaded tensors spilled).
"""

from memgraph.allocator import Allocator
from memgraph.baselines import layer_streaming_plan
from memgraph.bounds import TransferBounds, transfer_lower_bounds
from memgraph.budgets import BudgetReading, BudgetReferences, budget_references, read_budget
from memgraph.cost import PRESETS as COST_MODELS
from memgraph.cost import CostModel, get_cost_model, register_cost_model
from memgraph.eviction import POLICIES, EvictionContext, Rank, register_policy
from memgraph.graph import MemGraph, MemGraphBuilder, PlanStats
from memgraph.multi import (
    DeviceBudgetError,
    DevicePart,
    DevicePlan,
    Link,
    MultiPlan,
    MultiVerifyReport,
    PlacedGraph,
    plan_devices,
    verify_multi,
)
from memgraph.nodes import (
    NODE_FIELDS,
    DiskFile,
    DiskPlace,
    HostBox,
    HostRegion,
    HostStorage,
    HostTier,
    MemNode,
    NodeKind,
    Region,
)
from memgraph.optimal import OptimalTransfers, lp_transfer_bound, optimal_transfers
from memgraph.orders import ORDERS, register_order
from memgraph.placement import REPLICATED, pipeline_placement, place, split
from memgraph.planner import (
    PlanOptions,
    min_budget,
    plan,
    resident_peak,
    resolve_budget,
    sliced_reloads,
    streaming_minimum,
)
from memgraph.render import render_memgraph
from memgraph.residency import Residencies, Residency
from memgraph.simulate import SimResult, simulate
from memgraph.snapshot import memory_snapshot, write_memory_snapshot
from memgraph.tiers import CheckpointPlace, place_host
from memgraph.trace import StreamEvent, combine_chrome_traces
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
    "resident_peak",
    "streaming_minimum",
    "budget_references",
    "BudgetReferences",
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
    "combine_chrome_traces",
    "memory_snapshot",
    "write_memory_snapshot",
    "Allocator",
    "Link",
    "DevicePart",
    "PlacedGraph",
    "DevicePlan",
    "MultiPlan",
    "MultiVerifyReport",
    "DeviceBudgetError",
    "plan_devices",
    "verify_multi",
    "pipeline_placement",
    "split",
    "place",
    "REPLICATED",
    "place_host",
    "CheckpointPlace",
    "HostTier",
    "HostRegion",
    "DiskFile",
    "DiskPlace",
]


def __getattr__(name: str) -> object:
    """Former names (`memgraph.budgets.DEPRECATED_NAMES`: `no_offload_peak`), with a
    DeprecationWarning."""
    from memgraph.budgets import deprecated

    return deprecated(__name__, name)
