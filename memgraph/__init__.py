"""memgraph: the MemGraph IR (memory plans), the planner, the verifier and the simulator."""

# einpage.errors must be imported before any einpage-dependent module (see einpage/__init__.py).
import einpage.errors  # noqa: F401  isort: skip
from memgraph.graph import MemGraph, MemGraphBuilder, PlanStats
from memgraph.nodes import MemNode, NodeKind, Region
from memgraph.verify import VerifyReport, verify

__all__ = [
    "MemGraph",
    "MemGraphBuilder",
    "MemNode",
    "NodeKind",
    "PlanStats",
    "Region",
    "VerifyReport",
    "verify",
]
