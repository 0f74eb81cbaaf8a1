"""Tests of memgraph.allocator: examples for each behaviour, and a stateful model check."""

from __future__ import annotations

import doctest
import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

import memgraph.allocator as allocator_module
from einpage.errors import AllocationError
from memgraph.allocator import Allocator, Block, Interval, Piece

KiB = 1024
MiB = 1024 * KiB
U = 256  # the default alignment, one "unit" in the examples below


def snapshot(alloc: Allocator) -> tuple:
    """Everything observable about an allocator's state."""
    return (
        alloc.live(),
        alloc.free_intervals(),
        alloc.free_pieces(),
        alloc.bytes_live,
        alloc.bytes_free,
        alloc.largest_free,
        repr(alloc),
    )


def carve(alloc: Allocator, sizes: list[int]) -> list[Block]:
    """Allocate blocks of these unit counts back to back from offset 0."""
    blocks = [alloc.allocate(n * U) for n in sizes]
    assert [b.offset for b in blocks] == [sum(sizes[:i]) * U for i in range(len(sizes))]
    return blocks


def test_module_doctests():
    result = doctest.testmod(allocator_module)
    assert result.attempted > 0
    assert result.failed == 0


# ----------------------------------------------------------------------------- construction


def test_size_is_rounded_down_to_the_alignment_and_accepts_strings():
    assert Allocator(1000).size == 768
    assert Allocator("16MiB").size == 16 * MiB
    assert Allocator(1000, alignment=64).size == 960
    alloc = Allocator(1000)
    assert alloc.bytes_free == 768
    assert alloc.free_intervals() == [Interval(0, 768)]


def test_arena_smaller_than_one_unit_is_rejected():
    with pytest.raises(AllocationError, match=r"100 B .*256 B"):
        Allocator(100)


@pytest.mark.parametrize("alignment", [0, -256, 1.5, True])
def test_bad_alignment_is_rejected(alignment):
    with pytest.raises(AllocationError, match="alignment"):
        Allocator(MiB, alignment=alignment)


def test_repr():
    alloc = Allocator("16MiB")
    for _ in range(3):
        alloc.allocate(512 * KiB)
    alloc.free(512 * KiB, freed_by=1)
    assert repr(alloc) == ("<Allocator size=16.0 MiB live=2 (1.0 MiB) free=2 largest=14.5 MiB>")


# ----------------------------------------------------------------------------- alignment


def test_requests_are_rounded_up_and_offsets_aligned():
    alloc = Allocator(MiB)
    a = alloc.allocate(1)
    b = alloc.allocate(257)
    c = alloc.allocate(256)
    assert (a.offset, a.size) == (0, 256)
    assert (b.offset, b.size) == (256, 512)
    assert (c.offset, c.size) == (768, 256)
    assert alloc.bytes_live == 1024
    assert alloc.round_up(1) == 256
    assert alloc.round_up(512) == 512
    assert alloc.round_up(0) == 0


def test_custom_alignment():
    alloc = Allocator(4096, alignment=64)
    assert alloc.alignment == 64
    blocks = [alloc.allocate(n) for n in (1, 65, 64, 100)]
    assert [(b.offset, b.size) for b in blocks] == [(0, 64), (64, 128), (192, 64), (256, 128)]


def test_fitting_ends_lists_both_ends_of_every_block_that_fits():
    alloc = Allocator(4096)
    blocks = [alloc.allocate(n) for n in (256, 768, 256, 1024, 256)]  # 1536 B left at the end
    alloc.free(blocks[1].offset, freed_by=None)  # [256, 1024)
    alloc.free(blocks[3].offset, freed_by=None)  # [1280, 2304)
    ends = [(block.offset, block.size, offset) for block, offset in alloc.fitting_ends(1000)]
    # 1000 B takes 1024: the 768 B hole is too small; the 1024 B one has a single end
    assert ends == [(1280, 1024, 1280), (2560, 1536, 2560), (2560, 1536, 3072)]
    for _block, offset in alloc.fitting_ends(1000):  # each is an allocatable range
        token = alloc.checkpoint()
        assert alloc.allocate_at(offset, 1000).offset == offset
        alloc.rollback(token)
    assert alloc.fitting_ends(2048) == []
    with pytest.raises(AllocationError, match="positive"):
        alloc.fitting_ends(0)


