"""Join expressions: the scalar function a generalized einsum applies at every point.

A join is written as a string over the operands `a, b, c, ...` (in operand order),
for example `"exp(a - b)"` or `"a * rsqrt(b + 1e-6)"`. `parse` turns it into a small
immutable expression tree using Python's `ast` with an allow-list of node types and
function names; nothing is ever `eval`-ed, because programs and plans come from files.

Grammar: numbers, operand names, `+ - * / **`, unary `-`/`+`, comparisons
`< <= > >= == !=` (giving 1.0 or 0.0), and the functions in `FUNCTIONS`.

>>> e = parse("exp(a - b) / c", num_operands=3)
>>> str(e)
'exp(a - b) / c'
>>> e.count_ops()
3
"""

from __future__ import annotations

import ast
import math
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from einpage_core.errors import JoinError

__all__ = [
    "Expr",
    "Var",
    "Const",
    "Call",
    "BinOp",
    "FUNCTIONS",
    "BINARY_OPS",
    "VARIABLES",
    "parse",
    "default_join",
    "evaluate",
]

VARIABLES = string.ascii_lowercase
"""Operand names in order: operand 0 is `a`, operand 1 is `b`, ..."""


def _sigmoid(xp: Any, x: Any) -> Any:
    return 1.0 / (1.0 + xp.exp(-x))


def _gelu(xp: Any, x: Any) -> Any:
    # The tanh approximation used by GPT-2 (Hugging Face's "gelu_new").
    return 0.5 * x * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


@dataclass(frozen=True, slots=True)
class Function:
    """A function a join may call: its arity and its array implementation over `xp`."""

    name: str
    arity: int
    apply: Callable[..., Any]
    doc: str


FUNCTIONS: dict[str, Function] = {
    f.name: f
    for f in (
        Function("exp", 1, lambda xp, x: xp.exp(x), "e**x"),
        Function("log", 1, lambda xp, x: xp.log(x), "natural logarithm"),
        Function("sqrt", 1, lambda xp, x: xp.sqrt(x), "square root"),
        Function("rsqrt", 1, lambda xp, x: 1.0 / xp.sqrt(x), "1 / sqrt(x)"),
        Function("tanh", 1, lambda xp, x: xp.tanh(x), "hyperbolic tangent"),
        Function("sigmoid", 1, _sigmoid, "1 / (1 + exp(-x))"),
        Function("silu", 1, lambda xp, x: x * _sigmoid(xp, x), "x * sigmoid(x)"),
        Function("gelu", 1, _gelu, "GELU, tanh approximation (GPT-2's gelu_new)"),
        Function("relu", 1, lambda xp, x: xp.maximum(x, 0), "max(x, 0)"),
        Function("abs", 1, lambda xp, x: xp.abs(x), "absolute value"),
        Function("floor", 1, lambda xp, x: xp.floor(x), "largest integer <= x (int4 unpacking)"),
        Function("max", 2, lambda xp, x, y: xp.maximum(x, y), "elementwise maximum"),
        Function("min", 2, lambda xp, x, y: xp.minimum(x, y), "elementwise minimum"),
        Function("where", 3, lambda xp, c, x, y: xp.where(c != 0, x, y), "x if c != 0 else y"),
    )
}
"""The functions a join may call, by name."""

BINARY_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "+": lambda x, y: x + y,
    "-": lambda x, y: x - y,
    "*": lambda x, y: x * y,
    "/": lambda x, y: x / y,
    "**": lambda x, y: x**y,
    "<": lambda x, y: x < y,
    "<=": lambda x, y: x <= y,
    ">": lambda x, y: x > y,
    ">=": lambda x, y: x >= y,
    "==": lambda x, y: x == y,
    "!=": lambda x, y: x != y,
}
"""Binary operators by symbol; comparisons yield booleans (cast to the dtype when stored)."""

_PRECEDENCE = {
    "<": 1, "<=": 1, ">": 1, ">=": 1, "==": 1, "!=": 1,
    "+": 2, "-": 2, "*": 3, "/": 3, "neg": 4, "**": 5,
}  # fmt: skip
_AST_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}
_AST_CMPOPS = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
}


