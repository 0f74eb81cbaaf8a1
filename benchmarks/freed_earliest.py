"""Einsummable's "freed earliest" fit, the comparison point of `allocator_bench.py`.

Among the free blocks that fit a request, take the one whose freeing is oldest, so the
new allocation waits on the oldest free and constrains concurrency least (Einsummable's
"lowest dependency"); ties go to the lowest offset. A block's age is the newest freeing
node among its provenance pieces (memory never used is oldest of all).

`memgraph.allocator.Allocator` fits best (it fragments far less, see the benchmark);
this strategy is kept here, on top of the allocator's public API, only to show that.
It scans every free block and piece per request (O(n)): a reference for the
fragmentation comparison, not a fast allocator.

>>> from memgraph.allocator import Allocator
>>> alloc = Allocator(8 * 256)
>>> hole = alloc.allocate(2 * 256)
>>> _ = alloc.allocate(256)
>>> alloc.free(hole.offset, freed_by=0)
>>> allocate_freed_earliest(alloc, 256)  # never-used memory beats the freed hole
Block(offset=768, size=256, deps=())
"""

from __future__ import annotations

from memgraph.allocator import Allocator, Block

__all__ = ["NEVER_USED", "allocate_freed_earliest", "block_ages"]

NEVER_USED = -1
"""The age of memory never allocated: older than every freeing node."""


def block_ages(alloc: Allocator) -> list[tuple[int, int, int]]:
    """`(age, offset, size)` of every free block, in offset order."""
    pieces = alloc.free_pieces()  # they tile the free blocks, in offset order
    ages = []
    i = 0
    for block in alloc.free_intervals():
        age = NEVER_USED
        while i < len(pieces) and pieces[i].offset < block.end:
            freed_by = pieces[i].freed_by
            age = max(age, NEVER_USED if freed_by is None else freed_by)
            i += 1
        ages.append((age, block.offset, block.size))
    return ages


def allocate_freed_earliest(alloc: Allocator, nbytes: int) -> Block | None:
    """Allocate `nbytes` (rounded up) in the free block freed earliest that fits (ties:
    lowest offset); None when none fits."""
    size = alloc.round_up(nbytes)
    fitting = [(age, offset) for age, offset, free in block_ages(alloc) if free >= size]
    if not fitting:
        return None
    _age, offset = min(fitting)
    return alloc.allocate_at(offset, nbytes)
