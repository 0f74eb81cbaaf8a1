"""Einsum layouts for array backends: GEMMs in place, and broadcast operand views.

A matmul-shaped einsum (a plain einsum of two operands whose reduced indices are all in
both) runs as cuBLAS GEMMs that read the operands and write the output *where they are*
– C-contiguous arena views in whatever index order the program gave them – so that no
device byte is used outside the plan. `gemm_plan` finds how:

* the indices split into K (reduced), M (operand a and the output), N (operand b and
  the output) and batch indices (all three); size-1 indices do not matter;
* one GEMM computes `C[i, j] = sum_l A[i, l] B[l, j]` over three *groups* of indices,
  each fused into one dimension with one stride per operand (`rows` of the output with
  unit stride there, `cols`, and K): column-major with leading dimensions, the operand
  with its rows as the output's rows transposed or not, and, when the output's innermost
  index belongs to operand b, the product transposed (C^T = B^T A^T);
* the other output indices are a strided batch (one group, strides 0 where an operand
  lacks them: `gemmStridedBatchedEx`) and loops of such calls over the rest;
* where an operand's layout fits no GEMM (its reduced indices not fusable, or the
  output's innermost index a batch index), or only as a long loop of small GEMMs, it is
  copied – transposed – into the task's *workspace*, and the output computed there and
  copied out. Every way of copying is tried and timed on the `h100-pcie5` cost model
  (a launch 5 µs, a copied byte read and written at 2 TB/s); the least workspace within
  twice the fastest time is chosen (`gemm_plan`).

LLaMA's q/k/v projection `bsd,gred->bgrse` needs no copy: rows s, cols e, K d, a batch
over the heads (g, r) and a loop over b. The plan is a pure function of the spec, the
shapes and the dtypes, used both to declare a task's workspace before planning
(`runtime.workspace`) and by the kernels that run it (`run_gemm`), so the two cannot
disagree. `broadcast_operands(spec, arrays)` views every operand over the full iteration
space, for the generated elementwise and reduction kernels (no copy either).

>>> from taskgraph.einsum import EinsumSpec
>>> plan = gemm_plan(EinsumSpec.parse("bsd,gred->bgrse"), [(2, 16, 64), (2, 4, 8, 64)],
...                  "float16", "float16")
>>> plan.workspace, plan.calls, plan.call.batch, (plan.call.m, plan.call.n, plan.call.k)
(0, 2, 8, (8, 16, 64))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from memgraph.cost import PRESETS
from taskgraph.einsum import EinsumSpec, take_diagonals

__all__ = [
    "GEMM_DTYPES",
    "CUDA_R",
    "OP_N",
    "OP_T",
    "COMPUTE_32F",
    "COMPUTE_64F",
    "GemmCall",
    "Copy",
    "GemmPlan",
    "gemm_plan",
    "gemm_plans",
    "run_gemm",
    "broadcast_operands",
    "WORKSPACE_ALIGNMENT",
    "INT_MAX",
    "product_seconds",
    "reduction_seconds",
]

Shape = tuple[int, ...]

CUDA_R = {"float16": 2, "bfloat16": 14, "float32": 0, "float64": 1}
"""cudaDataType_t of each dtype a GEMM reads or writes (CUDA's library_types.h)."""
GEMM_DTYPES = frozenset(CUDA_R)
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
OP_N, OP_T = 0, 1  # cublasOperation_t
COMPUTE_32F, COMPUTE_64F = 68, 70  # cublasComputeType_t: float32 accumulation for 16-bit
INT_MAX = 2**31 - 1
"""The largest size, leading dimension or batch count cuBLAS's 32-bit API takes."""
WORKSPACE_ALIGNMENT = 256
"""Each array a GEMM lays out in its workspace starts at a multiple of this."""

_COST = PRESETS["h100-pcie5"]
LAUNCH_SECONDS = _COST.kernel_latency_s
"""Modelled cost of one launch (a GEMM call or a copy kernel): the cost model's latency."""
DEVICE_BYTES_PER_S = _COST.device_bytes_per_s
TENSOR_FLOPS = _COST.flops_per_s
"""A 16-bit GEMM's rate (tensor cores, float32 accumulation): the cost model's."""
CORE_FLOPS = 50e12
"""An H100's float32 rate on its CUDA cores (about 51 TFLOP/s): float32 and float64
GEMMs (no TF32), and the generated kernels, which compute in float32 or float64."""
CACHE_BYTES_PER_S = 10e12
"""What a generated reduction kernel reads its operands at, assumed: it has no tiling, so
each output element reads its K products' operands again, mostly from the caches."""


@dataclass(frozen=True, slots=True)
class GemmCall:
    """The arguments of one `cublasGemmStridedBatchedEx` (column-major, sizes and strides
    in elements): `C = op(A) op(B)` for `batch` products, `A` being operand b when `swap`
    (the output is computed transposed). `a_dtype`/`c_dtype` are the operands' and the
    output's dtypes; `compute` the compute type (float32 for 16-bit inputs)."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    batch: int
    swap: bool
    a_dtype: str
    c_dtype: str
    compute: int


@dataclass(frozen=True, slots=True)
class Copy:
    """An array the GEMMs use instead of `operand` ("a", "b" or "out"): bytes
    `[offset, offset + nbytes)` of the workspace, C-contiguous, of `shape`, whose axes are
    the operand's axes `perm` (it is `operand.transpose(perm)`). Operands are copied in
    before the GEMMs; "out" is computed there and copied to the output after."""

    operand: str
    offset: int
    nbytes: int
    perm: tuple[int, ...]
    shape: Shape


@dataclass(frozen=True, slots=True)
class GemmPlan:
    """How a matmul-shaped einsum runs: `copies` into (and out of) the workspace, then
    `call` for every combination of the `loops` (extent and element strides in a, b and
    the output each), at element offsets of the arrays it reads and writes."""

    call: GemmCall
    loops: tuple[tuple[int, int, int, int], ...]
    copies: tuple[Copy, ...]
    workspace: int  # bytes
    seconds: float  # modelled time: launches, copies and the products

    @property
    def calls(self) -> int:
        """How many GEMM calls run (the loops' extents multiplied)."""
        return math.prod(extent for extent, *_ in self.loops)


# -- finding the plan -----------------------------------------------------------------


def _strides(order: Sequence[str], sizes: dict[str, int]) -> dict[str, int]:
    """Element strides of a C-contiguous array whose axes are the indices `order`; size-1
    indices are left out (their stride does not matter)."""
    strides, step = {}, 1
    for c in reversed(order):
        if sizes[c] > 1:
            strides[c] = step
        step *= sizes[c]
    return strides


def _fuses(group: Sequence[str], strides: dict[str, int], sizes: dict[str, int]) -> bool:
    """Whether the indices `group` (outer to inner) are one dimension of the array: all
    present, each stride the next one's times its size."""
    if any(c not in strides for c in group):
        return False
    return all(
        strides[outer] == strides[inner] * sizes[inner]
        for outer, inner in itertools.pairwise(group)
    )


def _extent(group: Sequence[str], sizes: dict[str, int]) -> int:
    return math.prod(sizes[c] for c in group)


def _by_stride(indices: Sequence[str], strides: dict[str, int]) -> list[str]:
    """`indices` present in the array, outer (largest stride) to inner."""
    return sorted((c for c in indices if c in strides), key=lambda c: -strides[c])


@dataclass(frozen=True)
class _Problem:
    """The einsum's indices by class, and each operand's strides ("a", "b", "out")."""

    sizes: dict[str, int]
    k: tuple[str, ...]
    m: frozenset[str]
    n: frozenset[str]
    strides: dict[str, dict[str, int]]


def _fit(p: _Problem, swap: bool) -> tuple[tuple, tuple] | None:
    """The GEMM (as `GemmCall` fields, without dtypes) and loops for these layouts, the
    output's rows taken from operand a's indices (from b's when `swap`: the product is
    computed transposed), or None when no GEMM reads them in place. Some reduced index
    has a size above 1 (`gemm_plan` sends the others to elementwise kernels)."""
    sizes, st = p.sizes, p.strides
    out_order = _by_stride(list(st["out"]), st["out"])
    k = _by_stride(p.k, st["a"])
    if not (_fuses(k, st["a"], sizes) and _fuses(k, st["b"], sizes)):
        return None
    rows_of, cols_of, P, Q = (p.n, p.m, "b", "a") if swap else (p.m, p.n, "a", "b")
    rows: list[str] = []  # the output's rows: unit stride there (none: one row, m = 1)
    if out_order and out_order[-1] in rows_of:
        rows = [out_order[-1]]
        for c in reversed(out_order[:-1]):
            if c not in rows_of or not (
                _fuses([c, *rows], st["out"], sizes) and _fuses([c, *rows], st[P], sizes)
            ):
                break
            rows.insert(0, c)
    cols: list[str] = []  # the output's columns: the largest group the output and Q fuse
    for i, j in itertools.combinations_with_replacement(range(len(out_order)), 2):
        run = out_order[i : j + 1]
        if (
            all(c in cols_of for c in run)
            and _extent(run, sizes) > _extent(cols, sizes)
            and _fuses(run, st["out"], sizes)
            and _fuses(run, st[Q], sizes)
        ):
            cols = run
    m, n, kk = _extent(rows, sizes), _extent(cols, sizes), _extent(k, sizes)

    def inner(group: list[str], operand: str) -> int:
        return st[operand][group[-1]]

    # cuBLAS's A (operand P) is m x k: its rows unit-stride (N), or its K (T).
    if rows and inner(rows, P) == 1:
        transa, lda = OP_N, inner(k, P)
    elif inner(k, P) == 1:
        transa, lda = OP_T, inner(rows, P) if rows else kk
    else:
        return None
    # cuBLAS's B (operand Q) is k x n: its K unit-stride (N), or its columns (T).
    if inner(k, Q) == 1:
        transb, ldb = OP_N, inner(cols, Q) if cols else kk
    elif cols and inner(cols, Q) == 1:
        transb, ldb = OP_T, inner(k, Q)
    else:
        return None
    ldc = inner(cols, "out") if cols else max(1, m)
    if (
        lda < max(1, m if transa == OP_N else kk)
        or ldb < max(1, kk if transb == OP_N else n)
        or ldc < max(1, m)
    ):
        return None
    rest = [c for c in out_order if c not in rows and c not in cols]
    batch: list[str] = []
    for i, j in itertools.combinations_with_replacement(range(len(rest)), 2):
        run = rest[i : j + 1]
        if _extent(run, sizes) > _extent(batch, sizes) and all(
            _fuses(run, st[x], sizes) or not any(c in st[x] for c in run) for x in ("a", "b", "out")
        ):
            batch = run

    def stride(group: list[str], operand: str) -> int:
        return st[operand][group[-1]] if group and group[-1] in st[operand] else 0

    count = _extent(batch, sizes)
    if max(m, n, kk, lda, ldb, ldc, count) > INT_MAX:
        return None
    loops = tuple(
        (sizes[c], st["a"].get(c, 0), st["b"].get(c, 0), st["out"][c])
        for c in rest
        if c not in batch
    )
    strides = {x: stride(batch, x) for x in ("a", "b", "out")}
    call = (transa, transb, m, n, kk, lda, ldb, ldc, strides[P], strides[Q], strides["out"])
    return (*call, count, swap), loops


def gemm_plan(
    spec: EinsumSpec, shapes: Sequence[Shape], in_dtype: str, out_dtype: str
) -> GemmPlan | None:
    """How the plain einsum `spec` of two C-contiguous operands of `shapes` (both of
    `in_dtype`) runs as GEMMs writing a C-contiguous output of `out_dtype`; None when it
    is not matmul-shaped, cuBLAS cannot take its dtypes, or a generated reduction kernel
    (reading the operands in place) is the better choice.

    The candidates are the ways `gemm_plans` finds and the reduction kernel, each with
    its modelled time (`GemmPlan.seconds`; `reduction_seconds`). Chosen: of those whose
    time is at most `SLOWER` times the fastest's, the one with the smallest workspace;
    ties go to GEMMs over the reduction kernel (cuBLAS's tiles and tensor cores are
    what the model under-rates on small problems), then to the faster, then to the
    fewest products in a batch (the largest matrices). A workspace costs the plan memory
    that could hold tensors, so copies are made only where they save real time (a loop
    of many small GEMMs), or where nothing reads the operands in place and the reduction
    kernel would be much slower (a long reduced index: it has no tiling)."""
    plans = gemm_plans(spec, shapes, in_dtype, out_dtype)
    if not plans:
        return None
    kernel = reduction_seconds(spec, shapes, in_dtype, out_dtype)
    fastest = min(kernel, *(plan.seconds for plan in plans))
    choices = [
        (plan.workspace, 0, plan.seconds, plan.call.batch, plan)
        for plan in plans
        if plan.seconds <= SLOWER * fastest
    ]
    if kernel <= SLOWER * fastest:  # None: the reduction kernel, after GEMMs in place
        choices.append((0, 1, kernel, 0, None))
    return min(choices, key=lambda choice: choice[:4])[4]


def _bytes(spec: EinsumSpec, shapes: Sequence[Shape], in_dtype: str, out_dtype: str) -> int:
    """Bytes of both operands and the output."""
    out = math.prod(spec.output_shape(shapes))
    return sum(math.prod(s) for s in shapes) * ITEMSIZE[in_dtype] + out * ITEMSIZE[out_dtype]


def _flops(spec: EinsumSpec, shapes: Sequence[Shape]) -> int:
    """A multiply and an add per point of the iteration space."""
    return 2 * math.prod(spec.index_sizes(shapes).values())


def product_seconds(spec: EinsumSpec, shapes: Sequence[Shape], in_dtype: str, out_dtype: str):
    """Modelled time of the GEMMs' arithmetic: tensor cores for 16-bit inputs, CUDA cores
    otherwise, or the bytes at HBM bandwidth, whichever is longer."""
    rate = TENSOR_FLOPS if ITEMSIZE[in_dtype] == 2 else CORE_FLOPS
    moved = _bytes(spec, shapes, in_dtype, out_dtype) / DEVICE_BYTES_PER_S
    return max(_flops(spec, shapes) / rate, moved)


def reduction_seconds(spec: EinsumSpec, shapes: Sequence[Shape], in_dtype: str, out_dtype: str):
    """Modelled time of the einsum as one generated reduction kernel, reading the operands
    in place: a launch, and the longest of its arithmetic on CUDA cores, its operands'
    reads (every output element reads its K products' two operands: `CACHE_BYTES_PER_S`)
    and its bytes at HBM bandwidth."""
    sizes = spec.index_sizes(shapes)
    out = math.prod(spec.output_shape(shapes))
    k = math.prod(sizes[c] for c in spec.reduced)
    reads = out * k * 2 * ITEMSIZE[in_dtype] / CACHE_BYTES_PER_S
    moved = _bytes(spec, shapes, in_dtype, out_dtype) / DEVICE_BYTES_PER_S
    return LAUNCH_SECONDS + max(_flops(spec, shapes) / CORE_FLOPS, reads, moved)


SLOWER = 2.0
"""How much slower (modelled) than the fastest a GEMM plan may be and still be chosen for
needing less workspace."""


def gemm_plans(
    spec: EinsumSpec, shapes: Sequence[Shape], in_dtype: str, out_dtype: str
) -> list[GemmPlan]:
    """Every way `gemm_plan` considers: each operand read in place or copied into the
    workspace (the output computed there), and either operand's indices as the output's
    rows, those that fit a GEMM (see the module docstring); none when the einsum is not
    matmul-shaped or its dtypes are not cuBLAS's."""
    if len(spec.inputs) != 2 or spec.has_diagonal or in_dtype not in GEMM_DTYPES:
        return []
    wide_output = in_dtype in ("float16", "bfloat16") and out_dtype == "float32"
    if out_dtype != in_dtype and not wide_output:
        return []
    a, b = spec.inputs
    out = spec.output
    if any(c not in b and c not in out for c in a) or any(c not in a and c not in out for c in b):
        return []  # an index reduced from one operand only: not one product
    k = [c for c in a if c not in out]
    sizes = spec.index_sizes(shapes)
    if _extent(k, sizes) == 1:
        return []  # nothing summed: an elementwise product, not a GEMM
    m = frozenset(c for c in out if c in a and c not in b)
    n = frozenset(c for c in out if c in b and c not in a)
    batch = [c for c in out if c in a and c in b]
    itemsize = ITEMSIZE
    products = product_seconds(spec, shapes, in_dtype, out_dtype)
    terms = {"a": a, "b": b, "out": out}
    plans = []
    for copied, swap in itertools.product(itertools.product((False, True), repeat=3), (0, 1)):
        copy_a, copy_b, copy_out = copied

        def order(group: Sequence[str], *sources: tuple[str, bool]) -> list[str]:
            """The group in the order of the first source not copied (else as given)."""
            for source, is_copied in sources:
                if not is_copied:
                    return [c for c in terms[source] if c in group]
            return list(group)

        by_output = {x: sorted(group, key=out.index) for x, group in (("m", m), ("n", n))}
        canonical = {
            "a": order(batch, ("out", copy_out), ("b", copy_b))
            + order(by_output["m"], ("out", copy_out))
            + order(k, ("b", copy_b)),
            "b": order(batch, ("out", copy_out), ("a", copy_a))
            + order(k, ("a", copy_a))
            + order(by_output["n"], ("out", copy_out)),
            "out": order(batch, ("a", copy_a), ("b", copy_b))
            + order(by_output["m"], ("a", copy_a))
            + order(by_output["n"], ("b", copy_b)),
        }
        layouts = {
            x: canonical[x] if is_copied else list(terms[x])
            for x, is_copied in zip(("a", "b", "out"), copied, strict=True)
        }
        strides = {x: _strides(layout, sizes) for x, layout in layouts.items()}
        fit = _fit(_Problem(sizes, tuple(k), m, n, strides), bool(swap))
        if fit is None:
            continue
        fields, loops = fit
        copies, offset = [], 0
        for x, is_copied in zip(("a", "b", "out"), copied, strict=True):
            if not is_copied:
                continue
            shape = tuple(sizes[c] for c in layouts[x])
            nbytes = math.prod(shape) * itemsize[out_dtype if x == "out" else in_dtype]
            perm = tuple(terms[x].index(c) for c in layouts[x])
            copies.append(Copy(x, offset, nbytes, perm, shape))
            offset += -(-nbytes // WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT
        launches = math.prod(extent for extent, *_ in loops) + len(copies)
        moved = 2 * sum(c.nbytes for c in copies)
        seconds = launches * LAUNCH_SECONDS + moved / DEVICE_BYTES_PER_S + products
        compute = COMPUTE_64F if in_dtype == "float64" else COMPUTE_32F
        call = GemmCall(*fields, a_dtype=in_dtype, c_dtype=out_dtype, compute=compute)
        plans.append(GemmPlan(call, loops, tuple(copies), offset, seconds))
    return plans


# -- running it -----------------------------------------------------------------------

Gemm = Callable[[GemmCall, Any, int, Any, int, Any, int], None]
"""`gemm(call, A, offset, B, offset, C, offset)`: issue `call` on arrays A, B and C (the
cuBLAS operands: A is operand b when `call.swap`) at those element offsets."""
CopyKernel = Callable[[Any, Any], None]
"""`copy(source, target)`: copy the (strided) array `source` into `target`, same shape."""


def workspace_array(workspace: Any, copy: Copy, dtype: str) -> Any:
    """The array of `copy` in the workspace (a uint8 array): a view, no allocation."""
    return workspace[copy.offset : copy.offset + copy.nbytes].view(dtype).reshape(copy.shape)


def run_gemm(
    plan: GemmPlan, a: Any, b: Any, out: Any, workspace: Any, gemm: Gemm, copy: CopyKernel
) -> None:
    """Run `plan` on C-contiguous arrays `a`, `b` and `out` (NumPy or CuPy), with its
    copies in `workspace` (a uint8 array of at least `plan.workspace` bytes)."""
    arrays = {"a": a, "b": b, "out": out}
    written = None
    for c in plan.copies:
        dtype = plan.call.c_dtype if c.operand == "out" else plan.call.a_dtype
        target = workspace_array(workspace, c, dtype)
        if c.operand == "out":
            written = (target, c.perm)
        else:
            copy(arrays[c.operand].transpose(c.perm), target)
        arrays[c.operand] = target
    first, second = ("b", "a") if plan.call.swap else ("a", "b")
    extents = [range(extent) for extent, *_ in plan.loops]
    for point in itertools.product(*extents):
        offsets = [0, 0, 0]
        for i, (_, *steps) in zip(point, plan.loops, strict=True):
            for slot, step in enumerate(steps):
                offsets[slot] += i * step
        where = {"a": offsets[0], "b": offsets[1], "out": offsets[2]}
        gemm(
            plan.call,
            arrays[first],
            where[first],
            arrays[second],
            where[second],
            arrays["out"],
            where["out"],
        )
    if written is not None:
        target, perm = written
        inverse = tuple(perm.index(axis) for axis in range(len(perm)))
        copy(target.transpose(inverse), out)


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
