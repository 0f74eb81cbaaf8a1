"""The CuPy kernels that once made arrays of their own now write their output in place.

On the CPU stand-in (`cpu_cuda.fake_cupy`, whose device memory is counted and whose
CuPy functions count every array they make): argmax/argmin and the k-th largest value
are generated kernels (NumPy's answers, NaN and ties included), concatenation copies
each part into its slice of the output, a gather's error flag lives in its declared
workspace, and none of them allocates. The CuPy backend's retired `scratch=` option and
plans without declared workspaces are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from cpu_cuda import CXX, fake_cupy
from runtime_cases import block_program, make_inputs

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.errors import BackendError
from runtime.cupy_backend import RETIRED_OPTIONS, CupyBackend, CupyKernels, evaluate_on_gpu
from runtime.workspace import GATHER_FLAG, declare_workspaces

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++)")


def run_alone(tg, inputs):
    """`evaluate_on_gpu` on a fresh stand-in; the outputs and the bytes its kernels took
    besides the tensors and workspaces it allocated itself."""
    cp = fake_cupy()
    kernels = CupyKernels(cp)
    got = evaluate_on_gpu(tg, inputs, kernels)
    made = [what for what, _ in cp.memory.allocations if what not in ("empty", "cuda.Memory")]
    return got, made, kernels


def last_axis_program(dtype: str, k: int):
    prog = ep.Program("last")
    x = prog.input("x", (6, 9), dtype)
    prog.output(ep.argmax(x), "argmax")
    prog.output(prog._add(taskgraph.ArgReduce("argmin"), (x,), (6,), "int64"), "argmin")
    prog.output(prog._add(taskgraph.KthLargest(k), (x,), (6,), dtype), "kth")
    return prog.build()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("k", [1, 3, 9])
def test_argmax_argmin_and_kth_largest_are_numpys_answers(dtype, k):
    rng = np.random.default_rng(k)
    x = rng.standard_normal((6, 9)).astype(dtype)
    x[1, [2, 5]] = x[1].max() + 1  # ties: the first one wins
    x[2, 4] = np.nan  # NumPy's argmax and argmin name the first NaN; it sorts last
    x[2, 7] = np.nan
    x[3] = 0.0
    x[3, 1] = -0.0
    x[4, 0], x[4, 8] = -np.inf, np.inf
    x[5] = np.round(x[5])  # repeated values
    tg = last_axis_program(dtype, k)
    got, made, _ = run_alone(tg, {"x": x})
    want = taskgraph.evaluate(tg, {"x": x})
    np.testing.assert_array_equal(got["argmax"], want["argmax"])
    np.testing.assert_array_equal(got["argmin"], want["argmin"])
    np.testing.assert_array_equal(got["kth"], want["kth"])  # NaN == NaN here
    assert made == []


def test_concatenation_copies_each_part_into_its_place():
    prog = ep.Program("cat")
    a, b = prog.input("a", (2, 3, 4)), prog.input("b", (2, 5, 4))
    prog.output(prog.concat([a, b, a], axis=1), "y")
    tg = prog.build()
    inputs = make_inputs(tg, 0)
    got, made, kernels = run_alone(tg, inputs)
    np.testing.assert_array_equal(got["y"], taskgraph.evaluate(tg, inputs)["y"])
    assert made == [] and kernels.counters["copy"] == 3


def test_a_gathers_flag_is_its_workspace():
    tg = declare_workspaces(block_program())
    gathers = [t for t in tg if t.kind == "gather"]
    assert gathers and all(t.workspace == GATHER_FLAG for t in gathers)
    inputs = make_inputs(tg, 0)
    got, made, _ = run_alone(tg, inputs)
    assert made == []
    inputs["ids"][1] = 99
    with pytest.raises(ep.InputError, match="id 99 is out of range"):
        run_alone(tg, inputs)


def test_the_scratch_option_is_retired_with_its_reason():
    tg = block_program()
    mg = memgraph.plan(tg, "1MiB")
    with pytest.raises(BackendError, match="no option 'scratch' any more: kernels no longer"):
        runtime.run(mg, make_inputs(tg, 0), "cupy", scratch="256MiB")
    assert "scratch" in RETIRED_OPTIONS and "scratch" not in CupyBackend.OPTIONS


def test_a_plan_without_declared_workspaces_is_refused_before_anything_runs():
    from cuda_streams import StandInCupyBackend

    prog = ep.Program("lookup")
    table, ids = prog.input("table", (10, 4), role="weight"), prog.input("ids", (3,), "int64")
    prog.output(ep.exp(prog.gather(table, ids)), "y")
    tg = prog.build()
    needs = declare_workspaces(tg)
    assert needs.workspace_bytes == GATHER_FLAG and tg.workspace_bytes == 0
    backend = StandInCupyBackend()
    with pytest.raises(BackendError, match="needs a kernel workspace of 16 B .* declare"):
        runtime.Session(memgraph.plan(tg, "64KiB"), backend)
    assert backend.cp.memory.allocations == []  # refused before the arena
    inputs = make_inputs(tg, 0)
    with runtime.Session(memgraph.plan(needs, "64KiB"), StandInCupyBackend()) as session:
        got = session.run(inputs)
    np.testing.assert_allclose(got["y"], taskgraph.evaluate(tg, inputs)["y"], rtol=1e-6)


def test_a_gemm_that_copies_an_operand_runs_in_its_workspace():
    """The attention output projection `bgrse,gred->bsd` (heads and e not one dimension
    of the attention output): the operand is copied into the declared workspace, planned
    at the smallest budget, and the run takes the arena alone."""
    from cuda_streams import StandInCupyBackend

    prog = ep.Program("wo")
    a = prog.input("a", (2, 4, 2, 64, 128), "float64")
    w = prog.input("w", (4, 2, 128, 128), "float64", role="weight")
    prog.output(prog.einsum("bgrse,gred->bsd", a, w), "y")
    tg = declare_workspaces(prog.build())
    assert tg[2].workspace == 1 << 20
    mg = memgraph.plan(tg, memgraph.min_budget(tg)[0])
    inputs = make_inputs(tg, 0)
    backend = StandInCupyBackend(delay=0)
    with runtime.Session(mg, backend) as session:
        got = session.run(inputs)
        assert session.last.counters["gemm_workspace_copies"] == 1
    np.testing.assert_allclose(got["y"], taskgraph.evaluate(tg, inputs)["y"], rtol=1e-12)
    assert [what for what, _ in backend.cp.memory.allocations] == ["cuda.Memory"]
