"""The device-arena allocator: where in the budget each tensor lives, and what it must wait for.

The planner simulates execution against an arena of `budget` bytes. This module hands
out aligned regions of that arena, coalesces freed neighbours into maximal free blocks,
and remembers *who freed what*: every free byte carries the MemGraph node id of the
`free` that released it (None for memory never allocated). An allocation returns
exactly the freeing nodes of the bytes it takes; those are the write-after-read
dependencies of the new `alloc` node. Coalescing never blurs this: a coalesced free
block keeps its pieces (sub-interval -> freeing node), so reusing the left half of a
block waits only on the frees of the left half.

Rules
-----
* Every request is rounded up to a multiple of `alignment` (256 bytes by default) and
  every block starts at a multiple of it; the usable arena is the given size rounded
  down to the alignment (`Allocator.size`).
* Zero-byte (and negative) requests are rejected with an `AllocationError`: the
  planner never allocates an empty tensor, so asking for one is a bug upstream, and
  silently handing out a 256-byte block would hide it.
* A chosen free block is always used from its lowest address.
* `checkpoint()` / `rollback()` / `release()` (or `with alloc.transaction(): ...`)
  make a group of allocations all-or-nothing. They keep an undo log of primitive
  edits while a checkpoint is open (nothing is logged otherwise), so a rollback costs
  as much as the work it undoes, never a copy of the whole state.

Fit strategies (`STRATEGIES`, looked up by name with `get_strategy`)
--------------------------------------------------------------------
* `"best_fit"`: the smallest free block that fits, ties by lowest offset.
  O(log n) with a list of `(size, offset)` kept sorted with bisect.
* `"freed_earliest"` (Einsummable's "lowest dependency"): among the free blocks that
  fit, the one whose freeing is oldest, so the new allocation waits on the oldest free
  and constrains concurrency least; ties by lowest offset. A block's age is the
  largest freeing node id among its pieces (when it became entirely free); memory
  never used is oldest of all. Blocks are bucketed by `size.bit_length()`, each
  bucket sorted by age: every block in a bucket above the request's fits, so only
  the request's own bucket is scanned, and only while its entries are older than the
  best candidate found above (linear in that bucket in the worst case).

Measured with `python benchmarks/allocator_bench.py` (4 synthetic tensor-program
traces of 6,000 requests each on a 512 MiB arena; "frag. failures" are requests that
failed although the free bytes summed to enough):

    strategy         failures  frag. failures  mean largest_free/bytes_free
    best_fit              433             196                          0.652
    freed_earliest        568             331                          0.565

best_fit fragments less, so it is the default (`DEFAULT_STRATEGY`). Speed (one free
plus one allocate = 2 ops, steady state, Python 3.11):

    live blocks          1k          10k          50k
    best_fit        323k op/s    265k op/s    156k op/s
    freed_earliest  229k op/s    161k op/s     86k op/s

>>> alloc = Allocator("1MiB")
>>> a = alloc.allocate(1000)
>>> a
Block(offset=0, size=1024, deps=())
>>> alloc.free(a.offset, freed_by=7)
>>> alloc.allocate(300)
Block(offset=0, size=512, deps=(7,))
>>> alloc
<Allocator size=1.0 MiB live=1 (512 B) free=1 largest=1023.5 KiB strategy=best_fit>
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from einpage.errors import AllocationError
from einpage.units import format_bytes, parse_bytes

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "Allocator",
    "BestFit",
    "Block",
    "Checkpoint",
    "FitStrategy",
    "FreedEarliest",
    "Interval",
    "Piece",
    "get_strategy",
]

DEFAULT_ALIGNMENT = 256
DEFAULT_STRATEGY = "best_fit"

# How "never freed by any node" is stored internally (None in the public API). It is
# below every node id, so memory never used counts as the oldest free memory.
_NEVER = -1
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


# --------------------------------------------------------------------------- strategies


class FitStrategy:
    """Chooses the free block that serves a request; keeps whatever index it needs.

    The allocator reports every free block that appears (`add`) or disappears
    (`remove`) with its offset, size and age (the largest freeing node id among its
    pieces, -1 for memory never used; exact only when `uses_age` is set). `choose`
    gets the rounded request and the allocator's list of `(size, offset)` of all free
    blocks, sorted, and returns the offset of the chosen free block, or None when no
    block fits.
    """

    name: ClassVar[str]
    uses_age: ClassVar[bool] = False

    def add(self, offset: int, size: int, age: int) -> None:
        """A free block appeared."""

    def remove(self, offset: int, size: int, age: int) -> None:
        """A free block disappeared (it was taken, split or coalesced)."""

    def choose(self, nbytes: int, by_size: list[tuple[int, int]]) -> int | None:
        raise NotImplementedError

    def check(self, blocks: list[tuple[int, int, int]]) -> None:
        """Raise AssertionError unless the index holds exactly these `(offset, size, age)`."""


class BestFit(FitStrategy):
    """The smallest free block that fits; ties by lowest offset. O(log n)."""

    name = "best_fit"

    def choose(self, nbytes: int, by_size: list[tuple[int, int]]) -> int | None:
        i = bisect_left(by_size, (nbytes, -1))
        if i == len(by_size):
            return None
        _size, offset = by_size[i]
        return offset


class FreedEarliest(FitStrategy):
    """Among the blocks that fit, the one freed earliest; ties by lowest offset.

    Blocks live in buckets by `size.bit_length()`, each a list of `(age, offset, size)`
    kept sorted. A block in a higher bucket than the request always fits; in the
    request's own bucket it may not, so that bucket is scanned in age order, but only
    while its entries are older than the best block found in the higher buckets.
    """

    name = "freed_earliest"
    uses_age = True

    def __init__(self) -> None:
        self._buckets: list[list[tuple[int, int, int]]] = [[] for _ in range(65)]

    def add(self, offset: int, size: int, age: int) -> None:
        insort(self._buckets[size.bit_length()], (age, offset, size))

    def remove(self, offset: int, size: int, age: int) -> None:
        bucket = self._buckets[size.bit_length()]
        del bucket[bisect_left(bucket, (age, offset, size))]

    def choose(self, nbytes: int, by_size: list[tuple[int, int]]) -> int | None:
        if not by_size or by_size[-1][0] < nbytes:
            return None
        k = nbytes.bit_length()
        best = min((bucket[0] for bucket in self._buckets[k + 1 :] if bucket), default=None)
        for entry in self._buckets[k]:
            if best is not None and entry >= best:
                break
            _age, _offset, size = entry
            if size >= nbytes:
                best = entry
                break
        if best is None:
            return None
        _age, offset, _size = best
        return offset

    def check(self, blocks: list[tuple[int, int, int]]) -> None:
        expected = sorted((age, offset, size) for offset, size, age in blocks)
        held = sorted(entry for bucket in self._buckets for entry in bucket)
        if held != expected:
            raise AssertionError(f"freed_earliest index is stale: {held} != {expected}")
        for k, bucket in enumerate(self._buckets):
            if bucket != sorted(bucket) or any(size.bit_length() != k for _a, _o, size in bucket):
                raise AssertionError(f"freed_earliest bucket {k} is unsorted or misfiled")


STRATEGIES: dict[str, type[FitStrategy]] = {
    BestFit.name: BestFit,
    FreedEarliest.name: FreedEarliest,
}


def get_strategy(name: str) -> type[FitStrategy]:
    """The fit strategy registered under `name`; an unknown name lists the valid ones."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        valid = ", ".join(repr(known) for known in STRATEGIES)
        raise AllocationError(f"unknown fit strategy {name!r}; valid strategies: {valid}") from None


