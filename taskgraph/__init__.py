"""taskgraph: the TaskGraph IR, building it, serializing it, and the reference evaluator."""

from taskgraph import dtypes, expr
from taskgraph.autodiff import backward, grad
from taskgraph.builder import GraphBuilder
from taskgraph.dispatch import OpTable
from taskgraph.einsum import EinsumSpec
from taskgraph.evaluate import evaluate, evaluate_task
from taskgraph.graph import TaskGraph
from taskgraph.nodes import (
    BLOCK_KINDS,
    OP_KINDS,
    Block,
    Concat,
    Einsum,
    Fill,
    Gather,
    Input,
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
    "OP_KINDS",
    "OpTable",
    "Block",
    "BLOCK_KINDS",
    "GraphBuilder",
    "EinsumSpec",
    "evaluate",
    "evaluate_task",
    "grad",
    "backward",
    "dtypes",
    "expr",
]
