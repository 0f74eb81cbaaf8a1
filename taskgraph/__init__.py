"""taskgraph: the TaskGraph IR, building it, serializing it, and the reference evaluator.

Where things live: `nodes` (the op kinds; each says whether it computes or aliases its
input), `blocks` (provenance of partitioned tasks), `facts` (what a tensor is – a KV
page, the gradient or the update of an input, ... – as typed data: names are for
people), `graph` (`TaskGraph`), `builder`,
`dispatch` (`OpTable`: one table per pass or backend, checked complete at import),
`einsum` (specs), `expr` (the safe join parser), `dtypes`, `evaluate` (the reference
evaluator), `serialize` (JSON), `partition/` (block tasks under a size limit),
`assembly` (outputs rebuilt from blocks), `microbatch` (graphs stacked side by side,
sharing their weights), `render` and `labels` (drawings).
"""

from taskgraph import dtypes, expr, facts
from taskgraph.autodiff import backward, grad
from taskgraph.builder import GraphBuilder
from taskgraph.dispatch import OpTable
from taskgraph.einsum import EinsumSpec
from taskgraph.evaluate import evaluate, evaluate_task
from taskgraph.graph import TaskGraph
from taskgraph.microbatch import Stacked, stack
from taskgraph.nodes import (
    BLOCK_KINDS,
    OP_KINDS,
    ArgReduce,
    Block,
    Concat,
    Einsum,
    Fill,
    Gather,
    Input,
    KthLargest,
    Op,
    ScatterAdd,
    Slice,
    Task,
    View,
)

__all__ = [
    "TaskGraph",
    "Task",
    "Op",
    "Input",
    "Einsum",
    "Fill",
    "Gather",
    "View",
    "Slice",
    "Concat",
    "ScatterAdd",
    "ArgReduce",
    "KthLargest",
    "OP_KINDS",
    "OpTable",
    "Block",
    "BLOCK_KINDS",
    "GraphBuilder",
    "EinsumSpec",
    "evaluate",
    "evaluate_task",
    "grad",
    "stack",
    "Stacked",
    "backward",
    "dtypes",
    "expr",
    "facts",
]
