"""Hypothesis strategies shared by the test suite: random einsum programs and join trees."""

from __future__ import annotations

import math
import string
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

TOLERANCE = {"float16": 2e-2, "float32": 1e-4, "float64": 1e-10}


@dataclass(frozen=True)
class EinsumCase:
    """A random plain einsum: spec, operand shapes, dtype."""

    spec: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str


@st.composite
def einsum_cases(
    draw,
    max_operands: int = 6,
    max_indices: int = 7,
    max_size: int = 4,
    dtypes=("float32", "float64"),
):
    """Plain einsums of 1..max_operands operands over random index sets and sizes.

    Each operand uses a random subset of the indices in a random order; the output is
    a random subset (sometimes implicit); every index used by the output is bound.
    """
    n_idx = draw(st.integers(1, max_indices))
    letters = draw(st.permutations(string.ascii_letters[:20]))[:n_idx]
    sizes = {c: draw(st.integers(1, max_size)) for c in letters}
    n_ops = draw(st.integers(1, max_operands))
    terms = []
    for _ in range(n_ops):
        chosen = draw(
            st.lists(st.sampled_from(letters), min_size=0, max_size=min(4, n_idx), unique=True)
        )
        terms.append("".join(chosen))
    used = sorted(set("".join(terms)))
    if not used:
        terms[0] = letters[0]
        used = [letters[0]]
    # Keep the iteration space small so the reference stays cheap.
    while math.prod(sizes[c] for c in used) > 4096:
        c = max(used, key=lambda k: sizes[k])
        sizes[c] = max(1, sizes[c] // 2)
    implicit = draw(st.booleans()) and draw(st.booleans())
    if implicit:
        spec = ",".join(terms)
    else:
        out = draw(st.lists(st.sampled_from(used), max_size=len(used), unique=True))
        spec = ",".join(terms) + "->" + "".join(out)
    shapes = tuple(tuple(sizes[c] for c in term) for term in terms)
    return EinsumCase(spec, shapes, draw(st.sampled_from(dtypes)))


# -- join expression trees, with an evaluation independent of taskgraph.expr ------

UNARY = {
    "exp": lambda x: math.exp(min(x, 30.0)),
    "tanh": math.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)),
    "silu": lambda x: x / (1.0 + math.exp(-x)),
    "relu": lambda x: max(x, 0.0),
    "abs": abs,
    "gelu": lambda x: 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
}
SAFE_POSITIVE = {"sqrt": math.sqrt, "log": math.log, "rsqrt": lambda x: 1 / math.sqrt(x)}


@st.composite
def join_trees(draw, num_operands: int, depth: int = 3):
    """A random join as (source text, scalar function of the operand values).

    Functions with restricted domains are applied to `1 + x*x`-style positive
    arguments so every point is finite; exp's argument is kept small.
    """
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        if draw(st.booleans()):
            i = draw(st.integers(0, num_operands - 1))
            return "abcdef"[i], (lambda vals, i=i: vals[i])
        c = draw(st.sampled_from([0.5, 1.0, 2.0, -1.5, 3.0]))
        return repr(c), (lambda vals, c=c: c)
    kind = draw(st.sampled_from(["binary", "unary", "positive", "minmax", "neg"]))
    if kind == "binary":
        op = draw(st.sampled_from(["+", "-", "*", "/"]))
        ls, lf = draw(join_trees(num_operands, depth - 1))
        rs, rf = draw(join_trees(num_operands, depth - 1))
        if op == "/":  # keep the divisor away from zero
            return f"({ls}) / (2.0 + ({rs}) * ({rs}))", (
                lambda v, lf=lf, rf=rf: lf(v) / (2.0 + rf(v) * rf(v))
            )
        fn = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}[op]
        return f"({ls}) {op} ({rs})", (lambda v, lf=lf, rf=rf, fn=fn: fn(lf(v), rf(v)))
    if kind == "neg":
        s, f = draw(join_trees(num_operands, depth - 1))
        return f"-({s})", (lambda v, f=f: -f(v))
    if kind == "minmax":
        name = draw(st.sampled_from(["max", "min"]))
        ls, lf = draw(join_trees(num_operands, depth - 1))
        rs, rf = draw(join_trees(num_operands, depth - 1))
        pick = max if name == "max" else min
        return f"{name}({ls}, {rs})", (lambda v, lf=lf, rf=rf, pick=pick: pick(lf(v), rf(v)))
    if kind == "positive":
        name = draw(st.sampled_from(sorted(SAFE_POSITIVE)))
        s, f = draw(join_trees(num_operands, depth - 1))
        g = SAFE_POSITIVE[name]
        return f"{name}(1.0 + ({s}) * ({s}))", (lambda v, f=f, g=g: g(1.0 + f(v) * f(v)))
    name = draw(st.sampled_from(sorted(UNARY)))
    s, f = draw(join_trees(num_operands, depth - 1))
    if name == "exp":  # bounded argument so sums stay finite and comparable
        return f"exp(tanh({s}))", (lambda v, f=f: math.exp(math.tanh(f(v))))
    g = UNARY[name]
    return f"{name}({s})", (lambda v, f=f, g=g: g(f(v)))


