"""Direct sends between devices (`plan_devices(sends="direct")`, `memgraph.peer`): on
random programs and budgets the rewritten plan verifies, each link is either a send and
a receive with no host storage for it or staged through the host with its reason
counted, the union (a send and its receive one node) is acyclic by a reference that
shares no code with `verify_multi` (`graphlib`), each device's budget, peak and regions
are the host-staged plan's, and the rewrite is deterministic; `verify_multi` rejects
mutants of a direct plan, naming what is wrong."""

from __future__ import annotations

import graphlib
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_placement import layered_programs, weighted_programs
from test_verify_multi import rejected

import einpage as ep
from einpage_core.errors import PlanError
from memgraph import MemGraph, NodeKind, min_budget, read_budget
from memgraph.multi import DevicePlan, Link, MultiPlan, plan_devices, verify_multi
from memgraph.multi_serialize import multi_to_json
from memgraph.nodes import MemNode
from memgraph.options import PlanOptions
from memgraph.peer import direct_sends
from memgraph.placement import place

HOST = PlanOptions(outputs="host")


# -- a reference for what a direct plan must be --------------------------------------


def union_is_acyclic(mp: MultiPlan) -> bool:
    """Whether the plans' dependencies, one edge per host-staged link (output before
    input) and each direct link's send and receive taken as one node have no cycle:
    `graphlib`'s topological sort, nothing of `memgraph.multi`."""
    one: dict[tuple[int, int], tuple[int, int]] = {}  # a receive -> its send
    sends = {}
    for plan in mp.plans:
        for node in plan.mg.nodes:
            if node.kind is NodeKind.SEND:
                sends[node.link] = (plan.device, node.id)
    for plan in mp.plans:
        for node in plan.mg.nodes:
            if node.kind is NodeKind.RECV:
                one[(plan.device, node.id)] = sends[node.link]
    graph: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for plan in mp.plans:
        for node in plan.mg.nodes:
            me = one.get((plan.device, node.id), (plan.device, node.id))
            graph.setdefault(me, set()).update(
                one.get((plan.device, d), (plan.device, d)) for d in node.deps
            )
    for link in mp.links:
        if link.path == "host":
            output = named(mp.plans[link.source].mg, NodeKind.OUTPUT)[link.output]
            node = named(mp.plans[link.target].mg, NodeKind.INPUT)[link.input]
            graph.setdefault((link.target, node.id), set()).add((link.source, output.id))
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError:
        return False
    return True


def named(mg: MemGraph, kind: NodeKind) -> dict[str, MemNode]:
    return {node.name: node for node in mg.nodes if node.kind is kind}


def copies(mg: MemGraph, kind: NodeKind) -> dict[int, list[MemNode]]:
    found: dict[int, list[MemNode]] = {}
    for node in mg.nodes:
        if node.kind is kind:
            found.setdefault(node.link, []).append(node)
    return found


def check_direct_plan(host: MultiPlan, direct: MultiPlan) -> None:
    """`direct` is `host` with links made direct as the module docstring says."""
    assert verify_multi(direct).links == len(host.links)
    assert union_is_acyclic(direct)
    assert [(k.task, k.source, k.target, k.output, k.input) for k in direct.links] == [
        (k.task, k.source, k.target, k.output, k.input) for k in host.links
    ]
    assert {k.path for k in host.links} <= {"host"}
    sent = [copies(p.mg, NodeKind.SEND) for p in direct.plans]
    received = [copies(p.mg, NodeKind.RECV) for p in direct.plans]
    staged_outputs = {(k.source, k.output) for k in direct.links if k.path == "host"}
    for index, (before, link) in enumerate(zip(host.links, direct.links, strict=True)):
        old_out = named(host.plans[link.source].mg, NodeKind.OUTPUT)[link.output]
        old_in = named(host.plans[link.target].mg, NodeKind.INPUT)[link.input]
        src, dst = direct.plans[link.source].mg, direct.plans[link.target].mg
        if link.path == "peer":
            assert [n.name for n in sent[link.source][index]] == [link.output]
            assert [n.name for n in received[link.target][index]] == [link.input]
            # the target's host storage and input are gone; the source's output too,
            # unless another link of the same output stays staged, and its storage unless
            # a program output is that same host copy
            assert link.input not in named(dst, NodeKind.INPUT)
            assert old_in.storage not in dst.storages
            if (link.source, link.output) not in staged_outputs:
                assert link.output not in named(src, NodeKind.OUTPUT)
                also = [
                    n.name
                    for n in host.plans[link.source].mg.nodes
                    if n.kind is NodeKind.OUTPUT
                    and n.storage == old_out.storage
                    and n.name != link.output
                ]
                assert (old_out.storage in src.storages) == bool(also)
        else:
            assert link.path == "host" and link == before
            assert index not in sent[link.source] and index not in received[link.target]
            assert named(src, NodeKind.OUTPUT)[link.output].storage == old_out.storage
            assert named(dst, NodeKind.INPUT)[link.input].storage == old_in.storage
    direct_links = [k for k in direct.links if k.path == "peer"]
    counted = dict(direct.info["direct"])
    assert counted.pop("links") == len(direct_links)
    assert counted.pop("bytes") == sum(k.nbytes for k in direct_links)
    assert sum(counted.values()) == len(direct.links) - len(direct_links)  # each reason
    assert all(n > 0 for n in counted.values())
    assert direct.info["sends"] == "direct"
    for old, new in zip(host.plans, direct.plans, strict=True):  # the same memory
        assert (new.device, new.budget) == (old.device, old.budget)
        assert new.mg.budget == old.mg.budget
        assert new.mg.stats.peak_bytes == old.mg.stats.peak_bytes
        assert regions(new.mg) == regions(old.mg)


