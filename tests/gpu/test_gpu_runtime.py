"""The CuPy backend on a CUDA GPU: the NumPy backend's properties, memory, overlap, errors.

Strict about memory: no slack. A run allocates its arena (at most the budget) and
nothing else: CuPy's allocator refuses every request while a run issues work, and the
device's free memory does not move during a run (after a warm-up run has made cuBLAS's
handle and compiled the kernels). Graphs are planned with their kernels' workspaces
declared (`runtime.declare_workspaces`), as `einpage.compile` plans them.

Skipped cleanly without CuPy or a usable GPU (`make test-gpu` installs CuPy and runs
these). The shared helpers live in tests/runtime/runtime_cases.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import runtime

if not runtime.cupy_usable():
    pytest.skip(
        "needs CuPy and a CUDA GPU (pip install 'einpage[gpu]' or '.[gpu-cuda13]')",
        allow_module_level=True,
    )

import cupy  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from plans import reference_plan  # noqa: E402
from runtime_cases import (  # noqa: E402
    PLAN_MAKERS,
    assert_outputs_match,
    block_program,
    einsum_programs,
    make_inputs,
    reference,
)

import einpage as ep  # noqa: E402
import memgraph  # noqa: E402
from einpage.errors import BackendError, InputError  # noqa: E402
from runtime.cupy_backend import CupyBackend, evaluate_on_gpu  # noqa: E402

pytestmark = pytest.mark.gpu

MODES = ("streams", "sequential", "random")
declare = runtime.declare_workspaces


@pytest.mark.parametrize("maker", sorted(PLAN_MAKERS))
@settings(max_examples=25, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_random_programs_match_reference_on_gpu(maker, data, seed):
    tg = declare(data.draw(einsum_programs(), label="program"))
    mg = data.draw(PLAN_MAKERS[maker](tg), label="plan")
    inputs = make_inputs(tg, seed)
    expected = reference(tg, inputs)
    for mode in MODES:
        got = runtime.run(mg, inputs, "cupy", mode=mode, seed=seed)
        assert_outputs_match(got, expected, f"mode={mode} seed={seed}")


@settings(max_examples=25, deadline=None)
@given(tg=einsum_programs(), seed=st.integers(0, 99))
def test_kernels_without_a_plan_match_reference(tg, seed):
    inputs = make_inputs(tg, seed)
    assert_outputs_match(evaluate_on_gpu(tg, inputs), reference(tg, inputs))


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("outputs_to_host", [False, True])
def test_transformer_block_on_gpu(dtype, outputs_to_host):
    tg = declare(block_program(dtype=dtype, layers=2))
    mg = reference_plan(
        tg, offload=frozenset(t.id for t in tg if t.id % 2), outputs_to_host=outputs_to_host
    )
    inputs = make_inputs(tg, 1)
    expected = reference(tg, inputs)
    for mode in MODES:
        with runtime.Session(mg, "cupy", mode=mode) as session:
            got = session.run(inputs, seed=3)
            assert_outputs_match(got, expected, mode)
            counters = session.last.counters
            assert counters["cublas"] > 0


def test_session_stages_weights_once_on_gpu():
    tg = declare(block_program())
    mg = reference_plan(tg, offload=frozenset({4, 9, 17}))
    weights = {n: a for n, a in make_inputs(tg, 0).items() if n != "ids"}
    with runtime.Session(mg, "cupy") as session:
        session.stage(weights)
        for seed in range(3):
            ids = make_inputs(tg, seed)["ids"]
            got = session.run({"ids": ids})
            assert_outputs_match(got, reference(tg, {**weights, "ids": ids}))


def big_offload_program(layers=6, tokens=1024, width=2048):
    """Matmuls whose weights start on the host, and a skip tensor made first and used last:
    offloading it, and reloading each weight, can overlap the layers' compute."""
    prog = ep.Program("chain")
    x = prog.input("x", (tokens, width))
    skip = ep.tanh(x)
    for layer in range(layers):
        w = prog.input(f"w{layer}", (width, width), role="weight")
        x = ep.tanh(x @ w)
    prog.output(x + skip, "y")
    return prog.build()


def skip_tensor(tg):
    return next(t.id for t in tg if t.kind == "einsum")


