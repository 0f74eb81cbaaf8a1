"""Workloads on several devices with their links sent direct (`sends="direct"`): a decode
step and a training step placed both ways at each device's smallest budget, equal to the
unsplit reference; generation (unrolled and step plans, pipelined and tensor parallel)
choosing transformers' greedy tokens, with the partial sums and the residual stream
copied arena to arena."""

from __future__ import annotations

import numpy as np
import pytest
import workloads
from test_generate_devices import NEW_TOKENS, model_case

import taskgraph
from einpage.workloads.generate import Planning, generate
from memgraph import min_budget
from memgraph.multi import plan_devices, verify_multi
from memgraph.placement import place
from runtime.multi import run_devices

CASES = {"decode": workloads.decode_step, "training": workloads.training_step}


def direct_links(mp) -> int:
    """How many of the plan's links go direct, checked against the links' own paths."""
    count = sum(1 for link in mp.links if link.path == "peer")
    assert count == mp.info["direct"]["links"]
    return count


@pytest.mark.parametrize("strategy", ["pipeline", "tensor"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_and_training_steps_sent_direct_equal_the_reference(name, strategy):
    case = CASES[name]()
    placed = place(case.tg, 2, strategy)
    budgets = [min_budget(part.tg)[0] for part in placed.parts]
    mp = plan_devices(placed, 2, budgets, sends="direct")
    verify_multi(mp)
    assert direct_links(mp) > 0
    want = taskgraph.evaluate(case.tg, case.inputs)
    for order, seed in (("ready", None), ("random", 3)):
        got = run_devices(mp, case.inputs, order=order, seed=seed, timeout=30)
        workloads.assert_close(got, want, case.rtol)


@pytest.mark.parametrize(
    "model,way,strategy",
    [
        ("llama", "unrolled", "tensor"),
        ("llama", "steps", "tensor"),
        ("gpt2", "steps", "pipeline"),
        ("gpt2", "unrolled", "pipeline"),
    ],
)
def test_generation_sent_direct_chooses_transformers_tokens(model, way, strategy):
    cfg, weights, ids, want = model_case(model)
    planning = Planning(way=way, devices=2, strategy=strategy, sends="direct")
    out = generate(cfg, ids, NEW_TOKENS, "60%", weights=weights, page_size=4, plan=planning)
    np.testing.assert_array_equal(out.ids, want)
    for compiled in out.plan.plans.values():
        assert direct_links(compiled.plan) > 0