@pytest.mark.parametrize("nbytes", [0, -1, -256])
def test_non_positive_requests_are_rejected(nbytes):
    alloc = Allocator(MiB)
    with pytest.raises(AllocationError, match=rf"positive, got {nbytes} B"):
        alloc.allocate(nbytes)
    with pytest.raises(AllocationError, match=rf"positive, got {nbytes} B"):
        alloc.try_allocate(nbytes)
    with pytest.raises(AllocationError, match=rf"positive, got {nbytes} B"):
        alloc.allocate_at(0, nbytes)
    assert alloc.bytes_live == 0


@pytest.mark.parametrize("nbytes", [1.5, "256", True, None])
def test_non_int_requests_are_rejected(nbytes):
    with pytest.raises(AllocationError, match="must be an int"):
        Allocator(MiB).allocate(nbytes)


# ----------------------------------------------------------------------------- failures


def test_allocation_failure_names_request_free_bytes_and_largest_block():
    alloc = Allocator(8 * U)
    blocks = carve(alloc, [2, 1, 2, 1, 2])
    alloc.free(blocks[1].offset, freed_by=1)
    alloc.free(blocks[3].offset, freed_by=2)
    with pytest.raises(AllocationError) as info:
        alloc.allocate(300)
    message = str(info.value)
    assert "300 B requested" in message
    assert "512 B after rounding" in message
    assert "512 B free in 2 blocks" in message
    assert "largest free block 256 B" in message
    assert alloc.try_allocate(300) is None
    assert alloc.try_allocate(256).offset == 2 * U


def test_full_arena():
    alloc = Allocator(4 * U)
    assert alloc.allocate(4 * U) == Block(0, 4 * U, ())
    assert alloc.free_intervals() == []
    assert alloc.largest_free == 0
    assert alloc.try_allocate(1) is None
    with pytest.raises(AllocationError, match=r"0 B free in 0 blocks, largest free block 0 B"):
        alloc.allocate(1)


# ----------------------------------------------------------------------------- free


def test_free_of_a_non_live_offset_names_it():
    alloc = Allocator(8 * U)
    a, _b = carve(alloc, [2, 2])
    with pytest.raises(AllocationError, match=r"offset 256: .*inside the live block \[0, 512\)"):
        alloc.free(256, freed_by=1)
    with pytest.raises(AllocationError, match=r"offset 1024: .*that byte is free"):
        alloc.free(1024, freed_by=1)
    with pytest.raises(AllocationError, match=r"offset 99999: .*arena is \[0, 2048\)"):
        alloc.free(99999, freed_by=1)
    alloc.free(a.offset, freed_by=1)
    with pytest.raises(AllocationError, match="offset 0: no live block"):
        alloc.free(a.offset, freed_by=2)


@pytest.mark.parametrize("freed_by", [-1, 1.0, "3"])
def test_bad_freed_by_is_rejected(freed_by):
    alloc = Allocator(MiB)
    block = alloc.allocate(U)
    with pytest.raises(AllocationError, match="freed_by"):
        alloc.free(block.offset, freed_by=freed_by)
    assert alloc.live() == [Interval(0, U)]


@pytest.mark.parametrize("order", [(0, 1, 2), (1, 0, 2), (1, 2, 0), (2, 0, 1), (0, 2, 1)])
def test_freed_neighbours_coalesce(order):
    alloc = Allocator(6 * U)
    blocks = carve(alloc, [1, 2, 1])
    for node, i in enumerate(order):
        alloc.free(blocks[i].offset, freed_by=node)
        alloc.check_invariants()
    assert alloc.free_intervals() == [Interval(0, 6 * U)]
    assert alloc.largest_free == alloc.bytes_free == 6 * U
    assert alloc.num_free == 1


# ----------------------------------------------------------------------------- provenance


def test_never_used_memory_has_no_dependency():
    alloc = Allocator(MiB)
    assert alloc.allocate(1000).deps == ()
    assert alloc.free_pieces() == [Piece(1024, MiB - 1024, None)]


