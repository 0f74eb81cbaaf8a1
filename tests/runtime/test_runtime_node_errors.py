"""Errors at the node (issue 23), shown on the CPU stand-in of CuPy with a fault injected.

A GPU kernel runs after it is launched, so a fault in it (an illegal address) surfaces
at a later call – another node's launch or copy, or the final synchronization – and it
is sticky: the CUDA context is lost and every later call fails with it. The stand-in
behaves so (`StandInCupyBackend(fault_at=task)`). In normal mode the error must say the
context is lost and list the nodes in flight, the faulting one among them, rather than
blame the node where it surfaced; in debug mode (`debug=True`, `EINPAGE_SYNC=1`) the
session synchronizes after each node and names the one that failed, by its line.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from cpu_cuda import CXX
from cuda_streams import StandInCupyBackend
from plans import reference_plan
from runtime_cases import block_program, make_inputs, mlp_program

import memgraph
import runtime
import runtime.numpy_backend
from einpage.errors import BackendError
from memgraph import NodeKind
from runtime.session import ContextLostError

needs_cxx = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++)")


@pytest.fixture(scope="module")
def case():
    tg = runtime.declare_workspaces(block_program(layers=2))  # the CuPy kernels' workspaces
    mg = memgraph.plan(tg, memgraph.min_budget(tg)[0])
    applies = mg.of_kind(NodeKind.APPLY)
    faulty = applies[len(applies) // 3]  # an apply with much issued after it
    return tg, mg, make_inputs(tg, 0), faulty


@needs_cxx
@pytest.mark.parametrize("mode", ["sequential", "streams"])
def test_a_fault_says_the_context_is_lost_and_lists_the_nodes_in_flight(case, mode):
    tg, mg, inputs, faulty = case
    backend = StandInCupyBackend(delay=1e-3, fault_at=faulty.tensor)
    with runtime.Session(mg, backend, mode=mode) as session:
        with pytest.raises(ContextLostError) as info:
            session.run(inputs)
        message = str(info.value)
        assert message.startswith("the device context is lost (CUDA error 700, ")
        assert "which is not necessarily where it happened" in message
        assert "debug=True (EINPAGE_SYNC=1, or einpage run --sync)" in message
        assert faulty.id in info.value.in_flight  # the faulting node is among those listed
        assert f"n{info.value.in_flight[-1]} (" in message
        with pytest.raises(BackendError, match="its device context was lost in an earlier run"):
            session.run(inputs)  # the device can run nothing more
    # closing after a lost context does not raise (nothing can be released there)


@needs_cxx
@pytest.mark.parametrize("mode", ["sequential", "streams"])
def test_debug_mode_names_the_node_that_faulted_by_its_line(case, mode):
    tg, mg, inputs, faulty = case
    backend = StandInCupyBackend(delay=1e-3, fault_at=faulty.tensor)
    session = runtime.Session(mg, backend, mode=mode, debug=True)
    with session, pytest.raises(ContextLostError) as info:
        session.run(inputs)
    message = str(info.value)
    assert message.startswith(f"{faulty.line()} failed on stream 'compute'")
    assert "lost the device context (CUDA error 700, cudaErrorIllegalAddress" in message
    assert info.value.in_flight == (faulty.id,)


@needs_cxx
def test_the_environment_turns_debug_mode_on(case, monkeypatch):
    tg, mg, inputs, faulty = case
    monkeypatch.setenv("EINPAGE_SYNC", "1")
    with runtime.Session(mg, StandInCupyBackend(fault_at=faulty.tensor)) as session:
        assert session.debug
        with pytest.raises(ContextLostError, match="^" + re.escape(faulty.line()) + " failed"):
            session.run(inputs)
    monkeypatch.setenv("EINPAGE_SYNC", "0")
    with runtime.Session(mg, "numpy") as session:
        assert not session.debug


@needs_cxx
def test_without_a_fault_debug_mode_gives_the_same_outputs(case):
    tg, mg, inputs, _ = case
    with runtime.Session(mg, StandInCupyBackend(delay=1e-3), debug=True) as session:
        got = session.run(inputs)
    want = runtime.run(mg, inputs, "numpy")
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sequential", "streams"])
def test_debug_mode_on_numpy_names_the_failing_node_by_its_line(mode, monkeypatch):
    tg = mlp_program()
    mg = reference_plan(tg, offload=frozenset({3}))
    second = mg.of_kind(NodeKind.APPLY)[1]
    real = runtime.numpy_backend.evaluate_task

    def broken(task, operands, out):
        if task.id == second.tensor:
            raise ValueError("exploded")
        return real(task, operands, out=out)

    monkeypatch.setattr(runtime.numpy_backend, "evaluate_task", broken)
    with pytest.raises(BackendError) as info:
        runtime.run(mg, make_inputs(tg, 0), "numpy", mode=mode, debug=True, timeout=30)
    assert str(info.value) == f"{second.line()} failed on stream 'compute': ValueError: exploded"
