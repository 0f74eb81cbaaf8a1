"""The op library, each op checked against a direct NumPy formula."""

from __future__ import annotations

import math

import numpy as np
import pytest

import einpage as ep
import taskgraph
from einpage.errors import ProgramError, ShapeError

RNG = np.random.default_rng(42)
A = RNG.standard_normal((2, 3, 4))
B = RNG.standard_normal((3, 4))
M = RNG.standard_normal((4, 5))
V = RNG.standard_normal(4)
W = RNG.standard_normal(4)
P = np.abs(RNG.standard_normal((2, 3, 4))) + 0.5


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def np_softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


CASES = {
    "add": (lambda a, b: a + b, lambda a, b: a + b, [A, B]),
    "add_scalar": (lambda a: a + 2, lambda a: a + 2, [A]),
    "radd_scalar": (lambda a: 2 + a, lambda a: 2 + a, [A]),
    "sub": (lambda a, b: a - b, lambda a, b: a - b, [A, B]),
    "rsub": (lambda a: 1.5 - a, lambda a: 1.5 - a, [A]),
    "mul": (lambda a, b: a * b, lambda a, b: a * b, [A, V]),
    "div": (lambda a, b: a / b, lambda a, b: a / b, [A, P]),
    "rdiv": (lambda a: 1 / a, lambda a: 1 / a, [P]),
    "neg": (lambda a: -a, lambda a: -a, [A]),
    "scale": (lambda a: ep.scale(a, 0.25), lambda a: a * 0.25, [A]),
    "matmul": (lambda a, m: a @ m, lambda a, m: a @ m, [A, M]),
    "matmul_vec": (lambda a, v: a @ v, lambda a, v: a @ v, [A, V]),
    "vec_matmul": (lambda v, m: v @ m, lambda v, m: v @ m, [V, M]),
    "dot": (lambda v, w: v @ w, lambda v, w: v @ w, [V, W]),
    "transpose": (lambda a: a.T, lambda a: a.T, [A]),
    "permute": (lambda a: ep.permute(a, 0, 2, 1), lambda a: a.transpose(0, 2, 1), [A]),
    "sum_all": (lambda a: a.sum(), lambda a: a.sum(), [A]),
    "sum_axis": (lambda a: a.sum(axis=1), lambda a: a.sum(axis=1), [A]),
    "sum_keep": (
        lambda a: a.sum(axis=(0, 2), keepdims=True),
        lambda a: a.sum(axis=(0, 2), keepdims=True),
        [A],
    ),
    "max": (lambda a: a.max(axis=-1), lambda a: a.max(axis=-1), [A]),
    "min": (lambda a: ep.reduce_min(a, 0), lambda a: a.min(axis=0), [A]),
    "mean": (lambda a: a.mean(axis=-1), lambda a: a.mean(axis=-1), [A]),
    "softmax": (lambda a: ep.softmax(a, axis=-1), lambda a: np_softmax(a, -1), [A]),
    "softmax_mid": (lambda a: ep.softmax(a, axis=1), lambda a: np_softmax(a, 1), [A]),
    "rmsnorm": (
        lambda a, w: ep.rmsnorm(a, w, eps=1e-6),
        lambda a, w: a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6) * w,
        [A, W],
    ),
    "rmsnorm_plain": (
        lambda a: ep.rmsnorm(a),
        lambda a: a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6),
        [A],
    ),
    "layernorm": (
        lambda a, w, b: ep.layernorm(a, w, b, eps=1e-5),
        lambda a, w, b: (
            (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5) * w + b
        ),
        [A, W, V],
    ),
    "layernorm_plain": (
        lambda a: ep.layernorm(a),
        lambda a: (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5),
        [A],
    ),
    "exp": (ep.exp, np.exp, [A]),
    "log": (ep.log, np.log, [P]),
    "sqrt": (ep.sqrt, np.sqrt, [P]),
    "rsqrt": (ep.rsqrt, lambda a: 1 / np.sqrt(a), [P]),
    "tanh": (ep.tanh, np.tanh, [A]),
    "sigmoid": (ep.sigmoid, lambda a: 1 / (1 + np.exp(-a)), [A]),
    "silu": (ep.silu, lambda a: a / (1 + np.exp(-a)), [A]),
    "gelu": (ep.gelu, gelu_tanh, [A]),
    "relu": (ep.relu, lambda a: np.maximum(a, 0), [A]),
    "abs": (ep.abs, np.abs, [A]),
    "reshape": (lambda a: a.reshape(6, 4), lambda a: a.reshape(6, 4), [A]),
    "reshape_infer": (lambda a: ep.reshape(a, (-1, 2)), lambda a: a.reshape(-1, 2), [A]),
    "concat": (
        lambda a, b: ep.concat([a, b], axis=0),
        lambda a, b: np.concatenate([a, b]),
        [B, B * 2],
    ),
    "slice": (lambda a: ep.slice(a, -1, 1, 3), lambda a: a[..., 1:3], [A]),
    "getitem": (lambda a: a[1, :, 2:], lambda a: a[1, :, 2:], [A]),
    "getitem_int": (lambda a: a[0], lambda a: a[0], [A]),
    "cast": (lambda a: ep.cast(a, "float32"), lambda a: a.astype(np.float32), [A]),
    "causal_mask": (
        lambda a: ep.causal_mask(a),
        lambda a: np.where(np.triu(np.ones((3, 4), bool), 1), -np.inf, a),
        [A],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_numpy(name):
    build, reference, arrays = CASES[name]
    prog = ep.Program(name)
    tensors = [prog.input(f"x{i}", a.shape, "float64") for i, a in enumerate(arrays)]
    result = build(*tensors)
    prog.output(result, "out")
    got = taskgraph.evaluate(prog.build(), {f"x{i}": a for i, a in enumerate(arrays)})["out"]
    expected = reference(*arrays)
    assert result.shape == np.shape(expected)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-12)