class Expr:
    """Base of the join expression tree (Var, Const, Call, BinOp); nodes are immutable."""

    __slots__ = ()

    def variables(self) -> frozenset[int]:
        """The operand positions this expression reads."""
        raise NotImplementedError

    def count_ops(self) -> int:
        """Arithmetic operations per evaluation (calls and binary operators; for FLOP counts)."""
        raise NotImplementedError

    def to_source(self, parent_precedence: int = 0) -> str:
        """Canonical source text; `parse(e.to_source()) == e`."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.to_source()


@dataclass(frozen=True, slots=True)
class Var(Expr):
    """Operand number `index` (`a` is 0)."""

    index: int

    def variables(self) -> frozenset[int]:
        return frozenset((self.index,))

    def count_ops(self) -> int:
        return 0

    def to_source(self, parent_precedence: int = 0) -> str:
        return VARIABLES[self.index]


@dataclass(frozen=True, slots=True)
class Const(Expr):
    """A numeric literal."""

    value: float

    def variables(self) -> frozenset[int]:
        return frozenset()

    def count_ops(self) -> int:
        return 0

    def to_source(self, parent_precedence: int = 0) -> str:
        text = repr(float(self.value))
        if self.value < 0 and parent_precedence > 0:
            return f"({text})"
        return text


@dataclass(frozen=True, slots=True)
class Call(Expr):
    """A call of one of `FUNCTIONS`; unary minus is `Call("neg", (x,))`."""

    fn: str
    args: tuple[Expr, ...]

    def variables(self) -> frozenset[int]:
        return frozenset().union(*(arg.variables() for arg in self.args))

    def count_ops(self) -> int:
        return 1 + sum(arg.count_ops() for arg in self.args)

    def to_source(self, parent_precedence: int = 0) -> str:
        if self.fn == "neg":
            text = "-" + self.args[0].to_source(_PRECEDENCE["neg"])
            return f"({text})" if parent_precedence >= _PRECEDENCE["neg"] else text
        return f"{self.fn}({', '.join(arg.to_source() for arg in self.args)})"


@dataclass(frozen=True, slots=True)
class BinOp(Expr):
    """`left op right` for op in `BINARY_OPS`."""

    op: str
    left: Expr
    right: Expr

    def variables(self) -> frozenset[int]:
        return self.left.variables() | self.right.variables()

    def count_ops(self) -> int:
        return 1 + self.left.count_ops() + self.right.count_ops()

    def to_source(self, parent_precedence: int = 0) -> str:
        mine = _PRECEDENCE[self.op]
        if self.op == "**":  # right-associative
            left, right = self.left.to_source(mine + 1), self.right.to_source(mine)
        else:  # left-associative: the right operand of an equal-precedence op needs parens
            left, right = self.left.to_source(mine), self.right.to_source(mine + 1)
        text = f"{left} {self.op} {right}"
        # A comparison inside a comparison is always parenthesised (Python would chain them).
        if parent_precedence > mine or (parent_precedence == mine == 1):
            return f"({text})"
        return text


def default_join(num_operands: int) -> Expr:
    """The plain einsum join: the product `a * b * ...` of all operands."""
    expr: Expr = Var(0)
    for i in range(1, num_operands):
        expr = BinOp("*", expr, Var(i))
    return expr


def parse(source: str, num_operands: int) -> Expr:
    """Parse a join string over `num_operands` operands into an expression tree.

    Raises `JoinError` naming the column of the first problem: a syntax error, an
    unknown function or name, an operand beyond the operand count, a wrong number
    of arguments, or a construct outside the grammar.
    """
    if not isinstance(source, str):
        raise JoinError(f"join must be a string, got {type(source).__name__}")
    if not source.strip():
        raise JoinError("join expression is empty")
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as err:
        column = max((err.offset or 1) - 1, 0)
        raise JoinError(f"syntax error in join: {err.msg}", source.strip(), column) from None
    return _Converter(source.strip(), num_operands).convert(tree.body)


class _Converter:
    """Turns an allow-listed Python AST into an `Expr`, rejecting everything else."""

    def __init__(self, source: str, num_operands: int):
        self.source = source
        self.num_operands = num_operands

    def fail(self, message: str, node: ast.AST) -> JoinError:
        return JoinError(message, self.source, getattr(node, "col_offset", 0))

    def convert(self, node: ast.AST) -> Expr:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise self.fail(f"only numbers are allowed as constants, got {node.value!r}", node)
            if not math.isfinite(float(node.value)):
                raise self.fail(f"constants must be finite, got {node.value!r}", node)
            return Const(float(node.value))
        if isinstance(node, ast.Name):
            return self.convert_name(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            operand = self.convert(node.operand)
            if isinstance(node.op, ast.UAdd):
                return operand
            if isinstance(operand, Const):
                return Const(-operand.value)
            return Call("neg", (operand,))
        if isinstance(node, ast.BinOp) and type(node.op) in _AST_BINOPS:
            return BinOp(
                _AST_BINOPS[type(node.op)], self.convert(node.left), self.convert(node.right)
            )
        if isinstance(node, ast.BinOp):
            name = type(node.op).__name__
            raise self.fail(f"operator {name} is not allowed; use + - * / **", node)
        if isinstance(node, ast.Compare):
            if len(node.ops) != 1 or type(node.ops[0]) not in _AST_CMPOPS:
                raise self.fail("only a single comparison (<, <=, >, >=, ==, !=) is allowed", node)
            op = _AST_CMPOPS[type(node.ops[0])]
            return BinOp(op, self.convert(node.left), self.convert(node.comparators[0]))
        if isinstance(node, ast.Call):
            return self.convert_call(node)
        raise self.fail(f"{type(node).__name__} is not allowed in a join expression", node)

    def convert_name(self, node: ast.Name) -> Expr:
        name = node.id
        if len(name) == 1 and name in VARIABLES:
            index = VARIABLES.index(name)
            if index >= self.num_operands:
                last = VARIABLES[self.num_operands - 1]
                raise self.fail(
                    f"join uses operand {name!r} but the einsum has {self.num_operands} "
                    f"operand(s) (a..{last})",
                    node,
                )
            return Var(index)
        if name in FUNCTIONS:
            raise self.fail(f"function {name!r} must be called, e.g. {name}(a)", node)
        raise self.fail(f"unknown name {name!r}; operands are a, b, c, ... in order", node)

    def convert_call(self, node: ast.Call) -> Expr:
        if not isinstance(node.func, ast.Name):
            raise self.fail("only direct calls of known functions are allowed", node)
        name = node.func.id
        if name not in FUNCTIONS:
            known = ", ".join(sorted(FUNCTIONS))
            raise self.fail(f"unknown function {name!r}; known functions: {known}", node)
        if node.keywords:
            raise self.fail(f"{name}() takes no keyword arguments", node)
        fn = FUNCTIONS[name]
        if len(node.args) != fn.arity:
            raise self.fail(f"{name}() takes {fn.arity} argument(s), got {len(node.args)}", node)
        return Call(name, tuple(self.convert(arg) for arg in node.args))


def evaluate(expr: Expr, operands: Sequence[Any], xp: Any = None) -> Any:
    """Evaluate `expr` elementwise over broadcastable arrays with the array module `xp`.

    `xp` defaults to NumPy; any module with NumPy's ufunc names (CuPy) works.
    """
    if xp is None:
        import numpy as xp
    if isinstance(expr, Var):
        return operands[expr.index]
    if isinstance(expr, Const):
        return expr.value
    if isinstance(expr, BinOp):
        left, right = evaluate(expr.left, operands, xp), evaluate(expr.right, operands, xp)
        return BINARY_OPS[expr.op](left, right)
    if isinstance(expr, Call):
        args = [evaluate(arg, operands, xp) for arg in expr.args]
        if expr.fn == "neg":
            return -args[0]
        return FUNCTIONS[expr.fn].apply(xp, *args)
    raise TypeError(f"not a join expression: {expr!r}")
