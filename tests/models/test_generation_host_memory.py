"""The host memory of a generation's run: what `host_bytes` promises (checked before a
run by `check_run_memory`) bounds what a run allocates, both ways, traced; and the step
loop frees each plan's session before the next allocates its own."""

from __future__ import annotations

import tracemalloc
import weakref

import numpy as np
import pytest

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


def test_the_step_loop_frees_each_session_before_the_next(monkeypatch):
    plan = plan_generation(SPEC, "60%", Planning(way="steps"))
    assert len(plan.decoders) >= 2
    sessions, alive = [], []
    made = runtime.Session.__init__

    def init(self, *args, **kwargs):
        alive.append(sum(s() is not None for s in sessions))
        made(self, *args, **kwargs)
        sessions.append(weakref.ref(self))

    monkeypatch.setattr(runtime.Session, "__init__", init)
    plan.run(weights(), np.zeros((2, 6), np.int64), backend="numpy")
    assert alive == [0] * (1 + len(plan.decoders)), alive
