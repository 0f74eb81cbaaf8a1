"""Scheduled transfers (`PlanOptions.schedule_transfers`, `memgraph.transfer_schedule`):
steps ahead of the execution horizon prepared by evicting at their deadline, so reloads
overlap compute; reload victims read long enough ago (`PlanOptions.hide_reloads`); every
plan still verifies and computes the reference, every way."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from replay import check_outputs, check_plan
from strategies import einsum_programs, program_inputs

import einpage as ep
import runtime
import taskgraph
from einpage_core.errors import PlanError
from memgraph import NodeKind, PlanOptions, plan, simulate
from memgraph.cost import CostModel
from memgraph.planner import min_budget, streaming_minimum

# Compute-bound: a 64x256 @ 256x256 float32 matmul takes 0.42 ms, copying one of its
# 256 KiB weights 0.26 ms.
SLOW_COMPUTE = CostModel(
    "slow-compute",
    flops_per_s=2e10,
    device_bytes_per_s=1e12,
    h2d_bytes_per_s=1e9,
    d2h_bytes_per_s=1e9,
)


def weight_passes(layers: int = 6, passes: int = 2, d: int = 256, batch: int = 64):
    """`passes` passes over `layers` weights (each read once a pass): the weights that
    do not fit are streamed in every pass."""
    prog = ep.Program("weight-passes")
    weights = [prog.input(f"w{i}", (d, d), role="weight") for i in range(layers)]
    h = prog.input("x", (batch, d))
    for _ in range(passes):
        for w in weights:
            h = ep.silu(h @ w)
    prog.output(h, "y")
    return prog.build()


def test_streamed_weights_are_reloaded_behind_compute():
    tg = weight_passes()
    budget = 851_968  # three of the six weights and the activations
    scheduled = plan(tg, budget, cost_model=SLOW_COMPUTE, schedule_transfers=True)
    late = plan(tg, budget, cost_model=SLOW_COMPUTE)  # the default: not scheduled
    for mg in (scheduled, late):
        check_plan(mg)
        check_outputs(mg, program_inputs(tg, seed=3))
    assert scheduled.info["schedule_transfers"] is True
    assert late.info["schedule_transfers"] is False
    assert scheduled.info["prepared_ahead_evicting"] > 0
    assert late.info["prepared_ahead_evicting"] == 0
    # Evicting ahead only drops weights: nothing more is copied out.
    assert scheduled.stats.offload_bytes == late.stats.offload_bytes == 0
    fast, slow = simulate(scheduled, SLOW_COMPUTE), simulate(late, SLOW_COMPUTE)
    assert fast.compute_seconds == pytest.approx(slow.compute_seconds)
    # 6.42 ms against 7.46 ms: the reloads that waited for the previous weight's reader
    # now overlap the compute of the steps before their own.
    assert fast.makespan < 0.9 * slow.makespan
    assert fast.stall_seconds < 0.8 * slow.stall_seconds


def test_a_weight_is_dropped_for_a_later_step_before_an_earlier_apply():
    """Structurally: some weight still needed later is dropped, and a reload reuses its
    bytes, before the apply of a step that does not read the reloaded weight – the
    eviction was made for a step ahead of the execution horizon, not at its turn."""
    tg = weight_passes()
    mg = plan(tg, 851_968, cost_model=SLOW_COMPUTE, schedule_transfers=True)
    nodes = mg.nodes
    read_later: dict[int, int] = {}  # weight -> position of its last apply
    for i, node in enumerate(nodes):
        if node.kind is NodeKind.APPLY:
            for operand in tg[node.tensor].inputs:
                read_later[operand] = i
    ahead = 0
    for i, node in enumerate(nodes):
        if node.kind is not NodeKind.RELOAD:
            continue
        dropped = [
            d
            for d in node.deps
            if nodes[d].kind is NodeKind.ALLOC
            for f in nodes[d].deps
            if nodes[f].kind is NodeKind.FREE and read_later.get(nodes[f].tensor, -1) > f
        ]
        next_apply = next(n for n in nodes[i:] if n.kind is NodeKind.APPLY)
        if dropped and node.tensor not in tg[next_apply.tensor].inputs:
            ahead += 1
    assert ahead > 0


def test_the_runtime_computes_scheduled_plans_in_random_order():
    tg = weight_passes(layers=4, passes=2, d=64, batch=16)
    low, _ = min_budget(tg)
    inputs = program_inputs(tg, seed=5)
    expected = taskgraph.evaluate(tg, inputs)
    for budget in (low, (low + streaming_minimum(tg)) // 2):
        mg = plan(tg, budget, cost_model=SLOW_COMPUTE, schedule_transfers=True)
        for seed in range(3):
            got = runtime.run(mg, inputs, backend="numpy", mode="random", seed=seed)
            np.testing.assert_allclose(got["y"], expected["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_schedule_transfers_must_be_a_bool(value):
    with pytest.raises(PlanError, match="schedule_transfers must be True or False"):
        PlanOptions(schedule_transfers=value)


def waiting_reloads(mg, cost) -> tuple[int, int]:
    """(reloads whose bytes became free less than one copy's time before the apply that
    reads them starts, all reloads), simulated on `cost`: such a copy could not run
    behind compute, and that apply waited for it."""
    sim = simulate(mg, cost, timeline=True)
    times, nodes, tg = sim.node_times, mg.nodes, mg.taskgraph
    waiting = reloads = 0
    for node in nodes:
        if node.kind is not NodeKind.RELOAD:
            continue
        alloc = next(d for d in node.deps if nodes[d].kind is NodeKind.ALLOC)
        reader = next(
            n for n in nodes[node.id :] if n.kind is NodeKind.APPLY
            and node.tensor in tg[n.tensor].inputs
        )  # fmt: skip
        copy = cost.transfer_seconds(tg[node.tensor].nbytes, "h2d")
        reloads += 1
        waiting += times[reader.id][0] - times[alloc][1] < copy * (1 + 1e-9)
    return waiting, reloads


def test_reloads_go_into_bytes_read_long_enough_ago():
    """Four passes over six weights, three of which fit: Belady drops the weight read
    just now for the next one, so each copy waits for that read and the next read for
    the copy (14.6 ms simulated); with `hide_reloads` the victim is a weight read at
    least one copy's time ago, and the copies overlap compute (11.5 ms), for more bytes
    (5.75 MiB reloaded against 5.0)."""
    tg = weight_passes(layers=6, passes=4)
    budget = 851_968  # three of the six weights and the activations
    hidden = plan(tg, budget, cost_model=SLOW_COMPUTE, hide_reloads=True)
    plain = plan(tg, budget, cost_model=SLOW_COMPUTE)  # the default: Belady's victims
    for mg in (hidden, plain):
        check_plan(mg)
        check_outputs(mg, program_inputs(tg, seed=3))
    assert hidden.info["hide_reloads"] is True and plain.info["hide_reloads"] is False
    # 16 of Belady's 20 reloads wait for the read just made; 4 of 23 hidden ones (the
    # first pass, when no weight was read long enough ago)
    waiting, reloads = waiting_reloads(plain, SLOW_COMPUTE)
    assert waiting > 0.75 * reloads
    waiting, reloads = waiting_reloads(hidden, SLOW_COMPUTE)
    assert waiting < 0.25 * reloads
    assert hidden.stats.offload_bytes == plain.stats.offload_bytes == 0
    fast, slow = simulate(hidden, SLOW_COMPUTE), simulate(plain, SLOW_COMPUTE)
    assert fast.compute_seconds == pytest.approx(slow.compute_seconds)
    assert fast.makespan < 0.85 * slow.makespan
    assert fast.stall_seconds < 0.6 * slow.stall_seconds


def test_hidden_reloads_compute_the_reference_in_random_order():
    tg = weight_passes(layers=4, passes=3, d=64, batch=16)
    low, _ = min_budget(tg)
    inputs = program_inputs(tg, seed=5)
    expected = taskgraph.evaluate(tg, inputs)
    for budget in (low, (low + streaming_minimum(tg)) // 2):
        for scheduled in (False, True):
            mg = plan(
                tg, budget, cost_model=SLOW_COMPUTE, hide_reloads=True,
                schedule_transfers=scheduled,
            )  # fmt: skip
            check_plan(mg)
            for seed in range(3):
                got = runtime.run(mg, inputs, backend="numpy", mode="random", seed=seed)
                np.testing.assert_allclose(got["y"], expected["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", ["yes", 0, None])
def test_hide_reloads_must_be_a_bool(value):
    with pytest.raises(PlanError, match="hide_reloads must be True or False"):
        PlanOptions(hide_reloads=value)


@st.composite
def weight_streams(draw):
    """Random sequences of matmuls over a few shared weights: the weights that do not fit
    are dropped and reloaded, so steps ahead get prepared by evicting."""
    layers = draw(st.integers(2, 6), label="layers")
    d = draw(st.sampled_from([16, 32, 64]), label="d")
    batch = draw(st.sampled_from([4, 16, 64]), label="batch")
    sequence = draw(st.lists(st.integers(0, layers - 1), min_size=2, max_size=16))
    prog = ep.Program("weight-stream")
    weights = [prog.input(f"w{i}", (d, d), role="weight") for i in range(layers)]
    h = prog.input("x", (batch, d))
    for i in sequence:
        h = ep.silu(h @ weights[i])
    prog.output(h, "y")
    return prog.build()


def check_both_ways(tg, data):
    """Plan `tg` at a drawn budget and options (reloads hidden or not), scheduled and
    not: each plan verifies
    (and the oracle agrees, see conftest), and replays and runs on the NumPy runtime in
    random order to the reference evaluator's outputs."""
    alignment = data.draw(st.sampled_from([16, 256]), label="alignment")
    outputs = data.draw(st.sampled_from(["device", "host"]), label="outputs")
    options = {
        "alignment": alignment,
        "outputs": outputs,
        "eviction": data.draw(st.sampled_from(["belady", "lru", "belady-cost"]), label="eviction"),
        "order": data.draw(st.sampled_from(["program", "memory"]), label="order"),
        "lookahead": data.draw(st.sampled_from([1, 3, 64]), label="lookahead"),
        "lookahead_seconds": data.draw(st.sampled_from(["auto", None]), label="seconds"),
        "cost_model": data.draw(st.sampled_from(["h100-pcie5", SLOW_COMPUTE]), label="cost"),
        "hide_reloads": data.draw(st.booleans(), label="hide_reloads"),
    }
    low, _ = min_budget(tg, alignment)
    high = streaming_minimum(tg, alignment=alignment, outputs=outputs, order=options["order"])
    budget = data.draw(st.integers(low, high + alignment), label="budget")
    inputs = program_inputs(tg, seed=len(tg))
    with np.errstate(all="ignore"):  # random joins may overflow, identically in both
        expected = taskgraph.evaluate(tg, inputs)
    for scheduled in (True, False):
        mg = plan(tg, budget, schedule_transfers=scheduled, **options)
        check_plan(mg)
        check_outputs(mg, inputs)
        seed = data.draw(st.integers(0, 2**16), label="seed")
        with np.errstate(all="ignore"):
            got = runtime.run(mg, inputs, backend="numpy", mode="random", seed=seed)
        for name, value in expected.items():
            scale = max(1.0, float(np.abs(value[np.isfinite(value)]).max(initial=0.0)))
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5 * scale)


@given(tg=weight_streams(), data=st.data())
def test_weight_streams_plan_the_reference_outputs_scheduled_or_not(tg, data):
    check_both_ways(tg, data)


@given(tg=einsum_programs(), data=st.data())
def test_random_programs_plan_the_reference_outputs_scheduled_or_not(tg, data):
    check_both_ways(tg, data)