def regions(mg: MemGraph) -> list[tuple[str, int, int, int]]:
    """Every alloc and free, in order: kind, tensor, offset, size."""
    return [
        (n.kind.value, n.tensor, n.region.offset, n.region.size)
        for n in mg.nodes
        if n.kind in (NodeKind.ALLOC, NodeKind.FREE)
    ]


def budgets_between(placed, tight: float) -> list[int]:
    """Each device's budget `tight` of the way from its smallest to its resident peak."""
    budgets = []
    for part in placed.parts:
        low, high = min_budget(part.tg)[0], read_budget(part.tg, "100%", HOST).nbytes
        budgets.append(max(low, int(low + tight * (high - low))))
    return budgets


@settings(max_examples=25, deadline=None)
@given(case=st.one_of(layered_programs(), weighted_programs()), tight=st.floats(0.0, 1.0))
def test_random_programs_go_direct_where_safe_and_keep_their_memory(case, tight):
    tg, devices = case
    placed = place(tg, devices)
    budgets = budgets_between(placed, tight)
    host = plan_devices(placed, devices, budgets)
    direct = plan_devices(placed, devices, budgets, sends="direct")
    check_direct_plan(host, direct)
    again, report = direct_sends(host)
    assert multi_to_json(again) == multi_to_json(direct)  # deterministic, byte for byte
    assert (report.direct, report.direct_bytes) == (
        direct.info["direct"]["links"],
        direct.info["direct"]["bytes"],
    )
    assert report.staged == sum(1 for k in direct.links if k.path == "host")
    if report.direct:  # a plan with direct links is not rewritten again
        with pytest.raises(PlanError, match="already has direct links"):
            direct_sends(direct)


def test_direct_sends_on_an_already_direct_plan_is_refused():
    mp = chain(3)
    assert {k.path for k in mp.links} == {"peer"}
    with pytest.raises(PlanError, match="already has direct links"):
        direct_sends(mp)


def test_a_chain_sends_every_link_direct_and_moves_less():
    """A chain over three devices: both links direct; each device moves the link's bytes
    less (no offload on the source, no reload on the target)."""
    host, direct = chain(3, "host"), chain(3)
    check_direct_plan(host, direct)
    assert [k.path for k in direct.links] == ["peer", "peer"]
    for old, new in zip(host.plans, direct.plans, strict=True):
        out = sum(k.nbytes for k in host.links if k.source == old.device)
        into = sum(k.nbytes for k in host.links if k.target == old.device)
        assert new.mg.stats.offload_bytes == old.mg.stats.offload_bytes - out
        assert new.mg.stats.reload_bytes == old.mg.stats.reload_bytes - into


# -- mutants -----------------------------------------------------------------------------


def chain(devices: int, sends: str = "direct") -> MultiPlan:
    """tanh(x @ w_i) over 2 * `devices` (16, 16) weights, x (4, 16), placed as a pipeline."""
    prog = ep.Program("chain")
    x = prog.input("x", (4, 16))
    for i in range(2 * devices):
        x = ep.tanh(x @ prog.input(f"w{i}", (16, 16), role="weight"))
    prog.output(x, "y")
    return plan_devices(prog.build(), devices, "100%", sends=sends)


