"""A generation's step plans on the CuPy backend (the CPU stand-in): one session for the
whole generation (issue 23).

The stand-in counts what the backend allocates. A step-plan generation – a prefill
plan and decode plans of two buckets – allocates its device arena once (the largest
plan's) and its pinned buffer once (`runtime.pinned_bytes(plans)` less the weights read
in place), registers each weight once, and generates the NumPy backend's ids. Before,
each plan had a session: an arena, a pinned buffer holding every weight, and every
weight copied again, per plan.
"""

from __future__ import annotations

import numpy as np
import pytest
from cpu_cuda import CXX
from cuda_streams import StandInCupyBackend

import runtime
from einpage.models import llama
from einpage.workloads.generation import GenerationSpec, Planning, plan_generation

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++)")

CFG = llama.PRESETS["tiny"]
SPEC = GenerationSpec(llama.FAMILY, CFG, 2, 5, 7, "float32", page_size=4)
"""Prompts of 5, 7 new tokens in pages of 4: decode plans of two buckets."""


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        name: (0.2 * rng.standard_normal(shape)).astype(np.float32)
        for name, shape in CFG.weight_shapes().items()
    }


@pytest.fixture(scope="module")
def plan():
    made = plan_generation(SPEC, "60%", Planning(way="steps", chunk_steps=2))
    assert len(made.decoders) >= 2
    return made


@pytest.mark.parametrize("in_place_min", [0, None])
def test_a_step_plan_generation_allocates_its_arena_and_pins_host_memory_once(
    plan, in_place_min
):
    """`in_place_min=0`: every weight read in place (registered once); None: every weight
    copied, once, into the one pinned buffer."""
    given = weights()
    prompt = np.arange(10).reshape(2, 5) % CFG.vocab_size
    want = plan.run(given, prompt, backend="numpy")
    backend = StandInCupyBackend(delay=5e-4, in_place_min=in_place_min)
    got = plan.run(given, prompt, backend=backend, mode="streams")
    np.testing.assert_array_equal(got.ids, want.ids)
    plans = list(plan.session_plans.values())
    cp = backend.cp
    assert cp.device_allocations == [max(runtime.interpreter.arena_bytes(mg) for mg in plans)]
    promise = runtime.pinned_bytes(plans)
    if in_place_min is None:
        assert cp.pinned == [promise]
        assert cp.registrations == []
    else:
        (allocated,) = cp.pinned
        in_place = sum(-(-a.nbytes // 256) * 256 for a in given.values())
        assert allocated == promise - in_place
        registered = [c for c in cp.registrations if c[0] == "register"]
        assert len(registered) == len({c[1] for c in registered})  # each range once
        assert len(registered) <= len(given)
        assert cp.registered == {}  # all undone when the session closed
    for report in got.reports:
        assert report.memory["host_bytes"] == cp.pinned[0]
        assert report.memory["arena_allocated_bytes"] == cp.device_allocations[0]
