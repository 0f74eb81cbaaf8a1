"""Fine-grained paging end to end: `einpage.compile` partitions what cannot fit, and the
plans of partitioned graphs verify and run (NumPy runtime, random order too) to the
answers of the unpartitioned graph."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from partition_cases import random_programs
from strategies import einsum_programs, program_inputs

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.errors import InfeasibleBudgetError, PlanError
from einpage.pipeline import PartitionInfeasibleError
from memgraph import MemGraph, NodeKind
from memgraph.planner import min_budget, plan, streaming_minimum
from taskgraph import TaskGraph
from taskgraph.assembly import output_assemblies
from taskgraph.nodes import Einsum
from taskgraph.partition import BlockLimitError, finest_block, partition, working_set

KiB = 1024
TOLERANCE = {"float16": 5e-2, "float32": 1e-3, "float64": 1e-9}
"""Relative to each output's largest finite value: partitioning reorders sums (and
rounds float16 partials before combining them)."""
SENSITIVITY = {"float16": 100.0, "float32": 100.0, "float64": 1e-6}
"""Times an output's *sensitivity* (how far float32 evaluations of it, of the graph and
of its partition, are from float64 ones): a sum that cancels moves with the order of
its terms by more than any fixed tolerance of its result (a product of such sums
more), and this much more is allowed there. For float64 it is the ratio of the dtypes'
epsilons (2e-9) with a margin."""
RUN_TOLERANCE = {"float16": 1e-3, "float32": 1e-5, "float64": 1e-12}
"""A run against the reference evaluation of the very graph it plans: same kernels, only
the memory layout of the operands differs (which can reorder sums too)."""


def reorders_arithmetic(tg: TaskGraph) -> bool:
    """Whether partitioning may change results at all: some einsum sums or multiplies
    over a reduced index (the max and min of partial results are exact)."""
    return any(
        isinstance(t.op, Einsum) and t.op.spec.reduced and t.op.agg in ("sum", "prod") for t in tg
    )


def _largest_finite(value: np.ndarray) -> float:
    finite = np.abs(value[np.isfinite(value)]) if value.dtype.kind == "f" else np.abs(value)
    return float(finite.max(initial=0.0))


def sensitivity(graphs: list[TaskGraph], inputs: dict) -> dict[str, float]:
    """Per output, the largest distance between the float32 and float64 evaluations of
    any of `graphs` (which compute the same outputs)."""
    found: dict[str, float] = {}
    for tg in graphs:
        narrow = taskgraph.evaluate(tg, inputs, dtype="float32")
        wide = taskgraph.evaluate(tg, inputs, dtype="float64")
        for name in wide:
            distance = _largest_finite(narrow[name] - wide[name])
            found[name] = max(found.get(name, 0.0), distance)
    return found


def assert_close(got: dict, want: dict, atol, what: str = "") -> None:
    """Same names, shapes and dtypes; values within `atol(name, value)` (NaN equals NaN)."""
    assert got.keys() == want.keys(), what
    for name, value in want.items():
        have = got[name]
        assert have.shape == value.shape and have.dtype == value.dtype, f"{what} {name}"
        np.testing.assert_allclose(
            have, value, rtol=0, atol=atol(name, value), err_msg=f"{what} output {name!r}"
        )


def run_and_compare(mg: MemGraph, tg: TaskGraph, inputs: dict, seeds=(1, 2)) -> None:
    """`mg`, a plan of `tg` or of a partition of it, verifies, fits its budget, and runs
    (sequentially, and in random order with each seed) to the outputs of `tg`:

    * exactly where `tg` only takes maxima and minima (and for integer outputs);
    * else within `TOLERANCE` of the output dtype, relative to the output's largest
      value, plus `SENSITIVITY` times its sensitivity (see there).

    Runs are also compared with `taskgraph.evaluate` of the graph planned, within
    `RUN_TOLERANCE` (plus the sensitivity term), and a partitioned graph with `tg` in
    float64.
    """
    parted = mg.taskgraph
    report = memgraph.verify(mg)
    assert report.peak_bytes <= mg.budget and mg.stats.high_water <= mg.budget
    with np.errstate(all="ignore"):  # random joins may overflow, identically in all
        want = taskgraph.evaluate(tg, inputs)
        planned = want if parted is tg else taskgraph.evaluate(parted, inputs)
        exact = not reorders_arithmetic(tg)
        sens = {} if exact else sensitivity([tg, parted], inputs)

        def reordered(name: str, value: np.ndarray, dtype: str | None = None) -> float:
            dtype = dtype or str(value.dtype)
            if exact or value.dtype.kind != "f":
                return 0.0
            scale = max(1.0, _largest_finite(value))
            return TOLERANCE[dtype] * scale + SENSITIVITY[dtype] * sens[name]

        def rerun(name: str, value: np.ndarray) -> float:
            if exact or value.dtype.kind != "f":
                return 0.0
            dtype = str(value.dtype)
            scale = max(1.0, _largest_finite(value))
            return RUN_TOLERANCE[dtype] * scale + SENSITIVITY[dtype] * sens[name]

        if parted is not tg:
            wide = taskgraph.evaluate(tg, inputs, dtype="float64")
            same = taskgraph.evaluate(parted, inputs, dtype="float64")
            assert_close(same, wide, lambda n, v: reordered(n, v, "float64"), "float64")
        for mode, seed in [("sequential", 0)] + [("random", seed) for seed in seeds]:
            got = runtime.run(mg, inputs, backend="numpy", mode=mode, seed=seed)
            assert_close(got, planned, rerun, f"{mode} {seed} (planned graph)")
            assert_close(got, want, reordered, f"{mode} {seed}")


def softmax_program() -> TaskGraph:
    """y = softmax(x @ w): x [64, 256], w [256, 256] (a weight), y 64 KiB; the matmul
    needs 384 KiB at once."""
    prog = ep.Program("smx")
    x = prog.input("x", (64, 256))
    w = prog.input("w", (256, 256), role="weight")
    prog.output(ep.softmax(x @ w), "y")
    return prog.build()


def softmax_read_program() -> TaskGraph:
    """`softmax_program`, with the row maxima of y as a second output: y's blocks are read
    by the maxima too, so split, y cannot be assembled on the host."""
    prog = ep.Program("smx-read")
    x = prog.input("x", (64, 256))
    w = prog.input("w", (256, 256), role="weight")
    y = ep.softmax(x @ w)
    prog.output(y, "y")
    prog.output(y.max(axis=-1), "m")
    return prog.build()


def wide_weight_program() -> TaskGraph:
    """A 4 MiB weight read by one matmul, reduced to a small output."""
    prog = ep.Program("wide")
    x = prog.input("x", (16, 512))
    w = prog.input("w", (512, 2048), role="weight")
    prog.output(ep.relu(x @ w).sum(axis=-1), "s")
    return prog.build()


def compiled(tg: TaskGraph, budget, **options) -> MemGraph:
    """The plan `einpage.compile` makes (partitioning `tg` when needed), verified."""
    return ep.compile(tg, budget, **options).plan


# -- compile(..., partition=) --------------------------------------------------------------


def test_auto_partitions_a_graph_with_a_task_over_the_budget():
    tg = softmax_program()
    assert min_budget(tg)[0] == 384 * KiB
    mg = compiled(tg, "200KiB")
    info = mg.info
    assert info["partition"] == "auto" and info["block_limit"] == 50 * KiB
    assert info["original_tasks"] == len(tg) < len(mg.taskgraph)
    assert info["original_min_budget"] == 384 * KiB >= 200 * KiB >= info["min_budget"]
    assert info["finest_block_limit"] == finest_block(tg, 256)[0]
    assert mg.stats.block_limit == 50 * KiB and "block limit" in str(mg.stats)
    assert dict(mg.taskgraph.inputs).keys() == dict(tg.inputs).keys()
    assert mg.taskgraph.outputs.keys() == tg.outputs.keys()
    inputs = program_inputs(tg, 0)
    run_and_compare(mg, tg, inputs)
    loaded = MemGraph.from_json(mg.to_json())  # the partitioned graph travels with the plan
    assert loaded.info["block_limit"] == 50 * KiB
    run_and_compare(loaded, tg, inputs, seeds=(3,))


def test_auto_plans_a_graph_that_fits_as_it_is():
    tg = softmax_program()
    mg = compiled(tg, "1MiB")
    assert mg.taskgraph is tg and mg.info["block_limit"] is None and mg.stats.block_limit is None


def test_an_explicit_block_limit_partitions_even_a_graph_that_fits():
    tg = softmax_program()
    mg = compiled(tg, "1MiB", partition="32KiB")
    assert mg.info["partition"] == "limit" and mg.info["block_limit"] == 32 * KiB
    parted = mg.taskgraph
    for task in parted:
        if task.kind != "input" and task.block.kind != "output":
            assert working_set(parted, task.id, 256) <= 32 * KiB, task.line()
    run_and_compare(mg, tg, program_inputs(tg, 1), seeds=(4,))


def test_an_explicit_block_limit_below_the_finest_block_is_refused():
    tg = softmax_program()
    floor, task = finest_block(tg, 256)
    with pytest.raises(BlockLimitError) as caught:
        compiled(tg, "1MiB", partition=floor - 1)
    assert (caught.value.needed, caught.value.task) == (floor, task)


def test_a_percentage_budget_below_the_minimum_partitions():
    tg = softmax_program()
    peak = streaming_minimum(tg)
    mg = compiled(tg, "40%streaming")
    assert mg.budget == int(peak * 0.4) < min_budget(tg)[0]
    assert mg.info["block_limit"] == mg.budget // 4 // 256 * 256
    run_and_compare(mg, tg, program_inputs(tg, 6), seeds=())


def test_partition_off_refuses_with_the_minimum():
    tg = softmax_program()
    for off in ("off", False, None):
        with pytest.raises(InfeasibleBudgetError) as caught:
            compiled(tg, "200KiB", partition=off)
        assert not isinstance(caught.value, PartitionInfeasibleError)
        assert caught.value.needed == 384 * KiB


@pytest.mark.parametrize("value", ["sometimes", "-1KiB", 0, -5, 1.5, "lots"])
def test_bad_partition_values_are_refused_with_the_valid_ones(value):
    with pytest.raises(PlanError, match="'auto', 'off'"):
        compiled(softmax_program(), "1MiB", partition=value)


def test_a_budget_below_every_block_names_the_smallest_budget_and_block_limit():
    tg = softmax_read_program()
    floor, floor_task = finest_block(tg, 256)
    with pytest.raises(PartitionInfeasibleError) as caught:
        compiled(tg, 512)
    error = caught.value
    assert (error.block_limit, error.block_task) == (floor, floor_task)
    # The softmax output (64 KiB), split and read by the maxima, is rebuilt on the device
    # by a Concat holding 2 x 64 KiB.
    assert error.needed == 128 * KiB and error.budget == 512
    message = str(error)
    assert "smallest block limit that works, " in message and tg[floor_task].line() in message
    assert "'y'" in message and "No budget below 128.0 KiB (131072 B) can work" in message
    run_and_compare(compiled(tg, error.needed), tg, program_inputs(tg, 2), seeds=())


def test_rebuilding_a_split_output_that_cannot_fit_is_a_clear_error():
    tg = softmax_read_program()
    with pytest.raises(PartitionInfeasibleError) as caught:
        compiled(tg, "100KiB")
    error = caught.value
    assert error.needed == 128 * KiB and error.task == tg.outputs["y"]
    message = str(error)
    assert "rebuilds program output 'y' (64.0 KiB)" in message and "logits='last'" in message
    assert "cannot be assembled on the host" in message
    mg = compiled(tg, error.needed)
    assert mg.info["min_budget"] == 128 * KiB == mg.budget
    y = mg.taskgraph.outputs["y"]  # the fallback: y's Concat runs on the device
    assert "y" not in mg.info["outputs_on_host"]
    assert any(n.kind is NodeKind.APPLY and n.tensor == y for n in mg.nodes)
    assert not any(n.kind is NodeKind.OFFLOAD and n.into == y for n in mg.nodes)
    run_and_compare(mg, tg, program_inputs(tg, 3), seeds=(5,))


def test_a_split_output_nothing_else_reads_is_assembled_on_the_host():
    tg = softmax_program()  # y (64 KiB) never fits twice in 100 KiB
    mg = compiled(tg, "100KiB")
    parted = mg.taskgraph
    y = parted.outputs["y"]
    assert parted[y].block.kind == "output" and mg.info["outputs_on_host"] == ["y"]
    fills = [n for n in mg.nodes if n.kind is NodeKind.OFFLOAD and n.into == y]
    assert len(fills) == mg.stats.sliced_offload_count > 1
    assert not any(n.kind is NodeKind.APPLY and parted[n.tensor].kind == "concat" for n in mg)
    (out,) = mg.of_kind(NodeKind.OUTPUT)
    assert out.region is None and set(out.deps) == {n.id for n in fills}
    assert mg.info["min_budget"] < 2 * tg[tg.outputs["y"]].nbytes
    run_and_compare(mg, tg, program_inputs(tg, 3), seeds=(5,))
    # Below every block: the floor is now the finest block alone, and it plans.
    floor, _ = finest_block(tg, 256)
    with pytest.raises(PartitionInfeasibleError) as caught:
        compiled(tg, floor - 256)
    assert caught.value.needed == floor
    assert "No budget below 1.0 KiB (1024 B) can work" in str(caught.value)
    run_and_compare(compiled(tg, floor), tg, program_inputs(tg, 4), seeds=(6,))


def test_a_weight_larger_than_the_budget_is_streamed_in_slices():
    tg = wide_weight_program()
    w = tg.inputs["w"]
    mg = compiled(tg, "1MiB")
    parted = mg.taskgraph
    reloads = mg.of_kind(NodeKind.RELOAD)
    assert reloads and all(parted[n.tensor].kind == "slice" for n in reloads)
    assert mg.info["sliced_reloads"] == len(reloads)
    assert mg.stats.reload_bytes >= tg[w].nbytes > mg.budget
    run_and_compare(mg, tg, program_inputs(tg, 4))


# -- properties: random programs x random block limits ---------------------------------------


def _limit_between(low: int, high: int, position: float) -> int:
    """A limit from `low` to `high` on a log scale, denser at the small end."""
    high = max(low, high)
    return int(low * (high / low) ** (position**2))


@given(
    case=random_programs(),
    position=st.floats(0.0, 1.0),
    alignment=st.sampled_from([8, 16, 64]),
    data=st.data(),
)
def test_plans_of_partitioned_random_programs_run_to_the_unpartitioned_answer(
    case, position, alignment, data
):
    """Partition at a random block limit, plan within a random feasible budget (both
    orders, both policies, inputs and outputs on either side), verify, and run."""
    tg, arrays = case.tg, case.arrays
    floor, _ = finest_block(tg, alignment)
    largest = max(working_set(tg, t.id, alignment) for t in tg if t.kind != "input")
    limit = _limit_between(max(floor, 1), largest, position)
    parted = partition(tg, limit, alignment=alignment)
    inputs = data.draw(st.sampled_from(["auto", "host"]), label="inputs")
    low, _ = min_budget(parted, alignment, inputs)
    high = streaming_minimum(parted, alignment=alignment, inputs=inputs)
    budget = data.draw(st.integers(low, max(low, high)), label="budget")
    options = {
        "order": data.draw(st.sampled_from(["program", "memory"]), label="order"),
        "eviction": data.draw(st.sampled_from(["belady", "lru"]), label="eviction"),
        "outputs": data.draw(st.sampled_from(["device", "host"]), label="outputs"),
        "inputs": inputs,
    }
    mg = plan(parted, budget, alignment=alignment, **options)
    event(f"tasks x{min(len(parted) // len(tg), 20)}")
    event(f"sliced reloads: {'some' if mg.info['sliced_reloads'] else 'none'}")
    event(f"outputs assembled on the host: {'some' if mg.stats.sliced_offload_count else 'none'}")
    # The boxes host assembly computes from the Concats agree with the blocks' provenance.
    for root, pieces in output_assemblies(parted).items():
        for piece in pieces:
            block = parted[piece.task].block
            assert block.of == parted[root].block.of and block.kind == "block"
            assert tuple(zip(block.starts, block.shape, strict=True)) == piece.box
    run_and_compare(mg, tg, arrays)


@given(tg=einsum_programs(dtypes=("float32", "float64")), data=st.data())
def test_auto_partition_below_the_minimum_budget_plans_or_says_what_would_work(tg, data):
    """Budgets below `min_budget`: `compile` partitions on its own; where even that
    cannot fit, the error's smallest budget is above the budget asked for."""
    alignment = data.draw(st.sampled_from([16, 64]), label="alignment")
    needed, _ = min_budget(tg, alignment)
    floor, _ = finest_block(tg, alignment)
    # Budgets near the finest block split an einsum over 8^6 points into as many blocks:
    # correct, but slow to build and run, so the budgets start higher.
    low = max(4 * floor, needed // 8, alignment)
    if needed <= low:
        event("nothing to partition")
        return
    budget = data.draw(st.integers(low, needed - 1), label="budget")
    try:
        mg = compiled(tg, budget, alignment=alignment, verify=False)
    except PartitionInfeasibleError as error:
        assert error.needed > budget // alignment * alignment
        assert error.block_limit == floor
        event("infeasible")
        return
    assert mg.info["block_limit"] is not None and mg.budget == budget
    event("partitioned")
    event(f"outputs assembled on the host: {'some' if mg.stats.sliced_offload_count else 'none'}")
    run_and_compare(mg, tg, program_inputs(tg, seed=len(tg)), seeds=(7,))


def test_only_sums_and_products_over_reduced_indices_reorder_arithmetic():
    prog = ep.Program("maxes")
    x = prog.input("x", (8, 8))
    prog.output(prog.einsum("ij->i", ep.exp(x), agg="max") + 1.0, "m")
    assert not reorders_arithmetic(prog.build())
    assert reorders_arithmetic(softmax_program())
