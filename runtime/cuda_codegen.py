"""CUDA C for the CuPy backend's kernels: join expressions, fills, copies, gathers, scatter-adds.

Every kernel the backend launches (`runtime.cupy_backend.CupyKernels`) is defined here as
plain data – the pieces of a `cupy.ElementwiseKernel` or `cupy.ReductionKernel` – so
that the tests can compile each one without a GPU (with NVRTC for sm_80/sm_90, and with
g++ on the CPU stand-in) and `catalog()` can list them all.

**Joins.** A join (`taskgraph.expr`) is translated node by node into one C++ expression
over the kernel's inputs `in0, in1, ...`. Every node is computed in the type the
reference evaluator computes it in (`taskgraph.evaluate`), which is NumPy's: a task
with a float output widens its operands to its compute dtype first (float32 for
float16, bfloat16 and float32; float64), so its whole join runs there and is rounded
once when stored, as the NumPy backend does; a task with an integer output keeps its
integer operands, and each node takes the dtype NumPy's promotion gives it (`a / 16.0`
of an int64 is float64; `a + b` of two int8 wraps at 8 bits), found by asking NumPy
(`node_dtype`). The functions NumPy spells differently live in `PREAMBLE` as small
device templates with NumPy's semantics (`max`/`min` propagate NaN, `where` tests
`!= 0`). Nothing is evaluated: the tree is walked, and the text only ever contains
operand names, numeric literals and the operators and functions of the allow-list.

Operands and outputs may be any dtype of `taskgraph.dtypes`: float16 (CuPy's
`float16`, `cupy/float16.cuh`), bfloat16 (CuPy 14's `bfloat16` over `__nv_bfloat16`,
`cupy/bfloat16.cuh`: `ml_dtypes.bfloat16` arrays), float32/64 and the integers – so
casts (int8 weights to float16, the nibbles of int4 weights with `floor`, bfloat16 to
float32 and back) are generated kernels too. A 16-bit float is read as `float` and
written from `float` with round-to-nearest-even, as NumPy and `ml_dtypes` round. An
integer-valued task of 16-bit float operands is refused (`UnsupportedError`: NumPy
rounds to 16 bits after every operation there, and so for `exp` and the like of int8 or
uint8 values: no program makes one).

**Fixed kernels** (`FIXED`): the copy that slices, views and concatenations use, the
gather of embedding rows, and the three kernels of the deterministic scatter-add.
`fill_source` and `scatter_sum_source` are generated per dtype (they compute in its
work type). The scatter-add uses no atomics: the ids are sorted with their positions
(`(id << 32) | position` keys, a bitonic sort in a workspace of
`scatter_add_workspace` bytes), and each output element sums its rows' sources in
position order – the order `numpy.add.at` adds them in – so a run equals NumPy's bit
for bit and every run equals the last.

>>> from taskgraph.expr import parse
>>> join_to_c(parse("exp(a - b) / c", 3), "float32")
'(exp((((float)in0) - ((float)in1))) / ((float)in2))'
>>> join_to_c(parse("a / 16.0", 1), ["int64"])
'(((double)((long long)in0)) / ((double)16.0))'
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from einpage_core.errors import UnsupportedError
from taskgraph import dtypes
from taskgraph.expr import BinOp, Call, Const, Expr, Var
from taskgraph.expr import evaluate as evaluate_join
from taskgraph.nodes import ScatterAdd, Task

__all__ = [
    "PREAMBLE",
    "C_TYPES",
    "WORK_CTYPE",
    "AGGREGATIONS",
    "ElementwiseSource",
    "ReductionSource",
    "FixedKernel",
    "FIXED",
    "COPY",
    "GATHER",
    "SCATTER_KEYS",
    "BITONIC_STEP",
    "node_dtype",
    "join_to_c",
    "elementwise_source",
    "reduction_source",
    "fill_source",
    "scatter_sum_source",
    "scatter_add_workspace",
    "bitonic_steps",
    "argreduce_source",
    "kth_largest_sources",
    "KthLargestSources",
    "supports",
    "catalog",
    "reduction_catalog",
]

C_TYPES = {
    "bool": "bool",
    "int8": "signed char",
    "uint8": "unsigned char",
    "int16": "short",
    "uint16": "unsigned short",
    "int32": "int",
    "uint32": "unsigned int",
    "int64": "long long",
    "uint64": "unsigned long long",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float",
    "float64": "double",
}
"""The C type CuPy 14 names each dtype by in kernels (`cupy._core._scalar.get_typename`:
float16 and bfloat16 are CuPy's classes from `cupy/float16.cuh` and `cupy/bfloat16.cuh`)."""

WORK_CTYPE = {"float16": "float", "bfloat16": "float", "float32": "float", "float64": "double"}
"""The C type a task of each float dtype is computed in (its compute dtype's)."""

WEAK = "weak"
"""The type of a join node made of constants only: a Python float, computed in double
precision, that NumPy converts to the other operand's float type (NEP 50)."""

_NARROW = frozenset({"bool", "int8", "uint8", "int16", "uint16"})
"""Dtypes whose C arithmetic is done in `int`: a result is cast back (it wraps, as NumPy's)."""

PREAMBLE = r"""
template <typename T> __device__ __forceinline__ T ep_max(T a, T b) {
  return (a > b || a != a) ? a : b;
}
template <typename T> __device__ __forceinline__ T ep_min(T a, T b) {
  return (a < b || a != a) ? a : b;
}
template <typename C, typename T> __device__ __forceinline__ T ep_where(C c, T a, T b) {
  return c != C(0) ? a : b;
}
template <typename T> __device__ __forceinline__ T ep_abs(T x) { return x < T(0) ? T(-x) : x; }
template <typename T> __device__ __forceinline__ T ep_ipow(T b, T e) {
  T r = T(1);
  for (; e > T(0); e = T(e / T(2))) { if (e % T(2)) r = T(r * b); b = T(b * b); }
  return r;
}
template <typename T> __device__ __forceinline__ T ep_rsqrt(T x) { return T(1) / sqrt(x); }
template <typename T> __device__ __forceinline__ T ep_sigmoid(T x) {
  return T(1) / (T(1) + exp(-x));
}
template <typename T> __device__ __forceinline__ T ep_silu(T x) { return x * ep_sigmoid(x); }
template <typename T> __device__ __forceinline__ T ep_relu(T x) { return ep_max(x, T(0)); }
template <typename T> __device__ __forceinline__ T ep_gelu(T x) {
  return T(0.5) * x * (T(1) + tanh(T(0.7978845608028654) * (x + T(0.044715) * x * x * x)));
}
"""
"""Device helpers the generated code calls (NumPy semantics; GELU as in `taskgraph.expr`)."""

_FLOAT_FUNCTIONS = {
    "exp": "exp",
    "log": "log",
    "sqrt": "sqrt",
    "tanh": "tanh",
    "abs": "fabs",
    "floor": "floor",
    "rsqrt": "ep_rsqrt",
    "sigmoid": "ep_sigmoid",
    "silu": "ep_silu",
    "gelu": "ep_gelu",
    "relu": "ep_relu",
    "max": "ep_max",
    "min": "ep_min",
    "where": "ep_where",
}
"""The C function of each join function where its result is a float."""
_INT_FUNCTIONS = {"abs": "ep_abs", "relu": "ep_relu", "max": "ep_max", "min": "ep_min",
                  "where": "ep_where", "floor": ""}  # fmt: skip
"""Where its result is an integer (NumPy keeps integers there; floor is the identity)."""
_ARITHMETIC = {"+", "-", "*", "/", "**"}
_COMPARISONS = {"<", "<=", ">", ">=", "==", "!="}

AGGREGATIONS = {"sum": "a + b", "prod": "a * b", "max": "ep_max(a, b)", "min": "ep_min(a, b)"}
"""The reduce expression of each aggregation (`REDUCE(a, b)` in CuPy's template)."""


def _literal(value: float) -> str:
    text = repr(float(value))
    if text in ("inf", "-inf", "nan"):  # the parser only makes finite constants
        raise UnsupportedError(f"join constant {text} has no C literal")
    return text


def _carrier(kind: str) -> str:
    """The C type holding a node of `kind` (a dtype name, or `WEAK`: a double)."""
    return "double" if kind == WEAK else C_TYPES[kind]


def _identity(agg: str, kind: str) -> str:
    """The identity of `agg` in the C type of dtype `kind`: infinities from their bit
    patterns (device intrinsics need no header), integer limits as literals."""
    if agg in ("sum", "prod"):
        return "0" if agg == "sum" else "1"
    low = agg == "max"
    if kind == "float32":
        return "__int_as_float(0xff800000)" if low else "__int_as_float(0x7f800000)"
    if kind == "float64":
        return (
            "__longlong_as_double(0xfff0000000000000ULL)"
            if low
            else "__longlong_as_double(0x7ff0000000000000ULL)"
        )
    if kind == "bool":
        return "false" if low else "true"
    info = np.iinfo(kind)
    if low:
        return "0" if info.min == 0 else f"({info.min + 1}LL - 1)"
    return f"{info.max}ULL" if info.min == 0 else f"{info.max}LL"


# -- the type of every node ---------------------------------------------------------


@functools.cache
def node_dtype(expr: Expr, leaves: tuple[str, ...]) -> str:
    """The dtype NumPy computes `expr` in when operand i is an array of `leaves[i]`
    (`WEAK` for constants-only subtrees, which NumPy keeps as Python floats).

    >>> from taskgraph.expr import parse
    >>> node_dtype(parse("a / 16.0", 1), ("int64",))
    'float64'
    >>> node_dtype(parse("a + b", 2), ("int8", "int8"))
    'int8'
    """
    arrays = [np.ones(1, dtype=dtypes.numpy_dtype(d)) for d in leaves]
    try:
        with np.errstate(all="ignore"):
            value = evaluate_join(expr, arrays, np)
    except (TypeError, ValueError) as err:  # e.g. NumPy refuses -x of a bool
        raise UnsupportedError(
            f"join {expr} is not defined over {list(leaves)} in NumPy ({err})"
        ) from None
    if isinstance(value, float):
        return WEAK
    return np.asarray(value).dtype.name


def _cast(text: str, kind: str, to: str) -> str:
    return text if kind == to else f"(({_carrier(to)}){text})"


def _wrap(text: str, kind: str) -> str:
    """A narrow integer's C result (computed in `int`) cast back to its type."""
    return f"(({_carrier(kind)}){text})" if kind in _NARROW else text


def _emit(expr: Expr, leaves: tuple[str, ...], operand: str) -> str:
    """C text computing `expr` in the C type of `node_dtype(expr, leaves)`."""
    kind = node_dtype(expr, leaves)
    if kind in ("float16", "bfloat16"):
        raise UnsupportedError(
            f"join {expr} computes {kind} values from {list(leaves)} operands (NumPy rounds "
            "to 16 bits after every operation there), which generated kernels do not: cast "
            "the operands to float32 first"
        )
    if isinstance(expr, Var):
        return f"(({_carrier(leaves[expr.index])}){operand.format(expr.index)})"
    if isinstance(expr, Const):
        return _literal(expr.value)  # the parent casts it to its type
    if isinstance(expr, BinOp):
        left, right = _emit(expr.left, leaves, operand), _emit(expr.right, leaves, operand)
        if expr.op in _COMPARISONS:
            common = node_dtype(BinOp("+", expr.left, expr.right), leaves)
        elif expr.op in _ARITHMETIC:
            common = kind
        else:
            raise UnsupportedError(f"join operator {expr.op!r} has no CUDA translation")
        left = _cast(left, node_dtype(expr.left, leaves), common)
        right = _cast(right, node_dtype(expr.right, leaves), common)
        if expr.op == "**":
            if dtypes.is_float(common) or common == WEAK:
                return f"pow({left}, {right})"
            return f"ep_ipow({left}, {right})"
        if expr.op in _COMPARISONS:  # C's comparisons are bool already
            return f"({left} {expr.op} {right})"
        return _wrap(f"({left} {expr.op} {right})", kind)
    if isinstance(expr, Call):
        args = [
            _cast(_emit(arg, leaves, operand), node_dtype(arg, leaves), kind)
            if not (expr.fn == "where" and position == 0)
            else _emit(arg, leaves, operand)  # where's condition keeps its type
            for position, arg in enumerate(expr.args)
        ]
        if expr.fn == "neg":
            return _wrap(f"(-{args[0]})", kind)
        table = _FLOAT_FUNCTIONS if kind in ("float32", "float64", WEAK) else _INT_FUNCTIONS
        if expr.fn not in table:
            raise UnsupportedError(f"join function {expr.fn!r} has no CUDA translation for {kind}")
        name = table[expr.fn]
        return f"{name}({', '.join(args)})" if name else args[0]
    raise UnsupportedError(f"not a join expression: {expr!r}")


def join_to_c(expr: Expr, leaves: str | Sequence[str], operand: str = "in{}") -> str:
    """The join as one C++ expression, reading operand i as `operand.format(i)`, which
    holds a value of dtype `leaves[i]` (a single dtype: every operand's).

    Every node is computed in its NumPy dtype (`node_dtype`); constants are cast to the
    type of the operation using them, as NumPy converts Python floats.
    """
    if isinstance(leaves, str):
        count = 1 + max(expr.variables(), default=0)
        leaves = [leaves] * count
    return _emit(expr, tuple(leaves), operand)


# -- kernel sources -------------------------------------------------------------------


def _check(in_dtypes: Sequence[str], out_dtype: str) -> None:
    for dtype in (*in_dtypes, out_dtype):
        if dtype not in dtypes.TABLE:
            raise UnsupportedError(
                f"generated kernels have no dtype {dtype!r}; they take {', '.join(dtypes.DTYPES)}"
            )
    halves = [d for d in in_dtypes if d in ("float16", "bfloat16")]
    if not dtypes.is_float(out_dtype) and halves:
        raise UnsupportedError(
            f"generated kernels do not compute an {out_dtype} result from {halves[0]} operands "
            "(NumPy rounds to 16 bits after every operation there); cast the operands to "
            "float32 first"
        )


def supports(in_dtypes: Sequence[str], out_dtype: str) -> bool:
    """Whether generated kernels handle a join of these operand dtypes into `out_dtype`:
    every dtype of `taskgraph.dtypes`, except an integer result of float16/bfloat16
    operands."""
    try:
        _check(in_dtypes, out_dtype)
    except UnsupportedError:
        return False
    return True


def _leaves(in_dtypes: Sequence[str], out_dtype: str) -> tuple[str, ...]:
    """The dtypes a join's operands are computed in: a float task's compute dtype for
    every operand (`astype(work)`, as `taskgraph.evaluate`), an integer task's own."""
    _check(in_dtypes, out_dtype)
    if dtypes.is_float(out_dtype):
        return (dtypes.compute_dtype(out_dtype),) * len(in_dtypes)
    return tuple(in_dtypes)


def _value(expr: Expr, leaves: tuple[str, ...], out_dtype: str) -> tuple[str, str]:
    """The join's C text and dtype as the task stores or aggregates it: a float task's
    value in its compute dtype (the evaluator's `astype(work)`), an integer task's as is."""
    text, kind = _emit(expr, leaves, "in{}"), node_dtype(expr, leaves)
    if dtypes.is_float(out_dtype):
        work = dtypes.compute_dtype(out_dtype)
        return _cast(text, kind, work), work
    return text, kind


def _name(kind: str, *parts: str) -> str:
    digest = hashlib.sha1("\x00".join(parts).encode()).hexdigest()[:12]
    return f"einpage_{kind}_{digest}"


def _params(in_dtypes: Sequence[str]) -> str:
    return ", ".join(f"{dtype} in{i}" for i, dtype in enumerate(in_dtypes))


@dataclass(frozen=True, slots=True)
class ElementwiseSource:
    """Arguments of `cupy.ElementwiseKernel(in_params, out_params, operation, name,
    preamble=preamble)`. `scalars` names the parameters the backend passes as scalars
    (the others are arrays); call it with the arguments in parameter order."""

    in_params: str
    out_params: str
    operation: str
    name: str
    preamble: str = PREAMBLE
    scalars: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ReductionSource:
    """Arguments of `cupy.ReductionKernel(in_params, out_params, map_expr, reduce_expr,
    post_map_expr, identity, name, reduce_type=..., preamble=...)`; call it with the
    operands broadcast over the iteration space, `axis=` the reduced axes, `out=`
    (`scalars`: the parameters passed as scalars)."""

    in_params: str
    out_params: str
    map_expr: str
    reduce_expr: str
    post_map_expr: str
    identity: str
    name: str
    reduce_type: str
    preamble: str = PREAMBLE
    scalars: tuple[str, ...] = ()


@functools.cache
def _elementwise(expr: Expr, in_dtypes: tuple[str, ...], out_dtype: str) -> ElementwiseSource:
    body, _ = _value(expr, _leaves(in_dtypes, out_dtype), out_dtype)
    params = _params(in_dtypes)
    return ElementwiseSource(
        in_params=params,
        out_params=f"{out_dtype} out",
        operation=f"out = {body};",
        name=_name("join", params, out_dtype, body),
    )


def elementwise_source(expr: Expr, in_dtypes: Sequence[str], out_dtype: str) -> ElementwiseSource:
    """An elementwise kernel computing `out = join(in0, in1, ...)` (no reduction).

    >>> from taskgraph.expr import parse
    >>> elementwise_source(parse("a * b", 2), ["float16", "float16"], "float16").operation
    'out = (((float)in0) * ((float)in1));'
    >>> elementwise_source(parse("a", 1), ["uint8"], "bfloat16").in_params
    'uint8 in0'
    """
    return _elementwise(expr, tuple(in_dtypes), out_dtype)


@functools.cache
def _reduction(expr: Expr, agg: str, in_dtypes: tuple[str, ...], out_dtype: str) -> ReductionSource:
    if agg not in AGGREGATIONS:
        raise UnsupportedError(f"aggregation {agg!r} has no CUDA translation")
    body, kind = _value(expr, _leaves(in_dtypes, out_dtype), out_dtype)
    if dtypes.is_float(out_dtype):
        reduced = kind  # the compute dtype, as the evaluator aggregates it
    else:  # NumPy's: sums and products of small integers in 64 bits
        reduced = getattr(np, agg)(np.ones(2, dtype="float64" if kind == WEAK else kind)).dtype.name
    params = _params(in_dtypes)
    reduce_type = _carrier(reduced)
    return ReductionSource(
        in_params=params,
        out_params=f"{out_dtype} out",
        map_expr=_cast(body, kind, reduced),
        reduce_expr=AGGREGATIONS[agg],
        post_map_expr="out = a",
        identity=_identity(agg, reduced),
        name=_name("reduce", params, out_dtype, agg, body),
        reduce_type=reduce_type,
    )


def reduction_source(
    expr: Expr, agg: str, in_dtypes: Sequence[str], out_dtype: str
) -> ReductionSource:
    """A reduction kernel computing `out = agg over reduced axes of join(in0, in1, ...)`."""
    return _reduction(expr, agg, tuple(in_dtypes), out_dtype)


def _work(dtype: str) -> str:
    """The C type `dtype`'s values are computed in (its compute dtype's)."""
    return C_TYPES[dtypes.compute_dtype(dtype)]


FILL_PATTERNS = ("full", "causal")


@functools.cache
def fill_source(dtype: str, pattern: str) -> ElementwiseSource:
    """A fill of `dtype`: the value (a float64 scalar) converted to the dtype's work type
    first, then stored – the evaluator's `np.full(..., dtype=work).astype(dtype)`; the
    causal pattern puts it where column > row (`row0`, `col0`: the block's origin).

    >>> fill_source("bfloat16", "full").operation
    'out = ((float)value);'
    """
    work = _work(dtype)
    if pattern == "full":
        return ElementwiseSource(
            "float64 value", f"{dtype} out", f"out = (({work})value);",
            f"einpage_fill_{dtype}", preamble="", scalars=("value",),
        )  # fmt: skip
    if pattern == "causal":
        return ElementwiseSource(
            "float64 value, int64 row0, int64 col0, int64 rows, int64 cols",
            f"{dtype} out",
            "const ptrdiff_t c = i % cols; const ptrdiff_t r = (i / cols) % rows;"
            f" out = (col0 + c > row0 + r) ? (({work})value) : (({work})0);",
            f"einpage_causal_fill_{dtype}",
            preamble="",
            scalars=("value", "row0", "col0", "rows", "cols"),
        )
    raise UnsupportedError(f"fill pattern {pattern!r} has no kernel; known: {FILL_PATTERNS}")


# -- fixed kernels ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FixedKernel:
    """A kernel whose source does not depend on the task: `source`, and for each type
    placeholder of its parameters (`T`, `I`) the dtypes the backend binds it to."""

    source: ElementwiseSource
    placeholders: tuple[tuple[str, tuple[str, ...]], ...] = ()


COPY = FixedKernel(
    ElementwiseSource("T src", "T dst", "dst = src;", "einpage_copy", preamble=""),
    (("T", dtypes.DTYPES),),
)
"""`dst = src` of any dtype between arrays of one shape (strided views included): slices,
views and the parts of a concatenation, without a temporary."""

GATHER = FixedKernel(
    ElementwiseSource(  # the flag is an output: CuPy declares every input const
        "raw T table, raw I ids, int64 row, int64 rows",
        "T out, raw int64 flag",
        "const long long id = (long long)ids[i / row];"
        " if (id < 0 || id >= rows) { flag[0] = 1; flag[1] = id; out = (T)0; }"
        " else { out = table[id * row + i % row]; }",
        "einpage_gather",
        preamble="",
        scalars=("row", "rows"),
    ),
    (("T", dtypes.DTYPES), ("I", dtypes.INT_DTYPES)),
)
"""Rows of a table by id; a bad id sets `flag` (checked after the run) and writes 0."""

SCATTER_KEYS = FixedKernel(
    ElementwiseSource(
        "raw I ids, int64 n, int64 start, int64 rows",
        "raw int64 keys",
        "long long key = 0x7fffffffffffffffLL;"
        " if (i < n) { const long long r = (long long)ids[i] - start;"
        " key = ((r >= 0 && r < rows) ? r : rows) * 4294967296LL + (long long)i; }"
        " keys[i] = key;",
        "einpage_scatter_keys",
        preamble="",
        scalars=("n", "start", "rows"),
    ),
    (("I", dtypes.INT_DTYPES),),
)
"""Scatter-add, step 1 (over the workspace's `size=` keys): key i is `(row << 32) | i` for
position i of a row in range, `(rows << 32) | i` for one outside (sorted last, never
read), and the largest int64 for the padding up to a power of two."""

BITONIC_STEP = FixedKernel(
    ElementwiseSource(
        "int64 k, int64 j",
        "raw int64 keys",
        "const ptrdiff_t p = i ^ j;"
        " if (p > i) { const long long a = keys[i], b = keys[p];"
        " if ((a > b) == ((i & k) == 0)) { keys[i] = b; keys[p] = a; } }",
        "einpage_bitonic_step",
        preamble="",
        scalars=("k", "j"),
    )
)
"""Scatter-add, step 2: one compare-exchange pass of a bitonic sort (`bitonic_steps`);
each pair is ordered by the one thread of its lower index, so passes are deterministic."""

_LOWER_BOUND = r"""
template <typename A> __device__ __forceinline__ ptrdiff_t ep_lower_bound(
    const A &keys, ptrdiff_t n, long long key) {
  ptrdiff_t lo = 0, hi = n;
  while (lo < hi) {
    const ptrdiff_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}
"""


@functools.cache
def scatter_sum_source(dtype: str, src_dtype: str) -> ElementwiseSource:
    """Scatter-add, step 3, over the output: element (r, c) adds the sources of its row's
    sorted keys in position order, from zero, in the work type of `dtype` (float32 for
    float16/bfloat16, as `numpy.add.at` into the evaluator's float32 table), and rounds
    once when stored; rows no id names get zero."""
    work = _work(dtype)
    return ElementwiseSource(
        "raw S src, raw int64 keys, int64 nkeys, int64 row",
        f"{dtype} out",
        "const long long r = i / row, c = i % row;"
        " const ptrdiff_t lo = ep_lower_bound(keys, nkeys, r * 4294967296LL);"
        " const ptrdiff_t hi = ep_lower_bound(keys, nkeys, (r + 1) * 4294967296LL);"
        f" {work} acc = 0;"
        " for (ptrdiff_t p = lo; p < hi; ++p) {"
        f" acc += ({work})src[(keys[p] & 0xffffffffLL) * row + c]; }}"
        " out = acc;",
        f"einpage_scatter_sum_{dtype}",
        preamble=_LOWER_BOUND,
        scalars=("nkeys", "row"),
    )


def scatter_add_workspace(task: Task, shapes: Sequence[tuple[int, ...]]) -> int:
    """Bytes of device workspace the scatter-add `task` needs, from its operands' shapes
    (`src`, `ids`): one int64 key per id, padded to a power of two (the bitonic sort's
    size). A pure function of the task and its operand shapes, declared before planning;
    `CupyKernels.scatter_add` lays its keys out from the same number.

    >>> t = Task(3, ScatterAdd(), (1, 2), (10, 4), "float32")
    >>> scatter_add_workspace(t, [(5, 4), (5,)])
    64
    """
    if not isinstance(task.op, ScatterAdd):
        raise UnsupportedError(f"scatter_add_workspace: %{task.id} is a {task.kind}")
    count, rows = math.prod(shapes[1]), task.shape[0]
    if count >= 2**32 or rows >= 2**31:
        raise UnsupportedError(
            f"scatter-add %{task.id}: {count} ids into {rows} rows; its sort keys hold fewer "
            "than 2**32 ids and 2**31 rows (partition the task)"
        )
    return 8 * _padded(count) if count else 0


def _padded(count: int) -> int:
    return 1 << max(count - 1, 0).bit_length()


def bitonic_steps(size: int) -> Iterator[tuple[int, int]]:
    """The (k, j) of each pass of a bitonic sort of `size` keys (a power of two).

    >>> list(bitonic_steps(4))
    [(2, 1), (4, 2), (4, 1)]
    """
    k = 2
    while k <= size:
        j = k // 2
        while j >= 1:
            yield k, j
            j //= 2
        k *= 2


# -- argmax, argmin and the k-th largest ------------------------------------------------

ARG_AGGS = ("argmax", "argmin")

_ARG_PREAMBLE = r"""
template <typename W> struct ep_arg {
  W value;
  long long index;
  __device__ ep_arg() : value(0), index(-1) {}
  __device__ ep_arg(W v, long long i) : value(v), index(i) {}
};
template <typename W> __device__ __forceinline__ ep_arg<W> ep_arg_pick(
    const ep_arg<W> &a, const ep_arg<W> &b, bool largest) {
  if (a.index < 0) return b;
  if (b.index < 0) return a;
  const bool a_nan = a.value != a.value, b_nan = b.value != b.value;
  if (a_nan || b_nan) {
    if (a_nan && b_nan) return a.index < b.index ? a : b;
    return a_nan ? a : b;
  }
  if (a.value != b.value) return ((a.value > b.value) == largest) ? a : b;
  return a.index < b.index ? a : b;
}
"""


@functools.cache
def argreduce_source(dtype: str, agg: str) -> ReductionSource:
    """`argmax`/`argmin` over the last axis into int64, as NumPy's: the first position of
    the largest (smallest) value, or of the first NaN. The reduction's pairs (value,
    position) are ordered totally – NaN first, then by value, ties by position – so any
    order of reducing them gives that one position: deterministic, and no temporary (it
    writes the output, as `cupy.argmax` would not: it allocates its result, and CuPy 14
    has no bfloat16 loop for it).

    >>> argreduce_source("bfloat16", "argmax").map_expr
    'ep_arg<float>(((float)x), (long long)_J)'
    """
    if agg not in ARG_AGGS:
        raise UnsupportedError(f"argreduce {agg!r} has no kernel; known: {', '.join(ARG_AGGS)}")
    work = _work(dtype) if dtypes.is_float(dtype) else C_TYPES[dtype]
    return ReductionSource(
        in_params=f"{dtype} x",
        out_params="int64 out",
        map_expr=f"ep_arg<{work}>((({work})x), (long long)_J)",
        reduce_expr=f"ep_arg_pick(a, b, {'true' if agg == 'argmax' else 'false'})",
        post_map_expr="out = a.index",
        identity="",
        name=f"einpage_{agg}_{dtype}",
        reduce_type=f"ep_arg<{work}>",
        preamble=_ARG_PREAMBLE,
    )


@dataclass(frozen=True, slots=True)
class KthLargestSources:
    """The kernels of a k-th largest of `dtype` by radix selection, most significant bit
    first, on keys that order like the values (`ep_key`: NaN largest, as `np.partition`
    sorts it; -0 as +0), kept in the output itself viewed as `key_dtype`: `zero` clears
    the keys; `count`, once per bit (`bits`, the bit values from the top), counts the
    row's elements whose key is at least the prefix with that bit set and keeps the bit
    when at least k are; `unkey` turns the k-th largest key back into its value."""

    key_dtype: str
    zero: ElementwiseSource
    count: ReductionSource
    unkey: ElementwiseSource
    bits: tuple[int, ...]


def _key_preambles(dtype: str, key: str) -> tuple[str, str]:
    """`ep_key(x)` and `ep_unkey(k)` for `dtype`, its keys of unsigned type `key` (apart:
    a kernel of keys only has no declaration of a float16 or bfloat16 `x`)."""
    width = 8 * dtypes.itemsize(dtype)
    k = C_TYPES[key]
    sign = f"(({k})1 << {width - 1})"
    if dtypes.is_float(dtype):
        value = "((float)x)" if dtype in ("float16", "bfloat16") else "x"
        raw = {"float16": "x.to_bits()", "bfloat16": "x.to_bits()",
               "float32": "__float_as_uint(x)",
               "float64": "__double_as_longlong(x)"}[dtype]  # fmt: skip
        to_key = (
            f"  if ({value} != {value}) return ({k})~({k})0;\n"
            f"  const {k} u = ({value} == 0) ? ({k})0 : ({k}){raw};\n"
            f"  return (u & {sign}) ? ({k})~u : ({k})(u | {sign});\n"
        )
        from_key = f"  return (k & {sign}) ? ({k})(k & ~{sign}) : ({k})~k;\n"
    elif np.iinfo(dtype).min < 0:
        to_key = f"  return ({k})(({k})x ^ {sign});\n"
        from_key = f"  return ({k})(k ^ {sign});\n"
    else:
        to_key = f"  return ({k})x;\n"
        from_key = "  return k;\n"
    return (
        f"__device__ __forceinline__ {k} ep_key(const {C_TYPES[dtype]} &x) {{\n{to_key}}}\n",
        f"__device__ __forceinline__ {k} ep_unkey({k} k) {{\n{from_key}}}\n",
    )


@functools.cache
def kth_largest_sources(dtype: str) -> KthLargestSources:
    """The kernels of `KthLargest` in `dtype` (see `KthLargestSources`): no temporary,
    deterministic, exact; `8 * itemsize` passes over the operand.

    >>> kth_largest_sources("bfloat16").bits[:2], kth_largest_sources("bfloat16").key_dtype
    ((32768, 16384), 'uint16')
    """
    width = 8 * dtypes.itemsize(dtype)
    key = f"uint{width}"
    k = C_TYPES[key]
    to_key, from_key = _key_preambles(dtype, key)
    prefix = f"(_i < rows ? _raw_out[_i] : ({k})0)"  # CuPy's names: the output, its index
    return KthLargestSources(
        key_dtype=key,
        zero=ElementwiseSource("", f"{key} out", f"out = ({k})0;", f"einpage_zero_{key}", ""),
        count=ReductionSource(
            in_params=f"{dtype} x, int64 k, int64 rows, {key} bit",
            out_params=f"{key} out",
            map_expr=f"(ep_key(x) >= ({k})({prefix} | bit)) ? 1LL : 0LL",
            reduce_expr="a + b",
            post_map_expr=f"out = (a >= k) ? ({k})(out | bit) : out",
            identity="0",
            name=f"einpage_kth_count_{dtype}",
            reduce_type="long long",
            preamble=to_key,
            scalars=("k", "rows", "bit"),
        ),
        unkey=ElementwiseSource(
            "", f"{key} out", "out = ep_unkey(out);", f"einpage_kth_unkey_{dtype}", from_key
        ),
        bits=tuple(1 << b for b in range(width - 1, -1, -1)),
    )


FIXED = (COPY, GATHER, SCATTER_KEYS, BITONIC_STEP)
"""Every fixed kernel the backend launches."""


def catalog() -> Iterator[tuple[ElementwiseSource, dict[str, str]]]:
    """Every elementwise kernel the backend can launch that does not come from a join:
    each fixed kernel with each binding of its placeholders, each fill, scatter-sum and
    k-th largest step per dtype (`reduction_catalog` has the reductions; join kernels
    are generated per expression)."""
    for fixed in FIXED:
        names = [name for name, _ in fixed.placeholders]
        domains = [domain for _, domain in fixed.placeholders]
        for binding in _product(domains):
            yield fixed.source, dict(zip(names, binding, strict=True))
    for dtype in dtypes.FLOAT_DTYPES:  # fills are of floats (`taskgraph.nodes.Fill`)
        for pattern in FILL_PATTERNS:
            yield fill_source(dtype, pattern), {}
    for dtype in dtypes.DTYPES:
        yield scatter_sum_source(dtype, dtype), {"S": dtype}
        kth = kth_largest_sources(dtype)
        yield kth.zero, {}
        yield kth.unkey, {}


def reduction_catalog() -> Iterator[ReductionSource]:
    """Every reduction kernel the backend can launch that does not come from a join:
    argmax and argmin, and the k-th largest's counting pass, per dtype."""
    for dtype in dtypes.DTYPES:
        for agg in ARG_AGGS:
            yield argreduce_source(dtype, agg)
        yield kth_largest_sources(dtype).count


def _product(domains: Sequence[tuple[str, ...]]) -> Iterator[tuple[str, ...]]:
    if not domains:
        yield ()
        return
    for first in domains[0]:
        for rest in _product(domains[1:]):
            yield (first, *rest)