# --------------------------------------------------------------------------- allocator


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
    alignment), `alignment` (bytes, default 256), `strategy` (a name in `STRATEGIES`).

    State: free blocks (maximal, sorted by offset, plus a `(size, offset)` index),
    provenance pieces tiling the free memory (parallel lists sorted by offset), live
    blocks (sorted offsets plus offset -> size), and the undo log of open checkpoints.
    """

    def __init__(
        self,
        size: int | str,
        alignment: int = DEFAULT_ALIGNMENT,
        strategy: str = DEFAULT_STRATEGY,
    ) -> None:
        alignment = _check_int(alignment, "alignment")
        if alignment <= 0:
            raise AllocationError(f"alignment must be positive, got {alignment}")
        requested = parse_bytes(size)
        usable = requested // alignment * alignment
        if usable == 0:
            raise AllocationError(
                f"arena of {requested} B is smaller than one alignment unit ({alignment} B)"
            )
        self._size = usable
        self._alignment = alignment
        self._strategy_name = strategy
        self._strategy = get_strategy(strategy)()
        # Free blocks: maximal (no two adjacent), sorted by offset.
        self._free_starts: list[int] = []
        self._free_size: dict[int, int] = {}
        self._free_age: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        # Provenance pieces tile the free memory exactly; adjacent pieces differ in freed_by.
        self._piece_starts: list[int] = [0]
        self._piece_ends: list[int] = [usable]
        self._piece_by: list[int] = [_NEVER]
        # Live blocks.
        self._live_starts: list[int] = []
        self._live_size: dict[int, int] = {}
        self._bytes_live = 0
        # Undo log: (function, arguments) that reverse one primitive edit each.
        self._log: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._marks: list[tuple[int, int]] = []  # (checkpoint serial, log length)
        self._raw_add_free(0, usable, _NEVER)

    # ----------------------------------------------------------------------- queries

    @property
    def size(self) -> int:
        """Usable arena bytes (the size given, rounded down to the alignment)."""
        return self._size

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def strategy(self) -> str:
        """The name of the fit strategy."""
        return self._strategy_name

    @property
    def bytes_live(self) -> int:
        return self._bytes_live

    @property
    def bytes_free(self) -> int:
        return self._size - self._bytes_live

    @property
    def largest_free(self) -> int:
        """The size of the largest free block (0 when the arena is full)."""
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def num_live(self) -> int:
        return len(self._live_starts)

    @property
    def num_free(self) -> int:
        return len(self._free_starts)

    def round_up(self, nbytes: int) -> int:
        """`nbytes` rounded up to a multiple of the alignment: what a request really takes."""
        return -(-nbytes // self._alignment) * self._alignment

    def live(self) -> list[Interval]:
        """Live blocks sorted by offset."""
        sizes = self._live_size
        return [Interval(offset, sizes[offset]) for offset in self._live_starts]

    def free_intervals(self) -> list[Interval]:
        """Free blocks sorted by offset; they are maximal (no two are adjacent)."""
        sizes = self._free_size
        return [Interval(offset, sizes[offset]) for offset in self._free_starts]

    def free_pieces(self) -> list[Piece]:
        """Provenance of all free memory, sorted by offset: who freed each free range."""
        return [
            Piece(start, end - start, None if by == _NEVER else by)
            for start, end, by in zip(
                self._piece_starts, self._piece_ends, self._piece_by, strict=True
            )
        ]

    def is_free(self, offset: int, nbytes: int) -> bool:
        """Whether `allocate_at(offset, nbytes)` would succeed (aligned, inside, all free)."""
        if offset < 0 or offset % self._alignment or nbytes <= 0:
            return False
        end = offset + self.round_up(nbytes)
        j = bisect_right(self._free_starts, offset) - 1
        if j < 0:
            return False
        start = self._free_starts[j]
        return start + self._free_size[start] >= end

    def __repr__(self) -> str:
        return (
            f"<Allocator size={format_bytes(self._size)} live={self.num_live}"
            f" ({format_bytes(self._bytes_live)}) free={self.num_free}"
            f" largest={format_bytes(self.largest_free)} strategy={self._strategy_name}>"
        )

    # ----------------------------------------------------------------------- allocate / free

    def try_allocate(self, nbytes: int) -> Block | None:
        """Allocate `nbytes` (rounded up) with the fit strategy; None when no block fits.

        Invalid requests (not a positive int) still raise `AllocationError`.
        """
        nbytes = self._request(nbytes)
        start = self._strategy.choose(nbytes, self._by_size)
        if start is None:
            return None
        return self._take(start, start, nbytes)

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
        j = bisect_right(self._free_starts, offset) - 1
        if j >= 0:
            start = self._free_starts[j]
            if start + self._free_size[start] >= offset + nbytes:
                return self._take(start, offset, nbytes)
        blocker = self._first_live_overlapping(offset, offset + nbytes)
        raise AllocationError(
            f"allocate_at {_region(offset, nbytes)} is not free: it overlaps the live block"
            f" {_region(blocker.offset, blocker.size)}"
        )

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
        by = _NEVER if freed_by is None else freed_by

        # Provenance: one new piece, merged with neighbours freed by the same node.
        starts, ends, bys = self._piece_starts, self._piece_ends, self._piece_by
        lo = hi = bisect_left(starts, offset)
        piece_start, piece_end = offset, end
        if lo > 0 and ends[lo - 1] == offset and bys[lo - 1] == by:
            lo -= 1
            piece_start = starts[lo]
        if hi < len(starts) and starts[hi] == end and bys[hi] == by:
            piece_end = ends[hi]
            hi += 1
        self._splice(lo, hi, [piece_start], [piece_end], [by])

        # Free blocks: coalesce with the free neighbours on either side.
        block_start, block_end, age = offset, end, by
        j = bisect_left(self._free_starts, offset)
        if j > 0:
            left = self._free_starts[j - 1]
            if left + self._free_size[left] == offset:
                _size, left_age = self._remove_free(left)
                block_start, age = left, max(age, left_age)
        if end in self._free_size:
            right_size, right_age = self._remove_free(end)
            block_end, age = end + right_size, max(age, right_age)
        self._add_free(block_start, block_end - block_start, age)

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
            undo, args = log.pop()
            undo(*args)
        if not self._marks:
            log.clear()

    def release(self, token: Checkpoint) -> None:
        """Keep everything since `token`; closes it and every checkpoint opened after it."""
        depth = self._open_depth(token)
        del self._marks[depth:]
        if not self._marks:
            self._log.clear()

    @contextmanager
    def transaction(self) -> Iterator[Checkpoint]:
        """All-or-nothing: roll back if the block raises, keep its work otherwise.

        >>> alloc = Allocator(1024, alignment=256)
        >>> try:
        ...     with alloc.transaction():
        ...         _ = alloc.allocate(512)
        ...         _ = alloc.allocate(1024)
        ... except AllocationError:
        ...     pass
        >>> alloc.bytes_live
        0
        """
        token = self.checkpoint()
        try:
            yield token
        except BaseException:
            self.rollback(token)
            raise
        self.release(token)

    @property
    def open_checkpoints(self) -> int:
        return len(self._marks)

    def check_invariants(self) -> None:
        """Check every internal invariant in O(n) (a debugging aid); raises AssertionError."""

        def require(condition: bool, message: str) -> None:
            if not condition:
                raise AssertionError(f"allocator invariant broken: {message}")

        alignment, size = self._alignment, self._size
        free = self.free_intervals()
        live = self.live()
        require(self._free_starts == sorted(self._free_size), "free starts unsorted")
        require(self._live_starts == sorted(self._live_size), "live starts unsorted")
        require(self._by_size == sorted((b.size, b.offset) for b in free), "size index stale")
        regions = sorted(
            [(b.offset, b.end, True) for b in free] + [(b.offset, b.end, False) for b in live]
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
        for before, after in zip(pieces[:-1], pieces[1:], strict=True):
            require(before.end <= after.offset, f"pieces overlap at {after.offset}")
            require(
                before.end < after.offset or before.freed_by != after.freed_by,
                f"adjacent pieces with the same freed_by at {after.offset}",
            )
        covered = iter(pieces)
        for block in free:
            cursor, age = block.offset, _NEVER
            while cursor < block.end:
                piece = next(covered, None)
                require(
                    piece is not None and piece.offset == cursor,
                    f"pieces do not tile free block {_region(block.offset, block.size)}",
                )
                cursor = piece.end
                age = max(age, _NEVER if piece.freed_by is None else piece.freed_by)
            require(cursor == block.end, f"piece overruns free block at {block.offset}")
            if self._strategy.uses_age:
                require(self._free_age[block.offset] == age, f"stale age of block {block.offset}")
        require(next(covered, None) is None, "pieces outside free memory")
        self._strategy.check([(b.offset, b.size, self._free_age[b.offset]) for b in free])

    # ----------------------------------------------------------------------- internals

    def _request(self, nbytes: int) -> int:
        nbytes = _check_int(nbytes, "allocation size")
        if nbytes <= 0:
            raise AllocationError(
                f"allocation size must be positive, got {nbytes} B"
                " (empty tensors are never allocated)"
            )
        return self.round_up(nbytes)

    def _take(self, block_start: int, offset: int, nbytes: int) -> Block:
        """Carve `[offset, offset + nbytes)` out of the free block at `block_start`."""
        block_size, block_age = self._remove_free(block_start)
        block_end = block_start + block_size
        end = offset + nbytes
        starts, ends = self._piece_starts, self._piece_ends
        lo = bisect_right(starts, offset) - 1
        hi = bisect_left(starts, end)
        taken = self._piece_by[lo:hi]
        new_starts: list[int] = []
        new_ends: list[int] = []
        new_bys: list[int] = []
        if starts[lo] < offset:
            new_starts.append(starts[lo])
            new_ends.append(offset)
            new_bys.append(taken[0])
        if ends[hi - 1] > end:
            new_starts.append(end)
            new_ends.append(ends[hi - 1])
            new_bys.append(taken[-1])
        self._splice(lo, hi, new_starts, new_ends, new_bys)

        uses_age = self._strategy.uses_age
        one_side = (block_start == offset) != (end == block_end)
        keeps_age = uses_age and one_side and max(taken) < block_age
        if block_start < offset:
            age = block_age if keeps_age or not uses_age else self._age(block_start, offset)
            self._add_free(block_start, offset - block_start, age)
        if end < block_end:
            age = block_age if keeps_age or not uses_age else self._age(end, block_end)
            self._add_free(end, block_end - end, age)
        self._add_live(offset, nbytes)
        deps = set(taken)
        deps.discard(_NEVER)
        return Block(offset, nbytes, tuple(sorted(deps)))

    def _age(self, start: int, end: int) -> int:
        """The largest freeing id among the pieces of the free range `[start, end)`."""
        starts = self._piece_starts
        return max(self._piece_by[bisect_right(starts, start) - 1 : bisect_left(starts, end)])

    def _first_live_overlapping(self, start: int, end: int) -> Interval:
        k = bisect_right(self._live_starts, start) - 1
        if k >= 0:
            offset = self._live_starts[k]
            if offset + self._live_size[offset] > start:
                return Interval(offset, self._live_size[offset])
        offset = self._live_starts[k + 1]
        return Interval(offset, self._live_size[offset])

    def _not_live_message(self, offset: Any) -> str:
        message = f"cannot free offset {offset!r}: no live block starts there"
        if isinstance(offset, bool) or not isinstance(offset, int):
            return message
        if not 0 <= offset < self._size:
            return f"{message} (the arena is [0, {self._size}))"
        k = bisect_right(self._live_starts, offset) - 1
        if k >= 0:
            start = self._live_starts[k]
            if start + self._live_size[start] > offset:
                inside = _region(start, self._live_size[start])
                return f"{message} (it is inside the live block {inside})"
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

    def _raw_add_free(self, start: int, size: int, age: int) -> None:
        insort(self._free_starts, start)
        self._free_size[start] = size
        self._free_age[start] = age
        insort(self._by_size, (size, start))
        self._strategy.add(start, size, age)

    def _raw_remove_free(self, start: int) -> tuple[int, int]:
        size = self._free_size.pop(start)
        age = self._free_age.pop(start)
        del self._free_starts[bisect_left(self._free_starts, start)]
        del self._by_size[bisect_left(self._by_size, (size, start))]
        self._strategy.remove(start, size, age)
        return size, age

    def _raw_splice(
        self, lo: int, hi: int, starts: list[int], ends: list[int], bys: list[int]
    ) -> tuple[list[int], list[int], list[int]]:
        old = (self._piece_starts[lo:hi], self._piece_ends[lo:hi], self._piece_by[lo:hi])
        self._piece_starts[lo:hi] = starts
        self._piece_ends[lo:hi] = ends
        self._piece_by[lo:hi] = bys
        return old

    def _raw_add_live(self, start: int, size: int) -> None:
        insort(self._live_starts, start)
        self._live_size[start] = size
        self._bytes_live += size

    def _raw_remove_live(self, start: int) -> int:
        size = self._live_size.pop(start)
        del self._live_starts[bisect_left(self._live_starts, start)]
        self._bytes_live -= size
        return size

    def _add_free(self, start: int, size: int, age: int) -> None:
        self._raw_add_free(start, size, age)
        if self._marks:
            self._log.append((self._raw_remove_free, (start,)))

    def _remove_free(self, start: int) -> tuple[int, int]:
        size, age = self._raw_remove_free(start)
        if self._marks:
            self._log.append((self._raw_add_free, (start, size, age)))
        return size, age

    def _splice(self, lo: int, hi: int, starts: list[int], ends: list[int], bys: list[int]) -> None:
        old = self._raw_splice(lo, hi, starts, ends, bys)
        if self._marks:
            self._log.append((self._raw_splice, (lo, lo + len(starts), *old)))

    def _add_live(self, start: int, size: int) -> None:
        self._raw_add_live(start, size)
        if self._marks:
            self._log.append((self._raw_remove_live, (start,)))

    def _remove_live(self, start: int) -> None:
        size = self._raw_remove_live(start)
        if self._marks:
            self._log.append((self._raw_add_live, (start, size)))