def test_a_run_allocates_nothing_beyond_its_arena():
    """After a warm-up run (cuBLAS's handle and workspace, the kernels' modules), a run
    takes no device memory: not from CuPy's pool, not from the device. The arena is the
    plan's high-water mark, at most the budget."""
    tg = declare(big_offload_program(layers=3, tokens=256, width=512))
    mg = reference_plan(tg, offload=frozenset(t.id for t in tg if t.kind == "einsum"))
    assert mg.stats.offload_count >= 3
    inputs = {n: a * 0.05 for n, a in make_inputs(tg, 0).items()}
    default_pool = cupy.get_default_memory_pool()
    with runtime.Session(mg, "cupy") as session:
        session.run(inputs)  # warm-up
        cupy.cuda.runtime.deviceSynchronize()
        pool_before, (free_before, _) = default_pool.used_bytes(), cupy.cuda.runtime.memGetInfo()
        got = session.run(inputs)
        cupy.cuda.runtime.deviceSynchronize()
        free_after, _ = cupy.cuda.runtime.memGetInfo()
        memory = session.last.memory
    assert_outputs_match(got, reference(tg, inputs))
    assert memory["arena_bytes"] == memory["device_peak_bytes"] <= mg.budget
    assert default_pool.used_bytes() == pool_before
    assert free_after == free_before


def test_a_transposed_product_runs_in_place():
    """`hqk,khe->qhe`: the output's layout needs a transpose of the product. cuBLAS
    writes it in place (batched over h): no workspace, no temporary, at the smallest
    budget."""
    prog = ep.Program()
    p = prog.input("p", (8, 64, 64))
    v = prog.input("v", (64, 8, 32))
    prog.output(prog.einsum("hqk,khe->qhe", p, v), "o")
    tg = declare(prog.build())
    assert tg.workspace_bytes == 0
    mg = memgraph.plan(tg, memgraph.min_budget(tg)[0])
    inputs = make_inputs(tg, 0)
    with runtime.Session(mg, "cupy") as session:
        got = session.run(inputs)
        assert session.last.counters["cublas"] == 1
    assert_outputs_match(got, reference(tg, inputs))


def test_transfers_overlap_compute_in_the_trace(tmp_path):
    tg = declare(big_offload_program())
    # Without region reuse no alloc waits for a free: every weight's reload may run ahead.
    mg = reference_plan(tg, offload=frozenset({skip_tensor(tg)}), reuse=False)
    assert mg.stats.reload_count >= 7 and mg.stats.offload_count == 1
    inputs = {n: a * 0.02 for n, a in make_inputs(tg, 0).items()}
    with runtime.Session(mg, "cupy", mode="streams") as session:
        session.run(inputs)  # warm-up: kernel compilation, cuBLAS handles
        got = session.run(inputs, trace=True)
        trace = session.last.trace
    assert_outputs_match(got, reference(tg, inputs))
    assert trace.clock == "cuda" and set(trace.streams) == {"compute", "h2d", "d2h"}
    overlap = trace.overlap("compute", "h2d") + trace.overlap("compute", "d2h")
    assert overlap > 0.1 * trace.busy("h2d"), trace
    trace.write(tmp_path / "gpu-trace.json")


def test_arena_that_does_not_fit_names_the_budget_and_free_memory():
    """(A session's arena is its plan's high-water mark, not its budget: the backend is
    asked for more than the device has directly.)"""
    _, total = cupy.cuda.runtime.memGetInfo()
    backend = CupyBackend()
    with pytest.raises(BackendError, match=r"cannot allocate the arena of .*GiB.* is free"):
        backend.allocate_arena(2 * total)


def test_the_scratch_option_is_gone_and_says_why():
    mg = reference_plan(declare(block_program()))
    with pytest.raises(BackendError, match="no option 'scratch' any more"):
        runtime.run(mg, make_inputs(mg.taskgraph, 0), "cupy", scratch=1024)


def test_bad_gather_ids_are_reported_after_the_run():
    tg = declare(block_program())
    mg = reference_plan(tg)
    inputs = make_inputs(tg, 0)
    inputs["ids"][0] = 1000
    with pytest.raises(InputError, match="id 1000 is out of range"):
        runtime.run(mg, inputs, "cupy")


def test_auto_picks_cupy_on_a_gpu():
    mg = reference_plan(declare(block_program()))
    with runtime.Session(mg, "auto") as session:
        assert session.backend.name == "cupy" and session.mode == "streams"
        assert isinstance(session.host, np.ndarray)