def test_coalesced_block_keeps_its_pieces_and_partial_reuse_waits_only_on_them():
    alloc = Allocator(6 * U)
    a, b, c, _d = carve(alloc, [1, 2, 1, 2])
    alloc.free(b.offset, freed_by=20)
    alloc.free(a.offset, freed_by=10)
    alloc.free(c.offset, freed_by=30)
    assert alloc.free_intervals() == [Interval(0, 4 * U)]
    assert alloc.free_pieces() == [Piece(0, U, 10), Piece(U, 2 * U, 20), Piece(3 * U, U, 30)]

    first = alloc.allocate(U)  # exactly a's bytes
    assert (first.offset, first.deps) == (0, (10,))
    assert alloc.free_pieces() == [Piece(U, 2 * U, 20), Piece(3 * U, U, 30)]

    second = alloc.allocate(U)  # the first half of b's bytes
    assert (second.offset, second.deps) == (U, (20,))
    assert alloc.free_pieces() == [Piece(2 * U, U, 20), Piece(3 * U, U, 30)]

    third = alloc.allocate(2 * U)  # the rest of b, and c
    assert (third.offset, third.deps) == (2 * U, (20, 30))
    assert alloc.free_pieces() == []


def test_free_without_a_node_adds_no_dependency_and_merges_with_never_used_memory():
    alloc = Allocator(4 * U)
    a = alloc.allocate(U)
    alloc.free(a.offset, freed_by=None)
    assert alloc.free_pieces() == [Piece(0, 4 * U, None)]
    assert alloc.allocate(4 * U).deps == ()


def test_deps_are_sorted_and_deduplicated():
    alloc = Allocator(8 * U, alignment=U)
    blocks = carve(alloc, [1, 1, 1, 1])
    for block, node in zip(blocks, [9, 3, 9, 3], strict=True):
        alloc.free(block.offset, freed_by=node)
    assert alloc.allocate(4 * U).deps == (3, 9)


def test_adjacent_pieces_freed_by_the_same_node_merge():
    alloc = Allocator(4 * U)
    a, b, _c = carve(alloc, [1, 1, 2])
    alloc.free(a.offset, freed_by=5)
    alloc.free(b.offset, freed_by=5)
    assert alloc.free_pieces() == [Piece(0, 2 * U, 5)]


# ----------------------------------------------------------------------------- strategies


def holes(sizes_and_nodes: list[tuple[int, int | None]]) -> Allocator:
    """An arena of holes (unit count, freeing node) separated by one live unit each, full."""
    total = sum(n for n, _node in sizes_and_nodes) + len(sizes_and_nodes)
    alloc = Allocator(total * U)
    holes_ = []
    for n, node in sizes_and_nodes:
        holes_.append((alloc.allocate(n * U), node))
        alloc.allocate(U)
    for block, node in holes_:
        alloc.free(block.offset, freed_by=node)
    assert alloc.bytes_free == sum(n for n, _node in sizes_and_nodes) * U
    return alloc


def test_best_fit_takes_the_smallest_block_that_fits():
    alloc = holes([(4, 1), (2, 2), (3, 3), (2, 4)])
    # free blocks: [0,4) [5,7) [8,11) [12,14) units; two of size 2: lowest offset wins
    assert alloc.allocate(2 * U).offset == 5 * U
    assert alloc.allocate(2 * U).offset == 12 * U
    # 2 units again: the 4-unit block at 0 and the 3-unit block at 8 are left: the smaller
    block = alloc.allocate(U + 1)
    assert (block.offset, block.deps) == (8 * U, (3,))
    assert alloc.allocate(2 * U).offset == 0


# ----------------------------------------------------------------------------- freed earliest

