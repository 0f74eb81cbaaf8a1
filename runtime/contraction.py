"""Einsum layouts for array backends: matmul-shaped contractions and broadcast operand views.

Functions here take the array module `xp` (NumPy or CuPy) so that the GPU backend's
layout logic is tested on the CPU:

* `matmul_plan(spec, shapes)` recognizes a plain two-operand einsum that is one
  batched matrix product (every reduced index in both operands) and says how to
  transpose and reshape the operands (free for contiguous layouts) so that
  `matmul_into` can write the result straight into the output array;
* `broadcast_operands(spec, arrays)` views every operand over the full iteration
  space (output indices, then reduced ones), size-1 where it lacks an index, through
  its diagonal where its term repeats an index (a strided view: `take_diagonals`):
  what elementwise and reduction kernels broadcast over;
* `evaluate_einsum(xp, task, arrays)` is the generic path (the reference evaluator's
  algorithm over `xp`), for what no specialised kernel covers.

>>> from taskgraph.einsum import EinsumSpec, take_diagonals
>>> p = matmul_plan(EinsumSpec.parse("bqd,bkd->bqk"), [(2, 3, 4), (2, 5, 4)])
>>> p.left_shape, p.right_shape, p.out_shape, p.out_perm
((2, 3, 4), (2, 4, 5), (2, 3, 5), None)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from taskgraph import dtypes
from taskgraph.einsum import EinsumSpec, take_diagonals
from taskgraph.evaluate import compute_dtype
from taskgraph.expr import evaluate as evaluate_join
from taskgraph.nodes import Einsum, Task

__all__ = ["MatmulPlan", "matmul_plan", "matmul_into", "broadcast_operands", "evaluate_einsum"]

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MatmulPlan:
    """`out = left @ right` for a plain einsum of two operands.

    `swap`: the matmul's left operand is operand 1 (the output is laid out as
    batch, then operand 1's free indices, then operand 0's). `left_perm` and
    `right_perm` bring the operands to (batch, rows, k) and (batch, k, cols) index
    order, then they are reshaped to `left_shape` and `right_shape` (2-d without a
    batch index). The product has shape `out_shape`; when the output's index order is
    (batch, rows, cols), `out_perm` is None and the product is written in place into
    the output reshaped to `out_shape`. Otherwise the product, reshaped to
    `grouped_shape`, is transposed by `out_perm` into the output.
    """

    swap: bool
    left_perm: tuple[int, ...]
    right_perm: tuple[int, ...]
    left_shape: Shape
    right_shape: Shape
    out_shape: Shape
    grouped_shape: Shape
    out_perm: tuple[int, ...] | None


def matmul_plan(spec: EinsumSpec, shapes: Sequence[Shape]) -> MatmulPlan | None:
    """The plan of `spec` as one (batched) matmul, or None when it is not matmul-shaped.

    Matmul-shaped: two operands, at least one reduced index, every reduced index in
    both operands (an index reduced from one operand only needs a reduction first),
    and no index repeated inside an operand (a diagonal is not a reshape).
    """
    if len(spec.inputs) != 2 or spec.has_diagonal:
        return None
    a, b = spec.inputs
    out = spec.output
    sizes = spec.index_sizes(shapes)
    k = [c for c in a if c not in out]
    if not k or any(c not in b for c in k) or any(c not in a and c not in out for c in b):
        return None
    batch = [c for c in out if c in a and c in b]
    m = [c for c in out if c in a and c not in b]
    n = [c for c in out if c in b and c not in a]
    order = list(out)
    if order == batch + m + n:
        swap, out_perm = False, None
    elif order == batch + n + m:
        swap, out_perm = True, None
    else:
        grouped = batch + m + n
        swap, out_perm = False, tuple(grouped.index(c) for c in order)
    left, right = (b, a) if swap else (a, b)
    rows, cols = (n, m) if swap else (m, n)

    def size(indices: list[str]) -> int:
        return math.prod(sizes[c] for c in indices)

    lead = (size(batch),) if batch else ()
    return MatmulPlan(
        swap=swap,
        left_perm=tuple(left.index(c) for c in batch + rows + k),
        right_perm=tuple(right.index(c) for c in batch + k + cols),
        left_shape=(*lead, size(rows), size(k)),
        right_shape=(*lead, size(k), size(cols)),
        out_shape=(*lead, size(rows), size(cols)),
        grouped_shape=tuple(sizes[c] for c in batch + rows + cols),
        out_perm=out_perm,
    )


def matmul_into(xp: Any, plan: MatmulPlan, a: Any, b: Any, out: Any) -> bool:
    """Compute the plan's product into `out`; return whether it was written in place
    (False: through a temporary and a copy, when the output's layout needs a transpose)."""
    left, right = (b, a) if plan.swap else (a, b)
    left = xp.transpose(left, plan.left_perm).reshape(plan.left_shape)
    right = xp.transpose(right, plan.right_perm).reshape(plan.right_shape)
    if plan.out_perm is None and out.flags.c_contiguous:
        xp.matmul(left, right, out=out.reshape(plan.out_shape))  # a view: written in place
        return True
    product = xp.matmul(left, right).reshape(plan.grouped_shape)
    out[...] = product if plan.out_perm is None else xp.transpose(product, plan.out_perm)
    return False


def broadcast_operands(spec: EinsumSpec, arrays: Sequence[Any]) -> list[Any]:
    """Views of the operands over the iteration space `spec.indices` (output indices, then
    reduced ones): their diagonals taken where a term repeats an index, transposed into
    that order, with size-1 axes for missing indices."""
    order = spec.indices
    views = []
    for spec_term, whole in zip(spec.inputs, arrays, strict=True):
        term, array = take_diagonals(spec_term, whole)
        present = [c for c in order if c in term]
        moved = array.transpose([term.index(c) for c in present])
        views.append(moved[tuple(slice(None) if c in term else None for c in order)])
    return views


_AGGREGATE = {"sum": "sum", "max": "max", "min": "min", "prod": "prod"}


def evaluate_einsum(xp: Any, task: Task, arrays: Sequence[Any]) -> Any:
    """The generalized einsum `task` over `xp` arrays, as the reference evaluator computes it
    (float16 and bfloat16 in float32; the result in the task's dtype)."""
    op: Einsum = task.op  # type: ignore[assignment]
    spec = op.spec
    work = compute_dtype(task.dtype)
    if dtypes.is_float(work):
        arrays = [a.astype(work, copy=False) for a in arrays]
    sizes = spec.index_sizes([a.shape for a in arrays])
    full = tuple(sizes[c] for c in spec.indices)
    value = xp.asarray(evaluate_join(op.join_expr, broadcast_operands(spec, arrays), xp))
    value = xp.broadcast_to(value, full)
    if dtypes.is_float(work):
        value = value.astype(work, copy=False)
    reduced = tuple(range(len(spec.output), len(spec.indices)))
    if reduced:
        value = getattr(xp, _AGGREGATE[op.agg])(value, axis=reduced)
    return value.astype(task.dtype, copy=False)