def mixed() -> MultiPlan:
    """Two links from device 0 to device 1 (h1 and h2 of x -> h1 -> h2 -> y, y reading
    both on device 1): link 0 direct, link 1 staged through the host – `direct_sends` of
    the plan with link 1 hidden from it, then put back."""
    prog = ep.Program("two")
    x = prog.input("x", (4, 16))
    w = [prog.input(f"w{i}", (16, 16), role="weight") for i in range(4)]
    h1 = ep.tanh(x @ w[0])
    h2 = ep.tanh(h1 @ w[1])
    prog.output(ep.tanh(h1 @ w[3]) + ep.tanh(h2 @ w[2]), "y")
    mp = plan_devices(prog.build(), 2, "100%")
    first, second = mp.links
    assert (first.source, first.target, second.source, second.target) == (0, 1, 0, 1)
    direct, _ = direct_sends(replace(mp, placed=replace(mp.placed, links=(first,))))
    made = replace(direct, placed=replace(direct.placed, links=(direct.links[0], second)))
    assert [k.path for k in made.links] == ["peer", "host"]
    verify_multi(made)
    return made


def with_nodes(
    mp: MultiPlan, device: int, nodes: list[MemNode], storages: dict | None = None
) -> MultiPlan:
    """`mp` with device `device`'s plan made of `nodes` (and `storages`, if given; the
    budget kept)."""
    mg = mp.plans[device].mg
    storages = mg.storages if storages is None else storages
    new = MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, dict(mg.info),
                   storages)  # fmt: skip
    plans = list(mp.plans)
    plans[device] = DevicePlan(device, new, mp.plans[device].budget)
    return replace(mp, plans=tuple(plans))


def dropped(nodes: tuple[MemNode, ...], gone: int) -> list[MemNode]:
    """`nodes` without node `gone`, renumbered; a node that waited for it waits for what
    it waited for instead."""
    new_id = {n.id: n.id - (n.id > gone) for n in nodes if n.id != gone}

    def deps(node: MemNode) -> tuple[int, ...]:
        old = {d for d in node.deps if d != gone}
        if gone in node.deps:
            old |= set(nodes[gone].deps)
        return tuple(sorted(new_id[d] for d in old))

    return [replace(n, id=new_id[n.id], deps=deps(n)) for n in nodes if n.id != gone]


def inserted(nodes: tuple[MemNode, ...], after: int, node: MemNode) -> list[MemNode]:
    """`nodes` with `node` right after node `after`, renumbered."""
    new_id = {n.id: n.id + (n.id > after) for n in nodes}
    out = [replace(n, id=new_id[n.id], deps=tuple(new_id[d] for d in n.deps)) for n in nodes]
    out.insert(after + 1, replace(node, id=after + 1, deps=tuple(new_id[d] for d in node.deps)))
    return out


def only(mg: MemGraph, kind: NodeKind, link: int) -> MemNode:
    (node,) = copies(mg, kind)[link]
    return node


def test_a_dropped_send_is_named():
    """Device 0's own verifier finds the output the send stood for never produced."""
    mp = chain(2)
    send = only(mp.plans[0].mg, NodeKind.SEND, 0)
    mutant = with_nodes(mp, 0, dropped(mp.plans[0].mg.nodes, send.id))
    rejected(mutant, "device 0", f"['{mp.links[0].output}'] are never produced")


def test_a_receive_naming_a_host_link_is_named():
    """Device 1's weight "w2" (staged by the driver: its input on the host, reloaded)
    arrives instead by a receive naming link 1, which is staged through the host. Every
    link has its ends, and device 1's plan is valid alone."""
    mp = mixed()
    mg = mp.plans[1].mg
    weight = named(mg, NodeKind.INPUT)["w2"]
    (reload,) = [n for n in mg.nodes if n.kind is NodeKind.RELOAD and n.tensor == weight.tensor]
    nodes = list(mg.nodes)
    nodes[reload.id] = MemNode(reload.id, NodeKind.RECV, reload.deps, reload.tensor,
                               reload.region, name="w2", link=1)  # fmt: skip
    storages = {sid: s for sid, s in mg.storages.items() if sid != weight.storage}
    mutant = with_nodes(mp, 1, dropped(tuple(nodes), weight.id), storages)
    mutant.plans[1].mg.verified()
    rejected(mutant, "recv", "names link#1, which is no direct link to device 1")


