"""`numpy.einsum`'s full semantics through every stage: indices repeated inside an operand
(diagonals, traces), implicit outputs, ellipses and size-1 broadcasting.

Random specs (`einsum_cases.numpy_einsum_cases`) go through `Program.einsum` and must
equal `numpy.einsum` in the reference evaluator, in plans (verified, at random budgets
between the minimum and the streaming minimum) run by the NumPy runtime in random order,
and after partitioning. Tasks that read a diagonal run in every one of those stages:
generalized einsums keep their diagonal inside their one task, plain contractions take
it as a task of its own first.
"""

from __future__ import annotations

import numpy as np
import pytest
from einsum_cases import numpy_einsum_cases
from hypothesis import event, given
from hypothesis import strategies as st
from replay import check_outputs, check_plan

import einpage as ep
import memgraph
import runtime
import taskgraph
from taskgraph import TaskGraph
from taskgraph.partition import partition, smallest_feasible_block_limit, working_set
from taskgraph.partition.rules import geometry_of


def build(case, join: str | None = None, agg: str = "sum", dtype: str = "float64") -> TaskGraph:
    """The program of one einsum of `case` (inputs alternate weights and activations)."""
    prog = ep.Program("numpy-case")
    tensors = [
        prog.input(f"x{i}", shape, dtype, role="weight" if i % 2 else "activation")
        for i, shape in enumerate(case.shapes)
    ]
    prog.output(prog.einsum(case.spec, *tensors, join=join, agg=agg), "out")
    return prog.build()


def arrays_for(case, seed: int, dtype: str = "float64") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"x{i}": rng.standard_normal(s).astype(dtype) for i, s in enumerate(case.shapes)}


def reads_diagonal(task: taskgraph.Task) -> bool:
    return task.kind == "einsum" and task.op.spec.has_diagonal


@given(case=numpy_einsum_cases(), seed=st.integers(0, 2**16))
def test_programs_equal_numpy_einsum(case, seed):
    tg = build(case)
    arrays = arrays_for(case, seed)
    want = np.einsum(case.spec, *arrays.values())
    got = taskgraph.evaluate(tg, arrays)["out"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    for task in tg:
        if task.kind == "einsum":  # pairwise steps; a diagonal is its own task
            assert len(task.inputs) <= 2, task.line()
            assert not reads_diagonal(task) or len(task.inputs) == 1, task.line()
    event("reads a diagonal" if any(reads_diagonal(t) for t in tg) else "no diagonal")


@given(case=numpy_einsum_cases(max_operands=3), seed=st.integers(0, 2**16))
def test_generalized_einsums_read_diagonals_in_their_task(case, seed):
    """A join keeps the einsum one task, diagonals included: `max` of the product over
    the reduced indices equals NumPy's on the explicit (broadcast) operands."""
    tg = build(case, agg="max")
    (task,) = [t for t in tg if t.kind == "einsum"]
    arrays = arrays_for(case, seed)
    normalized = taskgraph.einsum.normalize(case.spec, case.shapes)
    operands = [
        np.squeeze(a, axis=drop) if drop else a
        for a, drop in zip(arrays.values(), normalized.squeeze, strict=True)
    ]
    spec = normalized.spec
    points = np.einsum(
        ",".join(spec.inputs) + "->" + spec.indices, *operands
    )  # the product at every point of the iteration space, diagonals read by NumPy
    reduced = tuple(range(len(spec.output), len(spec.indices)))
    want = points.max(axis=reduced) if reduced else points
    got = taskgraph.evaluate(tg, arrays)["out"]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert task.flops == spec.iteration_size([o.shape for o in operands]) * max(
        1, len(operands) - 1 + (1 if reduced else 0)
    )


@given(case=numpy_einsum_cases(max_operands=3), generalized=st.booleans(), data=st.data())
def test_planned_and_run_in_random_order_equal_numpy(case, generalized, data):
    """Plain einsums (diagonals as tasks of their own) and generalized ones (diagonals
    read inside the task) planned at random budgets, verified, and run."""
    tg = build(case, agg="max" if generalized else "sum")
    low, _ = memgraph.min_budget(tg)
    high = max(low, memgraph.streaming_minimum(tg))
    mg = memgraph.plan(tg, data.draw(st.integers(low, high), label="budget"))
    check_plan(mg)
    arrays = arrays_for(case, seed=len(tg))
    check_outputs(mg, arrays)
    want = taskgraph.evaluate(tg, arrays)["out"]
    for mode in ("sequential", "random"):
        got = runtime.run(mg, arrays, backend="numpy", mode=mode, seed=len(tg))["out"]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=mode)


# -- partitioning -----------------------------------------------------------------------


