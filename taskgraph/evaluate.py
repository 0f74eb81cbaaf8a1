"""The reference evaluator: runs a TaskGraph with NumPy, task by task.

This is the ground truth every later stage is checked against. It favours being
obviously right over speed: a generalized einsum is evaluated by broadcasting every
operand over the full iteration space, applying the join, and aggregating. Each op
kind's kernel is an entry of `REFERENCE_KERNELS` (a `taskgraph.dispatch.OpTable`, so
a new op kind without one fails at import); the NumPy runtime backend runs the same
kernels.

An operand whose spec term repeats an index is read through its diagonal (a strided
view, `taskgraph.einsum.take_diagonals`); plain einsums go to `numpy.einsum`, which
does the same.

Precision: each task is computed in its dtype's compute dtype (`dtypes.compute_dtype`)
and rounded to its dtype when stored. float32, float64 and the integer types compute in
themselves; float16 and bfloat16 compute in float32 and round once per task (NumPy's
bfloat16 is `ml_dtypes`', rounding to nearest even), as GPU kernels and PyTorch's CPU
and CUDA kernels for bfloat16 matmuls, reductions and elementwise ops do: operands are
widened exactly, a matmul accumulates in float32, the result is rounded once. So one
task agrees with the same PyTorch op to within one bfloat16 rounding (a relative error
of 2**-8 = 0.39% of the result's magnitude) plus float32 accumulation-order noise. A
chain of tasks rounds at every task boundary where PyTorch may round at different
points (a softmax of three einsums rounds the max and the sum; PyTorch's fused
softmax does not), so whole models differ from PyTorch's bfloat16 by a few roundings:
`tests/test_bfloat16.py` measures ops and `tests/models/test_bfloat16_models.py` whole
models against PyTorch, with the tolerances they document.
`evaluate(..., dtype="float64")` instead computes and keeps every float tensor in
float64, for checking lower-precision results.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from einpage_core.errors import InputError, expect_graph
from taskgraph import dtypes
from taskgraph.dispatch import OpTable
from taskgraph.einsum import take_diagonals
from taskgraph.expr import evaluate as evaluate_join
from taskgraph.graph import TaskGraph
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

__all__ = ["evaluate", "evaluate_task", "compute_dtype", "REFERENCE_KERNELS"]

_AGGREGATE: dict[str, Callable[..., np.ndarray]] = {
    "sum": np.sum,
    "max": np.max,
    "min": np.min,
    "prod": np.prod,
}


def compute_dtype(dtype: str) -> str:
    """The dtype a task of `dtype` is computed in: float16 and bfloat16 are widened to
    float32 (`taskgraph.dtypes.compute_dtype`)."""
    return dtypes.compute_dtype(dtype)


def evaluate(
    tg: TaskGraph, inputs: Mapping[str, Any], dtype: str | None = None
) -> dict[str, np.ndarray]:
    """Evaluate `tg` on `inputs` (name -> array) and return its outputs (name -> ndarray).

    `dtype="float64"` computes every float tensor in float64 (outputs too). Inputs are
    checked first: missing or extra names, shapes and dtypes raise `InputError` (an array
    of another float or integer type is converted to the input's: `TaskGraph.conform_inputs`).
    """
    expect_graph(tg, TaskGraph, "taskgraph.evaluate")
    inputs = tg.conform_inputs(inputs)
    wide = None if dtype is None else dtypes.canonical(dtype)
    if wide is not None and not dtypes.is_float(wide):
        raise InputError(f"evaluate: dtype must be a float type, got {wide}")
    remaining = [len(users) for users in tg.consumers]
    values: dict[int, np.ndarray] = {}
    for task in tg.tasks:
        if isinstance(task.op, Input):
            value = np.asarray(inputs[task.op.name])
            if wide is not None and dtypes.is_float(task.dtype):
                value = value.astype(wide)
        else:
            value = evaluate_task(task, [values[i] for i in task.inputs], wide)
        values[task.id] = value
        for i in dict.fromkeys(task.inputs):
            remaining[i] -= 1
            if remaining[i] == 0 and i not in tg.output_ids:
                del values[i]
    return {name: np.array(values[i], copy=True) for name, i in tg.outputs.items()}


def evaluate_task(
    task: Task,
    operands: Sequence[np.ndarray],
    wide: str | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Compute one non-input task from its operand arrays with NumPy.

    The result has the task's shape and dtype (or `wide` for float tasks when given).
    Shared by the reference evaluator and the NumPy runtime backend.

    `out`: an array of exactly that shape and dtype, sharing no memory with the
    operands, to write the result into; it is returned. Where the result's dtype is
    the compute dtype (not for float16 and bfloat16, computed in float32), kernels write into it
    directly – `np.einsum(..., out=)` for plain einsums, the aggregation's `out=`,
    `np.take`, `np.concatenate` – and otherwise the result is cast into it with
    `np.copyto`, so it holds the same values as a call without `out`.

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> a = prog.input("a", (2, 3))
    >>> prog.output(prog.einsum("ij->i", a), "s")
    >>> tg = prog.build()
    >>> out = np.empty(2, "float32")
    >>> evaluate_task(tg[1], [np.ones((2, 3), "float32")], out=out) is out, out
    (True, array([3., 3.], dtype=float32))
    """
    out_dtype = wide if wide is not None and dtypes.is_float(task.dtype) else task.dtype
    work = compute_dtype(out_dtype)
    kernel = REFERENCE_KERNELS.of(task.op)
    if out is None:
        return np.asarray(kernel(task, operands, work, None)).astype(out_dtype, copy=False)
    if out.shape != task.shape or out.dtype != dtypes.numpy_dtype(out_dtype):
        raise InputError(
            f"evaluate_task %{task.id}: out is {out.dtype}{list(out.shape)}, expected "
            f"{out_dtype}{list(task.shape)}"
        )
    result = kernel(task, operands, work, out if out.dtype == dtypes.numpy_dtype(work) else None)
    if result is not out:
        np.copyto(out, result, casting="unsafe")  # as astype would
    return out


def _einsum(
    task: Task, operands: Sequence[np.ndarray], work: str, out: np.ndarray | None
) -> np.ndarray:
    op: Einsum = task.op  # type: ignore[assignment]
    spec = op.spec
    arrays = [np.asarray(a) for a in operands]
    if dtypes.is_float(work):
        arrays = [a.astype(work, copy=False) for a in arrays]
    if op.is_plain:
        return np.einsum(str(spec), *arrays, optimize=len(arrays) > 1, out=out)
    # Broadcast each operand (its diagonals taken) over the iteration space, ordered
    # output then reduced indices.
    order = spec.indices
    sizes = spec.index_sizes([a.shape for a in arrays])
    full_shape = tuple(sizes[c] for c in order)
    aligned = []
    for spec_term, whole in zip(spec.inputs, arrays, strict=True):
        term, array = take_diagonals(spec_term, whole)
        present = [c for c in order if c in term]
        moved = np.transpose(array, [term.index(c) for c in present])
        aligned.append(moved.reshape([sizes[c] if c in term else 1 for c in order]))
    with np.errstate(all="ignore"):
        value = np.asarray(evaluate_join(op.join_expr, aligned, np))
        value = np.broadcast_to(value, full_shape)
        if dtypes.is_float(work):
            value = value.astype(work, copy=False)
        reduced_axes = tuple(range(len(spec.output), len(order)))
        if reduced_axes:
            value = _AGGREGATE[op.agg](value, axis=reduced_axes, out=out)
    return value


def _fill(
    task: Task, operands: Sequence[np.ndarray], work: str, out: np.ndarray | None
) -> np.ndarray:
    op: Fill = task.op  # type: ignore[assignment]
    if op.pattern == "full":
        return np.full(task.shape, op.value, dtype=work)
    origin = op.origin or (0,) * len(task.shape)
    rows = origin[-2] + np.arange(task.shape[-2])
    cols = origin[-1] + np.arange(task.shape[-1])
    mask = np.where(cols[None, :] > rows[:, None], op.value, 0.0).astype(work)
    return np.broadcast_to(mask, task.shape)


def _gather(
    task: Task, operands: Sequence[np.ndarray], work: str, out: np.ndarray | None
) -> np.ndarray:
    table, ids = operands
    rows = table.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        bad = ids.min() if ids.min() < 0 else ids.max()
        raise InputError(
            f"gather %{task.id}: id {int(bad)} is out of range for a table of {rows} rows"
        )
    if out is not None and out.dtype == table.dtype:  # ids checked: "clip" does not buffer
        return np.take(table, ids, axis=0, out=out, mode="clip")
    return np.take(table, ids, axis=0)


def _view(
    task: Task, operands: Sequence[np.ndarray], work: str, out: np.ndarray | None
) -> np.ndarray:
    return np.reshape(operands[0], task.shape)


def _slice(
    task: Task, operands: Sequence[np.ndarray], work: str, out: np.ndarray | None
) -> np.ndarray:
    op: Slice = task.op  # type: ignore[assignment]
    box = tuple(slice(s, s + n) for s, n in zip(op.starts, task.shape, strict=True))
    return operands[0][box]


def _concat(
    task: Task, operands: Sequence[np.ndarray], work: str, out: np.ndarray | None
) -> np.ndarray:
    op: Concat = task.op  # type: ignore[assignment]
    if out is not None and all(a.dtype == out.dtype for a in operands):
        return np.concatenate(list(operands), axis=op.axis, out=out)
    return np.concatenate(list(operands), axis=op.axis)


def _scatter_add(
    task: Task, operands: Sequence[np.ndarray], work: str, out: np.ndarray | None
) -> np.ndarray:
    op: ScatterAdd = task.op  # type: ignore[assignment]
    src, ids = operands
    rows = task.shape[0]
    local = np.asarray(ids).reshape(-1) - op.start
    keep = (local >= 0) & (local < rows)
    values = np.asarray(src).reshape((local.size, *task.shape[1:]))
    result = np.zeros(task.shape, dtype=work)
    np.add.at(result, local[keep], values[keep].astype(work, copy=False))
    return result


def _argreduce(
    task: Task, operands: Sequence[np.ndarray], work: str, out: np.ndarray | None
) -> np.ndarray:
    op: ArgReduce = task.op  # type: ignore[assignment]
    pick = np.argmax if op.agg == "argmax" else np.argmin
    values = np.asarray(operands[0])
    if dtypes.is_float_array(values.dtype):  # exact; ml_dtypes' bfloat16 orders no NaN
        values = values.astype(dtypes.compute_dtype(dtypes.canonical(values.dtype)), copy=False)
    return pick(values, axis=-1).astype(np.int64, copy=False)


def _kth_largest(
    task: Task, operands: Sequence[np.ndarray], work: str, out: np.ndarray | None
) -> np.ndarray:
    op: KthLargest = task.op  # type: ignore[assignment]
    values = np.asarray(operands[0])
    if dtypes.is_float_array(values.dtype):  # exact, NaNs last: ml_dtypes' bfloat16 sort
        values = values.astype(work, copy=False)  # leaves NaNs anywhere ([3, nan, 1] as is)
    at = values.shape[-1] - op.k  # the k-th largest is the (n-k)-th smallest
    return np.partition(values, at, axis=-1)[..., at]


_Kernel = Callable[[Task, Sequence[np.ndarray], str, "np.ndarray | None"], np.ndarray]
REFERENCE_KERNELS: OpTable[_Kernel] = OpTable(
    "reference kernels",
    {
        Einsum: _einsum,
        Fill: _fill,
        Gather: _gather,
        View: _view,
        Slice: _slice,
        Concat: _concat,
        ScatterAdd: _scatter_add,
        ArgReduce: _argreduce,
        KthLargest: _kth_largest,
    },
    without={Input: "inputs are given to `evaluate`, not computed"},
)
"""The NumPy kernel of each op kind: `kernel(task, operands, work dtype, out or None)`
returns the result (written into `out` where it can; see `evaluate_task`)."""
