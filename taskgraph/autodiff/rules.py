"""Gradient rules, one per op kind: `VJP_RULES`, an `OpTable` (complete at import).

A rule `rule(emitter, task, grad, wanted)` adds the tasks computing the gradient of
each operand of `task` that `wanted` names from `grad`, the gradient of the task's
output (a vector-Jacobian product), and hands each to `emitter.contribute`, which
sums the contributions to one tensor's gradient.

* einsum: `taskgraph.autodiff.einsum_rule`;
* view: the gradient viewed back to the operand's shape (no copy);
* slice: the gradient padded with zeros to the operand's shape (concats with fills,
  one per axis that the slice cuts);
* concat: each operand's part of the gradient (a slice);
* gather: a `ScatterAdd` of the gradient into a table of zeros (the ids get none);
* scatter-add: a gather of the gradient's rows (valid when every id is in range, as
  for an embedding's gradient; a partitioned block with `start` > 0 is refused).

Inputs and fills have no operands, so no rule (`without`); nor do argmax/argmin (integer
ids) and the k-th largest (a sampling threshold): differentiating through one is refused.
"""

from __future__ import annotations

from collections.abc import Callable

from einpage_core.errors import UnsupportedError
from taskgraph.autodiff.einsum_rule import einsum_gradients
from taskgraph.autodiff.emitter import Emitter
from taskgraph.dispatch import OpTable
from taskgraph.nodes import (
    ArgReduce,
    Concat,
    Einsum,
    Fill,
    Gather,
    Input,
    KthLargest,
    ScatterAdd,
    Slice,
    Task,
    View,
)

__all__ = ["VJP_RULES", "VjpRule"]

Wanted = Callable[[int], bool]
VjpRule = Callable[[Emitter, Task, int, Wanted], None]


def _view(em: Emitter, task: Task, grad: int, wanted: Wanted) -> None:
    (source,) = task.inputs
    if wanted(source):
        em.contribute(source, em.add(View(), (grad,), task, shape=em.tasks[source].shape), task)


def _slice(em: Emitter, task: Task, grad: int, wanted: Wanted) -> None:
    op: Slice = task.op  # type: ignore[assignment]
    (source,) = task.inputs
    if not wanted(source):
        return
    full = em.tasks[source].shape
    padded = grad
    for axis, (start, size, extent) in enumerate(zip(op.starts, task.shape, full, strict=True)):
        after = extent - start - size
        if start == 0 and after == 0:
            continue
        shape = em.tasks[padded].shape
        parts = []
        for width in (start, None, after):
            if width is None:
                parts.append(padded)
            elif width:
                zeros = (*shape[:axis], width, *shape[axis + 1 :])
                parts.append(em.fill(zeros, 0.0, task.dtype, task))
        padded = em.add(Concat(axis), parts, task)
    em.contribute(source, padded, task)


def _concat(em: Emitter, task: Task, grad: int, wanted: Wanted) -> None:
    op: Concat = task.op  # type: ignore[assignment]
    offset = 0
    for source in task.inputs:
        shape = em.tasks[source].shape
        if wanted(source):
            starts = tuple(offset if a == op.axis else 0 for a in range(len(shape)))
            em.contribute(source, em.add(Slice(starts), (grad,), task, shape=shape), task)
        offset += shape[op.axis]


def _gather(em: Emitter, task: Task, grad: int, wanted: Wanted) -> None:
    table, ids = task.inputs
    if wanted(table):
        shape = em.tasks[table].shape
        em.contribute(table, em.add(ScatterAdd(), (grad, ids), task, shape=shape), task)


def _scatter_add(em: Emitter, task: Task, grad: int, wanted: Wanted) -> None:
    op: ScatterAdd = task.op  # type: ignore[assignment]
    src, ids = task.inputs
    if not wanted(src):
        return
    if op.start:
        raise UnsupportedError(
            f"no gradient for task {task.line()}: a scatter-add block with start "
            f"{op.start} (differentiate the program before partitioning it)"
        )
    em.contribute(src, em.add(Gather(), (grad, ids), task), task)


VJP_RULES: OpTable[VjpRule] = OpTable(
    "gradient rules",
    {
        Einsum: einsum_gradients,
        View: _view,
        Slice: _slice,
        Concat: _concat,
        Gather: _gather,
        ScatterAdd: _scatter_add,
    },
    without={
        Input: "an input has no operands: its gradient is an output of the pass",
        Fill: "a constant has no operands: nothing to differentiate",
        ArgReduce: "its output is integer ids: no gradient flows through it",
        KthLargest: (
            "a top-k threshold for sampling: differentiating through it is not supported "
            "(use agg='max' einsums for a differentiable maximum)"
        ),
    },
)
"""The gradient rule of each op kind."""
