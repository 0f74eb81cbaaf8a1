"""The multi-device simulator on direct links (`Link.path == "peer"`): a send and its recv
are one copy, timed at the peer link's bandwidth or, without one, PCIe peer-to-peer over
the host links; checked against timings computed by hand from the cost model's rates and
the TaskGraphs' FLOPs, and against the same programs with their links staged through the
host."""

from __future__ import annotations

import dataclasses
import math

import pytest
import sim_plans
from hypothesis import given, settings
from hypothesis import strategies as st

import einpage as ep
import memgraph
from einpage.errors import GraphError, PlanError
from einpage.models import llama
from memgraph.cost import PRESETS, CostModel, Topology
from memgraph.multi import MultiPlan, plan_devices, verify_multi
from memgraph.nodes import NodeKind
from memgraph.peer import direct_sends
from memgraph.simulate_multi import simulate_multi
from memgraph.trace import PEER_STREAM

# Round rates, distinct in each direction, and latencies (as tests/multi/test_simulate_multi
# has them). No device-memory roofline: a task takes latency + FLOPs / rate. The peer link
# (4 MB/s) is faster than either host-link direction; PCIE has none.
PCIE = CostModel(
    "toy", flops_per_s=1e6, device_bytes_per_s=math.inf, h2d_bytes_per_s=1e6,
    d2h_bytes_per_s=5e5, kernel_latency_s=1e-5, transfer_latency_s=2e-5,
)  # fmt: skip
NVLINK = dataclasses.replace(PCIE, name="toy+nvlink", topology=Topology(peer_bytes_per_s=4e6))


def kernel(flops: int) -> float:
    return 1e-5 + flops / 1e6


def h2d(nbytes: int) -> float:
    return 2e-5 + nbytes / 1e6


def d2h(nbytes: int) -> float:
    return 2e-5 + nbytes / 5e5


def peer(model: CostModel, nbytes: int) -> float:
    """A direct copy by hand: the copy latency, then the bytes at the peer link's rate or,
    without one, at the slower host-link direction (d2h here)."""
    rate = 4e6 if model is NVLINK else 5e5
    return 2e-5 + nbytes / rate


def chain_program() -> ep.Program:
    """x (2 x 16, on the host) -> tanh(x @ w0) -> tanh(. @ w1) -> y: placed as a pipeline
    on 2 devices, one layer each, device 0 sends its 2 x 16 float32 (128 B) to device 1."""
    prog = ep.Program("chain")
    h = prog.input("x", (2, 16), location="host")
    for i in range(2):
        h = ep.tanh(h @ prog.input(f"w{i}", (16, 16), role="weight"))
    prog.output(h, "y")
    return prog


def layer_times(mp: MultiPlan, device: int) -> float:
    """The kernels of a device's layer, by hand from its TaskGraph's FLOPs."""
    return sum(kernel(task.flops) for task in mp.placed.parts[device].tg if task.is_compute)


def ends(mp: MultiPlan, index: int = 0):
    """The send and the recv of direct link `index`."""
    link = mp.links[index]
    (send,) = [n for n in mp.plans[link.source].mg.of_kind(NodeKind.SEND) if n.link == index]
    (recv,) = [n for n in mp.plans[link.target].mg.of_kind(NodeKind.RECV) if n.link == index]
    return send, recv


# -- one copy, timed by hand ------------------------------------------------------------


