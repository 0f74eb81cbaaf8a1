"""`memgraph.multi.plan_devices`: a plan per device under its own budget (percentages
read against that device's graph), outputs on the host, refusals naming the device and
its smallest budget; the plans pass `verify_multi` and, run device after device on the
NumPy runtime with each link's host array handed over, give the reference's outputs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import program_inputs
from test_placement import layered_programs, training_case
from test_placement_driver import assert_same_outputs, chain, llama_case

import runtime
import taskgraph
from einpage.models import llama
from einpage_core.errors import InfeasibleBudgetError, PlanError
from einpage_core.units import format_exact
from memgraph import NodeKind, min_budget, read_budget
from memgraph.multi import DeviceBudgetError, MultiPlan, plan_devices, verify_multi
from memgraph.options import PlanOptions
from memgraph.placement import place
from taskgraph.partition import partition

HOST = PlanOptions(outputs="host")


def run_plans(mp: MultiPlan, inputs) -> dict[str, np.ndarray]:
    """Run each device's plan on the NumPy runtime, devices in the order their links are
    ready (a pipeline's: 0, 1, ...), each link's output handed to its target's input."""
    feeds = {(k.target, k.input): (k.source, k.output) for k in mp.links}
    sent: dict[tuple[int, str], np.ndarray] = {}
    results = {}
    waiting = [p.device for p in mp.plans]
    while waiting:
        for device in waiting:
            tg = mp.plans[device].mg.taskgraph
            given = {
                n: sent.get(feeds[device, n]) if (device, n) in feeds else inputs[n]
                for n in tg.inputs
            }
            if any(v is None for v in given.values()):
                continue
            results[device] = runtime.run(mp.plans[device].mg, given, backend="numpy")
            sent.update(((device, n), v) for n, v in results[device].items())
            waiting.remove(device)
            break
        else:
            raise AssertionError(f"devices {waiting} wait for each other")
    return {name: results[d][local] for name, (d, local) in mp.outputs.items()}


def moved(mg) -> int:
    s = mg.stats
    return s.offload_bytes + s.reload_bytes + s.drop_bytes


def test_percentages_are_read_against_each_device_s_own_graph():
    tg, _ = llama_case(replace(llama.PRESETS["tiny"], num_layers=5))  # whole layers per device
    mp = plan_devices(tg, 3, "50%")
    verify_multi(mp)
    budgets = [read_budget(part.tg, "50%", HOST).nbytes for part in mp.placed.parts]
    assert [p.budget for p in mp.plans] == budgets and len(set(budgets)) == 3
    assert all(p.mg.stats.peak_bytes <= p.budget for p in mp.plans)


@pytest.mark.parametrize("devices", [2, 3])
def test_llama_prefill_at_each_device_s_smallest_budget_offloads_verifies_and_runs(devices):
    """Each device at its own `min_budget` moves more than at its resident peak (offloads
    and reloads forced); the plans verify as a whole and, run on the NumPy runtime device
    after device, give the reference's logits. A layer per device (stages hold whole
    layers) and the last position's logits (all positions' would set the last device's
    smallest budget so high that it moves nothing more there)."""
    cfg = replace(llama.PRESETS["tiny"], num_layers=devices)
    arrays = llama_case(cfg, seq=32)[1]
    tg = llama.prefill_program(cfg, 2, 32, logits="last").build()
    placed = place(tg, devices)
    smallest = [min_budget(part.tg)[0] for part in placed.parts]
    mp = plan_devices(placed, devices, smallest)
    report = verify_multi(mp)
    assert (report.devices, report.links) == (devices, len(mp.links))
    roomy = plan_devices(placed, devices, "100%")
    for plan, at_full in zip(mp.plans, roomy.plans, strict=True):
        assert plan.mg.stats.peak_bytes <= plan.budget < at_full.budget
        assert moved(plan.mg) > moved(at_full.mg)
        assert plan.mg.stats.offload_count > at_full.mg.stats.offload_count
        for link in mp.links:  # what a device sends leaves it as a host output
            if link.source == plan.device:
                (node,) = [n for n in plan.mg.of_kind(NodeKind.OUTPUT) if n.name == link.output]
                assert node.storage is not None
    want = taskgraph.evaluate(tg, arrays)["logits"]
    got = run_plans(mp, arrays)["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_a_training_step_plans_and_verifies_on_two_devices():
    tg, _ = training_case()
    mp = plan_devices(tg, 2, "60%")
    verify_multi(mp)
    assert {(k.source, k.target) for k in mp.links} == {(0, 1), (1, 0)}
    assert all(p.mg.stats.peak_bytes <= p.budget for p in mp.plans)


def test_one_budget_per_device_and_placed_graphs_are_taken():
    tg, arrays = chain()
    placed = place(tg, 2)
    sizes = [min_budget(part.tg)[0] for part in placed.parts]
    mp = plan_devices(placed, 2, [sizes[0], f"{sizes[1] + 512}B"])
    assert [p.budget for p in mp.plans] == [sizes[0], sizes[1] + 512]
    assert mp.placed is placed
    verify_multi(mp)
    assert_same_outputs(run_plans(mp, arrays), taskgraph.evaluate(tg, arrays))


def test_plans_are_deterministic():
    tg, _ = llama_case(llama.PRESETS["tiny"])
    first, second = plan_devices(tg, 2, "40%"), plan_devices(tg, 2, "40%")
    for a, b in zip(first.plans, second.plans, strict=True):
        assert a.mg.to_json() == b.mg.to_json()
    assert first.links == second.links


def test_a_budget_below_a_device_s_smallest_names_the_device_and_that_budget():
    tg, _ = chain()
    placed = place(tg, 2)
    needed, task = min_budget(placed.parts[1].tg)
    with pytest.raises(DeviceBudgetError) as caught:
        plan_devices(placed, 2, ["100%", needed - 256])
    error = caught.value
    assert isinstance(error, InfeasibleBudgetError)
    assert (error.device, error.budget, error.needed) == (1, needed - 256, needed)
    assert error.task == placed.parts[1].origin[task]
    message = str(error)
    assert message.startswith("device 1: budget")
    assert f"smallest feasible budget {format_exact(needed)}" in message
    assert f"Give device 1 at least {format_exact(needed)}" in message


def test_bad_arguments_are_refused_with_what_was_wrong():
    tg, _ = chain()
    with pytest.raises(PlanError, match="3 budgets given for 2 devices"):
        plan_devices(tg, 2, ["1MiB"] * 3)
    with pytest.raises(PlanError, match="outputs='host'.*got outputs='device'"):
        plan_devices(tg, 2, "1MiB", outputs="device")
    with pytest.raises(PlanError, match="has no option 'colour'"):
        plan_devices(tg, 2, "1MiB", colour="red")
    with pytest.raises(PlanError, match="split over 2 devices, not 3"):
        plan_devices(place(tg, 2), 3, "1MiB")
    with pytest.raises(PlanError, match="unknown placement strategy 'ring'"):
        plan_devices(tg, 2, "1MiB", strategy="ring")
    with pytest.raises(PlanError, match="a budget is bytes"):
        plan_devices(tg, 2, None)


def test_a_multiplan_prints_a_summary_line_and_a_header_per_device():
    tg, _ = chain()
    mp = plan_devices(tg, 2, "1MiB")
    text = repr(mp)
    assert "\n" not in text and text.startswith("<MultiPlan pipeline devices=2 links=1 ")
    lines = mp.lines()
    headers = [line for line in lines if line.startswith("device ")]
    assert [h.split(":")[0] for h in headers] == ["device 0", "device 1"]
    assert sum(len(p.mg) for p in mp.plans) == len(lines) - 2 - 1 - 1 - len(mp.outputs)
    assert mp.links[0].describe() in str(mp)
    assert len(mp.lines(nodes=False)) == 2 + 1 + len(mp.links) + len(mp.outputs)
    assert "device=1" in repr(mp.plans[1]) and "tasks=" in repr(replace(mp.placed))


def test_a_partitioned_prefill_plans_at_each_device_s_smallest_budget_and_runs():
    """Weights streamed in sliced reloads, the logits assembled on the host of the last
    device: the whole verifies and runs equal to the reference."""
    tg, arrays = llama_case(llama.PRESETS["tiny"], seq=8)
    blocks = partition(tg, "24KiB")
    placed = place(blocks, 2)
    mp = plan_devices(placed, 2, [min_budget(part.tg)[0] for part in placed.parts])
    verify_multi(mp)
    assert any(n.box is not None for p in mp.plans for n in p.mg.of_kind(NodeKind.RELOAD))
    want = taskgraph.evaluate(tg, arrays)["logits"]
    got = run_plans(mp, arrays)["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@settings(max_examples=15, deadline=None)
@given(case=layered_programs(), seed=st.integers(0, 2**16), tight=st.floats(0.0, 1.0))
def test_random_programs_plan_verify_and_run_on_their_devices(case, seed, tight):
    """Budgets between each device's smallest and its resident peak; where the devices
    can run one after the other (links only forward), the NumPy runtime's outputs equal
    the reference's."""
    tg, devices = case
    placed = place(tg, devices)
    budgets = []
    for part in placed.parts:
        low, high = min_budget(part.tg)[0], read_budget(part.tg, "100%", HOST).nbytes
        budgets.append(max(low, int(low + tight * (high - low))))
    mp = plan_devices(placed, devices, budgets)
    verify_multi(mp)
    if all(k.source < k.target for k in mp.links):
        arrays = program_inputs(tg, seed)
        want = taskgraph.evaluate(tg, arrays)
        got = run_plans(mp, arrays)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_the_planner_s_own_options_pass_through():
    """`placement` is the allocator's option (where in the arena), not the strategy."""
    tg, _ = chain()
    mp = plan_devices(tg, 2, "100%", placement="best_fit", eviction="lru")
    assert all(p.mg.info["placement"] == "best_fit" for p in mp.plans)
    assert all(p.mg.info["eviction"] == "lru" for p in mp.plans)
    assert mp.info["plan_options"]["outputs"] == "host"