def random_arrays(shapes, dtype: str, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


# -- random einsum programs (DAGs), for planner properties ---------------------------

SAFE_JOINS = {
    1: [None, "exp(tanh(a))", "relu(a)", "a * 0.5 + 1.0"],
    2: [None, "a + b", "max(a, b)", "a - b", "tanh(a) * b"],
    3: [None, "a * b + c", "max(a, b) - c"],
}
"""Join expressions that stay finite on standard-normal data, by operand count."""


@st.composite
def einsum_programs(
    draw,
    min_tasks: int = 2,
    max_tasks: int = 30,
    max_dim: int = 8,
    dtypes=("float32",),
):
    """A random program: a DAG of 2-30 generalized einsums over a few inputs, as a TaskGraph.

    Tensors carry index strings over a shared pool of letters (so operands share
    indices and contractions happen); operands are picked among the last few tensors
    (chains) or among all (fan-out and long-lived tensors); some steps are views (two
    leading axes merged, or a tensor flattened) that later einsums read. Inputs are
    weights or activations, on the host or the device; the last tensor and up to two
    random others (possibly inputs or views) are outputs.
    """
    import einpage as ep  # local: strategies.py is imported by tests that do not need it

    dtype = draw(st.sampled_from(dtypes))
    letters = iter(string.ascii_letters)
    sizes: dict[str, int] = {}

    def fresh(size: int) -> str:
        letter = next(letters)
        sizes[letter] = size
        return letter

    pool = [fresh(draw(st.integers(1, max_dim))) for _ in range(5)]
    prog = ep.Program("random")
    tensors: list[tuple[object, str]] = []  # (Tensor, index string)
    for i in range(draw(st.integers(1, 4))):
        idx = "".join(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True)))
        role = draw(st.sampled_from(["weight", "activation"]))
        location = draw(st.sampled_from([None, "host", "device"]))
        shape = tuple(sizes[c] for c in idx)
        tensors.append((prog.input(f"in{i}", shape, dtype, role=role, location=location), idx))
    for _ in range(draw(st.integers(min_tasks, max_tasks))):
        if draw(st.integers(0, 5)) == 0 and len(sizes) < 40:
            base, idx = draw(st.sampled_from(tensors))
            keep = 2 if len(idx) >= 2 and draw(st.booleans()) else len(idx)
            merged = fresh(math.prod(sizes[c] for c in idx[:keep]))
            new_idx = merged + idx[keep:]
            view = prog.view(base, tuple(sizes[c] for c in new_idx))
            tensors.append((view, new_idx))
            continue
        n_ops = draw(st.integers(1, 3))
        operands = []
        for _ in range(n_ops):
            recent = draw(st.booleans())
            choices = tensors[-3:] if recent else tensors
            operands.append(draw(st.sampled_from(choices)))
        used = list(dict.fromkeys("".join(idx for _, idx in operands)))
        out = ""
        if used:
            chosen = st.lists(st.sampled_from(used), max_size=min(3, len(used)), unique=True)
            out = "".join(draw(chosen))
        join = draw(st.sampled_from(SAFE_JOINS[n_ops]))
        agg = draw(st.sampled_from(["sum", "max"]))
        spec = ",".join(idx for _, idx in operands) + "->" + out
        result = prog.einsum(spec, *(t for t, _ in operands), join=join, agg=agg)
        tensors.append((result, out))
    prog.output(tensors[-1][0], "out")
    extra = draw(st.lists(st.integers(0, len(tensors) - 2), max_size=2, unique=True))
    for k, position in enumerate(extra):
        prog.output(tensors[position][0], f"extra{k}")
    return prog.build()


def program_inputs(tg, seed: int) -> dict:
    """Standard-normal arrays for every input of `tg` (name -> array)."""
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(tg[task_id].shape).astype(tg[task_id].dtype)
        for name, task_id in tg.inputs.items()
    }