@pytest.mark.parametrize("model", [NVLINK, PCIE], ids=["peer link", "pcie"])
def test_a_direct_copy_takes_latency_plus_bytes_at_its_bandwidth(model):
    mp = plan_devices(chain_program().build(), 2, "100%", sends="direct")
    verify_multi(mp)
    assert mp.info["direct"]["links"] == 1
    (link,) = mp.links
    size = link.nbytes
    assert (link.path, size) == ("peer", 128)
    result = simulate_multi(mp, model, timeline=True)
    send, recv = ends(mp)
    times0, times1 = result.per_device[0].node_times, result.per_device[1].node_times
    # Device 0 loads x (128 B) and w0 (1 KiB) one after the other on its h2d stream, runs
    # its layer, then sends; device 1 has loaded w1 long before and waits only for the
    # tensor: the copy starts when device 0's layer ends, and both ends end together.
    start = h2d(128) + h2d(1024) + layer_times(mp, 0)
    assert times0[send.id] == times1[recv.id]
    assert times0[send.id] == pytest.approx((start, start + peer(model, size)), rel=1e-12)
    # Then device 1's layer and the offload of y (128 B): the critical path.
    by_hand = start + peer(model, size) + layer_times(mp, 1) + d2h(128)
    assert result.makespan == pytest.approx(by_hand, rel=1e-12)
    # Reported: the pair's bytes, all direct; each end's direction, busy for the copy.
    assert result.sent_bytes == result.direct_bytes == {(0, 1): size}
    assert result.peer_bytes == {0: {"out": size, "in": 0}, 1: {"out": 0, "in": size}}
    assert result.peer_busy[0]["out"] == pytest.approx(peer(model, size), rel=1e-12)
    assert result.peer_busy[1] == pytest.approx({"out": 0.0, "in": peer(model, size)})
    # On the timeline: one event on each device's peer lane, the same interval.
    lanes = [[e for e in r.events if e.stream == PEER_STREAM] for r in result.per_device]
    assert [[(e.kind, e.node) for e in lane] for lane in lanes] == [
        [("send", send.id)],
        [("recv", recv.id)],
    ]
    assert (lanes[0][0].start, lanes[0][0].end) == (lanes[1][0].start, lanes[1][0].end)
    # A PCIe peer-to-peer copy crosses both host links; over the peer link it uses neither.
    crossed = size if model is PCIE else 0
    assert result.host_link_bytes[0]["d2h"] == crossed
    assert result.host_link_bytes[1]["h2d"] == 1024 + crossed
    assert result.host_link_busy[1]["h2d"] == pytest.approx(
        h2d(1024) + (peer(model, size) if model is PCIE else 0.0), rel=1e-12
    )


@pytest.mark.parametrize("model", [NVLINK, PCIE], ids=["peer link", "pcie"])
def test_a_direct_send_is_faster_than_staging_it_through_the_host(model):
    tg = chain_program().build()
    staged = plan_devices(tg, 2, "100%", sends="host")
    direct = plan_devices(tg, 2, "100%", sends="direct")
    size = staged.links[0].nbytes
    host_time = simulate_multi(staged, model).makespan
    direct_time = simulate_multi(direct, model).makespan
    # Staged: device 0 offloads the tensor, device 1 reloads it; direct: one copy.
    start = h2d(128) + h2d(1024) + layer_times(staged, 0)
    tail = layer_times(staged, 1) + d2h(128)
    assert host_time == pytest.approx(start + d2h(size) + h2d(size) + tail, rel=1e-12)
    assert direct_time == pytest.approx(start + peer(model, size) + tail, rel=1e-12)
    assert direct_time < host_time
    assert host_time - direct_time == pytest.approx(
        d2h(size) + h2d(size) - peer(model, size), rel=1e-9
    )


def test_a_pcie_peer_copy_waits_for_another_device_s_reload_on_its_host_link():
    """Devices 0, 1 and 2 on one host link (no peer link): device 0 sends a 1 KiB vector
    to device 1 direct while device 2 loads a 16 KiB weight. The h2d lane serves device
    0's load of x, then device 2's weight (both ready at 0, device order), and the copy,
    which needs that lane on the target's side, starts only when the weight is in."""
    n, m = 256, 4096
    d0 = ep.Program("p2p.0")
    d0.output(ep.exp(d0.input("x", (n,), location="host")), sim_plans.send(1))
    d1 = ep.Program("p2p.1")
    d1.output(ep.exp(d1.input(sim_plans.recv(1), (n,), location="host")), "y")
    d2 = ep.Program("p2p.2")
    d2.output(ep.exp(d2.input("w2", (m,), role="weight")), "y2")
    staged = sim_plans.multi_plan(
        [(d0.build(), (0, 1)), (d1.build(), (1, 2)), (d2.build(), (3, 4))],
        [sim_plans.link(1, 0, 1, n)],
        {"y": (1, "y"), "y2": (2, "y2")},
    )
    mp, report = direct_sends(staged)
    assert report.direct == 1
    send, recv = ends(mp)
    exp_x = kernel(mp.placed.parts[0].tg[1].flops)
    one_link = dataclasses.replace(PCIE, topology=Topology(devices_per_host_link=3))
    alone = simulate_multi(mp, PCIE, timeline=True)
    shared = simulate_multi(mp, one_link, timeline=True)
    # Own host links: the copy starts when exp(x) is done.
    ready = h2d(4 * n) + exp_x
    assert alone.per_device[0].node_times[send.id][0] == pytest.approx(ready, rel=1e-12)
    # One host link: after the weight, and the weight did not wait for the copy.
    loaded = h2d(4 * n) + h2d(4 * m)
    assert loaded > ready
    copy = (loaded, loaded + peer(PCIE, 4 * n))
    assert shared.per_device[0].node_times[send.id] == pytest.approx(copy, rel=1e-12)
    assert shared.per_device[1].node_times[recv.id] == pytest.approx(copy, rel=1e-12)
    (weight,) = [e for e in shared.per_device[2].events if e.kind == "reload"]
    assert (weight.start, weight.end) == pytest.approx((h2d(4 * n), loaded), rel=1e-12)
    # The link carried every copy of the three devices, the direct one in each direction.
    assert shared.host_link_bytes[0] == {"h2d": 4 * n + 4 * m + 4 * n, "d2h": 4 * n + 4 * n + 4 * m}


