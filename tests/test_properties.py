"""Hypothesis properties of the frontend, the TaskGraph and the reference evaluator."""

from __future__ import annotations

import itertools
import math
import string

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from strategies import TOLERANCE, einsum_cases, join_trees, random_arrays

import einpage as ep
import taskgraph
from taskgraph import TaskGraph
from taskgraph.expr import parse


def build_einsum(case, optimize="greedy", memory_limit=None):
    prog = ep.Program("case")
    tensors = [prog.input(f"x{i}", shape, case.dtype) for i, shape in enumerate(case.shapes)]
    prog.output(
        prog.einsum(case.spec, *tensors, optimize=optimize, memory_limit=memory_limit), "out"
    )
    return prog.build()


@given(
    case=einsum_cases(),
    seed=st.integers(0, 2**16),
    optimize=st.sampled_from(["greedy", "optimal", "dp", "auto"]),
    memory_limit=st.sampled_from([None, None, 1, 16, 64]),
)
def test_plain_einsum_matches_numpy(case, seed, optimize, memory_limit):
    if optimize == "dp":  # opt_einsum's dp optimizer may find no path under a memory limit
        memory_limit = None
    tg = build_einsum(case, optimize, memory_limit)
    for task in tg:
        if task.kind == "einsum":
            assert len(task.inputs) <= 2, f"not split into pairwise steps: {task.line()}"
    arrays = random_arrays(case.shapes, case.dtype, seed)
    got = taskgraph.evaluate(tg, {f"x{i}": a for i, a in enumerate(arrays)})["out"]
    expected = np.einsum(case.spec, *[a.astype(np.float64) for a in arrays])
    assert got.shape == expected.shape
    assert got.dtype == np.dtype(case.dtype)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(
        got, expected, rtol=TOLERANCE[case.dtype], atol=TOLERANCE[case.dtype] * scale
    )


@st.composite
def generalized_cases(draw, repeats: bool = False):
    """A generalized einsum: terms, output, sizes, join (source and scalar function), agg.
    With `repeats`, a term may repeat an index (the einsum reads a diagonal)."""
    n_idx = draw(st.integers(1, 5))
    letters = "".join(draw(st.permutations("ijklmn"))[:n_idx])
    sizes = {c: draw(st.integers(1, 3)) for c in letters}
    n_ops = draw(st.integers(1, 3))
    terms = [
        "".join(
            draw(
                st.lists(st.sampled_from(letters), max_size=4 if repeats else 3, unique=not repeats)
            )
        )
        for _ in range(n_ops)
    ]
    used = sorted(set("".join(terms))) or [letters[0]]
    if not "".join(terms):
        terms[0] = letters[0]
    out = "".join(draw(st.lists(st.sampled_from(used), max_size=len(used), unique=True)))
    source, scalar = draw(join_trees(n_ops))
    agg = draw(st.sampled_from(["sum", "max", "min", "prod"]))
    return terms, out, sizes, source, scalar, agg


def loop_reference(terms, out, sizes, scalar, agg, arrays):
    """The generalized einsum by explicit loops over every point (independent of taskgraph)."""
    used = sorted(set("".join(terms)) | set(out))
    reduced = [c for c in used if c not in out]
    combine = {"sum": sum, "max": max, "min": min, "prod": math.prod}[agg]
    result = np.zeros(tuple(sizes[c] for c in out))
    for point in itertools.product(*(range(sizes[c]) for c in out)):
        env = dict(zip(out, point, strict=True))
        values = []
        for rpoint in itertools.product(*(range(sizes[c]) for c in reduced)):
            env.update(zip(reduced, rpoint, strict=True))
            operand_values = [
                float(a[tuple(env[c] for c in term)]) for term, a in zip(terms, arrays, strict=True)
            ]
            values.append(scalar(operand_values))
        result[point] = combine(values) if reduced else values[0]
    return result


@given(case=generalized_cases(), seed=st.integers(0, 2**16))
def test_generalized_join_agg_matches_loops(case, seed):
    terms, out, sizes, source, scalar, agg = case
    shapes = [tuple(sizes[c] for c in term) for term in terms]
    arrays = random_arrays(shapes, "float64", seed)
    prog = ep.Program()
    tensors = [prog.input(f"x{i}", s, "float64") for i, s in enumerate(shapes)]
    spec = ",".join(terms) + "->" + out
    prog.output(prog.einsum(spec, *tensors, join=source, agg=agg), "out")
    got = taskgraph.evaluate(prog.build(), {f"x{i}": a for i, a in enumerate(arrays)})["out"]
    expected = loop_reference(terms, out, sizes, scalar, agg, arrays)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9 * scale)


@given(case=generalized_cases(repeats=True), seed=st.integers(0, 2**16))
def test_generalized_einsums_with_diagonals_match_loops(case, seed):
    """Terms that repeat an index read the diagonal, whatever the join and agg: the loops
    index each operand by its term, repeated letters included."""
    terms, out, sizes, source, scalar, agg = case
    shapes = [tuple(sizes[c] for c in term) for term in terms]
    arrays = random_arrays(shapes, "float64", seed)
    prog = ep.Program()
    tensors = [prog.input(f"x{i}", s, "float64") for i, s in enumerate(shapes)]
    spec = ",".join(terms) + "->" + out
    prog.output(prog.einsum(spec, *tensors, join=source, agg=agg), "out")
    tg = prog.build()
    assert TaskGraph.from_json(tg.to_json()).tasks == tg.tasks
    got = taskgraph.evaluate(tg, {f"x{i}": a for i, a in enumerate(arrays)})["out"]
    expected = loop_reference(terms, out, sizes, scalar, agg, arrays)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9 * scale)


@given(tree=join_trees(3))
def test_join_source_round_trips(tree):
    source, _ = tree
    parsed = parse(source, 3)
    assert parse(str(parsed), 3) == parsed


@given(
    case=einsum_cases(max_operands=4),
    gen=generalized_cases(),
    scope=st.text(string.ascii_lowercase + ".", max_size=8),
)
def test_json_round_trip_is_identity(case, gen, scope):
    prog = ep.Program("json")
    tensors = [
        prog.input(f"x{i}", s, case.dtype, role=r)
        for i, (s, r) in enumerate(zip(case.shapes, itertools.cycle(["weight", "activation"])))
    ]
    with prog.scope(scope or "s"):
        y = prog.einsum(case.spec, *tensors)
    terms, out, sizes, source, _, agg = gen
    others = [
        prog.input(f"g{i}", tuple(sizes[c] for c in t), case.dtype) for i, t in enumerate(terms)
    ]
    z = prog.einsum(",".join(terms) + "->" + out, *others, join=source, agg=agg)
    mask = prog.fill((3, 3), -math.inf, case.dtype, pattern="causal")
    prog.output(y, "y")
    prog.output(z, "z")
    prog.output(mask, "mask")
    tg = prog.build()
    text = tg.to_json()
    again = TaskGraph.from_json(text)
    assert again.tasks == tg.tasks
    assert dict(again.outputs) == dict(tg.outputs)
    assert again.to_json() == text
