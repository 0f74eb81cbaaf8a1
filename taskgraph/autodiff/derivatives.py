"""Symbolic derivatives of join expressions: `diff(expr, operand)` as another expression.

Every function of the join allow-list (`taskgraph.expr.FUNCTIONS`) and every operator
has a rule; the result is simplified as it is built (constants folded, `x + 0`,
`x * 1`, `x * 0` dropped), so that the derivative of a plain product is again a plain
product and a backward einsum computes no more than it must.

Rules where the function is not differentiable everywhere, chosen as PyTorch's
autograd does so that gradients equal `torch.autograd` also on ties:

* comparisons (`<`, `==`, ...) have derivative 0: they route, never carry, gradients;
* `where(c, x, y)`: `where(c, dx, dy)` (nothing flows into the condition);
* `relu(x)`: `dx` where `x > 0`, else 0 (0 at 0, as `torch.relu`);
* `floor(x)`: 0 (piecewise constant, as `torch.floor`);
* `abs(x)`: `sign(x) * dx`, 0 at 0 (as `torch.abs`);
* `max(x, y)` / `min(x, y)`: the whole gradient to the larger (smaller) argument and,
  on a tie, half to each (as `torch.maximum` / `torch.minimum`);
* `x ** y`: `y * x ** (y - 1) * dx` plus, when the exponent varies,
  `x ** y * log(x) * dy`, taken as 0 where `x == 0` (as `torch.pow`).

A derivative never negates or subtracts a bare comparison (NumPy refuses arithmetic
negation of booleans): negation is multiplication by -1.0, and a comparison is kept
inside a product with a float.

>>> from taskgraph.expr import parse
>>> str(diff(parse("exp(a - b) / c", 3), 1))
'(-1.0) * exp(a - b) / c'
>>> str(diff(parse("a * b", 2), 0))
'b'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from einpage_core.errors import UnsupportedError
from taskgraph.expr import BinOp, Call, Const, Expr, Var

__all__ = [
    "diff",
    "substitute",
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "where",
    "compare",
    "is_zero",
    "is_one",
    "product_vars",
]

ZERO = Const(0.0)
ONE = Const(1.0)
_COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")


# -- simplifying constructors ------------------------------------------------------


def is_zero(e: Expr) -> bool:
    return isinstance(e, Const) and e.value == 0.0


def is_one(e: Expr) -> bool:
    return isinstance(e, Const) and e.value == 1.0


def _boolean(e: Expr) -> bool:
    """Whether `e` evaluates to a boolean array (a comparison, or a product/sum of them)."""
    if isinstance(e, BinOp) and e.op in _COMPARISONS:
        return True
    return isinstance(e, BinOp) and e.op in ("*", "+") and _boolean(e.left) and _boolean(e.right)


def add(x: Expr, y: Expr) -> Expr:
    if isinstance(x, Const) and isinstance(y, Const):
        return Const(x.value + y.value)
    if is_zero(x) and not _boolean(y):
        return y
    if is_zero(y) and not _boolean(x):
        return x
    return BinOp("+", x, y)


def mul(x: Expr, y: Expr) -> Expr:
    if isinstance(x, Const) and isinstance(y, Const):
        return Const(x.value * y.value)
    if is_zero(x) or is_zero(y):
        return ZERO
    if is_one(x) and not _boolean(y):
        return y
    if is_one(y) and not _boolean(x):
        return x
    if isinstance(y, Const) and not isinstance(x, Const):  # constants first
        x, y = y, x
    for a, b in ((x, y), (y, x)):  # a cheap factor into a where with a constant branch
        if isinstance(a, Var | Const) and isinstance(b, Call) and b.fn == "where":
            cond, yes, no = b.args
            if isinstance(yes, Const) or isinstance(no, Const):
                return where(cond, mul(a, yes), mul(a, no))
    folds = isinstance(y, BinOp) and y.op == "*" and isinstance(y.left, Const)
    if isinstance(x, Const) and folds:  # c1 * (c2 * z) -> (c1 c2) * z
        return mul(Const(x.value * y.left.value), y.right)  # type: ignore[attr-defined]
    return BinOp("*", x, y)


def neg(x: Expr) -> Expr:
    """`-x` as `-1.0 * x`: valid for boolean `x` too."""
    return mul(Const(-1.0), x)


def sub(x: Expr, y: Expr) -> Expr:
    if isinstance(x, Const) and isinstance(y, Const):
        return Const(x.value - y.value)
    if is_zero(y) and not _boolean(x):
        return x
    if is_zero(x):
        return neg(y)
    if _boolean(x) and _boolean(y):
        return add(x, neg(y))
    if _boolean(y):
        return BinOp("+", x, neg(y))
    return BinOp("-", x, y)


def div(x: Expr, y: Expr) -> Expr:
    if is_zero(x):
        return ZERO
    if is_one(y) and not _boolean(x):
        return x
    if isinstance(x, Const) and isinstance(y, Const) and y.value != 0.0:
        return Const(x.value / y.value)
    return BinOp("/", x, y)


def where(c: Expr, x: Expr, y: Expr) -> Expr:
    if is_zero(x) and is_zero(y):
        return ZERO
    if x == y and not _boolean(x):
        return x
    return Call("where", (c, x, y))


def compare(op: str, x: Expr, y: Expr) -> Expr:
    return BinOp(op, x, y)


def _call(fn: str, *args: Expr) -> Expr:
    return Call(fn, tuple(args))


# -- rules -----------------------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715


def _gelu_prime(x: Expr) -> Expr:
    """d/dx of 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3):
    0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), t = tanh(u)."""
    cube = mul(Const(_GELU_CUBIC), mul(x, mul(x, x)))
    t = _call("tanh", mul(Const(_SQRT_2_OVER_PI), add(x, cube)))
    du = mul(Const(_SQRT_2_OVER_PI), add(ONE, mul(Const(3 * _GELU_CUBIC), mul(x, x))))
    return add(mul(Const(0.5), add(ONE, t)), mul(Const(0.5), mul(x, mul(sub(ONE, mul(t, t)), du))))


def _unary(fn: str, x: Expr, dx: Expr) -> Expr:
    """The derivative of `fn(x)` given `dx`, the derivative of its argument."""
    if fn == "neg":
        return neg(dx)
    if fn == "floor":  # piecewise constant: 0 everywhere (as torch.floor's gradient)
        return ZERO
    if fn == "relu":
        return where(compare(">", x, ZERO), dx, ZERO)
    if fn == "abs":
        return where(compare(">", x, ZERO), dx, where(compare("<", x, ZERO), neg(dx), ZERO))
    factor = _UNARY_FACTORS[fn](x)
    return mul(factor, dx)


_UNARY_FACTORS: dict[str, Callable[[Expr], Expr]] = {
    "exp": lambda x: _call("exp", x),
    "log": lambda x: div(ONE, x),
    "sqrt": lambda x: div(Const(0.5), _call("sqrt", x)),
    "rsqrt": lambda x: mul(Const(-0.5), div(_call("rsqrt", x), x)),
    "tanh": lambda x: sub(ONE, mul(_call("tanh", x), _call("tanh", x))),
    "sigmoid": lambda x: mul(_call("sigmoid", x), sub(ONE, _call("sigmoid", x))),
    "silu": lambda x: mul(_call("sigmoid", x), add(ONE, mul(x, sub(ONE, _call("sigmoid", x))))),
    "gelu": _gelu_prime,
}
"""d fn(x) / dx for the smooth unary functions, as a factor of `dx`."""


def _extremum(fn: str, x: Expr, y: Expr, dx: Expr, dy: Expr) -> Expr:
    """d max(x, y) (or min): to the winner; half each on a tie (as torch.maximum)."""
    wins = ">" if fn == "max" else "<"
    loses = "<" if fn == "max" else ">"
    half = mul(Const(0.5), add(dx, dy))
    return where(compare(wins, x, y), dx, where(compare(loses, x, y), dy, half))


def _power(e: BinOp, dl: Expr, dr: Expr) -> Expr:
    base, exponent = e.left, e.right
    result = ZERO
    if not is_zero(dl):
        if isinstance(exponent, Const):
            lower = exponent.value - 1.0
            power = {0.0: ONE, 1.0: base}.get(lower) or BinOp("**", base, Const(lower))
        else:
            power = BinOp("**", base, sub(exponent, ONE))
        result = mul(mul(exponent, power), dl)
    if not is_zero(dr):
        grow = mul(e, _call("log", base))
        result = add(result, mul(where(compare("==", base, ZERO), ZERO, grow), dr))
    return result


def diff(expr: Expr, operand: int) -> Expr:
    """The derivative of `expr` with respect to operand number `operand` (`Var(operand)`),
    simplified; `Const(0.0)` when `expr` does not depend on it."""
    if operand not in expr.variables():
        return ZERO
    if isinstance(expr, Var):
        return ONE
    if isinstance(expr, BinOp):
        dl, dr = diff(expr.left, operand), diff(expr.right, operand)
        return _binary(expr, dl, dr)
    if isinstance(expr, Call):
        parts = [diff(arg, operand) for arg in expr.args]
        if expr.fn == "where":
            cond, x, y = expr.args
            return where(cond, parts[1], parts[2])
        if expr.fn in ("max", "min"):
            return _extremum(expr.fn, *expr.args, *parts)
        if expr.fn == "neg" or expr.fn in _UNARY_FACTORS or expr.fn in ("relu", "abs", "floor"):
            return ZERO if is_zero(parts[0]) else _unary(expr.fn, expr.args[0], parts[0])
        raise UnsupportedError(f"no derivative rule for the join function {expr.fn!r}")
    return ZERO


def _binary(e: BinOp, dl: Expr, dr: Expr) -> Expr:
    if e.op in _COMPARISONS:
        return ZERO
    if e.op == "+":
        return add(dl, dr)
    if e.op == "-":
        return sub(dl, dr)
    if e.op == "*":
        return add(mul(dl, e.right), mul(e.left, dr))
    if e.op == "/":
        # d(l / r) = dl / r - l * dr / r^2 = (dl - (l / r) * dr) / r
        first = div(dl, e.right)
        if is_zero(dr):
            return first
        return sub(first, div(mul(e, dr), e.right))
    if e.op == "**":
        return _power(e, dl, dr)
    raise UnsupportedError(f"no derivative rule for the join operator {e.op!r}")


# -- rewriting -------------------------------------------------------------------------


def substitute(expr: Expr, values: Mapping[int, Expr]) -> Expr:
    """`expr` with each `Var(i)` replaced by `values[i]` (every variable must be mapped)."""
    if isinstance(expr, Var):
        return values[expr.index]
    if isinstance(expr, BinOp):
        return BinOp(expr.op, substitute(expr.left, values), substitute(expr.right, values))
    if isinstance(expr, Call):
        return Call(expr.fn, tuple(substitute(a, values) for a in expr.args))
    return expr


def product_vars(expr: Expr) -> list[int] | None:
    """The variables of `expr` when it is a product of variables only (any association,
    repeats kept), else None: `a * (b * c)` -> [0, 1, 2]."""
    if isinstance(expr, Var):
        return [expr.index]
    if isinstance(expr, BinOp) and expr.op == "*":
        left, right = product_vars(expr.left), product_vars(expr.right)
        if left is not None and right is not None:
            return left + right
    return None