def test_a_plan_with_some_links_direct_counts_both_kinds():
    """A residual read at the end of device 1's layers under a tight budget: one link
    stays staged through the host (its copy would wait in a cycle), the other goes direct."""
    prog = ep.Program("residual")
    x = prog.input("x", (4, 32), location="host")
    h0 = ep.tanh(x @ prog.input("w0", (32, 32), role="weight"))
    a = ep.tanh(h0 @ prog.input("w1", (32, 32), role="weight"))
    for i in range(2, 5):
        a = ep.tanh(a @ prog.input(f"w{i}", (32, 32), role="weight"))
    prog.output(a + h0, "y")
    mp = plan_devices(prog.build(), 2, 5120, sends="direct")
    verify_multi(mp)
    paths = sorted(link.path for link in mp.links)
    assert paths == ["host", "peer"]
    result = simulate_multi(mp, NVLINK, timeline=True)
    assert result.sent_bytes == {(0, 1): 1024}
    assert result.direct_bytes == {(0, 1): 512}
    assert result.peer_bytes[0]["out"] == result.peer_bytes[1]["in"] == 512
    table = result.table()
    line = "device 0 -> device 1: 512 B through the host, 512 B direct (over the peer link)"
    assert line in table.splitlines()
    assert "peer out ms" in result.rows()[0]
    assert "direct=512 B" in repr(result)
    # The staged link still goes offload -> (output -> input) -> reload.
    (staged,) = [link for link in mp.links if link.path == "host"]
    (out,) = [n for n in mp.plans[0].mg.of_kind(NodeKind.OUTPUT) if n.name == staged.output]
    (got,) = [n for n in mp.plans[1].mg.of_kind(NodeKind.INPUT) if n.name == staged.input]
    times = [r.node_times for r in result.per_device]
    assert times[1][got.id][0] >= times[0][out.id][1]


# -- plans without direct links: the peer link is not read --------------------------------


@settings(max_examples=20, deadline=None)
@given(
    devices=st.integers(2, 3),
    layers=st.integers(1, 2),
    width=st.sampled_from([16, 48]),
    share=st.sampled_from([0.0, 0.5, 1.0]),
    per_link=st.integers(1, 3),
)
def test_a_plan_staged_through_the_host_ignores_the_peer_link(
    devices, layers, width, share, per_link
):
    mp = sim_plans.pipeline(devices, 2, width, layers, share)
    base = dataclasses.replace(PCIE, topology=Topology(devices_per_host_link=per_link))
    fast = dataclasses.replace(
        base, topology=Topology(devices_per_host_link=per_link, peer_bytes_per_s=4e6)
    )
    without, with_peer = (simulate_multi(mp, m, timeline=True) for m in (base, fast))
    assert with_peer.makespan == without.makespan
    assert [r.node_times for r in with_peer.per_device] == [
        r.node_times for r in without.per_device
    ]
    assert with_peer.direct_bytes == {} and with_peer.sent_bytes == without.sent_bytes
    assert all(moved == {"out": 0, "in": 0} for moved in with_peer.peer_bytes.values())
    assert not any(e.stream == PEER_STREAM for r in with_peer.per_device for e in r.events)
    assert "peer out ms" not in with_peer.rows()[0]


