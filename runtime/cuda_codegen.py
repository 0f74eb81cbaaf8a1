"""CUDA C for generalized einsums: join expression trees turned into CuPy kernel code.

A join (`taskgraph.expr`) is translated node by node into a C++ expression over the
kernel's inputs `in0, in1, ...`, every value in the *work type* (`float` for float16
and float32 tasks, `double` for float64: as the reference evaluator computes). The
functions NumPy spells differently live in `PREAMBLE` as small device templates
with NumPy's semantics (`max`/`min` propagate NaN, `where` tests `!= 0`). Nothing
is evaluated: the tree is walked, and the text only ever contains operand names,
numeric literals and the operators and functions of the allow-list.

`elementwise_source` gives the pieces of a `cupy.ElementwiseKernel` (no reduced
index), `reduction_source` those of a `cupy.ReductionKernel` (sum, max, min or
prod over the reduced indices). Both are plain data, so they are tested here
without a GPU (and compiled with a host C++ compiler where one exists).

>>> from taskgraph.expr import parse
>>> join_to_c(parse("exp(a - b) / c", 3), "float")
'(exp((((float)in0) - ((float)in1))) / ((float)in2))'
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from einpage_core.errors import UnsupportedError
from taskgraph.expr import BinOp, Call, Const, Expr, Var

__all__ = [
    "PREAMBLE",
    "WORK_CTYPE",
    "ElementwiseSource",
    "ReductionSource",
    "join_to_c",
    "elementwise_source",
    "reduction_source",
    "supports",
]

WORK_CTYPE = {"float16": "float", "float32": "float", "float64": "double"}
"""The C type a task of each float dtype is computed in."""

INT_WORK_CTYPE = {"int8": "double", "uint8": "double", "int32": "double", "int64": "double"}
"""The C type a task of each integer dtype is computed in: double, as the reference
evaluator's joins compute integers with float constants (`labels / 16.0`), the result
converted to the integer type (truncated toward zero, as NumPy's `astype`)."""

PREAMBLE = r"""
template <typename T> __device__ __forceinline__ T ep_max(T a, T b) {
  return (a > b || a != a) ? a : b;
}
template <typename T> __device__ __forceinline__ T ep_min(T a, T b) {
  return (a < b || a != a) ? a : b;
}
template <typename T> __device__ __forceinline__ T ep_where(T c, T a, T b) {
  return c != T(0) ? a : b;
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

_FUNCTIONS = {
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
_ARITHMETIC = {"+", "-", "*", "/"}
_COMPARISONS = {"<", "<=", ">", ">=", "==", "!="}

# Identities of the aggregations, by work type: -inf and +inf from their bit patterns
# (device intrinsics need no header).
_IDENTITY = {
    ("sum", "float"): "0",
    ("sum", "double"): "0",
    ("prod", "float"): "1",
    ("prod", "double"): "1",
    ("max", "float"): "__int_as_float(0xff800000)",
    ("max", "double"): "__longlong_as_double(0xfff0000000000000ULL)",
    ("min", "float"): "__int_as_float(0x7f800000)",
    ("min", "double"): "__longlong_as_double(0x7ff0000000000000ULL)",
}
_REDUCE = {"sum": "a + b", "prod": "a * b", "max": "ep_max(a, b)", "min": "ep_min(a, b)"}


def _literal(value: float) -> str:
    text = repr(float(value))
    if text in ("inf", "-inf", "nan"):  # the parser only makes finite constants
        raise UnsupportedError(f"join constant {text} has no C literal")
    return text


def join_to_c(expr: Expr, work: str, operand: str = "in{}") -> str:
    """The join as one C++ expression of type `work`, reading operand i as `operand.format(i)`.

    Every operand and constant is cast to `work` first, so all arithmetic happens in
    the work type whatever the operands' dtypes (float16 loads become float).
    """
    if isinstance(expr, Var):
        return f"(({work}){operand.format(expr.index)})"
    if isinstance(expr, Const):
        return f"(({work}){_literal(expr.value)})"
    if isinstance(expr, BinOp):
        left, right = join_to_c(expr.left, work, operand), join_to_c(expr.right, work, operand)
        if expr.op in _ARITHMETIC:
            return f"({left} {expr.op} {right})"
        if expr.op == "**":
            return f"pow({left}, {right})"
        if expr.op in _COMPARISONS:
            return f"(({work})({left} {expr.op} {right}))"
        raise UnsupportedError(f"join operator {expr.op!r} has no CUDA translation")
    if isinstance(expr, Call):
        args = [join_to_c(arg, work, operand) for arg in expr.args]
        if expr.fn == "neg":
            return f"(-{args[0]})"
        if expr.fn not in _FUNCTIONS:
            raise UnsupportedError(f"join function {expr.fn!r} has no CUDA translation")
        return f"{_FUNCTIONS[expr.fn]}({', '.join(args)})"
    raise UnsupportedError(f"not a join expression: {expr!r}")


def supports(in_dtypes: Sequence[str], out_dtype: str) -> bool:
    """Whether generated kernels handle these dtypes: float and integer tasks of float or
    integer operands (int8/int4 weights' casts, the integer arithmetic of labels)."""
    known = WORK_CTYPE.keys() | INT_WORK_CTYPE.keys()
    return out_dtype in known and all(d in known for d in in_dtypes)


def _work_type(in_dtypes: Sequence[str], out_dtype: str) -> str:
    if not supports(in_dtypes, out_dtype):
        raise UnsupportedError(
            f"generated kernels compute float and integer dtypes, got {list(in_dtypes)} -> "
            f"{out_dtype}"
        )
    return WORK_CTYPE.get(out_dtype) or INT_WORK_CTYPE[out_dtype]


def _name(kind: str, *parts: str) -> str:
    digest = hashlib.sha1("\x00".join(parts).encode()).hexdigest()[:12]
    return f"einpage_{kind}_{digest}"


def _params(in_dtypes: Sequence[str]) -> str:
    return ", ".join(f"{dtype} in{i}" for i, dtype in enumerate(in_dtypes))


@dataclass(frozen=True, slots=True)
class ElementwiseSource:
    """Arguments of `cupy.ElementwiseKernel(in_params, out_params, operation, name,
    preamble=preamble)`; call it with the operands (broadcast views) and the output."""

    in_params: str
    out_params: str
    operation: str
    name: str
    preamble: str = PREAMBLE


@dataclass(frozen=True, slots=True)
class ReductionSource:
    """Arguments of `cupy.ReductionKernel(in_params, out_params, map_expr, reduce_expr,
    post_map_expr, identity, name, reduce_type=..., preamble=...)`; call it with the
    operands broadcast over the iteration space, `axis=` the reduced axes, `out=`."""

    in_params: str
    out_params: str
    map_expr: str
    reduce_expr: str
    post_map_expr: str
    identity: str
    name: str
    reduce_type: str
    preamble: str = PREAMBLE


def elementwise_source(expr: Expr, in_dtypes: Sequence[str], out_dtype: str) -> ElementwiseSource:
    """An elementwise kernel computing `out = join(in0, in1, ...)` (no reduction).

    >>> from taskgraph.expr import parse
    >>> elementwise_source(parse("a * b", 2), ["float16", "float16"], "float16").operation
    'out = (((float)in0) * ((float)in1));'
    """
    work = _work_type(in_dtypes, out_dtype)
    body = join_to_c(expr, work)
    params = _params(in_dtypes)
    return ElementwiseSource(
        in_params=params,
        out_params=f"{out_dtype} out",
        operation=f"out = {body};",
        name=_name("join", params, out_dtype, body),
    )


def reduction_source(
    expr: Expr, agg: str, in_dtypes: Sequence[str], out_dtype: str
) -> ReductionSource:
    """A reduction kernel computing `out = agg over reduced axes of join(in0, in1, ...)`."""
    work = _work_type(in_dtypes, out_dtype)
    if agg not in _REDUCE:
        raise UnsupportedError(f"aggregation {agg!r} has no CUDA translation")
    body = join_to_c(expr, work)
    params = _params(in_dtypes)
    return ReductionSource(
        in_params=params,
        out_params=f"{out_dtype} out",
        map_expr=body,
        reduce_expr=_REDUCE[agg],
        post_map_expr="out = a",
        identity=_IDENTITY[(agg, work)],
        name=_name("reduce", params, out_dtype, agg, body),
        reduce_type=work,
    )
