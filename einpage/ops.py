"""The op library: common tensor ops written as generalized einsums.

Every function takes `Tensor`s of one `Program` (and, where it says so, Python
numbers) and returns a new `Tensor`. Broadcasting follows NumPy (dimensions aligned
from the right, size 1 stretches); axes may be negative.

>>> import einpage as ep
>>> prog = ep.Program()
>>> x = prog.input("x", (2, 5))
>>> softmax(x, axis=-1).shape
(2, 5)
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import Any

from einpage.program import Program, Tensor
from einpage_core.errors import ProgramError, ShapeError
from taskgraph.einsum import LETTERS

__all__ = [
    "add", "sub", "mul", "div", "neg", "scale", "matmul", "transpose", "permute",
    "reduce_sum", "reduce_max", "reduce_min", "mean", "softmax", "rmsnorm", "layernorm",
    "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "silu", "gelu", "relu", "abs",
    "causal_mask", "reshape", "concat", "slice", "getitem", "gather", "cast",
]  # fmt: skip

Scalar = int | float


def _program(*values: Any) -> Program:
    """The one program the Tensor arguments belong to."""
    programs = {id(v.program): v.program for v in values if isinstance(v, Tensor)}
    if not programs:
        raise ProgramError("expected at least one Tensor argument")
    if len(programs) > 1:
        raise ProgramError("arguments belong to different programs")
    return next(iter(programs.values()))


def _constant(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProgramError(f"expected a Tensor or a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ProgramError(f"constants in ops must be finite, got {value!r}")
    return f"({float(value)!r})"


def _elementwise(template: str, *values: Any, label: str = "") -> Tensor:
    """Apply `template` (over `{0}`, `{1}`, ...) elementwise with NumPy broadcasting;
    number arguments become constants of the join."""
    prog = _program(*values)
    tensors = [v for v in values if isinstance(v, Tensor)]
    names, k = [], 0
    for value in values:
        if isinstance(value, Tensor):
            names.append("abcdefghijklmnopqrstuvwxyz"[k])
            k += 1
        else:
            names.append(_constant(value))
    spec = ",".join("..." for _ in tensors) + "->..."
    return prog.einsum(spec, *tensors, join=template.format(*names), label=label)


def _axes(tensor: Tensor, axis: int | Sequence[int] | None) -> tuple[int, ...]:
    """Normalize an axis argument (None: all axes) to sorted non-negative axes."""
    if axis is None:
        return tuple(range(tensor.ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    result = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, int) or not -tensor.ndim <= a < tensor.ndim:
            raise ShapeError(f"axis {a!r} is out of range for a tensor of rank {tensor.ndim}")
        result.append(a % tensor.ndim)
    if len(set(result)) != len(result):
        raise ShapeError(f"repeated axis in {axis!r}")
    return tuple(sorted(result))


def _letters(n: int) -> str:
    if n > len(LETTERS):
        raise ShapeError(f"rank {n} exceeds the {len(LETTERS)} einsum indices available")
    return LETTERS[:n]


# -- elementwise ------------------------------------------------------------------


def add(a: Tensor | Scalar, b: Tensor | Scalar) -> Tensor:
    """`a + b`."""
    return _elementwise("{0} + {1}", a, b)


def sub(a: Tensor | Scalar, b: Tensor | Scalar) -> Tensor:
    """`a - b`."""
    return _elementwise("{0} - {1}", a, b)


def mul(a: Tensor | Scalar, b: Tensor | Scalar) -> Tensor:
    """`a * b`."""
    return _elementwise("{0} * {1}", a, b)


def div(a: Tensor | Scalar, b: Tensor | Scalar) -> Tensor:
    """`a / b`."""
    return _elementwise("{0} / {1}", a, b)


def neg(a: Tensor) -> Tensor:
    """`-a`."""
    return _elementwise("-{0}", a)


def scale(a: Tensor, factor: Scalar) -> Tensor:
    """`a * factor` for a number `factor`."""
    return _elementwise("{0} * {1}", a, factor)


def _unary(fn: str) -> Any:
    def op(a: Tensor) -> Tensor:
        return _elementwise(f"{fn}({{0}})", a)

    op.__name__ = fn
    op.__doc__ = f"`{fn}(a)` elementwise."
    return op


exp = _unary("exp")
log = _unary("log")
sqrt = _unary("sqrt")
rsqrt = _unary("rsqrt")
tanh = _unary("tanh")
sigmoid = _unary("sigmoid")
silu = _unary("silu")
gelu = _unary("gelu")
relu = _unary("relu")
abs = _unary("abs")  # noqa: A001  (the op's name)


def cast(a: Tensor, dtype: Any) -> Tensor:
    """`a` converted to `dtype`."""
    return a.program.einsum("...->...", a, dtype=dtype)


# -- contractions and layout ------------------------------------------------------


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product with NumPy's `@` semantics (batch dimensions broadcast)."""
    prog = _program(a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError("matmul: operands must have at least one dimension")
    inner = b.shape[0] if b.ndim == 1 else b.shape[-2]
    if a.shape[-1] != inner:  # einsum would broadcast a size-1 k; `@` does not
        raise ShapeError(
            f"matmul: the contracted index 'k' has size {a.shape[-1]} in operand 0 "
            f"{a.shape} but {inner} in operand 1 {b.shape}"
        )
    if a.ndim == 1 and b.ndim == 1:
        return prog.einsum("k,k->", a, b)
    if a.ndim == 1:
        return prog.einsum("k,...kn->...n", a, b)
    if b.ndim == 1:
        return prog.einsum("...mk,k->...m", a, b)
    return prog.einsum("...mk,...kn->...mn", a, b)


def transpose(a: Tensor, axes: Sequence[int] | None = None) -> Tensor:
    """`a` with its axes permuted (reversed by default), copied."""
    letters = _letters(a.ndim)
    order = tuple(reversed(range(a.ndim))) if axes is None else tuple(axes)
    if sorted(x % a.ndim if isinstance(x, int) else x for x in order) != list(range(a.ndim)):
        raise ShapeError(f"transpose: axes {order} are not a permutation of {a.ndim} axes")
    out = "".join(letters[x % a.ndim] for x in order)
    return a.program.einsum(f"{letters}->{out}", a)


def permute(a: Tensor, *axes: int) -> Tensor:
    """`a` with axes in the order given (`permute(x, 0, 2, 1)`)."""
    return transpose(a, axes)


def reshape(a: Tensor, shape: Sequence[int]) -> Tensor:
    """A view of `a` with another shape (no copy); one dimension may be -1."""
    return a.program.view(a, shape)


def concat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Tensors joined along `axis`."""
    return _program(*tensors).concat(tensors, axis)


def slice(a: Tensor, axis: int, start: int, stop: int) -> Tensor:  # noqa: A001
    """`a[..., start:stop, ...]` along `axis`, copied."""
    (axis,) = _axes(a, axis)
    if not 0 <= start < stop <= a.shape[axis]:
        raise ShapeError(
            f"slice: [{start}, {stop}) is not a non-empty range within axis "
            f"{axis} of extent {a.shape[axis]}"
        )
    starts = [0] * a.ndim
    starts[axis] = start
    shape = list(a.shape)
    shape[axis] = stop - start
    return a.program.slice(a, starts, shape)


def getitem(a: Tensor, key: Any) -> Tensor:
    """Basic indexing: ints and step-1 slices per axis (`x[0]`, `x[:, 2:5]`)."""
    key = key if isinstance(key, tuple) else (key,)
    if len(key) > a.ndim:
        raise ShapeError(f"too many indices ({len(key)}) for a tensor of rank {a.ndim}")
    starts, shape, keep = [], [], []
    for axis, dim in enumerate(a.shape):
        item = key[axis] if axis < len(key) else builtins.slice(None)
        if isinstance(item, int) and not isinstance(item, bool):
            if not -dim <= item < dim:
                raise ShapeError(f"index {item} is out of range for axis {axis} of extent {dim}")
            starts.append(item % dim)
            shape.append(1)
        elif isinstance(item, builtins.slice):
            start, stop, step = item.indices(dim)
            if step != 1 or stop <= start:
                raise ShapeError(
                    f"axis {axis}: only non-empty step-1 slices are supported, got {item}"
                )
            starts.append(start)
            shape.append(stop - start)
            keep.append(axis)
        else:
            raise ShapeError(f"unsupported index {item!r}: use ints and step-1 slices")
    result = a.program.slice(a, starts, shape) if tuple(shape) != a.shape else a
    if len(keep) != a.ndim:
        result = a.program.view(result, [shape[i] for i in keep])
    return result


def gather(table: Tensor, ids: Tensor) -> Tensor:
    """Embedding lookup: `table[ids]` (rows of `table` by the integer tensor `ids`)."""
    return _program(table, ids).gather(table, ids)


# -- reductions and normalizations -----------------------------------------------


def _reduce(a: Tensor, axis: Any, keepdims: bool, agg: str, join: str | None) -> Tensor:
    axes = _axes(a, axis)
    letters = _letters(a.ndim)
    out = "".join(c for i, c in enumerate(letters) if i not in axes)
    result = a.program.einsum(f"{letters}->{out}", a, join=join, agg=agg)
    if keepdims:
        result = a.program.view(result, [1 if i in axes else d for i, d in enumerate(a.shape)])
    return result


def reduce_sum(
    a: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False
) -> Tensor:
    """Sum over `axis` (all axes by default)."""
    return _reduce(a, axis, keepdims, "sum", None)


def reduce_max(
    a: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False
) -> Tensor:
    """Maximum over `axis` (all axes by default)."""
    return _reduce(a, axis, keepdims, "max", None)


def reduce_min(
    a: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False
) -> Tensor:
    """Minimum over `axis` (all axes by default)."""
    return _reduce(a, axis, keepdims, "min", None)


def mean(a: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
    """Mean over `axis` (all axes by default)."""
    count = math.prod(a.shape[i] for i in _axes(a, axis))
    return _reduce(a, axis, keepdims, "sum", f"a / {float(count)!r}")


def softmax(a: Tensor, axis: int = -1) -> Tensor:
    """Softmax over `axis`, stabilized by the maximum: three einsums, no exp materialized."""
    prog = a.program
    (axis,) = _axes(a, axis)
    letters = _letters(a.ndim)
    rest = letters.replace(letters[axis], "")
    peak = prog.einsum(f"{letters}->{rest}", a, agg="max", label="softmax.max")
    total = prog.einsum(
        f"{letters},{rest}->{rest}", a, peak, join="exp(a - b)", label="softmax.sum"
    )
    return prog.einsum(
        f"{letters},{rest},{rest}->{letters}",
        a,
        peak,
        total,
        join="exp(a - b) / c",
        label="softmax",
    )


def rmsnorm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """RMS normalization over the last axis: `x * rsqrt(mean(x**2) + eps) * weight`."""
    prog = x.program
    width = float(x.shape[-1])
    ms = prog.einsum("...d->...", x, join=f"a * a / {width!r}", label="rmsnorm.ms")
    if weight is None:
        return prog.einsum(
            "...d,...->...d", x, ms, join=f"a * rsqrt(b + {float(eps)!r})", label="rmsnorm"
        )
    return prog.einsum(
        "...d,...,d->...d",
        x,
        ms,
        weight,
        join=f"a * rsqrt(b + {float(eps)!r}) * c",
        label="rmsnorm",
    )


def layernorm(
    x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """Layer normalization over the last axis: `(x - mean) * rsqrt(var + eps) * weight + bias`."""
    prog = x.program
    width = float(x.shape[-1])
    mu = prog.einsum("...d->...", x, join=f"a / {width!r}", label="layernorm.mean")
    var = prog.einsum(
        "...d,...->...", x, mu, join=f"(a - b) * (a - b) / {width!r}", label="layernorm.var"
    )
    operands, terms = [x, mu, var], ["...d", "...", "..."]
    join = f"(a - b) * rsqrt(c + {float(eps)!r})"
    if weight is not None:
        operands.append(weight)
        terms.append("d")
        join += " * d"
    if bias is not None:
        operands.append(bias)
        terms.append("d")
        join += f" + {'abcde'[len(operands) - 1]}"
    return prog.einsum(",".join(terms) + "->...d", *operands, join=join, label="layernorm")


def causal_mask(scores: Tensor, value: float = -math.inf) -> Tensor:
    """`scores` (..., q, k) with `value` added where key > query: the causal attention mask."""
    prog = scores.program
    if scores.ndim < 2:
        raise ShapeError(f"causal_mask: scores need rank >= 2, got shape {scores.shape}")
    mask = prog.fill(scores.shape[-2:], value, scores.dtype, pattern="causal", label="mask")
    return prog.einsum("...qk,qk->...qk", scores, mask, join="a + b", label="masked")
