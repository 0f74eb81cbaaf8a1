"""The multi-device simulator: devices on their own streams, links staged through the host,
host links shared by serialising copies; checked against `memgraph.simulate` and against
timings computed by hand from the cost model's rates."""

from __future__ import annotations

import dataclasses
import doctest
import math

import pytest
import sim_plans
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import einsum_programs

import memgraph
import memgraph.simulate_multi as simulate_multi_module
from einpage.errors import GraphError, PlanError, VerificationError
from memgraph.cost import PRESETS, CostModel, Topology
from memgraph.multi import Link, MultiPlan, PlacedGraph
from memgraph.planner import OUTPUTS, min_budget, streaming_minimum
from memgraph.simulate_multi import simulate_multi

# Round rates, distinct in each direction (a swapped direction shows), and latencies (a
# dropped latency shows). No device-memory roofline: a task takes latency + FLOPs / rate.
TOY = CostModel(
    "toy", flops_per_s=1e6, device_bytes_per_s=math.inf, h2d_bytes_per_s=1e6,
    d2h_bytes_per_s=5e5, kernel_latency_s=1e-5, transfer_latency_s=2e-5,
)  # fmt: skip


def shared(model: CostModel, per_link: int) -> CostModel:
    """`model` with `per_link` devices on each host link."""
    topology = Topology(devices_per_host_link=per_link)
    return dataclasses.replace(model, name=f"{model.name}/{per_link}", topology=topology)


# The cost model's numbers, by hand: a float32 vector of 256 is 1024 bytes; exp of it is
# tg[...].flops FLOPs (read from the TaskGraph, not from the cost model).
VECTOR = 4 * 256
H2D = 2e-5 + VECTOR / 1e6
D2H = 2e-5 + VECTOR / 5e5


def kernel(flops: int) -> float:
    return 1e-5 + flops / 1e6


def exp_flops(mp: MultiPlan, device: int, output: str) -> int:
    tg = mp.placed.parts[device].tg
    return tg[tg.outputs[output]].flops


def test_module_doctests():
    assert doctest.testmod(simulate_multi_module).failed == 0


# -- one device is `simulate` -----------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(tg=einsum_programs(max_tasks=15), data=st.data())
def test_one_device_is_simulate(tg, data):
    outputs = data.draw(st.sampled_from(OUTPUTS), label="outputs")
    low, _ = min_budget(tg, 256)
    high = streaming_minimum(tg, outputs=outputs)
    budget = data.draw(st.integers(low, max(low, high)), label="budget")
    model = data.draw(st.sampled_from([TOY, *PRESETS.values(), shared(TOY, 4)]), label="model")
    mp = sim_plans.single(tg, budget, outputs=outputs)
    mg = mp.plans[0].mg
    alone = memgraph.simulate(mg, model, timeline=True)
    together = simulate_multi(mp, model, timeline=True)
    device = together.per_device[0]
    assert together.makespan == alone.makespan
    assert device.node_times == alone.node_times
    assert dict(device.busy) == dict(alone.busy)
    assert dict(device.bytes_moved) == dict(alone.bytes_moved)
    assert sorted(device.events, key=lambda e: e.node) == sorted(alone.events, key=lambda e: e.node)
    assert together.host_link_bytes == {0: {"h2d": alone.h2d_bytes, "d2h": alone.d2h_bytes}}
    assert together.reordered == 0 and together.sent_bytes == {}


# -- independent devices ------------------------------------------------------------------


def test_independent_devices_take_the_longest_of_their_makespans():
    mp = sim_plans.independent((256, 4096))
    result = simulate_multi(mp, TOY)
    alone = [memgraph.simulate(p.mg, TOY).makespan for p in mp.plans]
    assert alone[1] > alone[0]
    assert result.finish_seconds == tuple(alone)
    assert result.makespan == max(alone)
    # Device d alone: load w{d}, exp, offload y{d}: by hand.
    for d, n in enumerate((256, 4096)):
        flops = exp_flops(mp, d, f"y{d}")
        by_hand = (2e-5 + 4 * n / 1e6) + kernel(flops) + (2e-5 + 4 * n / 5e5)
        assert alone[d] == pytest.approx(by_hand, rel=1e-12)
    assert result.stall_seconds[1] == pytest.approx(alone[1] - result.compute_seconds[1])


# -- links --------------------------------------------------------------------------------