def test_gather_is_an_embedding_lookup():
    prog = ep.Program()
    table = prog.input("table", (10, 4), role="weight")
    ids = prog.input("ids", (2, 3), dtype="int32")
    prog.output(ep.gather(table, ids), "emb")
    t = RNG.standard_normal((10, 4)).astype("float32")
    i = np.array([[0, 9, 3], [3, 3, 1]], dtype="int32")
    np.testing.assert_array_equal(
        taskgraph.evaluate(prog.build(), {"table": t, "ids": i})["emb"], t[i]
    )


def test_op_errors():
    prog = ep.Program()
    a = prog.input("a", (2, 3))
    with pytest.raises(ShapeError, match="axis 3 is out of range for a tensor of rank 2"):
        a.sum(axis=3)
    with pytest.raises(ShapeError, match="repeated axis"):
        a.sum(axis=(0, 0))
    with pytest.raises(ShapeError, match="not a permutation"):
        ep.transpose(a, (0, 0))
    with pytest.raises(ShapeError, match=r"\[2, 2\) is not a non-empty range"):
        ep.slice(a, 1, 2, 2)
    with pytest.raises(ShapeError, match="only non-empty step-1 slices"):
        a[:, ::2]
    with pytest.raises(ShapeError, match="index 5 is out of range"):
        a[5]
    with pytest.raises(ShapeError, match="too many indices"):
        a[0, 0, 0]
    with pytest.raises(ProgramError, match="expected a Tensor or a number"):
        ep.add(a, "x")
    with pytest.raises(ProgramError, match="must be finite"):
        ep.add(a, math.inf)
    with pytest.raises(ShapeError, match="index 'k' has size 3"):
        a @ prog.input("b", (2, 2))
    with pytest.raises(ShapeError, match="rank >= 2"):
        ep.causal_mask(prog.input("v", (3,)))


def test_matmul_does_not_broadcast_the_contracted_dimension():
    """NumPy's `@` refuses k of size 1 against a larger k, though einsum broadcasts it."""
    prog = ep.Program()
    a = prog.input("a", (2, 1))
    with pytest.raises(ShapeError, match=r"'k' has size 1 in operand 0 \(2, 1\) but 3"):
        a @ prog.input("b", (3, 4))
    with pytest.raises(ShapeError, match="has size 1 in operand 0"):
        a @ prog.input("v", (3,))
    with pytest.raises(ValueError):
        np.ones((2, 1)) @ np.ones((3, 4))
