"""The residency analysis: each stay on the device, how it arrived and left, live bytes."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st
from plans import hand_assembled, reference_plan, sliced_weight_plan
from plans import two_output_mlp as mlp_graph

import einpage as ep
import memgraph
from memgraph import MemGraph, NodeKind, verify
from memgraph.residency import ARRIVALS, DEPARTURES, analyze


def drop_program() -> ep.Program:
    prog = ep.Program("drop")
    x = prog.input("x", (4, 4))
    w = prog.input("w", (4, 4), role="weight")
    prog.output((x @ w) @ w, "y")
    return prog


def test_one_residency_per_alloc_with_its_arrival_and_departure():
    tg = mlp_graph()
    mg = reference_plan(tg, offload=frozenset({3}))
    stays = mg.residencies.stays
    assert len(stays) == len(mg.of_kind(NodeKind.ALLOC))
    assert {s.arrival for s in stays} <= set(ARRIVALS)
    assert {s.departure for s in stays} <= set(DEPARTURES)
    for s in stays:
        assert mg[s.alloc].kind is NodeKind.ALLOC and mg[s.alloc].tensor == s.tensor
        writer = mg[s.writer]
        assert writer.tensor == s.tensor and writer.region == s.region
        kind = {"computed": NodeKind.APPLY, "reloaded": NodeKind.RELOAD}.get(s.arrival)
        assert kind is None or writer.kind is kind
        assert (s.free is None) == (s.departure == "resident")
        for reader in s.readers:
            assert s.alloc < reader and (s.free is None or reader < s.free)
    (offloaded,) = [s for s in stays if s.departure == "offloaded"]
    assert offloaded.tensor == 3 and mg[offloaded.offloads[0]].kind is NodeKind.OFFLOAD
    weights = {tg.inputs["w1"], tg.inputs["w2"]}
    assert {s.tensor for s in stays if s.arrival == "reloaded"} >= weights
    assert {s.role for s in stays if s.tensor in weights} == {"weight"}


def test_drops_are_frees_of_tensors_reloaded_later_with_no_copy_out():
    mg = reference_plan(drop_program().build())
    (drop,) = mg.residencies.dropped()
    w = mg.taskgraph.inputs["w"]
    assert drop.tensor == w and drop.departure == "dropped" and not drop.offloads
    assert any(n.kind is NodeKind.RELOAD and n.tensor == w and n.id > drop.free for n in mg)
    assert mg.stats.drop_count == 1 and mg.stats.drop_bytes == mg.taskgraph[w].nbytes


def test_sliced_reloads_and_sliced_offloads():
    mg = sliced_weight_plan()
    by_tensor = {s.tensor: s for s in mg.residencies.stays}
    assert by_tensor[1].arrival == "reloaded" and by_tensor[1].departure == "freed"
    assert by_tensor[2].departure == "resident"
    assembled = memgraph.plan(hand_assembled(), "64KiB")
    pieces = {n.tensor for n in assembled.nodes if n.kind is NodeKind.OFFLOAD}
    for s in assembled.residencies.stays:
        if s.tensor in pieces:
            assert s.departure == "offloaded" and len(s.offloads) == 1


@given(mask=st.integers(0, 2**9 - 1), reuse=st.booleans(), host=st.booleans())
def test_live_bytes_peak_and_drops_agree_with_stats_and_verify(mask, reuse, host):
    tg = mlp_graph()
    offload = frozenset(t for t in range(len(tg)) if mask >> t & 1)
    mg = reference_plan(tg, offload=offload, reuse=reuse, outputs_to_host=host)
    found = analyze(mg)
    assert len(found.live_bytes) == len(mg)
    assert found.peak_bytes == mg.stats.peak_bytes == verify(mg).peak_bytes
    assert found.high_water == mg.stats.high_water
    assert len(found.dropped()) == mg.stats.drop_count
    level = 0
    for node in mg.nodes:  # live bytes: allocs add, frees remove, nothing else moves them
        if node.kind is NodeKind.ALLOC:
            level += node.region.size
        elif node.kind is NodeKind.FREE:
            level -= node.region.size
        assert found.live_bytes[node.id] == level


def test_a_broken_plan_is_analysed_without_raising():
    mg = reference_plan(mlp_graph())
    alloc = mg.of_kind(NodeKind.ALLOC)[0]
    nodes = list(mg.nodes)
    nodes[alloc.id] = dataclasses.replace(alloc, tensor=999)
    free = mg.of_kind(NodeKind.FREE)[0]
    nodes[free.id] = dataclasses.replace(free, region=None)
    broken = MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment)
    found = analyze(broken)
    assert len(found.live_bytes) == len(broken)
    assert len(found.stays) == len(mg.residencies.stays) - 1