@st.composite
def diagonal_programs(draw):
    """A chain over square-ish tensors that reads diagonals: a generalized einsum with an
    index repeated in an operand, then a plain one (its diagonal taken as a task), each
    big enough to split."""
    n = draw(st.integers(2, 6))
    m = draw(st.integers(1, 5))
    prog = ep.Program("diagonals")
    a = prog.input("a", (n, n, m), "float64", role=draw(st.sampled_from(["weight", "activation"])))
    b = prog.input("b", (m, n), "float64")
    first = draw(st.sampled_from(["iij,ji->ij", "iij,jk->ik", "iij,ji->i", "iij,ki->kj"]))
    join = draw(st.sampled_from(["a * b", "exp(tanh(a)) + b", "max(a, b)"]))
    agg = draw(st.sampled_from(["sum", "max", "min"]))
    h = prog.einsum(first, a, b, join=join, agg=agg)
    square = prog.einsum("ij,kj->ik", h, h) if h.ndim == 2 else prog.einsum("i,k->ik", h, h)
    second = draw(st.sampled_from(["ii->i", "ii", "iij,jk->ik", "ii,ik->k"]))
    if second == "iij,jk->ik":
        out = prog.einsum(second, prog.view(square, (*square.shape, 1)), b[:1, :])
    elif second == "ii,ik->k":
        out = prog.einsum(second, square, square)
    else:
        out = prog.einsum(second, square)
    prog.output(out, "out")
    prog.output(h, "h")
    tg = prog.build()
    rng = np.random.default_rng(draw(st.integers(0, 99)))
    arrays = {name: rng.standard_normal(tg[i].shape) for name, i in tg.inputs.items()}
    return tg, arrays


def assert_same(tg: TaskGraph, parted: TaskGraph, arrays: dict) -> None:
    want = taskgraph.evaluate(tg, arrays)
    got = taskgraph.evaluate(parted, arrays)
    for name in want:
        scale = max(1.0, float(np.abs(want[name]).max()))
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-9 * scale)


@given(program=diagonal_programs(), position=st.floats(0.0, 1.0))
def test_partitioning_splits_diagonal_reads_correctly(program, position):
    tg, arrays = program
    needed = smallest_feasible_block_limit(tg)
    largest = max(working_set(tg, t.id) for t in tg.tasks if t.kind != "input")
    limit = int(needed * (max(needed, largest) / needed) ** position)
    parted = partition(tg, limit)
    if parted is tg:  # nothing to split: every task fits whole
        assert largest <= limit
        event("nothing to split")
        return
    assert_same(tg, parted, arrays)
    for task in parted.tasks:
        if task.kind != "input" and task.block.kind != "output":
            assert working_set(parted, task.id) <= limit, task.line()
    split = {
        t.block.of
        for t in parted.tasks
        if reads_diagonal(t)
        and t.block.kind in ("block", "partial")
        and t.shape != tg[t.block.of].shape
    }
    event("a diagonal read is split" if split else "diagonal reads whole")
    mg = memgraph.plan(parted, memgraph.min_budget(parted)[0])
    check_plan(mg)
    got = runtime.run(mg, arrays, backend="numpy", mode="random", seed=3)
    np.testing.assert_allclose(got["out"], taskgraph.evaluate(tg, arrays)["out"], rtol=1e-9)


def test_a_diagonal_read_splits_by_its_index_and_reads_square_boxes():
    prog = ep.Program("trace-rows")
    a = prog.input("a", (64, 64, 8), "float64")
    prog.output(prog.einsum("iij->ij", a, join="a * 2.0"), "d")
    tg = prog.build()
    geometry = geometry_of(tg[1], tg.tasks)
    assert geometry.operand_dims == ((0, 0, 1),)  # both axes of a are the dim of i
    parted = partition(tg, "8KiB")  # a is 256 KiB; a block of 8 rows reads 8*8*8 elements
    blocks = [t for t in parted.tasks if t.kind == "einsum"]
    assert len(blocks) > 1
    for task in blocks:
        (source,) = (parted[i] for i in task.inputs)
        rows = task.shape[0]
        assert source.shape[:2] == (rows, rows), (task.line(), source.line())
    arrays = {"a": np.random.default_rng(0).standard_normal((64, 64, 8))}
    assert_same(tg, parted, arrays)
    np.testing.assert_array_equal(
        taskgraph.evaluate(parted, arrays)["d"], 2.0 * np.einsum("iij->ij", arrays["a"])
    )


@pytest.mark.parametrize(
    "spec, shapes, flops",
    [
        ("ii->i", [(5, 5)], 5),
        ("ii->", [(5, 5)], 5),  # n points, one addition each
        ("iij->ij", [(3, 3, 4)], 12),
        ("ij,ij->ij", [(3, 4), (3, 4)], 12),
    ],
)
def test_flops_count_a_diagonal_once(spec, shapes, flops):
    prog = ep.Program()
    tensors = [prog.input(f"x{i}", s) for i, s in enumerate(shapes)]
    prog.output(prog.einsum(spec, *tensors), "y")
    (task,) = [t for t in prog.build() if t.kind == "einsum"]
    assert task.flops == flops
