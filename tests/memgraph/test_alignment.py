"""Alignment of device regions: every tensor starts at a multiple of its element size.

A GPU faults on a load of a float32 from an address that is not a multiple of 4 (of a
float64 from one not a multiple of 8); NumPy views such bytes without complaint, so
the runtime's CPU tests cannot catch it. Three guards: the planner's alignment must be
a power of two >= the largest dtype size (8 bytes), so every offset it hands out suits
every dtype; the verifier checks each region's offset against the plan's alignment and
the element size of each tensor seen there; and the test oracle checks the same by its
own reasoning (its rule S5), on plans that did not come from the planner.
"""

from __future__ import annotations

import dataclasses

import pytest
from oracle import judge
from plans import reference_plan

import einpage as ep
import memgraph
from einpage.errors import AllocationError, PlanError, VerificationError
from memgraph import MemGraph, NodeKind, Region, verify
from memgraph.allocator import MIN_ALIGNMENT, Allocator


def mixed_program():
    """float16, float32 and float64 tensors of odd sizes: packed back to back at a small
    alignment, some would start inside another's element."""
    prog = ep.Program("mixed")
    h = prog.input("h", (3,), "float16")
    x = prog.input("x", (5,), "float32")
    d = prog.input("d", (3,), "float64")
    prog.output(prog.einsum("i,j->ij", h, h), "hh")
    prog.output(prog.einsum("i,j->ij", x, x), "xx")
    prog.output(prog.einsum("i,j->ij", d, d), "dd")
    return prog.build()


def test_the_largest_dtype_sets_the_smallest_alignment():
    assert MIN_ALIGNMENT == 8


@pytest.mark.parametrize("alignment", [1, 2, 4, 12, 24, 0, -8, 2.0, True])
def test_plan_refuses_an_alignment_that_is_not_a_power_of_two_of_at_least_8(alignment):
    tg = mixed_program()
    with pytest.raises(PlanError, match=r"alignment must be a power of two >= 8 \(the largest"):
        memgraph.plan(tg, "64KiB", alignment=alignment)
    with pytest.raises(AllocationError, match=r"alignment must be a power of two >= 8"):
        Allocator(4096, alignment=alignment)


@pytest.mark.parametrize("alignment", [8, 16, 256, 4096])
def test_every_region_of_a_plan_starts_at_a_multiple_of_its_element_size(alignment):
    tg = mixed_program()
    mg = memgraph.plan(tg, "64KiB", alignment=alignment)
    for node in mg.nodes:
        if node.kind is NodeKind.ALLOC:
            size = tg[node.tensor].nbytes // tg[node.tensor].size
            assert node.region.offset % alignment == 0
            assert node.region.offset % size == 0
    assert verify(mg).nodes == len(mg)


def shifted(mg: MemGraph, by: int, alignment: int) -> MemGraph:
    """`mg` with every device region moved up by `by` bytes, declared at `alignment`."""

    def move(region: Region | None) -> Region | None:
        return None if region is None else Region(region.offset + by, region.size)

    nodes = tuple(
        dataclasses.replace(n, region=move(n.region), reads=tuple(map(move, n.reads)))
        for n in mg.nodes
    )
    return MemGraph(mg.taskgraph, nodes, mg.budget + by, alignment, mg.info, mg.storages)


def test_the_verifier_and_the_oracle_refuse_a_tensor_inside_an_element():
    """A plan (hand-made, or read from JSON) at alignment 2 whose float32 tensors start at
    byte 2 of a word: its offsets honour its own alignment, its tensors' do not."""
    prog = ep.Program("f32")
    x = prog.input("x", (4, 8))
    w = prog.input("w", (8, 4), role="weight")
    prog.output(x @ w, "y")
    mg = reference_plan(prog.build())
    first_alloc = next(n for n in mg.nodes if n.kind is NodeKind.ALLOC)
    bad = shifted(mg, 2, alignment=2)
    with pytest.raises(VerificationError, match=r"not a multiple of its element size \(4 B\)") as e:
        verify(bad)
    assert e.value.node == first_alloc.id
    verdict = judge(bad.to_json())
    assert (verdict.accepted, verdict.node, verdict.rule) == (False, first_alloc.id, "S5")
    good = shifted(mg, 4, alignment=4)  # a multiple of 4: a float32 tensor's own alignment
    assert verify(good).nodes == len(mg)
    assert judge(good.to_json()).accepted


def test_a_float64_tensor_at_a_multiple_of_4_is_refused():
    prog = ep.Program("f64")
    d = prog.input("d", (3,), "float64")
    prog.output(prog.einsum("i,j->ij", d, d), "dd")
    mg = reference_plan(prog.build())
    bad = shifted(mg, 4, alignment=4)
    with pytest.raises(VerificationError, match=r"float64\) at offset 0x4.*element size \(8 B\)"):
        verify(bad)
    assert judge(bad.to_json()).rule == "S5"
