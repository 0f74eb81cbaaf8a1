"""`memgraph.bounds.generation_time_bound`: a lower bound on every plan's simulated time of
an unrolled generation, at least the step-by-step bound it replaces."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

import einpage as ep
import memgraph
from einpage.errors import EinpageError
from einpage.models import llama
from memgraph.bounds import generation_time_bound
from memgraph.cost import CostModel, get_cost_model
from taskgraph.facts import ChosenIds
from taskgraph.nodes import Input

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import generation as generation_bench  # noqa: E402

SLOW_LINK = CostModel("slow-link", 1e12, 1e11, 1e8, 1e8)
"""Transfers dominate: the bound's load and working-memory readings decide."""

CELLS = [  # (preset, batch, prompt, new tokens, page size)
    ("tiny", 2, 8, 4, 4),
    ("tiny-gqa", 4, 12, 5, 4),
    ("tiny", 16, 24, 3, 8),
]


def old_bound(tg, cfg, batch, prompt, budget, cost) -> float:
    """The step-by-step bound `benchmarks/generation.py` reported before: per step
    max(compute, (weights + KV so far - budget) / h2d)."""
    new_kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * 2
    compute, kv, weights = generation_bench.per_step(tg, cost, prompt, new_kv)
    return generation_bench.bound_seconds(compute, kv, weights, budget, cost)


def budgets(tg, rng: random.Random, count: int) -> list[int]:
    low, high = memgraph.min_budget(tg)[0], memgraph.resident_peak(tg)
    return [rng.randint(low, high) for _ in range(count)] + [high]


@pytest.mark.parametrize("cost", ["h100-pcie5", SLOW_LINK], ids=["h100-pcie5", "slow-link"])
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c[0]}-b{c[1]}")
def test_the_bound_is_below_every_plans_simulated_time(cell, cost):
    name, batch, prompt, new_tokens, page = cell
    cfg = llama.PRESETS[name]
    tg = llama.generation_program(cfg, batch, prompt, new_tokens, "float16", page_size=page)
    tg = tg.build()
    rng = random.Random(f"{cell}-{cost}")
    model = get_cost_model(cost)
    for budget in budgets(tg, rng, 2):
        for order, eviction in (("program", "belady"), ("memory", "lru")):
            plan = ep.compile(tg, budget, cost_model=model, order=order, eviction=eviction).plan
            bound = generation_time_bound(plan.taskgraph, budget, model)
            simulated = memgraph.simulate(plan, model).makespan
            assert bound.seconds <= simulated * (1 + 1e-9), (budget, order, bound, simulated)
            # every step must bring at least what the step-by-step bound said (all weights
            # for the prefill, weights + KV - budget after), and the whole bound is at
            # least the old one but for the compute no plan need run where it said
            new_kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * 2
            _, kv, _ = generation_bench.per_step(tg, model, prompt, new_kv)
            read = {tg.storage_root(i) for t in tg if t.is_compute for i in t.inputs}
            weights = sum(
                t.nbytes for t in tg if isinstance(t.op, Input) and t.op.role == "weight"
                and t.id in read
            )  # fmt: skip
            assert bound.steps[0].load_bytes >= weights
            for step in bound.steps[1:]:
                assert step.load_bytes >= weights + kv[step.step] - budget
            unrun = bound.floating_s + sum(
                model.task_seconds(tg, t.id) for t in tg if tg.is_input_slice(t.id)
            )
            assert bound.seconds >= old_bound(tg, cfg, batch, prompt, budget, model) - unrun


def two_weight_chain(steps: int) -> ep.Program:
    """A hand-made generation: each step t spreads the previous choice v (16 floats) over
    a 16x64 weight A (H = v_i * A_ij, 4 KiB) and reduces H against a second weight B to
    the next choice (`ChosenIds(t)`). Both weights are read every step; H is the step's
    own working memory."""
    prog = ep.Program("two-weights")
    v = prog.input("x", (16,))  # 64 B, on the device
    a = prog.input("A", (16, 64), role="weight")  # 4 KiB each, on the host
    b = prog.input("B", (16, 64), role="weight")
    for t in range(steps):
        h = prog.einsum("i,ij->ij", v, a)
        v = prog.fact(prog.einsum("ij,ij->i", h, b), ChosenIds(t))
    prog.output(v, "y")
    return prog


def test_the_steps_working_memory_forces_loads_the_old_bound_misses():
    # Budget 8448 B (aligned: v 256 + A 4096 + H 4096, the largest working set). The old
    # bound saw A + B = 8192 B <= 8448 B: nothing need move after the prefill. But while
    # a step spreads v over A, H (4096 B) is resident and B is still to be read: of
    # v + A + H + B = 12,352 B at most 8448 B are on the device, so 3904 B cross every
    # decode step (a plan reloads A or B, 4096 B).
    tg = two_weight_chain(4).build()
    budget = 8448
    bound = generation_time_bound(tg, budget, SLOW_LINK)
    assert bound.steps[0].load_bytes == 2 * 4096  # the prefill loads both weights
    assert [s.load_bytes for s in bound.steps[1:]] == [3904] * 3
    plan = ep.compile(tg, budget, cost_model=SLOW_LINK).plan
    assert plan.stats.reload_bytes >= 2 * 4096 + 3 * 3904
    simulated = memgraph.simulate(plan, SLOW_LINK).makespan
    assert bound.seconds <= simulated
    old = 2 * 4096 / SLOW_LINK.h2d_bytes_per_s  # the old reading: the prefill's loads
    assert bound.seconds >= old + 3 * 3904 / SLOW_LINK.h2d_bytes_per_s


def test_a_program_that_chooses_nothing_is_refused():
    prog = ep.Program("no-choice")
    prog.output(ep.exp(prog.input("x", (4,))), "y")
    with pytest.raises(EinpageError, match="ChosenIds"):
        generation_time_bound(prog.build(), 4096, "h100-pcie5")
