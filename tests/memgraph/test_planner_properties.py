"""Planner properties on random einsum programs: every budget from the minimum to the
no-offload peak, both orders, both eviction policies, gives a plan that verifies,
fits its budget and computes the reference outputs; below the minimum it refuses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from replay import check_outputs, check_plan
from strategies import einsum_programs, program_inputs

from einpage.errors import InfeasibleBudgetError
from memgraph.eviction import POLICIES
from memgraph.orders import ORDERS
from memgraph.planner import OUTPUTS, min_budget, no_offload_peak, plan


@given(tg=einsum_programs(), data=st.data())
def test_random_programs_plan_within_any_feasible_budget(tg, data):
    alignment = data.draw(st.sampled_from([16, 64, 256]), label="alignment")
    order = data.draw(st.sampled_from(sorted(ORDERS)), label="order")
    eviction = data.draw(st.sampled_from(sorted(POLICIES)), label="eviction")
    outputs = data.draw(st.sampled_from(OUTPUTS), label="outputs")
    lookahead = data.draw(st.sampled_from([0, 1, 3, 64]), label="lookahead")
    seconds = data.draw(st.sampled_from(["auto", None]), label="lookahead_seconds")
    inputs = data.draw(st.sampled_from(["auto", "host"]), label="inputs")
    low, _ = min_budget(tg, alignment)
    high = no_offload_peak(tg, order=order, alignment=alignment, outputs=outputs, inputs=inputs)
    assert high >= low
    budget = data.draw(st.integers(low, high + alignment), label="budget")
    mg = plan(
        tg,
        budget,
        order=order,
        eviction=eviction,
        outputs=outputs,
        lookahead=lookahead,
        lookahead_seconds=seconds,
        alignment=alignment,
        inputs=inputs,
    )
    check_plan(mg)
    assert mg.budget == budget
    if data.draw(st.booleans(), label="replay"):
        check_outputs(mg, program_inputs(tg, seed=len(tg)))


@given(tg=einsum_programs(), data=st.data())
def test_budgets_below_the_minimum_are_refused_with_the_minimum(tg, data):
    alignment = data.draw(st.sampled_from([16, 256]), label="alignment")
    needed, task = min_budget(tg, alignment)
    budget = data.draw(st.integers(0, needed - 1), label="budget")
    with pytest.raises(InfeasibleBudgetError) as caught:
        plan(tg, budget, alignment=alignment)
    assert caught.value.needed == needed
    assert caught.value.task == task
    assert caught.value.budget == budget


@given(tg=einsum_programs(), order=st.sampled_from(sorted(ORDERS)))
def test_the_minimum_budget_always_plans(tg, order):
    needed, _ = min_budget(tg, 64)
    for eviction in POLICIES:
        mg = plan(tg, needed, order=order, eviction=eviction, alignment=64)
        check_plan(mg)
        check_outputs(mg, program_inputs(tg, seed=1))
