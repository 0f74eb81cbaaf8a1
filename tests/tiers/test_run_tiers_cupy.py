"""Plans with a host tier on the CuPy backend, over the CPU stand-in of CUDA streams
(`tests/runtime/cuda_streams.py`: the real `CupyBackend`, its copies landing late on
worker threads, kernels in their stream's order).

No GPU is drawn for this project, so this is how the CuPy path of a host tier runs
here: the host arena is pinned memory allocated once, each read, write and release is a
host function in its disk stream's order (`launch_host_func`, in which a CUDA call
fails, as CUDA forbids it), and the copies between slots and the device wait on events.
The results must equal the reference evaluator's and the NumPy backend's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from cpu_cuda import CXX  # noqa: E402
from cuda_streams import CUDARuntimeError, StandInCupyBackend, StandInStream  # noqa: E402
from plans import reference_plan  # noqa: E402
from run_tier_plans import tier_plan  # noqa: E402
from test_run_tiers import arrays, case, checkpoint_of, mlp, reference  # noqa: E402, F401

import runtime  # noqa: E402
from einpage_core.errors import DiskError  # noqa: E402
from memgraph.nodes import NodeKind  # noqa: E402
from runtime.tiers import host_arena_bytes  # noqa: E402

MOVES = (NodeKind.READ, NodeKind.WRITE)

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++)")


@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("mode", ["sequential", "streams"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tier_plan_runs_to_the_reference_on_cupy(case, mode, seed, poison, monkeypatch):  # noqa: F811
    """Each read and write is a host function on its stream; poisoned, each release too
    (it fills its slot with NaNs: a copy from the slot still in flight, landing late as
    the stand-in's copies do, would read them)."""
    mg, spill, weights, xs = case
    launched = []
    launch = StandInStream.launch_host_func

    def counted(stream, callback, arg):
        launched.append(stream)
        launch(stream, callback, arg)

    monkeypatch.setattr(StandInStream, "launch_host_func", counted)
    backend = StandInCupyBackend(delay=1e-3, seed=seed)
    got = runtime.run(mg, xs, backend=backend, mode=mode, spill=spill, poison=poison)
    kinds = (*MOVES, NodeKind.RELEASE) if poison else MOVES
    assert len(launched) == sum(n.kind in kinds for n in mg.nodes)  # each a host function
    expected = reference(mg, weights, xs)
    np.testing.assert_allclose(got["y"], expected["y"], rtol=1e-6, atol=1e-7)
    assert host_arena_bytes(mg) in backend.cp.pinned  # the arena: pinned, once
    assert os.listdir(spill) == []


def test_a_failing_read_in_a_host_function_is_raised_by_the_session(case, monkeypatch):  # noqa: F811
    """A host function cannot raise into CUDA: the port keeps the failure and the session
    raises it when the run is drained."""
    mg, spill, _, xs = case

    def broken(fd, buffers, offset):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "preadv", broken)
    with pytest.raises(DiskError, match="Input/output error"):
        runtime.run(mg, xs, backend=StandInCupyBackend(delay=1e-3), mode="streams", spill=spill)
    assert os.listdir(spill) == []


def test_a_release_that_does_not_wait_for_its_reload_is_caught_on_cupy(tmp_path):
    """The poison mutant on the stand-in: a release that waits only for its read poisons
    the slot while the reload's copy, queued on another stream, has not landed."""
    weights, xs = arrays()
    path, offsets = checkpoint_of(tmp_path / "m.safetensors", weights)
    base = reference_plan(mlp(), offload=frozenset({4}))
    bad = tier_plan(base, path, offsets, release_after_read=True)
    expected = reference(bad, weights, xs)["y"]
    wrong = 0
    for seed in range(6):
        got = runtime.run(
            bad, xs, backend=StandInCupyBackend(delay=2e-3, seed=seed), mode="streams",
            spill=tmp_path, poison=True, unsafe_skip_verify=True,
        )  # fmt: skip
        wrong += not np.array_equal(got["y"], expected)
    assert wrong > 0


def test_the_stand_in_runs_host_functions_in_order_and_forbids_cuda_calls_in_them():
    """What the tests above lean on: a host function runs after the work queued before it
    and before the work after it, and a CUDA call inside it fails (cudaErrorNotPermitted)."""
    cp = StandInCupyBackend(delay=1e-3).cp
    stream = cp.cuda.Stream(non_blocking=True)
    order = []
    stream.submit(lambda: order.append("before"))
    stream.launch_host_func(order.append, "host function")
    stream.submit(lambda: order.append("after"))
    stream.synchronize()
    assert order == ["before", "host function", "after"]
    stream.launch_host_func(lambda _: stream.submit(lambda: None), None)
    with pytest.raises(CUDARuntimeError, match="cudaErrorNotPermitted"):
        stream.synchronize()
