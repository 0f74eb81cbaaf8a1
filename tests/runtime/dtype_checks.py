"""Task-by-task comparison of the CuPy backend's kernels with the NumPy backend's, in any
dtype (tests only): the CPU stand-in's (`test_runtime_kernel_dtypes_on_cpu.py`) and a
real GPU's (`tests/gpu/test_gpu_bfloat16.py`).

`compare_every_task(tg, inputs, kernels)` runs every task of `tg` with `kernels` (a
`CupyKernels` over the stand-in or over CuPy) and with `taskgraph.evaluate_task`, each
from the same operands (the reference evaluator's values), and holds each task to one of
two standards:

* **bit for bit** (NaNs equal whatever their payload), every task both compute by the
  same sequence of correctly rounded operations in the task's compute dtype (float32
  for bfloat16 and float16), rounded once into its dtype (`compared_bit_for_bit`):
  fills, copies (slices, views, concatenations), gathers, the scatter-add (in
  `numpy.add.at`'s order), argmax/argmin and k-th largest (either zero where the row
  holds both: NumPy's introselect may pick either), every task with an integer
  result, and joins of `+ - * /`, comparisons, `sqrt`, `rsqrt`, `abs`, `floor`, `max`,
  `min`, `where`, `relu` (casts among them) – elementwise or under a max/min
  aggregation;
* **within one rounding** of the task's dtype at its magnitude, plus float32 noise at
  the task's scale (`within_one_rounding`), the rest: sums and products over reduced
  indices (float32 in another order: a BLAS's for a matmul, NumPy's pairwise sums
  against a kernel's loop or tree) and `exp`, `log`, `tanh`, `**`, `sigmoid`, `silu`,
  `gelu` (NumPy's own float32 implementations against the host's libm or CUDA's: values
  an ulp apart in float32 can round to neighbouring bfloat16 values).

On a GPU CuPy compiles with `-ftz=true`: float32 results below the smallest normal are
flushed to zero, which `flushed=True` accepts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from runtime.workspace import kernel_workspace
from taskgraph import TaskGraph, dtypes
from taskgraph.evaluate import evaluate_task
from taskgraph.expr import BinOp, Call, Const, Var
from taskgraph.nodes import Einsum, Input, KthLargest

EXACT_FUNCTIONS = frozenset({"neg", "abs", "floor", "max", "min", "where", "relu", "sqrt", "rsqrt"})
"""Join functions whose float32 result is correctly rounded on both sides."""
EXACT_OPERATORS = frozenset({"+", "-", "*", "/", "<", "<=", ">", ">=", "==", "!="})


def exactly_rounded(expr) -> bool:
    """Whether every node of the join is a correctly rounded operation."""
    if isinstance(expr, Var | Const):
        return True
    if isinstance(expr, Call):
        return expr.fn in EXACT_FUNCTIONS and all(exactly_rounded(a) for a in expr.args)
    assert isinstance(expr, BinOp)
    return expr.op in EXACT_OPERATORS and exactly_rounded(expr.left) and exactly_rounded(expr.right)


def compared_bit_for_bit(task) -> bool:
    """Whether the module docstring says `task` is equal bit for bit."""
    if not isinstance(task.op, Einsum) or not dtypes.is_float(task.dtype):
        return True
    op = task.op
    if op.spec.reduced and op.agg not in ("max", "min"):
        return False
    return exactly_rounded(op.join_expr)


def bits(array: np.ndarray) -> np.ndarray:
    return array.view(f"u{array.itemsize}") if dtypes.is_float_array(array.dtype) else array


def differing(
    got: np.ndarray, want: np.ndarray, flushed: bool = False, zeros: bool = False
) -> np.ndarray:
    """Where `got` and `want` differ in their bits (NaNs count as equal; with `flushed`,
    a zero where `want` is below the smallest normal float32 too; with `zeros`, -0 and +0:
    which zero NumPy's introselect puts at a k-th position is its own affair)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.dtype, want.dtype)
    different = bits(got) != bits(want)
    if dtypes.is_float_array(want.dtype):
        g, w = got.astype(np.float64), want.astype(np.float64)
        different &= ~(np.isnan(g) & np.isnan(w))
        if zeros:
            different &= ~((g == 0) & (w == 0))
        if flushed:
            tiny = float(np.finfo(np.float32).tiny)
            different &= ~((g == 0) & (np.abs(w) < tiny))
    return different


def worst_difference(got: np.ndarray, want: np.ndarray) -> str:
    """Where `got` is farthest from `want`, in units of `within_one_rounding`'s bound."""
    g, w = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    eps = float(dtypes.finfo(want.dtype).eps)
    scale = float(np.abs(w[np.isfinite(w)]).max(initial=0.0))
    bound = eps * np.maximum(np.abs(g), np.abs(w)) + 2.0**-20 * scale
    with np.errstate(all="ignore"):
        ratio = np.where(np.isfinite(g) & np.isfinite(w), np.abs(g - w) / bound, np.inf)
    at = int(np.nanargmax(ratio))
    return f"worst at {at}: got {g[at]!r}, want {w[at]!r}, {ratio[at]:.2f}x the bound"


def within_one_rounding(got: np.ndarray, want: np.ndarray) -> bool:
    """|got - want| <= one ulp of the dtype at the larger magnitude, plus float32 noise
    (2**-20) at the task's scale; infinities and NaNs where the other has them."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    finite = np.isfinite(g) & np.isfinite(w)
    if not (same | finite).all():
        return False
    eps = float(dtypes.finfo(want.dtype).eps)
    scale = float(np.abs(w[np.isfinite(w)]).max(initial=0.0))
    bound = eps * np.maximum(np.abs(g), np.abs(w)) + 2.0**-20 * scale
    return bool((same | (np.abs(g - w) <= bound)).all())


def compare_every_task(
    tg: TaskGraph,
    inputs: Mapping[str, np.ndarray],
    kernels: Any,
    to_device: Callable[[np.ndarray], Any] = np.asarray,
    to_host: Callable[[Any], np.ndarray] = np.asarray,
    flushed: bool = False,
) -> dict[str, int]:
    """Run every task of `tg` with `kernels` and with the NumPy backend's kernel from the
    same operands, assert the module docstring's standard for each, and count the tasks
    compared bit for bit, those that differed within one rounding, and the others (equal
    although not bound to be)."""
    cp = kernels.cp
    values: dict[int, np.ndarray] = {}
    counts = {"bit for bit": 0, "one rounding": 0, "equal anyway": 0}
    for task in tg.tasks:
        if isinstance(task.op, Input):
            values[task.id] = np.asarray(inputs[task.op.name])
            continue
        operands = [values[i] for i in task.inputs]
        with np.errstate(all="ignore"):
            want = evaluate_task(task, operands)
            out = cp.empty(task.shape, dtype=dtypes.numpy_dtype(task.dtype))
            nbytes = kernel_workspace(task, [(a.shape, a.dtype.name) for a in operands])
            workspace = cp.empty(nbytes, dtype=np.uint8) if nbytes else None
            device = [to_device(np.asarray(a, order="C")) for a in operands]  # as in an arena
            kernels.run(task, device, out, workspace)
            got = to_host(out)
        values[task.id] = want
        if compared_bit_for_bit(task):
            bad = differing(got, want, flushed, zeros=isinstance(task.op, KthLargest))
            assert not bad.any(), f"{task.line()}: {bad.sum()} of {bad.size} elements differ"
            counts["bit for bit"] += 1
        elif differing(got, want, flushed).any():
            assert within_one_rounding(got, want), f"{task.line()}: {worst_difference(got, want)}"
            counts["one rounding"] += 1
        else:
            counts["equal anyway"] += 1
    kernels.check_flags()
    assert "generic_fallback" not in kernels.counters, kernels.counters  # every dtype runs
    return counts