# -- invariants of direct copies on pipelines ------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    devices=st.integers(2, 4),
    layers=st.integers(1, 2),
    width=st.sampled_from([16, 48]),
    share=st.sampled_from([0.0, 0.3, 1.0]),
    per_link=st.integers(1, 4),
    model=st.sampled_from([NVLINK, PCIE]),
)
def test_each_copy_starts_after_both_ends_and_its_lanes_never_overlap(
    devices, layers, width, share, per_link, model
):
    mp, report = direct_sends(sim_plans.pipeline(devices, 2, width, layers, share))
    machine = dataclasses.replace(
        model,
        topology=dataclasses.replace(model.topology, devices_per_host_link=per_link),
    )
    result = simulate_multi(mp, machine, timeline=True)
    eps = 1e-12 * max(1.0, result.makespan)
    times = [r.node_times for r in result.per_device]
    for d, plan in enumerate(mp.plans):
        for node in plan.mg.nodes:
            start, end = times[d][node.id]
            assert all(start + eps >= times[d][dep][1] for dep in node.deps)
    # Lanes: a copy holds its source's out (d2h) lane and its target's in (h2d) lane.
    topology = machine.topology
    lanes: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for index, link in enumerate(mp.links):
        if link.path != "peer":
            continue
        send, recv = ends(mp, index)
        span = times[link.source][send.id]
        assert span == times[link.target][recv.id]
        assert span[1] - span[0] == pytest.approx(peer(model, link.nbytes), rel=1e-12)
        if topology.peer_bytes_per_s is None:
            out = ("d2h", topology.host_link(link.source))
            into = ("h2d", topology.host_link(link.target))
        else:
            out, into = ("peer-out", link.source), ("peer-in", link.target)
        lanes.setdefault(out, []).append(span)
        lanes.setdefault(into, []).append(span)
    for d, r in enumerate(result.per_device):
        for event in r.events:
            if event.stream in ("h2d", "d2h"):
                lanes.setdefault((event.stream, topology.host_link(d)), []).append(
                    (event.start, event.end)
                )
    for spans in lanes.values():
        spans.sort()
        assert all(a[1] <= b[0] + eps for a, b in zip(spans, spans[1:], strict=False))
    assert sum(result.direct_bytes.values()) == report.direct_bytes
    assert sum(result.sent_bytes.values()) == report.direct_bytes + report.staged_bytes
    assert result.reordered == 0


# -- a model ------------------------------------------------------------------------------------


def test_a_tensor_parallel_llama_is_faster_with_direct_sends():
    tg = llama.prefill_program(llama.PRESETS["tiny"], 1, 8).build()
    staged = plan_devices(tg, 2, "100%", strategy="tensor", sends="host")
    direct = plan_devices(tg, 2, "100%", strategy="tensor", sends="direct")
    verify_multi(direct)
    assert direct.info["direct"]["links"] == len(direct.links) > 0
    machine = PRESETS["8xh100-sxm"]
    host_run, direct_run = simulate_multi(staged, machine), simulate_multi(direct, machine)
    assert direct_run.makespan < host_run.makespan
    assert direct_run.direct_bytes == direct_run.sent_bytes == host_run.sent_bytes
    # The partial sums go both ways over NVLink, none through the host links.
    assert all(r.h2d_bytes < s.h2d_bytes for r, s in
               zip(direct_run.per_device, host_run.per_device, strict=True))  # fmt: skip
    assert direct_run.reordered == 0


# -- errors -------------------------------------------------------------------------------------


def test_simulating_one_device_of_a_direct_plan_is_an_error_naming_simulate_multi():
    mp = plan_devices(chain_program().build(), 2, "100%", sends="direct")
    with pytest.raises(PlanError, match=r"n\d+ \(send .*link 0.*memgraph.simulate_multi"):
        memgraph.simulate(mp.plans[0].mg, NVLINK)
    with pytest.raises(PlanError, match=r"recv .*simulate the plan with its devices"):
        memgraph.simulate(mp.plans[1].mg)


def test_a_direct_link_without_its_ends_or_an_end_without_its_link_is_an_error():
    tg = chain_program().build()
    direct = plan_devices(tg, 2, "100%", sends="direct")
    staged = plan_devices(tg, 2, "100%", sends="host")
    # The links say direct, the plans have no send or recv.
    peer_links = tuple(dataclasses.replace(k, path="peer") for k in staged.links)
    placed = dataclasses.replace(staged.placed, links=peer_links)
    with pytest.raises(GraphError, match=r"needs one send on device 0 and one recv on device 1; "
                                         r"found 0 send\(s\) and 0 recv\(s\)"):  # fmt: skip
        simulate_multi(MultiPlan(placed, staged.plans), NVLINK)
    # The plans have them, the link says staged through the host.
    host_links = tuple(dataclasses.replace(k, path="host") for k in direct.links)
    placed = dataclasses.replace(direct.placed, links=host_links)
    with pytest.raises(GraphError, match=r"device 0 n\d+ \(send .*names link 0: .*path 'host'"):
        simulate_multi(MultiPlan(placed, direct.plans), NVLINK)
