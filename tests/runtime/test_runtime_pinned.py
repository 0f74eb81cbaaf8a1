"""Host memory is what the plan says: a staging backend (CuPy's pinned memory; here the
NumPy backend with staging, as CuPy has it) allocates `runtime.pinned_bytes(plan)` once
per session – the plan's host storages plus staging slots for device-side inputs and
outputs – and nothing per run; `host_budget` refuses a plan that needs more."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_cases import make_inputs

import memgraph
import runtime
import taskgraph
from einpage.models import llama
from runtime.interpreter import HOST_ALIGNMENT
from runtime.numpy_backend import NumpyBackend


class CountingStagingBackend(NumpyBackend):
    """NumPy with host staging; records every host allocation."""

    name = "counting-staging"
    host_staging = True

    def __init__(self):
        super().__init__()
        self.host_allocations: list[int] = []

    def allocate_host(self, nbytes):
        self.host_allocations.append(nbytes)
        return super().allocate_host(nbytes)


def aligned(n: int) -> int:
    return -(-max(n, 1) // HOST_ALIGNMENT) * HOST_ALIGNMENT


def plan_of_llama(budget_fraction: float):
    cfg = llama.PRESETS["tiny"]
    tg = llama.prefill_program(cfg, 2, 16, "float32", "all").build()
    low, _ = memgraph.min_budget(tg)
    peak = memgraph.streaming_minimum(tg)
    return tg, memgraph.plan(tg, int(low + budget_fraction * (peak - low)))


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_a_session_allocates_exactly_the_stated_pinned_bytes_once(fraction):
    tg, mg = plan_of_llama(fraction)
    stated = runtime.pinned_bytes(mg)
    layout = runtime.HostLayout.of(mg, True)
    storages = sum(aligned(s.nbytes) for s in mg.storages.values())
    staged = sum(
        aligned(slot.nbytes) for slot in [*layout.inputs.values(), *layout.outputs.values()]
    )
    assert stated == storages + staged
    assert storages >= mg.host_bytes
    backend = CountingStagingBackend()
    inputs = make_inputs(tg, 0)
    want = taskgraph.evaluate(tg, inputs)
    with runtime.Session(mg, backend, mode="sequential") as session:
        for _ in range(2):
            got = session.run(inputs)
            np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
        assert session.last.memory["host_bytes"] == stated
    assert backend.host_allocations == [stated]


def test_host_budget_refuses_a_plan_that_needs_more_before_allocating():
    tg, mg = plan_of_llama(0.0)
    stated = runtime.pinned_bytes(mg)
    backend = CountingStagingBackend()
    with pytest.raises(
        runtime.HostBudgetError, match=rf"needs .* \({stated} bytes\) of pinned host"
    ):
        runtime.Session(mg, backend, host_budget=stated - 1)
    assert backend.host_allocations == []
    with runtime.Session(mg, backend, host_budget=stated):
        pass
    assert backend.host_allocations == [stated]
    out = runtime.run(mg, make_inputs(tg, 0), backend="numpy", host_budget="1GiB")
    assert set(out) == set(tg.outputs)
    with pytest.raises(runtime.HostBudgetError, match="host memory, over the host budget"):
        runtime.run(mg, make_inputs(tg, 0), backend=CountingStagingBackend(), host_budget=1)


def test_without_a_host_budget_the_available_memory_is_the_limit(monkeypatch):
    import runtime.session as session_module

    tg, mg = plan_of_llama(0.0)
    host = session_module.HostLayout.of(mg, False).nbytes
    need = host + mg.budget  # the NumPy arena is host memory too
    monkeypatch.setattr(session_module, "available_memory", lambda: need - 1)
    with pytest.raises(runtime.HostBudgetError, match=rf"needs .* \({need} bytes\) of host"):
        runtime.run(mg, make_inputs(tg, 0), backend="numpy")
    monkeypatch.setattr(session_module, "available_memory", lambda: need)
    assert set(runtime.run(mg, make_inputs(tg, 0), backend="numpy")) == set(tg.outputs)
    monkeypatch.setattr(session_module, "available_memory", lambda: None)  # unknown: no check
    assert set(runtime.run(mg, make_inputs(tg, 0), backend="numpy")) == set(tg.outputs)


def test_the_cupy_backend_allocates_pinned_memory_outside_the_pool():
    """On a GPU, pinned memory comes from `cupy.cuda.PinnedMemory`, not CuPy's pool, so
    dropping the session's buffer returns it to the system (checked on the source: no
    GPU here)."""
    import inspect

    from runtime.cupy_backend import CupyBackend

    source = inspect.getsource(CupyBackend.allocate_host)
    assert "cp.cuda.PinnedMemory(" in source and "empty_pinned" not in source
