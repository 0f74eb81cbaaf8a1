"""The planner's parts: victim windows (both searches agree) and the order registry."""

from __future__ import annotations

import bisect

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import einsum_programs

import einpage as ep
from einpage.errors import PlanError
from memgraph import NodeKind, plan, verify
from memgraph.eviction import (
    NEVER,
    POLICIES,
    EvictionContext,
    Segment,
    Window,
    belady,
    choose_window,
    choose_window_ranked,
    get_policy,
    lru,
    register_policy,
)
from memgraph.orders import ORDERS, check_order, get_order, program_order, register_order

U = 256  # one alignment unit

# -- victim windows ------------------------------------------------------------------


def test_the_window_whose_soonest_use_is_latest_wins():
    segs = [
        Segment(0, U, tensor=1, rank=4),
        Segment(U, U, tensor=2, rank=7),
        Segment(2 * U, U, tensor=3, rank=9),
        Segment(3 * U, U, tensor=4, rank=3),
    ]
    assert choose_window(segs, 2 * U) == Window(U, (2, 3), 7, 0, 2 * U)


def test_free_bytes_beat_any_tensor_and_pinned_tensors_split_windows():
    segs = [
        Segment(0, U, tensor=1, rank=100),
        Segment(U, U),  # free
        Segment(2 * U, U, tensor=2, rank=5, evictable=False),
        Segment(3 * U, 2 * U, tensor=3, rank=50),
    ]
    assert choose_window(segs, 2 * U) == Window(0, (1,), 100, 0, U)
    assert choose_window(segs, 3 * U) is None  # the pinned tensor splits the arena


def test_ties_go_to_fewer_transferred_then_fewer_evicted_bytes_then_lower_offsets():
    segs = [
        Segment(0, U, tensor=1, rank=9, transfer=U),  # needs an offload
        Segment(U, U, tensor=2, rank=9),  # has a host copy
        Segment(2 * U, 2 * U, tensor=3, rank=9),
        Segment(4 * U, U, tensor=4, rank=9),
    ]
    assert choose_window(segs, U).victims == (2,)
    segs = [Segment(0, U, tensor=1, rank=9), Segment(U, U, tensor=2, rank=9)]
    assert choose_window(segs, U).offset == 0


def test_policies_rank_by_next_use_and_by_last_use():
    assert set(POLICIES) == {"belady", "lru", "belady-cost"}
    assert get_policy("belady") is belady and get_policy("lru") is lru
    early, late = context(next_use=10, last_use=3), context(next_use=5, last_use=8)
    assert belady(early) > belady(late)
    assert lru(early) > lru(late)
    with pytest.raises(PlanError, match="valid policies: 'belady', 'lru'"):
        get_policy("random")


def context(next_use: int, last_use: int, size: int = U, transfer_bytes: int = 0):
    return EvictionContext(next_use, last_use, size, transfer_bytes)


def test_a_registered_policy_is_listed_and_sees_size_and_transfer_bytes():
    def cheapest_to_move(ctx: EvictionContext) -> int:
        return -ctx.transfer_bytes

    register_policy("cheapest-to-move", cheapest_to_move)
    try:
        assert get_policy("cheapest-to-move") is cheapest_to_move
        register_policy("cheapest-to-move", cheapest_to_move)  # the same again is fine
        with pytest.raises(PlanError, match="already registered"):
            register_policy("cheapest-to-move", belady)
        with pytest.raises(PlanError, match="'belady', 'lru', 'belady-cost', 'cheapest-to-move'"):
            get_policy("random")
        dropped, offloaded = context(5, 1, transfer_bytes=0), context(5, 1, transfer_bytes=U)
        assert cheapest_to_move(dropped) > cheapest_to_move(offloaded)
    finally:
        del POLICIES["cheapest-to-move"]
    with pytest.raises(PlanError, match="non-empty string"):
        register_policy("", belady)
    with pytest.raises(PlanError, match="must be a function"):
        register_policy("numbers", 42)
    assert set(POLICIES) == {"belady", "lru", "belady-cost"}