def test_a_chain_takes_its_critical_path_computed_by_hand():
    mp = sim_plans.chain()
    result = simulate_multi(mp, TOY, timeline=True)
    a, b = exp_flops(mp, 0, sim_plans.send(1)), exp_flops(mp, 1, "y")
    # Device 0 loads x, computes a, offloads it; then device 1 reloads it, computes b and
    # offloads y. Nothing overlaps: the makespan is the sum.
    source = H2D + kernel(a) + D2H
    assert result.finish_seconds[0] == pytest.approx(source, rel=1e-12)
    assert result.makespan == pytest.approx(source + H2D + kernel(b) + D2H, rel=1e-12)
    # Device 1's reload of the sent tensor starts when device 0's offload of it ends.
    times0, times1 = result.per_device[0].node_times, result.per_device[1].node_times
    mg0, mg1 = mp.plans[0].mg, mp.plans[1].mg
    (offload,) = mg0.of_kind(memgraph.NodeKind.OFFLOAD)
    (reload,) = mg1.of_kind(memgraph.NodeKind.RELOAD)
    assert times1[reload.id][0] == times0[offload.id][1]
    assert result.sent_bytes == {(0, 1): VECTOR}
    assert result.host_link_bytes == {
        0: {"h2d": VECTOR, "d2h": VECTOR},
        1: {"h2d": VECTOR, "d2h": VECTOR},
    }
    # Each device alone would be done sooner: device 1 waits for device 0.
    assert result.makespan > max(memgraph.simulate(p.mg, TOY).makespan for p in mp.plans)
    assert result.stall_seconds[1] == pytest.approx(result.makespan - kernel(b), rel=1e-12)


def test_a_chain_with_a_weight_takes_at_least_its_critical_path():
    mp = sim_plans.chain(weight=True)
    result = simulate_multi(mp, TOY)
    a = exp_flops(mp, 0, sim_plans.send(2))
    # Device 1 computes exp(recv) then times w: two kernels, each with its latency.
    b = sum(kernel(t.flops) for t in mp.placed.parts[1].tg if t.is_compute)
    critical = H2D + kernel(a) + D2H + H2D + b + D2H
    # The weight's reload is queued behind the received tensor's on device 1's h2d
    # stream, but that copy waits for nothing queued behind it: the weight loads while
    # device 0 works, and the makespan is the critical path.
    mg1 = mp.plans[1].mg
    received, weight = mg1.of_kind(memgraph.NodeKind.RELOAD)  # in this order on the stream
    assert mg1.taskgraph[weight.tensor].op.name == "w"
    assert result.makespan == pytest.approx(critical, rel=1e-12)
    times = simulate_multi(mp, TOY, timeline=True).per_device[1].node_times
    assert times[weight.id] == pytest.approx((0.0, H2D), rel=1e-12)
    assert times[received.id][0] == pytest.approx(H2D + kernel(a) + D2H, rel=1e-12)


def test_a_round_trip_between_two_devices_runs():
    mp = sim_plans.round_trip()
    result = simulate_multi(mp, TOY)
    hops = [
        exp_flops(mp, 0, sim_plans.send(1)),
        exp_flops(mp, 1, sim_plans.send(2)),
        exp_flops(mp, 0, "y"),
    ]
    by_hand = sum(H2D + kernel(flops) + D2H for flops in hops)
    assert result.makespan == pytest.approx(by_hand, rel=1e-12)
    assert result.sent_bytes == {(0, 1): VECTOR, (1, 0): VECTOR}
    assert result.reordered == 0


def test_a_stream_order_that_would_deadlock_runs_out_of_order():
    # Device 0 queues the apply that reads the tensor coming back from device 1 before
    # the apply that device 1 needs first: in-order streams would wait forever, the
    # plans' dependencies and links do not.
    mp = sim_plans.round_trip_out_of_order()
    memgraph.verify(mp.plans[0].mg)
    result = simulate_multi(mp, TOY)
    # Two nodes run out of order: the apply device 1 needs, then its offload (queued on
    # the d2h stream behind the offload of what reads the returning tensor).
    assert result.reordered == 2
    assert result.makespan == pytest.approx(simulate_multi(sim_plans.round_trip(), TOY).makespan)
    assert "2 node(s) started out of their stream's order" in result.table()
    assert "reordered=2" in repr(result)


def test_a_cycle_between_devices_is_an_error_naming_them():
    with pytest.raises(VerificationError, match="cycle") as caught:
        simulate_multi(sim_plans.deadlock(), TOY)
    message = str(caught.value)
    assert 'device 0 n0 (input "recv:%1"' in message
    assert 'device 1 n0 (input "recv:%0"' in message


# -- shared host links ----------------------------------------------------------------------


