"""`memgraph.multi.verify_multi` accepts what `plan_devices` makes and rejects mutants,
each built from a valid MultiPlan with `dataclasses.replace`: a dropped link, a size
that does not match, a link from a device to itself, links that wait for each other in a
cycle, an input fed twice, an end that is missing or on the device, a device plan that
breaks its own rules."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_placement_driver import llama_case

import einpage as ep
import memgraph
from einpage.models import llama
from einpage_core.errors import VerificationError
from memgraph import MemGraph, NodeKind
from memgraph.multi import Link, MultiPlan, plan_devices, verify_multi


def pipeline(location: str = "host", shared: bool = False) -> MultiPlan:
    """x -> tanh(x @ w0) -> ... -> y over four (16, 16) weights on two devices: one link,
    of shape (4, 16) like x and y; with `shared`, an activation "bias" (4, 16) that both
    devices read."""
    prog = ep.Program("chain")
    x = prog.input("x", (4, 16), location=location)
    bias = prog.input("bias", (4, 16), location="host") if shared else None
    for i in range(4):
        x = ep.tanh(x @ prog.input(f"w{i}", (16, 16), role="weight"))
        if bias is not None and i in (0, 3):
            x = x + bias
    prog.output(x, "y")
    return plan_devices(prog.build(), 2, "100%")


def with_links(mp: MultiPlan, *links: Link, **changes) -> MultiPlan:
    """`mp` with these links (and other changes of its placed graph)."""
    return replace(mp, placed=replace(mp.placed, links=links, **changes))


def rejected(mp: MultiPlan, *words: str) -> str:
    """The message of `verify_multi`'s error on `mp`, checked to contain `words`."""
    with pytest.raises(VerificationError) as caught:
        verify_multi(mp)
    message = str(caught.value)
    for word in words:
        assert word in message, message
    return message


def test_a_valid_plan_is_accepted_with_its_counts():
    mp = pipeline()
    report = verify_multi(mp)
    assert (report.devices, report.links) == (2, 1)
    assert report.nodes == sum(len(p.mg) for p in mp.plans)
    assert report.edges == sum(len(n.deps) for p in mp.plans for n in p.mg) + 1
    assert len(report.plans) == 2


def test_plans_whose_devices_send_both_ways_are_accepted():
    """Tied embeddings: device 1 sends its last hidden state back to device 0 (the union
    of the plans and links is still acyclic)."""
    tg, _ = llama_case(replace(llama.PRESETS["tiny"], tie_embeddings=True))
    mp = plan_devices(tg, 2, "60%")
    assert {(k.source, k.target) for k in mp.links} == {(0, 1), (1, 0)}
    verify_multi(mp)


def test_a_dropped_link_leaves_its_input_unfed():
    mp = pipeline()
    (link,) = mp.links
    rejected(with_links(mp), f'input "{link.input}" of device 1', "fed by nothing")


def test_a_link_whose_size_differs_from_its_ends_is_rejected():
    mp = pipeline()
    (link,) = mp.links
    rejected(with_links(mp, replace(link, shape=(16, 4))), "float32[4, 16], 256 B", "[16, 4]")
    rejected(with_links(mp, replace(link, dtype="float16", nbytes=128)), "float16[4, 16], 128 B")


def test_a_link_into_an_input_of_another_shape_is_rejected():
    mp = pipeline()
    (link,) = mp.links
    message = rejected(with_links(mp, replace(link, input="w2")), "device 1's input")
    assert "float32[16, 16], 1024 B" in message and "link carries float32[4, 16]" in message


def test_a_link_from_a_device_to_itself_is_rejected():
    mp = pipeline()
    (link,) = mp.links
    rejected(with_links(mp, replace(link, target=0, input="x")), "from device 0 to itself")
    rejected(with_links(mp, replace(link, target=5)), "target device 5 is not one of 0..1")


