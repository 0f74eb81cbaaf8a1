"""Join expressions: the safe parser, printing, evaluation, and its errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from einpage.errors import JoinError
from taskgraph.expr import FUNCTIONS, BinOp, Call, Const, Var, default_join, evaluate, parse


@pytest.mark.parametrize(
    "source, tree",
    [
        ("a", Var(0)),
        ("2.5", Const(2.5)),
        ("-a", Call("neg", (Var(0),))),
        ("-3", Const(-3.0)),
        ("a + b * c", BinOp("+", Var(0), BinOp("*", Var(1), Var(2)))),
        ("(a + b) * c", BinOp("*", BinOp("+", Var(0), Var(1)), Var(2))),
        ("a ** 2", BinOp("**", Var(0), Const(2.0))),
        ("exp(a - b)", Call("exp", (BinOp("-", Var(0), Var(1)),))),
        ("where(a > 0, a, b)", Call("where", (BinOp(">", Var(0), Const(0.0)), Var(0), Var(1)))),
        ("max(a, 0)", Call("max", (Var(0), Const(0.0)))),
    ],
)
def test_parse_builds_the_tree(source, tree):
    assert parse(source, 3) == tree


@pytest.mark.parametrize(
    "source",
    [
        "a - (b - c)",
        "a / (b * c)",
        "(a - b) - c",
        "-(a + b)",
        "(-a) ** 2",
        "-a ** 2",
        "a ** b ** c",
        "(a ** b) ** c",
        "where((a > b) * 1, a, c)",
        "a * -1.5",
        "exp(-a)",
    ],
)
def test_printing_round_trips_and_keeps_meaning(source):
    tree = parse(source, 3)
    assert parse(str(tree), 3) == tree
    values = [np.array([0.7, 1.3]), np.array([1.1, 0.4]), np.array([2.0, 0.5])]
    a, b, c = values
    names = {"a": a, "b": b, "c": c, "exp": np.exp, "where": np.where}
    # Python's own reading of the source is the reference for precedence (test only).
    expected = eval(source, {"__builtins__": {}}, names)  # noqa: S307
    np.testing.assert_allclose(evaluate(tree, values), expected)


@pytest.mark.parametrize(
    "name, x, expected",
    [
        ("exp", 1.0, math.e),
        ("log", math.e, 1.0),
        ("sqrt", 4.0, 2.0),
        ("rsqrt", 4.0, 0.5),
        ("tanh", 0.5, math.tanh(0.5)),
        ("sigmoid", 0.0, 0.5),
        ("silu", 2.0, 2.0 / (1 + math.exp(-2.0))),
        ("gelu", 1.0, 0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * 1.044715))),
        ("relu", -2.0, 0.0),
        ("abs", -2.0, 2.0),
    ],
)
def test_unary_functions(name, x, expected):
    assert evaluate(parse(f"{name}(a)", 1), [np.array(x)]) == pytest.approx(expected)


def test_binary_and_ternary_functions():
    a, b = np.array([1.0, 5.0]), np.array([3.0, 2.0])
    np.testing.assert_array_equal(evaluate(parse("max(a, b)", 2), [a, b]), [3.0, 5.0])
    np.testing.assert_array_equal(evaluate(parse("min(a, b)", 2), [a, b]), [1.0, 2.0])
    np.testing.assert_array_equal(evaluate(parse("where(a < b, a, b)", 2), [a, b]), [1.0, 2.0])
    np.testing.assert_array_equal(evaluate(parse("a >= b", 2), [a, b]), [False, True])


def test_every_function_is_documented_and_parses():
    for name, fn in FUNCTIONS.items():
        args = ", ".join("abc"[: fn.arity])
        assert parse(f"{name}({args})", 3) == Call(name, tuple(Var(i) for i in range(fn.arity)))
        assert fn.doc


def test_count_ops_and_default_join():
    assert parse("exp(a - b) / c", 3).count_ops() == 3
    assert default_join(3) == BinOp("*", BinOp("*", Var(0), Var(1)), Var(2))
    assert default_join(1) == Var(0)


@pytest.mark.parametrize(
    "source, message, column",
    [
        ("a +", "syntax error", None),
        ("foo(a)", "unknown function 'foo'", 0),
        ("a + exp(b, c)", "exp() takes 1 argument(s), got 2", 4),
        ("a + d", "join uses operand 'd' but the einsum has 3 operand(s) (a..c)", 4),
        ("a + x1", "unknown name 'x1'", 4),
        ("exp", "function 'exp' must be called", 0),
        ("__import__('os').system('true')", "only direct calls of known functions", 0),
        ("__import__('os')", "unknown function '__import__'", 0),
        ("a.real", "Attribute is not allowed", 0),
        ("'text'", "only numbers are allowed", 0),
        ("[a, b]", "List is not allowed", 0),
        ("a if b else c", "IfExp is not allowed", 0),
        ("a < b < c", "only a single comparison", 0),
        ("lambda: 1", "Lambda is not allowed", 0),
        ("exp(a, x=1)", "takes no keyword arguments", 0),
        ("True", "only numbers", 0),
        ("a % b", "operator Mod is not allowed", 0),
        ("", "empty", None),
        ("1e999", "must be finite", 0),
    ],
)
def test_parse_errors_name_the_problem_and_column(source, message, column):
    with pytest.raises(JoinError) as info:
        parse(source, 3)
    assert message in str(info.value)
    if column is not None:
        assert info.value.column == column
        assert "^" in str(info.value)


def test_parse_rejects_non_strings():
    with pytest.raises(JoinError, match="must be a string"):
        parse(3, 1)  # type: ignore[arg-type]