def test_devices_on_one_host_link_serialise_their_copies():
    mp = sim_plans.independent((256, 256))
    c = kernel(exp_flops(mp, 0, "y0"))
    alone = simulate_multi(mp, TOY)
    assert alone.makespan == pytest.approx(H2D + c + D2H, rel=1e-12)
    together = simulate_multi(mp, shared(TOY, 2))
    # The rule: one lane per direction per link, copies first come first served (device
    # 0 first on a tie), each at the full bandwidth. h2d: device 0 [0, H2D], device 1
    # [H2D, 2 H2D]; each computes after its load; d2h: device 0 from H2D + c, device 1
    # once its exp is done and the lane is free.
    d2h0_end = H2D + c + D2H
    d2h1_start = max(2 * H2D + c, d2h0_end)
    assert together.finish_seconds[0] == pytest.approx(d2h0_end, rel=1e-12)
    assert together.makespan == pytest.approx(d2h1_start + D2H, rel=1e-12)
    assert together.makespan > alone.makespan
    assert together.host_link_bytes == {0: {"h2d": 2 * VECTOR, "d2h": 2 * VECTOR}}
    assert together.host_link_busy[0]["h2d"] == pytest.approx(2 * H2D, rel=1e-12)
    # The per-device view: device 1 stalls a whole copy more than it does alone.
    assert together.stall_seconds[1] - alone.stall_seconds[1] >= H2D * (1 - 1e-12)


def test_a_shared_lane_serves_copies_in_the_order_they_became_ready():
    # Device 0 queues two loads, device 1 one; all on one host link. Device 1's load has
    # waited since 0, device 0's second since its first ended: device 1's goes first.
    mp = sim_plans.two_loads_and_one()
    result = simulate_multi(mp, shared(TOY, 2), timeline=True)
    loads = sorted(
        (event.start, device)
        for device, r in enumerate(result.per_device)
        for event in r.events
        if event.stream == "h2d"
    )
    assert [device for _, device in loads] == [0, 1, 0]
    assert [start for start, _ in loads] == pytest.approx([0.0, H2D, 2 * H2D], rel=1e-12)


def test_host_links_are_shared_only_by_their_own_devices():
    two = simulate_multi(sim_plans.independent((256, 256)), shared(TOY, 2))
    four = simulate_multi(sim_plans.independent((256,) * 4), shared(TOY, 2))
    assert four.makespan == pytest.approx(two.makespan, rel=1e-12)
    assert four.finish_seconds == pytest.approx(two.finish_seconds * 2, rel=1e-12)
    assert set(four.host_link_bytes) == {0, 1}
    assert all(moved == {"h2d": 2 * VECTOR, "d2h": 2 * VECTOR} for moved in
               four.host_link_bytes.values())  # fmt: skip
    one_link = simulate_multi(sim_plans.independent((256,) * 4), shared(TOY, 4))
    assert one_link.makespan > four.makespan
    assert one_link.host_link_busy[0]["h2d"] == pytest.approx(4 * H2D, rel=1e-12)


# -- results --------------------------------------------------------------------------------


def test_scaling_efficiency_is_the_speedup_per_device():
    result = simulate_multi(sim_plans.independent((256, 256)), TOY)
    # Two devices each doing half of a job that takes twice as long on one: perfect.
    assert result.speedup(2 * result.makespan) == pytest.approx(2.0)
    assert result.scaling_efficiency(2 * result.makespan) == pytest.approx(1.0)
    assert result.scaling_efficiency(result.makespan) == pytest.approx(0.5)
    with pytest.raises(PlanError, match="positive makespans, got single device 0"):
        result.scaling_efficiency(0)


def test_the_table_and_repr_name_devices_links_and_bytes():
    result = simulate_multi(sim_plans.chain(), shared(TOY, 2))
    table = result.table()
    assert table.splitlines()[0] == (
        "toy/2: any number of devices, 2 per host link; direct sends PCIe peer-to-peer over "
        "the host links"
    )
    assert "device  host link  finish ms" in table
    assert "host link 0: h2d 2.0 KiB" in table
    assert "device 0 -> device 1: 1.0 KiB through the host" in table
    assert len(result.rows()) == 3
    assert repr(result).startswith("<MultiSimResult toy/2 devices=2 makespan=")
    assert str(result) == table


# -- bad plans --------------------------------------------------------------------------------


def test_more_devices_than_the_machine_has_is_an_error():
    one = dataclasses.replace(TOY, name="one", topology=Topology(devices=1))
    with pytest.raises(PlanError, match="the plan uses 2 devices; cost model 'one' has 1"):
        simulate_multi(sim_plans.chain(), one)


