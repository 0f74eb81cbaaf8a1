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

from einpage.program.program import Program, Tensor
from einpage_core.errors import DTypeError, ProgramError, ShapeError
from taskgraph import dtypes
from taskgraph.einsum import LETTERS
from taskgraph.facts import LogSumExp, Softmax
from taskgraph.nodes import ArgReduce, KthLargest

__all__ = [
    "add", "sub", "mul", "div", "neg", "scale", "matmul", "transpose", "permute",
    "reduce_sum", "reduce_max", "reduce_min", "mean", "softmax", "rmsnorm", "layernorm",
    "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "silu", "gelu", "relu", "abs",
    "causal_mask", "reshape", "concat", "slice", "getitem", "gather", "cast",
    "cross_entropy",
    "argmax", "argmin", "kth_largest", "sample_gumbel",
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
    """Softmax over `axis`, stabilized by the maximum: three einsums, no exp materialized.
    The result carries the fact `taskgraph.facts.Softmax`, by which the backward pass
    differentiates the three as one (`taskgraph.autodiff.patterns`)."""
    prog = a.program
    (axis,) = _axes(a, axis)
    letters = _letters(a.ndim)
    rest = letters.replace(letters[axis], "")
    peak = prog.einsum(f"{letters}->{rest}", a, agg="max", label="softmax.max")
    total = prog.einsum(
        f"{letters},{rest}->{rest}", a, peak, join="exp(a - b)", label="softmax.sum"
    )
    probs = prog.einsum(
        f"{letters},{rest},{rest}->{letters}",
        a,
        peak,
        total,
        join="exp(a - b) / c",
        label="softmax",
    )
    return prog.fact(probs, Softmax())


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


# -- losses -----------------------------------------------------------------------

REDUCTIONS = ("mean", "sum", "none")
"""How `cross_entropy` reduces the per-position losses."""


def _digits(prog: Program, count: int, dtype: str) -> tuple[Tensor, Tensor, int]:
    """The numbers 0..count-1 as two digits in base w = ceil(sqrt(count)): tensors
    `high`, `low` of [count] in `dtype` with `n = high[n] * w + low[n]`, and w. Every digit
    is below w <= 2048 (for up to 4M classes), so exact even in float16. O(count) work: a
    causal fill `up[q, k] = (k > q)` of [w, w] summed over q is 0..w-1."""
    width = math.isqrt(count - 1) + 1 if count > 1 else 1
    up = prog.fill((width, width), 1.0, dtype, pattern="causal", label="classes.up")
    column = prog.einsum("qk->k", up, label="classes.column")
    digits = []
    for join in ("a + 0.0 * b", "b + 0.0 * a"):  # grid[i, j] = i, then = j
        flat = prog.view(prog.einsum("i,j->ij", column, column, join=join), (width * width,))
        if width * width != count:
            flat = prog.slice(flat, (0,), (count,))
        digits.append(flat)
    return digits[0], digits[1], width


def cross_entropy(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """The cross-entropy of `logits` [..., classes] against integer `labels` [...], as
    `torch.nn.functional.cross_entropy` (every position counts; labels must be in
    [0, classes): the program cannot check data, so `einpage.workloads.training.training_inputs`
    refuses labels outside the vocabulary): `logsumexp(logits) - logits[label]` per
    position, then their mean (`reduction="mean"`, a scalar), sum, or none.

    Numerically stable: `logsumexp = log(sum(exp(logits - m))) + m` with m the maximum
    over the classes (marked `taskgraph.facts.LogSumExp`: a group the backward pass
    differentiates as one, its gradient `softmax(logits) * g`, see
    `taskgraph.autodiff.patterns`). The label's logit is
    picked by comparing labels and class numbers written as two digits below
    sqrt(classes) (no one-hot tensor, no copy of the logits), exact in every float dtype.

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> loss = cross_entropy(prog.input("logits", (2, 3, 10)), prog.input("y", (2, 3), "int64"))
    >>> loss.shape, loss.dtype
    ((), 'float32')
    """
    prog = _program(logits, labels)
    if reduction not in REDUCTIONS:
        raise ProgramError(
            f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}"
        )
    if logits.ndim < 1 or labels.shape != logits.shape[:-1]:
        raise ShapeError(
            f"cross_entropy: labels {labels.shape} must be the logits' shape {logits.shape} "
            "without its last (class) axis"
        )
    if dtypes.is_float(labels.dtype) or not dtypes.is_float(logits.dtype):
        raise ProgramError(
            f"cross_entropy: logits must be float and labels integer, got {logits.dtype} "
            f"and {labels.dtype}"
        )
    x, dtype = logits, logits.dtype
    lead = _letters(labels.ndim + 1)[:-1]
    c = "z" if "z" not in lead else "Z"
    high, low, width = _digits(prog, x.shape[-1], dtype)
    w = float(width)
    label_high = prog.einsum(f"{lead}->{lead}", labels, join=f"a / {w!r}", label="ce.high")
    label_low = prog.einsum(
        f"{lead},{lead}->{lead}", labels, label_high, join=f"a - b * {w!r}", label="ce.low"
    )
    targets = [prog.einsum(f"{lead}->{lead}", t, dtype=dtype) for t in (label_high, label_low)]
    peak = prog.einsum(f"{lead}{c}->{lead}", x, agg="max", label="ce.max")
    total = prog.einsum(f"{lead}{c},{lead}->{lead}", x, peak, join="exp(a - b)", label="ce.sum")
    lse = prog.einsum(f"{lead},{lead}->{lead}", total, peak, join="log(a) + b", label="ce.lse")
    prog.fact(lse, LogSumExp())
    picked = prog.einsum(
        f"{lead}{c},{lead},{lead},{c},{c}->{lead}",
        x,
        *targets,
        high,
        low,
        join=f"where(d * {w!r} + e == b * {w!r} + c, a, 0.0)",
        label="ce.picked",
    )
    if reduction == "none":
        return prog.einsum(f"{lead},{lead}->{lead}", lse, picked, join="a - b", label="ce")
    scale = 1.0 / labels.size if reduction == "mean" else 1.0
    join = "a - b" if scale == 1.0 else f"(a - b) * {scale!r}"
    return prog.einsum(f"{lead},{lead}->", lse, picked, join=join, label="ce")


# -- selections along an axis: greedy and sampled next tokens ---------------------------


def _last_axis(a: Tensor, axis: int) -> Tensor:
    """`a` with `axis` moved last (a copy unless it already is)."""
    (axis,) = _axes(a, axis)
    if axis == a.ndim - 1:
        return a
    return transpose(a, [*(i for i in range(a.ndim) if i != axis), axis])


def _arg(a: Tensor, axis: int, agg: str, label: str) -> Tensor:
    if a.ndim == 0:
        raise ShapeError(f"{agg}: the tensor must have at least one dimension, got a scalar")
    a = _last_axis(a, axis)
    return a.program._add(ArgReduce(agg), (a,), label=label)


def argmax(a: Tensor, axis: int = -1, label: str = "") -> Tensor:
    """The position of the largest element along `axis` as int64 ids (the first one on
    ties): `a.shape` without `axis`. Greedy decoding's next token from logits [b, vocab].

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> argmax(prog.input("logits", (2, 50))).task.line()
    '%1 : i64[2] = argreduce[argmax](%0)'
    """
    return _arg(a, axis, "argmax", label)


def argmin(a: Tensor, axis: int = -1, label: str = "") -> Tensor:
    """The position of the smallest element along `axis` as int64 ids (the first on ties)."""
    return _arg(a, axis, "argmin", label)


def kth_largest(a: Tensor, k: int, axis: int = -1, label: str = "") -> Tensor:
    """The `k`-th largest value along `axis` (k=1: the maximum), in `a`'s dtype: the
    threshold that keeps the top k elements (those `>=` it; ties at it are all kept)."""
    if a.ndim == 0:
        raise ShapeError("kth_largest: the tensor must have at least one dimension")
    a = _last_axis(a, axis)
    return a.program._add(KthLargest(k), (a,), label=label)


def sample_gumbel(
    logits: Tensor,
    gumbel: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    label: str = "",
) -> Tensor:
    """Ids sampled from `softmax(logits / temperature)` over the last axis, restricted to
    the `top_k` largest logits when given: the Gumbel-max trick,
    `argmax(logits / temperature + gumbel)` over the kept entries, where `gumbel` (the
    shape and dtype of `logits`) holds independent standard Gumbel noise – an input, so
    that the program stays static and a seed on the host makes it reproducible
    (`numpy.random.Generator.gumbel`). Entries below the k-th largest logit get the
    dtype's lowest value, so they are never chosen.
    """
    if gumbel.shape != logits.shape:
        raise ShapeError(
            f"sample_gumbel: the noise has shape {gumbel.shape}, the logits {logits.shape}"
        )
    if not dtypes.is_float(logits.dtype):
        raise DTypeError(f"sample_gumbel: logits must be a float type, got {logits.dtype}")
    ok = isinstance(temperature, int | float) and not isinstance(temperature, bool)
    if not ok or not math.isfinite(temperature) or temperature <= 0:
        raise ProgramError(f"sample_gumbel: temperature must be > 0, got {temperature!r}")
    prog = _program(logits, gumbel)
    scaled = f"a * {1.0 / float(temperature)!r}"
    if top_k is None:
        z = prog.einsum("...,...->...", logits, gumbel, join=f"{scaled} + b", label="gumbel")
    else:
        floor = float(dtypes.finfo(logits.dtype).min)
        threshold = kth_largest(logits, top_k, label="top_k")
        z = prog.einsum(
            "...v,...,...v->...v",
            logits,
            threshold,
            gumbel,
            join=f"where(a >= b, {scaled} + c, {floor!r})",
            label="gumbel",
        )
    return argmax(z, label=label)
