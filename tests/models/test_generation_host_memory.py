"""The host memory of a generation's run: what `host_bytes` promises (checked before a
run by `check_run_memory`) bounds what a run allocates, both ways, traced; and the step
loop runs every plan in one session, which allocates its arena and host buffer once
and releases them when it closes, without waiting for the garbage collector."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
from counting_backend import Counting

import runtime
from einpage.models import gpt2
from einpage.models.decode import Sampling
from einpage.workloads.generation import WAYS, GenerationSpec, Planning, plan_generation

CFG = gpt2.PRESETS["tiny"]
SPEC = GenerationSpec(gpt2.FAMILY, CFG, 2, 6, 7, page_size=4, sampling=Sampling(top_k=4))
"""Prompts of 6, 7 new tokens in pages of 4: step plans of three buckets."""


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s, dtype=np.float32) for n, s in CFG.weight_shapes().items()}


@pytest.mark.parametrize("way", WAYS)
def test_a_run_allocates_at_most_what_host_bytes_says(way):
    plan = plan_generation(SPEC, "60%", Planning(way=way))
    given, prompt = weights(), np.zeros((2, 6), np.int64)
    tracemalloc.start()
    try:
        plan.run(given, prompt, backend="numpy")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    promised = plan.host_bytes(runtime.get_backend("numpy"))
    assert peak <= promised, (peak, promised)


def test_the_step_loop_runs_every_plan_in_one_session(monkeypatch):
    """Issue 23: one session for the whole generation – one arena (the largest plan's),
    one host buffer – freed when it closes, with the garbage collector off (the loop
    made a session per plan, and called gc.collect() between them, since a closed
    session held its arena until collected)."""
    plan = plan_generation(SPEC, "60%", Planning(way="steps"))
    assert len(plan.decoders) >= 2
    sessions = []
    made = runtime.Session.__init__

    def init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        sessions.append(self)

    monkeypatch.setattr(runtime.Session, "__init__", init)
    backend = Counting()
    want = plan.run(weights(), np.zeros((2, 6), np.int64), backend="numpy")
    gc.disable()
    try:
        got = plan.run(weights(), np.zeros((2, 6), np.int64), backend=backend)
        assert all(ref() is None for ref in backend.buffers), "a buffer outlived the session"
    finally:
        gc.enable()
    np.testing.assert_array_equal(got.ids, want.ids)
    assert len(sessions) == 2  # one per run of the generation, each over every plan
    assert len(sessions[-1].plans) == 1 + len(plan.decoders)
    arenas = [runtime.interpreter.arena_bytes(mg) for mg in plan.session_plans.values()]
    assert backend.arenas == [max(arenas)]
    assert backend.hosts == [sessions[-1].host_layout.nbytes]
    assert len(got.reports) == 1 + len(plan.chunks)