# `benchmarks/freed_earliest.py` keeps Einsummable's "freed earliest" fit (the oldest free
# block that fits) on top of the allocator, as the comparison point of the allocator
# benchmark; these tests check it picks what it says.

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load_freed_earliest():
    spec = importlib.util.spec_from_file_location(
        "freed_earliest", BENCHMARKS / "freed_earliest.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


freed_earliest = _load_freed_earliest()
oldest = freed_earliest.allocate_freed_earliest


def test_freed_earliest_doctests():
    result = doctest.testmod(freed_earliest)
    assert result.attempted > 0 and result.failed == 0


def test_freed_earliest_takes_the_oldest_block_that_fits():
    alloc = holes([(4, 8), (2, 3), (3, 5), (2, 3)])
    # ages: 8, 3, 5, 3; request of 2 units fits all: the oldest (3), lowest offset first
    block = oldest(alloc, 2 * U)
    assert (block.offset, block.deps) == (5 * U, (3,))
    block = oldest(alloc, 2 * U)
    assert (block.offset, block.deps) == (12 * U, (3,))
    # 3 units: ages 8 (size 4) and 5 (size 3): the one freed by 5
    block = oldest(alloc, 3 * U)
    assert (block.offset, block.deps) == (8 * U, (5,))
    assert oldest(alloc, 5 * U) is None


def test_freed_earliest_prefers_never_used_memory():
    alloc = Allocator(8 * U)
    a = alloc.allocate(2 * U)
    alloc.allocate(U)
    alloc.free(a.offset, freed_by=0)
    # free: [0,2) freed by 0, [3,8) never used: the never-used block wins despite being larger
    assert oldest(alloc, U) == Block(3 * U, U, ())
    # best fit would have reused the freed hole
    alloc = Allocator(8 * U)
    a = alloc.allocate(2 * U)
    alloc.allocate(U)
    alloc.free(a.offset, freed_by=0)
    assert alloc.allocate(U) == Block(0, U, (0,))


def test_freed_earliest_age_of_a_coalesced_block_is_its_latest_free():
    alloc = Allocator(9 * U)
    a, b, _sep, c, _sep2 = carve(alloc, [2, 2, 1, 3, 1])
    alloc.free(a.offset, freed_by=1)
    alloc.free(b.offset, freed_by=9)  # [0,4) becomes free when node 9 frees
    alloc.free(c.offset, freed_by=5)  # [5,8) free since node 5
    assert oldest(alloc, 2 * U).offset == 5 * U
    # the remainder [7,8) (freed by 5) is older than [0,4) (age 9) but too small for 2 units
    block = oldest(alloc, 2 * U)
    assert (block.offset, block.deps) == (0, (1,))
    # after taking [0,2), the rest of that block was freed by 9 only
    assert alloc.free_pieces() == [Piece(2 * U, 2 * U, 9), Piece(7 * U, U, 5)]
    alloc.check_invariants()


def test_freed_earliest_skips_an_older_block_that_is_too_small():
    # A 6-unit request skips the older 5-unit block for the 7-unit one.
    alloc = holes([(5, 1), (7, 2), (16, 9)])
    block = oldest(alloc, 6 * U)
    assert block.offset == 6 * U
    assert block.deps == (2,)


# ----------------------------------------------------------------------------- allocate_at


def test_allocate_at_takes_exactly_that_range():
    alloc = Allocator(8 * U)
    a, b = carve(alloc, [2, 2])
    alloc.free(a.offset, freed_by=4)
    alloc.free(b.offset, freed_by=7)
    block = alloc.allocate_at(U, 2 * U - 10)
    assert block == Block(U, 2 * U, (4, 7))
    assert alloc.free_intervals() == [Interval(0, U), Interval(3 * U, 5 * U)]
    assert alloc.free_pieces() == [Piece(0, U, 4), Piece(3 * U, U, 7), Piece(4 * U, 4 * U, None)]
    alloc.check_invariants()


def test_allocate_at_errors_name_the_culprit():
    alloc = Allocator(8 * U)
    a, _b, _c = carve(alloc, [2, 1, 1])
    with pytest.raises(
        AllocationError, match=r"\[256, 768\) .* overlaps the live block \[0, 512\)"
    ):
        alloc.allocate_at(U, 2 * U)
    alloc.free(a.offset, freed_by=0)
    # [0, 512) is free now; the request runs on into the next live block
    with pytest.raises(AllocationError, match=r"overlaps the live block \[512, 768\)"):
        alloc.allocate_at(0, 3 * U)
    with pytest.raises(AllocationError, match=r"overlaps the live block \[768, 1024\)"):
        alloc.allocate_at(3 * U, 2 * U)
    with pytest.raises(AllocationError, match="offset 100 is not a multiple of the alignment"):
        alloc.allocate_at(100, U)
    with pytest.raises(AllocationError, match=r"\[1792, 2304\) .* outside the arena \[0, 2048\)"):
        alloc.allocate_at(7 * U, 2 * U)
    with pytest.raises(AllocationError, match="outside the arena"):
        alloc.allocate_at(-U, U)
    assert alloc.live() == [Interval(2 * U, U), Interval(3 * U, U)]


# ----------------------------------------------------------------------------- queries


def test_queries_report_live_and_free_memory():
    alloc = Allocator(10 * U)
    blocks = carve(alloc, [1, 2, 3])
    alloc.free(blocks[1].offset, freed_by=0)
    assert alloc.live() == [Interval(0, U), Interval(3 * U, 3 * U)]
    assert alloc.free_intervals() == [Interval(U, 2 * U), Interval(6 * U, 4 * U)]
    assert alloc.bytes_live == 4 * U
    assert alloc.bytes_free == 6 * U
    assert alloc.largest_free == 4 * U
    assert (alloc.num_live, alloc.num_free) == (2, 2)
    assert alloc.free_intervals()[1].end == 10 * U


# ----------------------------------------------------------------------------- checkpoints


def test_rollback_restores_exactly():
    alloc = Allocator(16 * U)
    blocks = carve(alloc, [1, 2, 1, 3])
    alloc.free(blocks[1].offset, freed_by=1)
    alloc.free(blocks[3].offset, freed_by=2)
    before = snapshot(alloc)
    token = alloc.checkpoint()
    alloc.allocate(U)
    alloc.allocate_at(4 * U, 2 * U)
    alloc.free(blocks[0].offset, freed_by=3)
    alloc.free(blocks[2].offset, freed_by=4)
    alloc.allocate(5 * U)
    assert snapshot(alloc) != before
    alloc.rollback(token)
    assert snapshot(alloc) == before
    assert alloc.open_checkpoints == 0
    alloc.check_invariants()
    # the restored allocator behaves exactly as an untouched copy would
    twin = Allocator(16 * U)
    twin_blocks = carve(twin, [1, 2, 1, 3])
    twin.free(twin_blocks[1].offset, freed_by=1)
    twin.free(twin_blocks[3].offset, freed_by=2)
    for n in (1, 3, 2, 1):
        assert alloc.try_allocate(n * U) == twin.try_allocate(n * U)


def test_nested_checkpoints_follow_stack_discipline():
    alloc = Allocator(16 * U)
    s0 = snapshot(alloc)
    outer = alloc.checkpoint()
    alloc.allocate(U)
    s1 = snapshot(alloc)
    inner = alloc.checkpoint()
    alloc.allocate(U)
    assert alloc.open_checkpoints == 2
    alloc.rollback(inner)
    assert snapshot(alloc) == s1
    inner = alloc.checkpoint()
    alloc.allocate(2 * U)
    alloc.release(inner)  # keep the inner work, inside the outer checkpoint
    assert alloc.bytes_live == 3 * U
    alloc.rollback(outer)  # undoes the released inner work too
    assert snapshot(alloc) == s0


def test_rolling_back_an_outer_checkpoint_closes_the_inner_ones():
    alloc = Allocator(16 * U)
    outer = alloc.checkpoint()
    alloc.allocate(U)
    inner = alloc.checkpoint()
    alloc.allocate(U)
    alloc.rollback(outer)
    assert alloc.bytes_live == 0
    assert alloc.open_checkpoints == 0
    with pytest.raises(AllocationError, match="is not open"):
        alloc.rollback(inner)


def test_stale_or_foreign_tokens_are_rejected():
    alloc, other = Allocator(MiB), Allocator(MiB)
    token = alloc.checkpoint()
    with pytest.raises(AllocationError, match="is not open on this allocator"):
        other.rollback(token)
    alloc.release(token)
    with pytest.raises(AllocationError, match="is not open"):
        alloc.rollback(token)
    with pytest.raises(AllocationError, match="is not open"):
        alloc.release("token")


def test_nothing_is_logged_without_a_checkpoint():
    alloc = Allocator(MiB)
    alloc.allocate(U)
    assert alloc._log == []
    token = alloc.checkpoint()
    alloc.allocate(U)
    assert alloc._log
    alloc.release(token)
    assert alloc._log == []


# ----------------------------------------------------------------------------- stateful model


def model_runs(owner: list[int | None]) -> list[tuple[int, int]]:
    """Maximal runs of free units as (start, length)."""
    runs, start = [], None
    for unit, who in enumerate([*owner, 0]):
        if who is None and start is None:
            start = unit
        elif who is not None and start is not None:
            runs.append((start, unit - start))
            start = None
    return runs


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / allocate_at / free / checkpoint / rollback / release sequences,
    checked against a unit-level model: `owner[u]` is the start unit of the live block
    covering unit u (None when free), `freed[u]` the node that freed unit u."""

    strategy = "best_fit"
    live_blocks = Bundle("live_blocks")

    @initialize(
        alignment=st.sampled_from([8, 16, 256]),
        units=st.integers(1, 24),
        extra=st.integers(0, 255),
    )
    def make(self, alignment, units, extra):
        self.align = alignment
        self.units = units
        self.alloc = Allocator(units * alignment + extra % alignment, alignment)
        self.owner: list[int | None] = [None] * units
        self.freed: list[int | None] = [None] * units
        self.saved: list[tuple] = []  # (token, owner copy, freed copy)

    # -- model helpers

    def expect_block(self, block: Block, start_unit: int, nunits: int) -> None:
        assert block.offset == start_unit * self.align
        assert block.size == nunits * self.align
        covered = range(start_unit, start_unit + nunits)
        assert all(self.owner[u] is None for u in covered)
        expected_deps = sorted({self.freed[u] for u in covered} - {None})
        assert list(block.deps) == expected_deps
        for u in covered:
            self.owner[u] = start_unit
            self.freed[u] = None

    def model_choice(self, nunits: int) -> int | None:
        fits = [(start, n) for start, n in model_runs(self.owner) if n >= nunits]
        if not fits:
            return None

        def smallest(run):
            start, n = run
            return (n, start)

        def oldest(run):
            start, n = run
            return (max(-1 if f is None else f for f in self.freed[start : start + n]), start)

        keys = {"best_fit": smallest, "freed_earliest": oldest}
        start, _n = min(fits, key=keys[self.strategy])
        return start

    def fit(self, nbytes: int, use_try: bool) -> Block:
        """Allocate with the strategy under test (it fits)."""
        return self.alloc.try_allocate(nbytes) if use_try else self.alloc.allocate(nbytes)

    def expect_no_fit(self, nbytes: int, use_try: bool) -> None:
        if use_try:
            assert self.alloc.try_allocate(nbytes) is None
        else:
            with pytest.raises(AllocationError, match=f"{nbytes} B requested"):
                self.alloc.allocate(nbytes)

    # -- rules

    @rule(target=live_blocks, nbytes=st.integers(1, 26 * 256), use_try=st.booleans())
    def allocate(self, nbytes, use_try):
        nbytes = nbytes % (self.units * self.align + self.align) + 1
        nunits = -(-nbytes // self.align)
        choice = self.model_choice(nunits)
        if choice is None:
            self.expect_no_fit(nbytes, use_try)
            return multiple()
        block = self.fit(nbytes, use_try)
        assert block.size >= nbytes
        self.expect_block(block, choice, nunits)
        return block.offset

    @rule(target=live_blocks, start=st.integers(0, 25), nunits=st.integers(1, 25))
    def allocate_at(self, start, nunits):
        start %= self.units + 1
        nbytes = nunits * self.align - (self.align // 2)  # exercises rounding up
        fits = start + nunits <= self.units
        free = fits and all(self.owner[u] is None for u in range(start, start + nunits))
        if not free:
            with pytest.raises(AllocationError, match="outside the arena|not free"):
                self.alloc.allocate_at(start * self.align, nbytes)
            return multiple()
        block = self.alloc.allocate_at(start * self.align, nbytes)
        self.expect_block(block, start, nunits)
        return block.offset

    @rule(offset=consumes(live_blocks), freed_by=st.none() | st.integers(0, 40))
    def free(self, offset, freed_by):
        start = offset // self.align
        if self.owner[start] != start or offset % self.align:
            # freed already, e.g. undone by a rollback: must be an error naming it
            with pytest.raises(AllocationError, match=f"offset {offset}"):
                self.alloc.free(offset, freed_by=freed_by)
            return
        self.alloc.free(offset, freed_by=freed_by)
        unit = start
        while unit < self.units and self.owner[unit] == start:
            self.owner[unit] = None
            self.freed[unit] = freed_by
            unit += 1

    @rule(unit=st.integers(0, 30))
    def free_not_live(self, unit):
        offset = unit * self.align + (1 if unit % 3 == 0 else 0)
        start, misalignment = divmod(offset, self.align)
        if misalignment == 0 and start < self.units and self.owner[start] == start:
            return
        with pytest.raises(AllocationError, match=f"offset {offset}"):
            self.alloc.free(offset, freed_by=1)

    @rule()
    def checkpoint(self):
        self.saved.append((self.alloc.checkpoint(), self.owner.copy(), self.freed.copy()))

    @precondition(lambda self: self.saved)
    @rule(index=st.integers(0, 10), keep=st.booleans())
    def close(self, index, keep):
        index %= len(self.saved)
        token, owner, freed = self.saved[index]
        if keep:
            self.alloc.release(token)
        else:
            self.alloc.rollback(token)
            self.owner, self.freed = owner, freed
        del self.saved[index:]
        assert self.alloc.open_checkpoints == len(self.saved)

    # -- invariants

    @invariant()
    def matches_the_model(self):
        align, alloc = self.align, self.alloc
        runs = model_runs(self.owner)
        assert alloc.free_intervals() == [Interval(s * align, n * align) for s, n in runs]
        starts = sorted({u for u in self.owner if u is not None})
        lengths = [self.owner.count(s) for s in starts]
        expected_live = [
            Interval(s * align, n * align) for s, n in zip(starts, lengths, strict=True)
        ]
        assert alloc.live() == expected_live
        unit_freed: list[int | None] = [None] * self.units
        seen_free = [False] * self.units
        for piece in alloc.free_pieces():
            assert piece.offset % align == 0 and piece.size % align == 0
            for u in range(piece.offset // align, piece.end // align):
                unit_freed[u] = piece.freed_by
                seen_free[u] = True
        assert seen_free == [o is None for o in self.owner]
        assert unit_freed == [
            f if o is None else None for f, o in zip(self.freed, self.owner, strict=True)
        ]

    @invariant()
    def accounting(self):
        alloc = self.alloc
        assert alloc.size == self.units * self.align
        assert alloc.bytes_free + alloc.bytes_live == alloc.size
        assert alloc.bytes_free == self.owner.count(None) * self.align
        free = alloc.free_intervals()
        assert alloc.largest_free == max((b.size for b in free), default=0)
        for left, right in zip(free[:-1], free[1:], strict=True):
            assert left.end < right.offset  # maximal: never adjacent
        for block in alloc.live():
            assert block.offset % self.align == 0 and 0 <= block.offset < block.end <= alloc.size
        if alloc.bytes_live == 0:
            assert free == [Interval(0, alloc.size)]
        alloc.check_invariants()

    def teardown(self):
        # Free everything left: exactly one free interval spanning the arena remains.
        if not hasattr(self, "alloc"):
            return
        for token, _owner, _freed in reversed(self.saved):
            self.alloc.release(token)
        for block in self.alloc.live():
            self.alloc.free(block.offset, freed_by=None)
        assert self.alloc.free_intervals() == [Interval(0, self.alloc.size)]
        self.alloc.check_invariants()


class BestFitMachine(AllocatorMachine):
    strategy = "best_fit"


class FreedEarliestMachine(AllocatorMachine):
    """The benchmark's freed-earliest fit, on top of the allocator, against the model."""

    strategy = "freed_earliest"

    def fit(self, nbytes: int, use_try: bool) -> Block:
        return freed_earliest.allocate_freed_earliest(self.alloc, nbytes)

    def expect_no_fit(self, nbytes: int, use_try: bool) -> None:
        assert freed_earliest.allocate_freed_earliest(self.alloc, nbytes) is None


TestBestFitMachine = BestFitMachine.TestCase
TestFreedEarliestMachine = FreedEarliestMachine.TestCase


def test_the_allocator_benchmark_runs_and_compares_both_fits():
    spec = importlib.util.spec_from_file_location(
        "allocator_bench", BENCHMARKS / "allocator_bench.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules["allocator_bench"] = bench  # dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
        frag = bench.fragmentation([0], 400)
        assert set(frag) == {"best_fit", "freed_earliest"}
        assert frag["best_fit"]["requests"] == frag["freed_earliest"]["requests"] > 0
        assert set(bench.speed([50], 50)) == {"best_fit", "best_fit (checkpoint open)"}
        assert bench.stack_pattern(200)["refill"] > 0
    finally:
        sys.modules.pop("allocator_bench", None)
