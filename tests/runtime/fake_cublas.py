"""cuBLAS's `gemmStridedBatchedEx` on the CPU, as strict as cuBLAS about its arguments (tests).

`strided_gemm(call, A, a_offset, B, b_offset, C, c_offset)` runs a
`runtime.contraction.GemmCall` on NumPy arrays the way cuBLAS runs it on device memory:
every matrix is column-major at an element offset of its array's memory, with leading
dimensions and batch strides, `op(A)` transposed or not, products accumulated in the
compute type (float32 for 16-bit operands, float64 for float64) and rounded once into
C. Arguments cuBLAS refuses (a leading dimension below the rows it stores, a size or
count out of range) raise `CublasError`, and so does any element outside an array's
memory: on a GPU that is another tensor's bytes or a fault, here it is an error.
"""

from __future__ import annotations

import numpy as np

from runtime.contraction import COMPUTE_32F, COMPUTE_64F, INT_MAX, OP_N, OP_T, GemmCall
from taskgraph import dtypes

__all__ = ["CublasError", "strided_gemm", "matrices"]


class CublasError(RuntimeError):
    """What cuBLAS would answer with CUBLAS_STATUS_INVALID_VALUE (or a fault)."""


def _flat(array: np.ndarray) -> np.ndarray:
    """The array's memory as a 1-D array of its elements (it must be contiguous)."""
    if not array.flags.c_contiguous:
        raise CublasError("a GEMM operand must be a contiguous block of memory")
    return np.asarray(array).reshape(-1)


def _matrix(
    flat: np.ndarray, offset: int, batch: int, stride: int, rows: int, cols: int, ld: int,
    what: str,
) -> np.ndarray:  # fmt: skip
    """The `batch` column-major rows x cols matrices at `offset` (leading dimension `ld`,
    batch stride `stride`) of `flat`, as a (batch, rows, cols) view; refused when any
    element lies outside `flat`."""
    if ld < max(1, rows):
        raise CublasError(f"{what}: leading dimension {ld} < rows {rows}")
    last = offset + (batch - 1) * stride + (rows - 1) + (cols - 1) * ld
    if offset < 0 or last >= flat.size or (batch - 1) * stride < 0:
        raise CublasError(
            f"{what}: elements [{offset}, {last}] lie outside its {flat.size} elements"
        )
    size = flat.itemsize
    return np.lib.stride_tricks.as_strided(
        flat[offset:], (batch, rows, cols), (stride * size, size, ld * size), writeable=False
    )


def matrices(call: GemmCall, a, a_offset: int, b, b_offset: int, c, c_offset: int):
    """op(A), op(B) and C of `call` as (batch, rows, cols) views (C's writable)."""
    for name in ("m", "n", "k", "lda", "ldb", "ldc", "batch"):
        value = getattr(call, name)
        if not 1 <= value <= INT_MAX:
            raise CublasError(f"{name} = {value} is out of cuBLAS's range")
    if call.transa not in (OP_N, OP_T) or call.transb not in (OP_N, OP_T):
        raise CublasError(f"bad operations {call.transa}, {call.transb}")
    if call.compute != (COMPUTE_64F if call.a_dtype == "float64" else COMPUTE_32F):
        raise CublasError(f"compute type {call.compute} for {call.a_dtype}")
    for array, dtype, what in ((a, call.a_dtype, "A"), (b, call.a_dtype, "B"),
                               (c, call.c_dtype, "C")):  # fmt: skip
        if np.dtype(array.dtype) != dtypes.numpy_dtype(dtype):
            raise CublasError(f"{what} is {array.dtype}, the call says {dtype}")
    m, n, k = call.m, call.n, call.k
    fa, fb, fc = _flat(a), _flat(b), _flat(c)
    if call.transa == OP_N:
        op_a = _matrix(fa, a_offset, call.batch, call.stride_a, m, k, call.lda, "A")
    else:
        op_a = _matrix(fa, a_offset, call.batch, call.stride_a, k, m, call.lda, "A")
        op_a = op_a.transpose(0, 2, 1)
    if call.transb == OP_N:
        op_b = _matrix(fb, b_offset, call.batch, call.stride_b, k, n, call.ldb, "B")
    else:
        op_b = _matrix(fb, b_offset, call.batch, call.stride_b, n, k, call.ldb, "B")
        op_b = op_b.transpose(0, 2, 1)
    out = _matrix(fc, c_offset, call.batch, call.stride_c, m, n, call.ldc, "C")
    if call.batch * m * n <= 1 << 20:  # no element of C written twice (a race on a GPU)
        b, i, j = np.meshgrid(np.arange(call.batch), np.arange(m), np.arange(n), indexing="ij")
        offsets = b * call.stride_c + i + j * call.ldc
        if np.unique(offsets).size != offsets.size:
            raise CublasError("elements of C are written by two products: they would race")
    size = fc.itemsize
    writable = np.lib.stride_tricks.as_strided(
        fc[c_offset:], out.shape, (call.stride_c * size, size, call.ldc * size)
    )
    return op_a, op_b, writable


def strided_gemm(call: GemmCall, a, a_offset: int, b, b_offset: int, c, c_offset: int) -> None:
    """`C = op(A) op(B)` for each of `call.batch` products, as cuBLAS computes it."""
    op_a, op_b, out = matrices(call, a, a_offset, b, b_offset, c, c_offset)
    work = np.float64 if call.compute == COMPUTE_64F else np.float32
    product = np.matmul(op_a.astype(work), op_b.astype(work))
    out[...] = product.astype(out.dtype)
