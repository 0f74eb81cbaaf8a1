"""The device-arena allocator: where in the budget each tensor lives, and what it must wait for.

The planner simulates execution against an arena of `budget` bytes. This module hands
out aligned regions of that arena (best fit), coalesces freed neighbours into maximal
free blocks, and remembers *who freed what*: every free byte carries the MemGraph node
id of the `free` that released it (None for memory never allocated). An allocation
returns exactly the freeing nodes of the bytes it takes; those are the write-after-read
dependencies of the new `alloc` node. Coalescing never blurs this: a coalesced free
block keeps its pieces (sub-interval -> freeing node), so reusing the left half of a
block waits only on the frees of the left half.

Rules
-----
* Every request is rounded up to a multiple of `alignment` (256 bytes by default) and
  every block starts at a multiple of it; the usable arena is the given size rounded
  down to the alignment (`Allocator.size`). The alignment is a power of two no smaller
  than the largest dtype's size (`MIN_ALIGNMENT`, 8 bytes): then every tensor starts
  at a multiple of its own element size, which a GPU needs (a float32 load from an
  address that is not a multiple of 4 faults; NumPy would not notice).
* Zero-byte (and negative) requests are rejected with an `AllocationError`: the
  planner never allocates an empty tensor, so asking for one is a bug upstream, and
  silently handing out a 256-byte block would hide it.
* `try_allocate` and `allocate` take the smallest free block that fits (best fit), ties
  by lowest offset, from its lowest address; `allocate_at` takes an exact range;
  `fitting_ends` lists both ends of every free block that fits, for a placement rule
  that chooses by neighbours (the planner's "lifetime" placement, `memgraph.horizon`).
* `checkpoint()` / `rollback()` / `release()` make a group of allocations
  all-or-nothing. They keep an undo log of primitive edits while a checkpoint is open
  (nothing is logged otherwise), so a rollback costs as much as the work it undoes,
  never a copy of the whole state.

Best fit fragments far less than Einsummable's "freed earliest" (the oldest free block
that fits, which constrains concurrency least): 2.6x fewer failed requests on
synthetic tensor-program traces (`benchmarks/allocator_bench.py`, which keeps that
strategy as its comparison point).

Cost: the free blocks by offset and by `(size, offset)`, and the provenance pieces by
start, are `sortedcontainers.SortedList`s, so an operation costs O(log n); an
allocation also pays O(k) for the k pieces it overlaps (one per dependency).

>>> alloc = Allocator("1MiB")
>>> a = alloc.allocate(1000)
>>> a
Block(offset=0, size=1024, deps=())
>>> alloc.free(a.offset, freed_by=7)
>>> alloc.allocate(300)
Block(offset=0, size=512, deps=(7,))
>>> alloc
<Allocator size=1.0 MiB live=1 (512 B) free=1 largest=1023.5 KiB>
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedList

from einpage_core.errors import AllocationError
from einpage_core.units import format_bytes, parse_bytes
from taskgraph.dtypes import TABLE as DTYPE_TABLE

__all__ = [
    "DEFAULT_ALIGNMENT",
    "MIN_ALIGNMENT",
    "alignment_problem",
    "Allocator",
    "Block",
    "Checkpoint",
    "Interval",
    "Piece",
]

DEFAULT_ALIGNMENT = 256
"""Arena alignment unless asked otherwise (cudaMalloc's, and cuBLAS's preference)."""

MIN_ALIGNMENT = max(d.bits for d in DTYPE_TABLE.values()) // 8
"""The smallest alignment accepted: the size of the largest dtype (8 bytes), so that an
offset aligned to it is a multiple of every tensor's element size."""


def alignment_problem(alignment: Any) -> str | None:
    """What is wrong with `alignment` as an arena alignment, or None: it must be an int,
    a power of two, and at least `MIN_ALIGNMENT` (the largest dtype's size).

    >>> alignment_problem(256) is None, alignment_problem(12)
    (True, 'alignment must be a power of two >= 8 (the largest dtype size), got 12')
    """
    rule = f"a power of two >= {MIN_ALIGNMENT} (the largest dtype size)"
    if isinstance(alignment, bool) or not isinstance(alignment, int):
        return f"alignment must be {rule}, got {alignment!r}"
    if alignment < MIN_ALIGNMENT or alignment & (alignment - 1):
        return f"alignment must be {rule}, got {alignment}"
    return None


