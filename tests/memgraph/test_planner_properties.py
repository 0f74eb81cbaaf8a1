"""Planner properties on random einsum programs: every budget from the minimum to the
streaming minimum, both orders, both eviction policies, gives a plan that verifies,
fits its budget and computes the reference outputs; below the minimum it refuses; a
budget holding the resident peak moves nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from replay import check_outputs, check_plan
from strategies import einsum_programs, program_inputs

from einpage.errors import InfeasibleBudgetError
from memgraph import NodeKind, PlanOptions
from memgraph.eviction import POLICIES
from memgraph.options import PLACEMENTS
from memgraph.orders import ORDERS
from memgraph.planner import OUTPUTS, min_budget, plan, resident_peak, streaming_minimum
from taskgraph.nodes import Input


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
    high = streaming_minimum(tg, order=order, alignment=alignment, outputs=outputs, inputs=inputs)
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


@given(tg=einsum_programs(), data=st.data())
def test_a_budget_holding_the_resident_peak_moves_nothing(tg, data):
    options = {
        "alignment": data.draw(st.sampled_from([16, 64, 256]), label="alignment"),
        "order": data.draw(st.sampled_from(sorted(ORDERS)), label="order"),
        "eviction": data.draw(st.sampled_from(sorted(POLICIES)), label="eviction"),
        "outputs": data.draw(st.sampled_from(OUTPUTS), label="outputs"),
        "lookahead": data.draw(st.sampled_from([0, 1, 3, 64]), label="lookahead"),
        "lookahead_seconds": data.draw(st.sampled_from(["auto", None]), label="seconds"),
        "inputs": data.draw(st.sampled_from(["auto", "host"]), label="inputs"),
        "placement": data.draw(st.sampled_from(PLACEMENTS), label="placement"),
    }
    peak = resident_peak(tg, PlanOptions(**options))
    weights = sum(
        -(-t.nbytes // options["alignment"]) * options["alignment"]
        for t in tg
        if isinstance(t.op, Input)
        and t.op.location == "host"
        and any(tg[c].is_compute for c in tg.consumers[t.id])  # read whole by a step
    )
    assert peak >= max(weights, min_budget(tg, options["alignment"])[0])
    extra = data.draw(st.integers(0, 4), label="extra units")
    budget = data.draw(st.sampled_from([peak + extra * options["alignment"], "100%"]))
    mg = plan(tg, budget, **options)
    check_plan(mg)
    s = mg.stats
    assert mg.info["evictions"] == 0 and not mg.info["inputs_on_host_for_room"]
    assert s.drop_count == 0  # nothing needed again is ever freed
    reloads = [n.tensor for n in mg.of_kind(NodeKind.RELOAD)]
    assert len(reloads) == len(set(reloads))  # each tensor is loaded at most once
    assert s.first_load_count == s.reload_count  # ... and only to arrive, never to return
    if options["outputs"] == "device":
        assert s.offload_count == s.sliced_offload_count  # only outputs assembled on the host
