"""The NumPy backend in every mode: outputs equal the reference evaluator's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from plans import reference_plan
from runtime_cases import (
    PLAN_MAKERS,
    assert_outputs_match,
    block_program,
    einsum_programs,
    make_inputs,
    mlp_program,
    reference,
)

import memgraph
import runtime
from memgraph import NodeKind
from memgraph.eviction import POLICIES

MODES = ("sequential", "threaded", "random")


@pytest.mark.parametrize("maker", sorted(PLAN_MAKERS))
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_random_programs_match_reference_in_every_mode(maker, data, seed):
    tg = data.draw(einsum_programs(), label="program")
    mg = data.draw(PLAN_MAKERS[maker](tg), label="plan")
    inputs = make_inputs(tg, seed)
    expected = reference(tg, inputs)
    for mode in MODES:
        got = runtime.run(mg, inputs, "numpy", mode=mode, seed=seed, timeout=30)
        assert_outputs_match(got, expected, f"mode={mode} seed={seed}")


OFFLOADS = {
    "none": lambda tg: frozenset(),
    "all": lambda tg: frozenset(t.id for t in tg),
    "every_other": lambda tg: frozenset(t.id for t in tg if t.id % 2),
}


@pytest.mark.parametrize("offload", sorted(OFFLOADS))
@pytest.mark.parametrize("outputs_to_host", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_transformer_block_in_every_mode(offload, outputs_to_host, dtype):
    tg = block_program(dtype=dtype, layers=2)
    mg = reference_plan(tg, offload=OFFLOADS[offload](tg), outputs_to_host=outputs_to_host)
    assert mg.stats.reload_count > 0
    inputs = make_inputs(tg, seed=1)
    expected = reference(tg, inputs)
    for mode in MODES:
        for seed in range(2 if mode == "random" else 1):
            got = runtime.run(mg, inputs, "numpy", mode=mode, seed=seed, timeout=30)
            assert_outputs_match(got, expected, f"mode={mode} seed={seed}")


def test_random_mode_orders_differ_by_seed():
    mg = reference_plan(block_program(), offload=frozenset(range(0, 200, 3)))
    orders = {tuple(runtime.random_order(mg, seed)) for seed in range(5)}
    assert len(orders) == 5
    assert runtime.random_order(mg, 3) == runtime.random_order(mg, 3)


def test_arena_is_exactly_the_budget_and_tensors_are_views_of_it():
    tg = mlp_program()
    mg = reference_plan(tg, offload=frozenset({3}))
    with runtime.Session(mg, "numpy") as session:
        assert session.arena.dtype == np.uint8 and session.arena.nbytes == mg.budget
        assert session.arena.ctypes.data % 256 == 0
        session.run(make_inputs(tg, 0))
        apply = mg.of_kind(NodeKind.APPLY)[0]
        view = session.interpreter.device_view(apply.region, apply.tensor)
        assert np.shares_memory(view, session.arena)
        assert view.ctypes.data - session.arena.ctypes.data == apply.region.offset


def test_session_stages_weights_once_and_runs_many_activations():
    tg = block_program()
    mg = reference_plan(tg, offload=frozenset(t.id for t in tg if t.id % 3 == 0))
    weights = {n: a for n, a in make_inputs(tg, 0).items() if n != "ids"}
    for mode in MODES:
        with runtime.Session(mg, "numpy", mode=mode, timeout=30) as session:
            session.stage(weights)
            assert set(session.staged) == set(weights)
            for seed in range(3):
                ids = make_inputs(tg, seed)["ids"]
                got = session.run({"ids": ids}, seed=seed)
                assert_outputs_match(got, reference(tg, {**weights, "ids": ids}), mode)
            # A staged input given again replaces the staged value, for later runs too.
            changed = {**weights, "emb": weights["emb"] * 2}
            session.run({"ids": ids, "emb": changed["emb"]})
            assert_outputs_match(session.run({"ids": ids}), reference(tg, {**changed, "ids": ids}))


def test_staged_data_is_read_where_it_is():
    """Staging reads the caller's arrays in place (issue 23: weights are not duplicated):
    an array changed while staged changes what later runs read; stage it again, or a
    copy, to fix what the session reads. (Before, `stage` copied every array.)"""
    tg = mlp_program()
    mg = reference_plan(tg)
    inputs = make_inputs(tg, 0)
    expected = reference(tg, inputs)
    with runtime.Session(mg, "numpy") as session:
        w1 = inputs["w1"].copy()
        x = inputs["x"].copy()
        session.stage({"w1": w1, "x": x})
        assert_outputs_match(session.run({"w2": inputs["w2"]}), expected)
        w1 += 1
        changed = reference(tg, {**inputs, "w1": w1})
        assert_outputs_match(session.run({"w2": inputs["w2"]}), changed)
        session.stage({"w1": inputs["w1"].copy()})
        w1 += 1
        assert_outputs_match(session.run({"w2": inputs["w2"]}), expected)


def test_run_report_and_outputs_are_fresh_arrays():
    tg = mlp_program()
    mg = reference_plan(tg, outputs_to_host=True)
    inputs = make_inputs(tg, 0)
    with runtime.Session(mg, "numpy") as session:
        first = session.run(inputs)
        second = session.run(inputs)
        assert not np.shares_memory(first["y"], second["y"])
        report = session.last
        assert report.backend == "numpy" and report.mode == "sequential"
        assert report.nodes == len(mg) and report.seconds > 0 and report.trace is None
        assert report.memory["arena_bytes"] == mg.stats.high_water <= mg.budget
        assert report.memory["device_peak_bytes"] == mg.stats.high_water


def test_the_arena_is_what_the_plan_uses_not_the_whole_budget():
    """A plan at a budget far above its need allocates only its high-water mark: a
    generous budget on the NumPy backend costs no host memory."""
    tg = mlp_program()
    mg = memgraph.plan(tg, "64GiB")
    with runtime.Session(mg, "numpy") as session:
        session.run(make_inputs(tg, 0))
        assert session.arena.nbytes == mg.stats.high_water < 2**20


def test_auto_backend_without_a_gpu_is_numpy():
    if runtime.cupy_usable():
        pytest.skip("a GPU is usable here")
    tg = mlp_program()
    mg = reference_plan(tg)
    with runtime.Session(mg) as session:
        assert session.backend.name == "numpy" and session.mode == "sequential"


@pytest.mark.parametrize("eviction", sorted(POLICIES))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_transformer_block_planned_by_memgraph_in_every_mode(eviction, dtype):
    tg = block_program(dtype=dtype, layers=2)
    low, _ = memgraph.min_budget(tg)
    peak = memgraph.streaming_minimum(tg)
    inputs = make_inputs(tg, seed=2)
    expected = reference(tg, inputs)
    moved = 0
    for budget in sorted({low, (low + peak) // 2, peak}):
        mg = memgraph.plan(tg, budget, eviction=eviction)
        moved += mg.stats.offload_count
        for mode in MODES:
            for seed in range(2 if mode == "random" else 1):
                got = runtime.run(mg, inputs, "numpy", mode=mode, seed=seed, timeout=30)
                assert_outputs_match(got, expected, f"budget={budget} mode={mode} seed={seed}")
    assert moved > 0  # the small budgets force offloads