_SERIALS = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Block:
    """A live allocation `[offset, offset + size)`.

    `deps` are the ids of the free nodes whose released bytes this block reuses,
    sorted and without duplicates: the new alloc node must wait for them.
    """

    offset: int
    size: int
    deps: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True, slots=True)
class Interval:
    """A byte range `[offset, offset + size)` of the arena (a live block or a free block)."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True, slots=True)
class Piece:
    """Provenance of free memory: `[offset, offset + size)` was released by node `freed_by`.

    `freed_by` is None for memory that was never allocated (reusing it has no dependency).
    """

    offset: int
    size: int
    freed_by: int | None

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A token from `Allocator.checkpoint()`; `depth` is its position in the stack."""

    serial: int
    depth: int


def _bytes(n: int) -> str:
    """`1.5 MiB (1572864 B)`, or just `512 B` below a KiB."""
    text = format_bytes(n)
    return text if n < 1024 else f"{text} ({n} B)"


def _region(offset: int, size: int) -> str:
    return f"[{offset}, {offset + size}) ({format_bytes(size)})"


def _check_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AllocationError(f"{what} must be an int, got {value!r}")
    return value


class Allocator:
    """A simulated device arena of `size` bytes: aligned blocks, coalescing, provenance.

    Parameters: `size` (bytes, or a string like `"16MiB"`; rounded down to the
    alignment) and `alignment` (bytes, default 256: a power of two >= `MIN_ALIGNMENT`).

    State: free blocks (`Interval`s by offset, offsets by block end, and sorted indexes
    of offsets and of `(size, offset)`), provenance pieces tiling the free memory
    (`Piece`s by start, plus a sorted index of the starts), live blocks (offset -> size),
    and the undo log of the open checkpoints.
    """

    def __init__(self, size: int | str, alignment: int = DEFAULT_ALIGNMENT) -> None:
        problem = alignment_problem(alignment)
        if problem is not None:
            raise AllocationError(problem)
        requested = parse_bytes(size)
        usable = requested // alignment * alignment
        if usable == 0:
            raise AllocationError(
                f"arena of {requested} B is smaller than one alignment unit ({alignment} B)"
            )
        self._size = usable
        self._alignment = alignment
        # Free blocks: maximal (no two adjacent).
        self._free: dict[int, Interval] = {}  # by offset
        self._free_by_end: dict[int, int] = {}  # end -> offset
        self._free_starts = SortedList()
        self._by_size = SortedList()  # (size, offset)
        # Provenance pieces tile the free memory; adjacent pieces differ in `freed_by`.
        self._pieces: dict[int, Piece] = {}  # by start
        self._piece_starts = SortedList()
        # Live blocks.
        self._live_size: dict[int, int] = {}
        self._bytes_live = 0
        # Undo log of (function, argument) pairs that each reverse one primitive edit.
        self._log: list[tuple[Callable[[Allocator, Any], Any], Any]] = []
        self._marks: list[tuple[int, int]] = []  # (checkpoint serial, log length)
        self._raw_add_piece(Piece(0, usable, None))
        self._raw_add_free(Interval(0, usable))

    # ----------------------------------------------------------------------- queries

    @property
    def size(self) -> int:
        """Usable arena bytes (the size given, rounded down to the alignment)."""
        return self._size

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def bytes_live(self) -> int:
        return self._bytes_live

    @property
    def bytes_free(self) -> int:
        return self._size - self._bytes_live

    @property
    def largest_free(self) -> int:
        """The size of the largest free block (0 when the arena is full)."""
        if not self._by_size:
            return 0
        size, _offset = self._by_size[-1]
        return size

    @property
    def num_live(self) -> int:
        return len(self._live_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def round_up(self, nbytes: int) -> int:
        """`nbytes` rounded up to a multiple of the alignment: what a request really takes."""
        return -(-nbytes // self._alignment) * self._alignment

    def live(self) -> list[Interval]:
        """Live blocks sorted by offset."""
        sizes = self._live_size
        return [Interval(offset, sizes[offset]) for offset in sorted(sizes)]

    def free_intervals(self) -> list[Interval]:
        """Free blocks sorted by offset; they are maximal (no two are adjacent)."""
        blocks = self._free
        return [blocks[offset] for offset in self._free_starts]

    def free_pieces(self) -> list[Piece]:
        """Provenance of all free memory, sorted by offset: who freed each free range."""
        pieces = self._pieces
        return [pieces[start] for start in self._piece_starts]

    def __repr__(self) -> str:
        return (
            f"<Allocator size={format_bytes(self._size)} live={self.num_live}"
            f" ({format_bytes(self._bytes_live)}) free={self.num_free}"
            f" largest={format_bytes(self.largest_free)}>"
        )

    # ----------------------------------------------------------------------- allocate / free

    def try_allocate(self, nbytes: int) -> Block | None:
        """Allocate `nbytes` (rounded up) in the best-fitting free block; None when none fits.

        Invalid requests (not a positive int) still raise `AllocationError`.
        """
        nbytes = self._request(nbytes)
        found = next(self._by_size.irange((nbytes, -1)), None)
        if found is None:
            return None
        _size, offset = found
        return self._take(self._free[offset], offset, nbytes)

    def fitting_ends(self, nbytes: int) -> list[tuple[Interval, int]]:
        """Where `nbytes` (rounded up) could go without moving anything: for each free block
        that fits, by offset, `(block, offset)` at its low end and, when the block is
        larger, at its high end (flush against the next live block or the arena's end).
        A placement rule chooses among them by the neighbour each offset touches, then
        takes it with `allocate_at`.

        >>> alloc = Allocator(2048)
        >>> a, b = alloc.allocate(512), alloc.allocate(512)
        >>> alloc.free(a.offset, freed_by=None)
        >>> [offset for _block, offset in alloc.fitting_ends(256)]
        [0, 256, 1024, 1792]
        """
        nbytes = self._request(nbytes)
        ends = []
        for offset in self._free_starts:
            block = self._free[offset]
            if block.size < nbytes:
                continue
            ends.append((block, block.offset))
            if block.size > nbytes:
                ends.append((block, block.end - nbytes))
        return ends

    def allocate(self, nbytes: int) -> Block:
        """Allocate `nbytes` (rounded up); `AllocationError` with the numbers when nothing fits."""
        block = self.try_allocate(nbytes)
        if block is None:
            rounded = self.round_up(nbytes)
            raise AllocationError(
                f"cannot allocate {format_bytes(rounded)} ({nbytes} B requested, {rounded} B"
                f" after rounding up to {self._alignment} B): {_bytes(self.bytes_free)} free"
                f" in {self.num_free} blocks, largest free block {_bytes(self.largest_free)}"
            )
        return block

    def allocate_at(self, offset: int, nbytes: int) -> Block:
        """Allocate exactly `[offset, offset + round_up(nbytes))`, which must be entirely free."""
        nbytes = self._request(nbytes)
        offset = _check_int(offset, "offset")
        if offset % self._alignment:
            raise AllocationError(
                f"allocate_at offset {offset} is not a multiple of the alignment"
                f" ({self._alignment} B)"
            )
        if offset < 0 or offset + nbytes > self._size:
            raise AllocationError(
                f"allocate_at {_region(offset, nbytes)} is outside the arena [0, {self._size})"
            )
        holder = self._free_block_holding(offset, offset + nbytes)
        if holder is None:
            blocker = self._first_live_overlapping(offset, offset + nbytes)
            raise AllocationError(
                f"allocate_at {_region(offset, nbytes)} is not free: it overlaps the live block"
                f" {_region(blocker.offset, blocker.size)}"
            )
        return self._take(holder, offset, nbytes)

    def free(self, offset: int, freed_by: int | None) -> None:
        """Release the live block starting at `offset`; `freed_by` is the free node's id.

        Later allocations reusing these bytes depend on `freed_by` (None: no dependency).
        """
        if freed_by is not None and (_check_int(freed_by, "freed_by") < 0):
            raise AllocationError(f"freed_by must be a node id >= 0 or None, got {freed_by}")
        size = self._live_size.get(offset)
        if size is None:
            raise AllocationError(self._not_live_message(offset))
        self._remove_live(offset)
        end = offset + size

        # Provenance: one new piece, merged with neighbouring pieces freed by the same node.
        piece_start, piece_end = offset, end
        left = self._piece_before(offset)
        if left is not None and left.end == offset and left.freed_by == freed_by:
            self._remove_piece(left.offset)
            piece_start = left.offset
        right = self._pieces.get(end)
        if right is not None and right.freed_by == freed_by:
            self._remove_piece(end)
            piece_end = right.end
        self._add_piece(Piece(piece_start, piece_end - piece_start, freed_by))

        # Free blocks: coalesce with the free neighbours on either side.
        start = offset
        left_start = self._free_by_end.get(offset)
        if left_start is not None:
            start = self._remove_free(left_start).offset
        if end in self._free:
            end = self._remove_free(end).end
        self._add_free(Interval(start, end - start))

    # ----------------------------------------------------------------------- checkpoints

    def checkpoint(self) -> Checkpoint:
        """Open a checkpoint; `rollback(token)` returns to exactly this state."""
        token = Checkpoint(serial=next(_SERIALS), depth=len(self._marks))
        self._marks.append((token.serial, len(self._log)))
        return token

    def rollback(self, token: Checkpoint) -> None:
        """Undo everything since `token`; closes it and every checkpoint opened after it."""
        depth = self._open_depth(token)
        _serial, mark = self._marks[depth]
        del self._marks[depth:]
        log = self._log
        while len(log) > mark:
            undo, argument = log.pop()
            undo(self, argument)
        if not self._marks:
            log.clear()

    def release(self, token: Checkpoint) -> None:
        """Keep everything since `token`; closes it and every checkpoint opened after it."""
        depth = self._open_depth(token)
        del self._marks[depth:]
        if not self._marks:
            self._log.clear()

    @property
    def open_checkpoints(self) -> int:
        return len(self._marks)

    def check_invariants(self) -> None:
        """Check every internal invariant in O(n) (a debugging aid); raises AssertionError."""

        def require(condition: bool, message: str) -> None:
            if not condition:
                raise AssertionError(f"allocator invariant broken: {message}")

        alignment, size = self._alignment, self._size
        blocks = self.free_intervals()
        require([b.offset for b in blocks] == sorted(self._free), "free offsets index stale")
        require(list(self._by_size) == sorted((b.size, b.offset) for b in blocks), "size index")
        require(self._free_by_end == {b.end: b.offset for b in blocks}, "free end index stale")
        live = self.live()
        regions = sorted(
            [(b.offset, b.end, True) for b in blocks] + [(b.offset, b.end, False) for b in live]
        )
        cursor, previous_free = 0, False
        for start, end, is_free in regions:
            require(start == cursor, f"gap or overlap at {cursor}..{start}")
            require(
                end > start and start % alignment == 0 and end % alignment == 0,
                f"bad region [{start}, {end})",
            )
            require(not (is_free and previous_free), f"free blocks not coalesced at {start}")
            cursor, previous_free = end, is_free
        require(cursor == size, f"regions end at {cursor}, arena is {size}")
        require(self._bytes_live == sum(b.size for b in live), "bytes_live stale")
        pieces = self.free_pieces()
        require(list(self._piece_starts) == sorted(self._pieces), "piece index stale")
        for before, after in zip(pieces[:-1], pieces[1:], strict=True):
            require(
                before.end < after.offset or before.freed_by != after.freed_by,
                f"adjacent pieces with the same freed_by at {after.offset}",
            )
        covered = iter(pieces)
        for block in blocks:
            cursor = block.offset
            while cursor < block.end:
                piece = next(covered, None)
                require(
                    piece is not None and piece.offset == cursor and piece.end > cursor,
                    f"pieces do not tile free block {_region(block.offset, block.size)}",
                )
                require(cursor % alignment == 0, f"unaligned piece at {cursor}")
                cursor = piece.end
            require(cursor == block.end, f"piece overruns free block at {block.offset}")
        require(next(covered, None) is None, "pieces outside free memory")

    # ----------------------------------------------------------------------- internals

    def _request(self, nbytes: int) -> int:
        nbytes = _check_int(nbytes, "allocation size")
        if nbytes <= 0:
            raise AllocationError(
                f"allocation size must be positive, got {nbytes} B"
                " (empty tensors are never allocated)"
            )
        return self.round_up(nbytes)

    def _take(self, block: Interval, offset: int, nbytes: int) -> Block:
        """Carve `[offset, offset + nbytes)` out of the free block `block`."""
        self._remove_free(block.offset)
        end = offset + nbytes

        # Provenance: drop the pieces overlapping [offset, end), keep what sticks out.
        # They tile the free block, so each starts where the one before ends.
        piece = self._piece_before(offset + 1)  # the piece holding `offset`
        taken = [self._remove_piece(piece.offset)]
        while taken[-1].end < end:
            taken.append(self._remove_piece(taken[-1].end))
        first, last = taken[0], taken[-1]
        if first.offset < offset:
            self._add_piece(Piece(first.offset, offset - first.offset, first.freed_by))
        if last.end > end:
            self._add_piece(Piece(end, last.end - end, last.freed_by))

        # Free blocks: what is left of `block` on either side.
        if block.offset < offset:
            self._add_free(Interval(block.offset, offset - block.offset))
        if end < block.end:
            self._add_free(Interval(end, block.end - end))

        self._add_live(offset, nbytes)
        deps = {p.freed_by for p in taken if p.freed_by is not None}
        return Block(offset, nbytes, tuple(sorted(deps)))

    def _piece_before(self, offset: int) -> Piece | None:
        """The last piece starting before `offset`, or None."""
        start = next(self._piece_starts.irange(maximum=offset - 1, reverse=True), None)
        return None if start is None else self._pieces[start]

    def _free_block_holding(self, start: int, end: int) -> Interval | None:
        """The free block containing all of `[start, end)`, or None."""
        offset = next(self._free_starts.irange(maximum=start, reverse=True), None)
        if offset is None:
            return None
        block = self._free[offset]
        return block if block.end >= end else None

    def _live_block_at(self, offset: int) -> Interval | None:
        """The live block holding byte `offset`, or None (a scan: for error messages)."""
        for start, size in self._live_size.items():
            if start <= offset < start + size:
                return Interval(start, size)
        return None

    def _first_live_overlapping(self, start: int, end: int) -> Interval:
        overlapping = [b for b in self.live() if b.offset < end and start < b.end]
        return overlapping[0]

    def _not_live_message(self, offset: Any) -> str:
        message = f"cannot free offset {offset!r}: no live block starts there"
        if isinstance(offset, bool) or not isinstance(offset, int):
            return message
        if not 0 <= offset < self._size:
            return f"{message} (the arena is [0, {self._size}))"
        inside = self._live_block_at(offset)
        if inside is not None:
            return f"{message} (it is inside the live block {_region(inside.offset, inside.size)})"
        return f"{message} (that byte is free)"

    def _open_depth(self, token: Checkpoint) -> int:
        depth = getattr(token, "depth", None)
        if (
            not isinstance(token, Checkpoint)
            or depth >= len(self._marks)
            or self._marks[depth][0] != token.serial
        ):
            open_serials = [serial for serial, _mark in self._marks]
            raise AllocationError(
                f"checkpoint {token!r} is not open on this allocator"
                f" (open checkpoint serials: {open_serials})"
            )
        return depth

    # Primitive edits. Each `_raw_*` edits the state; its logged wrapper records the
    # inverse raw edit while a checkpoint is open. Rollback replays inverses, newest first.

    def _raw_add_free(self, block: Interval) -> None:
        self._free[block.offset] = block
        self._free_by_end[block.end] = block.offset
        self._free_starts.add(block.offset)
        self._by_size.add((block.size, block.offset))

    def _raw_remove_free(self, offset: int) -> Interval:
        block = self._free.pop(offset)
        del self._free_by_end[block.end]
        self._free_starts.remove(offset)
        self._by_size.remove((block.size, offset))
        return block

    def _raw_add_piece(self, piece: Piece) -> None:
        self._pieces[piece.offset] = piece
        self._piece_starts.add(piece.offset)

    def _raw_remove_piece(self, start: int) -> Piece:
        piece = self._pieces.pop(start)
        self._piece_starts.remove(start)
        return piece

    def _raw_add_live(self, interval: Interval) -> None:
        self._live_size[interval.offset] = interval.size
        self._bytes_live += interval.size

    def _raw_remove_live(self, offset: int) -> Interval:
        size = self._live_size.pop(offset)
        self._bytes_live -= size
        return Interval(offset, size)

    def _add_free(self, block: Interval) -> None:
        self._raw_add_free(block)
        if self._marks:
            self._log.append((Allocator._raw_remove_free, block.offset))

    def _remove_free(self, offset: int) -> Interval:
        block = self._raw_remove_free(offset)
        if self._marks:
            self._log.append((Allocator._raw_add_free, block))
        return block

    def _add_piece(self, piece: Piece) -> None:
        self._raw_add_piece(piece)
        if self._marks:
            self._log.append((Allocator._raw_remove_piece, piece.offset))

    def _remove_piece(self, start: int) -> Piece:
        piece = self._raw_remove_piece(start)
        if self._marks:
            self._log.append((Allocator._raw_add_piece, piece))
        return piece

    def _add_live(self, offset: int, size: int) -> None:
        self._raw_add_live(Interval(offset, size))
        if self._marks:
            self._log.append((Allocator._raw_remove_live, offset))

    def _remove_live(self, offset: int) -> None:
        interval = self._raw_remove_live(offset)
        if self._marks:
            self._log.append((Allocator._raw_add_live, interval))