class ListArena:
    """An `Arena` over a segment list (what the planner's residents provide)."""

    def __init__(self, segments: list[Segment]):
        self.segments_ = segments
        self.live = [s for s in segments if s.tensor is not None]
        self.offsets = [s.offset for s in self.live]
        self.size = segments[-1].offset + segments[-1].size

    def neighbours(self, offset: int) -> tuple[int, int]:
        i = bisect.bisect_left(self.offsets, offset)
        before = self.live[i - 1].offset + self.live[i - 1].size if i else 0
        after = self.offsets[i + 1] if i + 1 < len(self.offsets) else self.size
        return before, after

    def segments(self, start: int, end: int) -> list[Segment]:
        return [s for s in self.segments_ if start <= s.offset < end]


def groups_by_rank(segments: list[Segment]) -> list[list[Segment]]:
    live = sorted(
        (s for s in segments if s.tensor is not None and s.evictable),
        key=lambda s: (-s.rank, s.tensor),
    )
    groups: list[list[Segment]] = []
    for seg in live:
        if groups and groups[-1][0].rank == seg.rank:
            groups[-1].append(seg)
        else:
            groups.append([seg])
    return groups


@st.composite
def layouts(draw):
    """Live tensors and coalesced free blocks tiling an arena, with ranks and pins."""
    segments, offset, tensor, previous_free = [], 0, 0, False
    for _ in range(draw(st.integers(1, 14))):
        size = U * draw(st.integers(1, 4))
        free = not previous_free and draw(st.integers(0, 3)) == 0
        if free:
            segments.append(Segment(offset, size))
        else:
            tensor += 1
            segments.append(
                Segment(
                    offset,
                    size,
                    tensor,
                    rank=draw(st.integers(0, 6)),
                    transfer=draw(st.sampled_from([0, size])),
                    evictable=draw(st.integers(0, 4)) > 0,
                )
            )
        previous_free = free
        offset += size
    return segments


@given(segments=layouts(), units=st.integers(1, 12))
def test_the_ranked_search_finds_the_same_window_as_the_sweep(segments, units):
    arena = ListArena(segments)
    nbytes = units * U
    if any(s.tensor is None and s.size >= nbytes for s in segments):
        return  # the planner only searches when no free block fits
    expected = choose_window(segments, nbytes)
    got = choose_window_ranked(arena, groups_by_rank(segments), nbytes)
    assert got == expected
    if got is not None:
        covered = [s for s in segments if s.offset < got.offset + nbytes <= s.offset + s.size]
        assert covered and got.offset + nbytes <= arena.size
        assert got.score < NEVER


# -- orders --------------------------------------------------------------------------


def test_unknown_orders_list_the_valid_ones():
    with pytest.raises(PlanError, match="valid orders: 'program', 'memory'"):
        get_order("fastest")


def test_a_registered_order_is_listed_and_used():
    def last_first(tg):  # the inputs, then tanh before exp, then their sum
        inputs = [t.id for t in tg if t.kind == "input"]
        return [*inputs, 2, 1, 3]

    prog = ep.Program("branches")
    x = prog.input("x", (16, 16))
    prog.output(ep.exp(x) + ep.tanh(x), "y")  # tasks: x, exp, tanh, add
    tg = prog.build()
    register_order("last-first", last_first)
    try:
        assert get_order("last-first") is last_first
        mg = plan(tg, "64KiB", order="last-first")
        verify(mg)
        assert mg.info["order"] == "last-first"
        applies = [n.tensor for n in mg.nodes if n.kind is NodeKind.APPLY]
        assert applies == [2, 1, 3]  # tanh before exp, as the order says
        with pytest.raises(PlanError, match="already registered"):
            register_order("last-first", program_order)
        with pytest.raises(PlanError, match="'program', 'memory', 'last-first'"):
            get_order("fastest")
    finally:
        del ORDERS["last-first"]
    with pytest.raises(PlanError, match="must be a function"):
        register_order("nothing", None)
    assert set(ORDERS) == {"program", "memory"}


@given(tg=einsum_programs(), name=st.sampled_from(sorted(ORDERS)))
def test_every_registered_order_is_topological(tg, name):
    order = get_order(name)(tg)
    assert check_order(tg, order) == order
    assert sorted(order) == list(range(len(tg)))
