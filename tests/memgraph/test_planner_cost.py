"""The "belady-cost" policy: ranks compared at a step, merged across scales exactly, and
plans that move no more than Belady's where eviction costs differ."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from replay import check_outputs, check_plan
from strategies import program_inputs

import einpage as ep
from memgraph import plan, verify
from memgraph.eviction import (
    NEVER,
    EvictionContext,
    Rank,
    belady_cost,
    choose_window,
    choose_window_ranked,
    get_policy,
)
from memgraph.nodes import Region
from memgraph.optimal import optimal_transfers
from memgraph.residents import Residents, TensorState

U = 256
KiB = 1024


def test_ranks_compare_at_a_step():
    assert Rank(7).key(now=3) == 4 and Rank(7, 2).key(now=3) == 16
    assert Rank(NEVER, 3).key(now=5) == NEVER
    assert get_policy("belady-cost") is belady_cost


def test_an_activation_weighs_half_a_weight_and_a_scalar_its_room():
    weight = EvictionContext(10, 0, size=KiB, transfer_bytes=0, nbytes=KiB)
    activation = EvictionContext(10, 0, size=KiB, transfer_bytes=KiB, nbytes=KiB)
    offloaded = EvictionContext(10, 0, size=KiB, transfer_bytes=0, nbytes=KiB)
    scalar = EvictionContext(10, 0, size=U, transfer_bytes=4, nbytes=4)
    assert belady_cost(weight) == belady_cost(offloaded) == Rank(10, 1)
    assert belady_cost(activation) == Rank(10, 0)
    assert belady_cost(scalar).scale == 6  # 256 B freed per 8 B moved, times 2
    assert belady_cost(EvictionContext(10, 0, size=KiB, transfer_bytes=0)).scale == 1


@st.composite
def residents(draw):
    """Live tensors tiling part of an arena, with next uses, host copies, pins and sizes."""
    tensors: dict[int, TensorState] = {}
    offset = 0
    for i in range(draw(st.integers(1, 12))):
        offset += U * draw(st.integers(0, 2))  # a free gap before it, maybe
        units = draw(st.integers(1, 4))
        nbytes = draw(st.sampled_from([4, units * U - 100, units * U]))
        uses = sorted(draw(st.lists(st.integers(10, 60), max_size=3, unique=True)))
        tensor = TensorState(i, nbytes, units * U, uses=uses)
        tensor.region = Region(offset, units * U)
        tensor.writer = None if draw(st.integers(0, 9)) == 0 else 1  # None: unwritten
        tensor.storage = draw(st.sampled_from([None, 0]))
        tensor.pins = int(draw(st.integers(0, 5)) == 0)
        tensors[i] = tensor
        offset += units * U
    size = offset + U * draw(st.integers(0, 2))
    arena = Residents(size, belady_cost, tensors)
    for tensor in tensors.values():
        arena.add(tensor)
    return arena


@given(arena=residents(), nows=st.lists(st.integers(0, 9), min_size=1, max_size=3))
def test_ranked_groups_merge_the_scales_in_key_order(arena, nows):
    for now in nows:  # searches at several steps: each restores what it popped
        groups = list(arena.ranked_groups(now))
        arena.restore()
        flat = [seg for group in groups for seg in group]
        evictable = [t for t in arena.tensors.values() if not t.pins and t.writer is not None]
        assert sorted(s.tensor for s in flat) == sorted(t.id for t in evictable)
        keys = [group[0].rank for group in groups]
        assert keys == sorted(keys, reverse=True) and len(set(keys)) == len(keys)
        for group in groups:
            for seg in group:
                expected = belady_cost(_context(arena.tensors[seg.tensor])).key(now)
                assert seg.rank == expected == group[0].rank


def _context(tensor: TensorState) -> EvictionContext:
    transfer = 0 if tensor.storage is not None else tensor.nbytes
    return EvictionContext(tensor.next_use, tensor.last_use, tensor.size, transfer, tensor.nbytes)


@given(arena=residents(), now=st.integers(0, 9), units=st.integers(1, 10))
def test_the_ranked_search_agrees_with_the_sweep_at_any_step(arena, now, units):
    nbytes = units * U
    free = arena.size - sum(t.size for t in arena.tensors.values())
    got = choose_window_ranked(arena, arena.ranked_groups(now), nbytes)
    arena.restore()
    segments = arena.segments()
    if any(s.tensor is None and s.size >= nbytes for s in segments) or free < 0:
        return  # the planner searches only when no free block fits
    assert got == choose_window(segments, nbytes)


def waiting_activation(passes: int = 2):
    """Two passes over three 1 KiB weights; each pass makes a 1 KiB activation `k` that the
    next pass reads after all its weights: Belady evicts `k` (needed last), which costs an
    offload and a reload, where dropping a weight costs one reload."""
    prog = ep.Program("waiting")
    weights = [prog.input(f"w{i}", (256,), role="weight") for i in range(3)]
    h = prog.input("x", (256,))
    k = None
    for _ in range(passes):
        for w in weights:
            h = ep.tanh(h * w)
        if k is not None:
            h = h + k
        k = ep.exp(h)
    prog.output(h + k, "y")
    return prog.build()


@pytest.mark.parametrize("budget", [4 * KiB, 5 * KiB])
def test_belady_cost_drops_weights_rather_than_offload_activations(budget):
    tg = waiting_activation()
    moved = {}
    for policy in ("belady", "belady-cost"):
        mg = plan(tg, budget, eviction=policy, lookahead=0, alignment=U)
        check_plan(mg)
        check_outputs(mg, program_inputs(tg, 5))
        moved[policy] = mg.stats.offload_bytes + mg.stats.reload_bytes
    best = optimal_transfers(tg, budget, alignment=U, recompute=False).moved_bytes
    assert best == moved["belady-cost"] < moved["belady"]


def scalars_program():
    """Four 4-byte scalars and a 1 KiB activation `a` wait while a chain of 1 KiB steps
    runs; the scalars are summed before `a` is read. Each scalar frees an alignment unit
    (256 B) for 8 bytes moved; `a` frees 1 KiB for 2 KiB (offload and reload)."""
    prog = ep.Program("scalars")
    x = prog.input("x", (256,))
    a = ep.exp(x)
    scalars = [prog.einsum("i->", x, join=f"a * {i + 1.0}") for i in range(4)]
    chain = ep.tanh(ep.tanh(ep.tanh(x)))
    total = scalars[0]
    for scalar in scalars[1:]:
        total = total + scalar
    prog.output(prog.einsum("i,i,->", chain, a, total, join="a * b + c"), "y")
    return prog.build()


@pytest.mark.parametrize("units", [12, 13, 14, 15])
def test_belady_cost_evicts_scalars_before_an_activation_that_needs_an_offload(units):
    tg = scalars_program()
    budget = units * U
    moved = {}
    for policy in ("belady", "belady-cost"):
        mg = plan(tg, budget, eviction=policy, lookahead=0)
        verify(mg)
        check_outputs(mg, program_inputs(tg, 1))
        moved[policy] = mg.stats.offload_bytes + mg.stats.reload_bytes
    assert moved["belady"] == 2 * KiB  # `a`, offloaded and reloaded
    assert moved["belady-cost"] == 8 * (16 - units)  # one scalar per missing unit
    assert moved["belady-cost"] == optimal_transfers(tg, budget, recompute=False).moved_bytes