@pytest.mark.parametrize(
    "change, words",
    [
        ({"nbytes": 1024}, ["copies", "1024 B"]),
        ({"shape": (16, 4)}, ["copies", "[16,4]"]),
        ({"dtype": "float16", "nbytes": 128}, ["copies", "float16"]),
    ],
    ids=["bytes", "shape", "dtype"],
)
def test_a_link_unlike_its_send_is_named(change, words):
    mp = chain(2)
    link = replace(mp.links[0], **change)
    mutant = replace(mp, placed=replace(mp.placed, links=(link,)))
    rejected(mutant, "link#0", "device 0's send", *words)


def test_a_send_and_its_receive_waiting_for_each_other_in_a_cycle_are_named():
    """Device 0 offloads the staged link's output after sending the direct one (a
    dependency added); device 1 allocates the direct link's region after that staged
    input (a dependency added): the copy waits for itself. Each plan is valid alone."""
    mp = mixed()
    direct, staged = mp.links
    send = only(mp.plans[0].mg, NodeKind.SEND, 0)
    output = named(mp.plans[0].mg, NodeKind.OUTPUT)[staged.output]
    recv = only(mp.plans[1].mg, NodeKind.RECV, 0)
    staged_input = named(mp.plans[1].mg, NodeKind.INPUT)[staged.input]
    (alloc,) = [
        n
        for n in mp.plans[1].mg.nodes[: recv.id]
        if n.kind is NodeKind.ALLOC and n.region == recv.region and n.tensor == recv.tensor
    ]
    assert send.id < output.id and staged_input.id < alloc.id  # the edges go backwards
    source = list(mp.plans[0].mg.nodes)
    source[output.id] = replace(output, deps=tuple(sorted({*output.deps, send.id})))
    target = list(mp.plans[1].mg.nodes)
    target[alloc.id] = replace(alloc, deps=tuple(sorted({*alloc.deps, staged_input.id})))
    mutant = with_nodes(with_nodes(mp, 0, source), 1, target)
    for plan in mutant.plans:
        plan.mg.verified()  # each device's plan is fine on its own
    assert not union_is_acyclic(mutant)
    message = rejected(mutant, "wait for each other in a cycle")
    assert send.line() in message or recv.line() in message, message
    # without the receive counting as its send's node, there would be no cycle
    assert union_is_acyclic(with_nodes(mp, 1, target)) and union_is_acyclic(
        with_nodes(mp, 0, source)
    )


def test_the_same_link_sent_twice_on_one_device_is_named():
    mp = chain(2)
    send = only(mp.plans[0].mg, NodeKind.SEND, 0)
    mutant = with_nodes(mp, 0, inserted(mp.plans[0].mg.nodes, send.id, send))
    rejected(mutant, "device 0", "link#0 is already used by")


def test_a_direct_link_whose_receive_is_missing_is_named():
    """The receive names another link (its own has none); dropped, its region is read
    before it is written (the device's own verifier says so)."""
    mp = chain(2)
    recv = only(mp.plans[1].mg, NodeKind.RECV, 0)
    nodes = list(mp.plans[1].mg.nodes)
    nodes[recv.id] = replace(recv, link=5)
    rejected(with_nodes(mp, 1, nodes), "link#0", "device 1's plan has no recv of it")
    rejected(with_nodes(mp, 1, dropped(mp.plans[1].mg.nodes, recv.id)), "device 1")


def test_a_link_whose_path_is_unknown_is_named():
    mp = chain(2)
    link = replace(mp.links[0], path="nvlink")
    rejected(replace(mp, placed=replace(mp.placed, links=(link,))), "path 'nvlink'")


def test_a_receive_of_another_name_is_named():
    mp = chain(2)
    recv = only(mp.plans[1].mg, NodeKind.RECV, 0)
    nodes = list(mp.plans[1].mg.nodes)
    nodes[recv.id] = replace(recv, name="elsewhere")
    rejected(with_nodes(mp, 1, nodes), "device 1", 'is not the input named "elsewhere"')


def test_a_direct_link_read_as_host_staged_is_named():
    """The nodes are a direct link's, the link says host: its output is gone."""
    mp = chain(2)
    link: Link = replace(mp.links[0], path="host")
    rejected(replace(mp, placed=replace(mp.placed, links=(link,))), "has no output")
