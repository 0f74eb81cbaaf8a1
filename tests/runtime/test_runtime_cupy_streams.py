"""The whole `CupyBackend` on the CPU, with streams and copies as asynchronous as a GPU's
(`cuda_streams.StandInCupyBackend`: worker threads per stream, copies landing after
random delays, kernels run in their stream's order).

Plans of random programs at budgets that force offloads, run under random delays,
equal the reference evaluator; the pinned memory a session allocates is what the plan
states; and the stand-in is strict enough to matter: a plan run with one of the
backend's event waits dropped gives a wrong answer.
"""

from __future__ import annotations

import numpy as np
import pytest
from cpu_cuda import CXX
from cuda_streams import StandInCupyBackend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_cases import assert_outputs_match, block_program, einsum_programs, make_inputs

import memgraph
import runtime
import taskgraph
from runtime.cupy_backend import CupyStream

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++)")


def budgets(tg):
    low, _ = memgraph.min_budget(tg)
    peak = memgraph.streaming_minimum(tg)
    return sorted({low, (low + peak) // 2, peak})


def run_standin(mg, inputs, delay, seed):
    backend = StandInCupyBackend(delay=delay, seed=seed)
    with runtime.Session(mg, backend) as session:
        out = session.run(inputs)
    return out, backend


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(einsum_programs(dtypes=("float32", "float64")), st.integers(0, 2), st.integers(0, 99))
def test_random_programs_under_random_delays_equal_the_reference(tg, which, seed):
    tg = runtime.declare_workspaces(tg)
    inputs = make_inputs(tg, seed)
    want = taskgraph.evaluate(tg, inputs)
    options = budgets(tg)
    mg = memgraph.plan(tg, options[min(which, len(options) - 1)])
    got, _ = run_standin(mg, inputs, delay=1e-3, seed=seed)
    assert_outputs_match(got, want)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_block_at_its_tightest_budget_equals_the_reference(seed):
    tg = runtime.declare_workspaces(block_program(layers=2))
    inputs = make_inputs(tg, seed)
    mg = memgraph.plan(tg, budgets(tg)[0])
    assert mg.stats.offload_bytes + mg.stats.reload_bytes > 0
    got, backend = run_standin(mg, inputs, delay=2e-3, seed=seed)
    assert_outputs_match(got, taskgraph.evaluate(tg, inputs))
    assert backend.cp.pinned == [runtime.pinned_bytes(mg)]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # matmuls of poisoned (NaN) bytes
def test_dropping_an_event_wait_gives_a_wrong_answer(monkeypatch):
    """Skip the compute stream's waits for reloads (h2d events): kernels then read
    arena bytes before the copies land, and the outputs differ from the reference."""
    tg = runtime.declare_workspaces(block_program(layers=2))
    inputs = make_inputs(tg, 0)
    want = taskgraph.evaluate(tg, inputs)
    mg = memgraph.plan(tg, budgets(tg)[0])
    h2d_events: set[int] = set()
    original_record, original_wait = CupyStream.record, CupyStream.wait

    def record(self, timing=False):
        event = original_record(self, timing)
        if self.name == "h2d":
            h2d_events.add(id(event))
        return event

    def wait(self, event):
        if self.name == "compute" and id(event) in h2d_events:
            return  # the dropped wait
        original_wait(self, event)

    monkeypatch.setattr(CupyStream, "record", record)
    monkeypatch.setattr(CupyStream, "wait", wait)
    wrong = 0
    for seed in range(5):  # copies land 0-10 ms late: some kernel reads before one lands
        got, _ = run_standin(mg, inputs, delay=10e-3, seed=seed)
        wrong += any(
            not np.allclose(got[name], value, rtol=1e-4, atol=1e-4, equal_nan=False)
            for name, value in want.items()
        )
    assert wrong >= 1