def test_links_that_point_at_each_other_are_a_cycle():
    """Device 1's output "y" sent back as device 0's input "x" (no longer staged by the
    driver, so it is fed once): device 0 waits for device 1, which waits for device 0."""
    mp = pipeline()
    (link,) = mp.links
    back = Link(link.task, 1, 0, "y", "x", (4, 16), "float32", 256)
    inputs = tuple(name for name in mp.placed.inputs if name != "x")
    message = rejected(with_links(mp, link, back, inputs=inputs), "in a cycle of")
    assert "device 0" in message and "device 1" in message
    assert 'input "x"' in message and f'output "{link.output}"' in message
    assert 'output "y"' in message and f'input "{link.input}"' in message


def test_an_input_fed_twice_is_rejected():
    mp = pipeline()
    (link,) = mp.links
    rejected(with_links(mp, link, link), f'input "{link.input}" of device 1', "fed by 2 links")
    shared = pipeline(shared=True)
    (link,) = shared.links
    assert "bias" in shared.plans[1].mg.taskgraph.inputs
    rejected(
        with_links(shared, link, replace(link, input="bias")),
        'input "bias" of device 1',
        "fed twice: the driver stages",
    )


def test_an_end_that_is_missing_or_on_the_device_is_rejected():
    mp = pipeline()
    (link,) = mp.links
    rejected(with_links(mp, replace(link, output="nope")), 'device 0\'s plan has no output "nope"')
    on_device = pipeline(location="device")  # x starts on the device: not a link's input
    back = Link(link.task, 1, 0, "y", "x", (4, 16), "float32", 256)
    inputs = tuple(name for name in on_device.placed.inputs if name != "x")
    rejected(with_links(on_device, link, back, inputs=inputs), "device 0's input", "not the host")
    device_output = memgraph.plan(mp.placed.parts[0].tg, mp.plans[0].budget)  # outputs="device"
    plans = (replace(mp.plans[0], mg=device_output), mp.plans[1])
    rejected(replace(mp, plans=plans), "device 0's output", "is on the device")


def test_a_device_plan_that_breaks_its_own_rules_is_named_by_its_device():
    mp = pipeline()
    mg = mp.plans[1].mg
    apply = next(n for n in mg if n.kind is NodeKind.APPLY)
    nodes = tuple(replace(n, deps=()) if n is apply else n for n in mg)
    broken = MemGraph(mg.taskgraph, nodes, mg.budget, mg.alignment, mg.info, mg.storages)
    plans = (mp.plans[0], replace(mp.plans[1], mg=broken))
    message = rejected(replace(mp, plans=plans), "device 1: ", f"n{apply.id} (apply)")
    assert "missing dependency" in message or "not resident" in message or "written" in message


def test_the_whole_must_match_its_parts():
    mp = pipeline()
    rejected(replace(mp, plans=mp.plans[:1]), "over 2 devices but has 1 device plans")
    swapped = (replace(mp.plans[0], device=1), mp.plans[1])
    rejected(replace(mp, plans=swapped), "device plan 0 says it is device 1")
    rejected(with_links(mp, *mp.links, outputs={"y": (0, "y")}), 'output "y"', "device 0")
    with pytest.raises(VerificationError, match="takes a MultiPlan"):
        verify_multi(mp.placed)


def test_the_cycle_check_is_iterative_on_long_plans():
    """A chain of 1500 tasks over 3 devices: no recursion limit in the union's check."""
    prog = ep.Program("long")
    x = prog.input("x", (2, 2))
    weights = [prog.input(f"w{i}", (2, 2), role="weight") for i in range(3)]
    for i in range(1500):
        x = ep.tanh(x @ weights[i * 3 // 1500])
    prog.output(x, "y")
    mp = plan_devices(prog.build(), 3, "100%")
    report = verify_multi(mp)
    assert report.links == 2 and report.nodes > 1500
    assert np.all(np.asarray([p.mg.stats.peak_bytes for p in mp.plans]) > 0)