def test_a_link_to_a_missing_output_is_an_error_naming_it():
    mp = sim_plans.chain()
    wrong = dataclasses.replace(mp.links[0], output="send:%9")
    placed = dataclasses.replace(mp.placed, links=(wrong,))
    named = r"has no output node named 'send:%9'; its outputs: 'send:%1'"
    with pytest.raises(GraphError, match=named):
        simulate_multi(MultiPlan(placed, mp.plans), TOY)
    far = Link(1, 0, 5, "send:%1", "recv:%1", (256,), "float32", VECTOR)
    placed = PlacedGraph(2, mp.placed.parts, (far,), mp.outputs)
    with pytest.raises(GraphError, match="device 5 is not one of the plan's 2 devices"):
        simulate_multi(MultiPlan(placed, mp.plans), TOY)


def test_a_missing_device_plan_is_an_error():
    mp = sim_plans.chain()
    with pytest.raises(GraphError, match=r"devices 0..1; got devices \[0\]"):
        simulate_multi(MultiPlan(mp.placed, mp.plans[:1]), TOY)


# -- invariants on pipelines planned under tight budgets -------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    devices=st.integers(2, 4),
    layers=st.integers(1, 3),
    width=st.sampled_from([16, 48]),
    batch=st.integers(1, 8),
    share=st.sampled_from([0.0, 0.3, 1.0]),
    per_link=st.integers(1, 4),
    model=st.sampled_from([TOY, PRESETS["h100-pcie5"], PRESETS["cpu"]]),
)
def test_pipelines_keep_every_dependency_link_and_lane(
    devices, layers, width, batch, share, per_link, model
):
    mp = sim_plans.pipeline(devices, batch, width, layers, share)
    machine = shared(model, per_link)
    result = simulate_multi(mp, machine, timeline=True)
    eps = 1e-12 * max(1.0, result.makespan)
    times = [r.node_times for r in result.per_device]
    # Every node starts after its dependencies end, and a link's input after its output.
    for d, plan in enumerate(mp.plans):
        for node in plan.mg.nodes:
            start, end = times[d][node.id]
            assert end >= start
            assert all(start + eps >= times[d][dep][1] for dep in node.deps)
    for link in mp.links:
        (out,) = [n for n in mp.plans[link.source].mg.of_kind(memgraph.NodeKind.OUTPUT)
                  if n.name == link.output]  # fmt: skip
        (got,) = [n for n in mp.plans[link.target].mg.of_kind(memgraph.NodeKind.INPUT)
                  if n.name == link.input]  # fmt: skip
        assert times[link.target][got.id][0] + eps >= times[link.source][out.id][1]
    # No two copies overlap on a host link's lane, nor two applies on a device.
    lanes: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for d, r in enumerate(result.per_device):
        for event in r.events:
            owner = d if event.stream == "compute" else machine.topology.host_link(d)
            lanes.setdefault((event.stream, owner), []).append((event.start, event.end))
    for spans in lanes.values():
        spans.sort()
        pairs = zip(spans, spans[1:], strict=False)
        assert all(a_end <= b_start + eps for (_, a_end), (b_start, _) in pairs)
    # Device 0 receives nothing: alone on its host link it runs as `simulate` times it,
    # sharing one it is no sooner done. Every device moves the bytes it moves alone and
    # is busy on each stream as long as alone. Nothing takes longer than every node one
    # after another.
    first = memgraph.simulate(mp.plans[0].mg, model, timeline=True)
    if per_link == 1:
        assert times[0] == first.node_times
    assert result.finish_seconds[0] + eps >= first.makespan
    for d, plan in enumerate(mp.plans):
        alone = memgraph.simulate(plan.mg, model)
        assert dict(result.per_device[d].bytes_moved) == dict(alone.bytes_moved)
        assert result.per_device[d].busy == pytest.approx(dict(alone.busy), rel=1e-12)
        assert result.finish_seconds[d] + eps >= max(alone.busy.values())
    serial = sum(sum(r.busy.values()) for r in result.per_device)
    assert result.makespan <= serial + eps
    # Each link moves its devices' bytes; each link between devices is sent once.
    for k, moved in result.host_link_bytes.items():
        on_link = [r for d, r in enumerate(result.per_device) if machine.topology.host_link(d) == k]
        assert moved == {s: sum(r.bytes_moved[s] for r in on_link) for s in ("h2d", "d2h")}
    assert result.sent_bytes == {(d, d + 1): 4 * batch * width for d in range(devices - 1)}
    assert result.reordered == 0
