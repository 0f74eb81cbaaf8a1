"""How a generation reads its budget, the same way whichever way it is planned: a
streaming percentage is of one token's streaming minimum (an unrolled program's own
would keep every weight resident), a resident one of the plans' own peak, and every
plan says which reference point it used; an infeasible budget's message is whole."""

from __future__ import annotations

import pytest

from einpage.models import llama
from einpage.models.errors import GenerationBudgetError
from einpage.workloads.generation import GenerationSpec, Planning, plan_generation

CFG = llama.PRESETS["tiny"]
SPEC = GenerationSpec(llama.FAMILY, CFG, 1, 9, 4, page_size=4)
WAYS = {
    "unrolled": {"way": "unrolled"},
    "steps": {"way": "steps"},
    "chunks": {"way": "steps", "chunk_steps": 3, "bucket_pages": 2},
}


@pytest.mark.parametrize("budget", ["100%streaming", "150%streaming"])
def test_a_streaming_percentage_means_the_same_bytes_every_way(budget):
    plans = {name: plan_generation(SPEC, budget, Planning(**how)) for name, how in WAYS.items()}
    read = {name: {c.budget.nbytes for c in p.plans.values()} for name, p in plans.items()}
    assert len(set().union(*read.values())) == 1, read
    for plan in plans.values():
        for compiled in plan.plans.values():
            assert str(compiled.budget).startswith(f"{budget[:-9]} of the streaming minimum")
    # one token's weights, not the whole generation's: the unrolled plan streams them
    assert plans["unrolled"].stats().transfers.weight_reload > 4 * CFG.num_parameters()


def test_a_resident_percentage_is_of_the_plans_own_peak_and_says_so():
    for how in WAYS.values():
        plan = plan_generation(SPEC, "50%", Planning(**how))
        for name, compiled in plan.plans.items():
            text = str(compiled.budget)
            assert text.startswith("50% of the resident peak (the "), (name, text)
            assert text.endswith(f"= {compiled.budget.nbytes / 1024:.1f} KiB")
        assert plan.budget == plan.plans[next(iter(plan.plans))].budget


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_an_infeasible_budget_puts_the_planners_message_on_a_line_of_its_own(way):
    with pytest.raises(GenerationBudgetError) as caught:
        plan_generation(SPEC, "0", Planning(way=way))
    where, message = str(caught.value).split("\n")
    assert where.startswith(f"the {caught.value.plan} plan of ") and where.endswith(":")
    assert message.startswith("budget '0' = 0 B is below the smallest budget that compiles")
