"""The workloads on several devices, in one process (`runtime.multi.run_devices`: a
thread and a NumPy arena per device): LLaMA-tiny and GPT-2-tiny prefill on 2-4 devices,
unrolled generations and a decode step on 2, a training step on 2, each placed by
weights, planned at each device's smallest budget (offloads forced), verified as a
whole, and run in "ready" order and random orders equal to `taskgraph.evaluate` of the
unsplit graph; random layered programs at random budgets likewise."""

from __future__ import annotations

import numpy as np
import pytest
import workloads
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import program_inputs
from test_placement import layered_programs, weighted_programs

import taskgraph
from memgraph import NodeKind
from memgraph.multi import plan_devices, verify_multi
from memgraph.placement import pipeline_placement, place, used_weights
from runtime.multi import run_devices

ORDERS = [("ready", None), ("random", 0), ("random", 7)]


def run_everywhere(mp, inputs, want, rtol):
    """`mp` run in each order of `ORDERS`, each equal to `want`."""
    for order, seed in ORDERS:
        got = run_devices(mp, inputs, order=order, seed=seed, timeout=30)
        workloads.assert_close(got, want, rtol)


@pytest.mark.parametrize(
    "make,devices",
    [
        (workloads.llama_prefill, 2),
        (workloads.llama_prefill, 3),
        (workloads.llama_prefill, 4),
        (workloads.gpt2_prefill, 2),
        (workloads.gpt2_prefill, 3),
        (workloads.gpt2_prefill, 4),
    ],
)
def test_prefill_at_each_device_s_smallest_budget_equals_the_unsplit_reference(make, devices):
    case = make()
    mp, roomy = workloads.smallest_plans(case.tg, devices)
    directions = {(k.source, k.target) for k in mp.links}
    forward = {(d, d + 1) for d in range(devices - 1)}
    if case.name.startswith("llama"):  # weight groups end between layers' tensors
        assert directions == forward
    else:  # tied embeddings: the head is the first device's, the hidden state goes back;
        # a group ending inside an attention (v on the next device) sends tensors back too
        assert directions >= forward | {(devices - 1, 0)}
        assert mp.outputs["logits"][0] == 0
    workloads.assert_forced_to_move(mp, roomy)
    # each weight is on one device only, stages in the order of first use: a weight
    # read together with a larger one (a norm's bias) follows its reader's device
    holders = []
    for weight in used_weights(case.tg):
        name = case.tg[weight].op.name
        on = [p.device for p in mp.plans if name in p.mg.taskgraph.inputs]
        assert len(on) == 1, name
        holders.append(on[0])
    assert holders == sorted(holders) and set(holders) == set(range(devices))
    run_everywhere(mp, case.inputs, taskgraph.evaluate(case.tg, case.inputs), case.rtol)


@pytest.mark.parametrize("devices", [2, 3])
def test_a_partitioned_prefill_keeps_its_blocks_and_equals_the_unsplit_reference(devices):
    """Block tasks and sliced weight reloads (each slice with its weight's device) at
    each device's smallest budget."""
    case = workloads.partitioned_prefill()
    mp, roomy = workloads.smallest_plans(case.tg, devices)
    workloads.assert_forced_to_move(mp, roomy)
    assert all(any(t.block is not None for t in p.mg.taskgraph) for p in mp.plans)
    sliced = [p.device for p in mp.plans if any(n.box for n in p.mg.of_kind(NodeKind.RELOAD))]
    assert sliced
    run_everywhere(mp, case.inputs, taskgraph.evaluate(case.tg, case.inputs), case.rtol)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_an_unrolled_generation_on_two_devices_chooses_the_reference_s_ids(model):
    """LLaMA: each step's ids are chosen by the head on device 1 and read back by the
    embedding on device 0. GPT-2 (tied embeddings): the head is device 0's, so each
    step's last hidden state comes back and device 0 chooses. Either way links go both
    ways."""
    case = workloads.generation(model, new=3)
    mp, roomy = workloads.smallest_plans(case.tg, 2)
    back = [k for k in mp.links if (k.source, k.target) == (1, 0)]
    assert {(k.source, k.target) for k in mp.links} == {(0, 1), (1, 0)}
    if model == "llama":  # the last new token's ids are not read again
        assert len(back) == 2
        assert all(k.dtype == "int64" and k.shape == (2,) for k in back)  # the chosen ids
        assert mp.outputs["ids"][0] == 1
    else:
        assert len(back) == 3
        assert all(k.dtype == "float32" and k.shape == (2, 64) for k in back)
        assert mp.outputs["ids"][0] == 0
    workloads.assert_forced_to_move(mp, roomy)
    want = taskgraph.evaluate(case.tg, case.inputs)
    assert want["ids"].dtype == np.int64
    run_everywhere(mp, case.inputs, want, case.rtol)


def test_a_decode_step_keeps_each_kv_page_on_its_layer_s_device_and_runs():
    """Every KV page is an input of exactly one device's plan, the one that runs its
    layer's attention; the pages of one layer share a device."""
    case = workloads.decode_step()
    mp, roomy = workloads.smallest_plans(case.tg, 2)
    device_of = pipeline_placement(case.tg, 2)
    pages = workloads.kv_pages(case.tg)
    assert len(pages) == 2 * 2 * 2  # layers x (k, v) x pages
    by_layer: dict[int, set[int]] = {}
    for page, fact in pages.items():
        name = case.tg[page].op.name
        holders = [p.device for p in mp.plans if name in p.mg.taskgraph.inputs]
        assert len(holders) == 1, name
        assert {device_of[t] for t in case.tg.consumers[page]} == set(holders), name
        by_layer.setdefault(fact.layer, set()).update(holders)
    assert all(len(devices) == 1 for devices in by_layer.values())
    assert not any(k.task in pages for k in mp.links)  # pages are never sent
    workloads.assert_forced_to_move(mp, roomy)
    run_everywhere(mp, case.inputs, taskgraph.evaluate(case.tg, case.inputs), case.rtol)


def test_a_training_step_on_two_devices_updates_every_weight_as_the_reference():
    """Activations go forward to device 1 and gradients come back to device 0; every
    updated weight, state and the loss equal the unsplit step's."""
    case = workloads.training_step()
    mp, roomy = workloads.smallest_plans(case.tg, 2)
    assert {(k.source, k.target) for k in mp.links} == {(0, 1), (1, 0)}
    workloads.assert_forced_to_move(mp, roomy)
    want = taskgraph.evaluate(case.tg, case.inputs)
    assert "loss" in want and len(want) > 10
    run_everywhere(mp, case.inputs, want, case.rtol)


@settings(max_examples=40, deadline=None)
@given(
    case=st.one_of(layered_programs(), weighted_programs()),
    tight=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    order=st.sampled_from(["ready", "random"]),
)
def test_random_programs_at_random_budgets_equal_the_reference(case, tight, seed, order):
    """Layered programs on 2-4 devices and random programs with mostly weights on 1-4,
    budgets between each device's smallest and its resident peak. Links may go back to
    an earlier device (weights are grouped by bytes, not stages), and a device may be
    left without tasks or with dead code only: the threads run it all the same."""
    tg, devices = case
    placed = place(tg, devices)
    mp = plan_devices(placed, devices, workloads.random_budgets(placed, tight))
    verify_multi(mp)
    inputs = program_inputs(tg, seed)
    got = run_devices(mp, inputs, order=order, seed=seed, timeout=30)
    workloads.assert_close(got, taskgraph.evaluate(tg, inputs), workloads.tolerance_of(tg))
