"""The planner's bookkeeping of tensors: where each one's bytes are, and who may be evicted.

`TensorState` is the planner's view of one storage root (where its bytes are, on the
device and on the host, and when it is used); `Residents` keeps the live ones by offset
and by eviction rank, and implements `memgraph.eviction.Arena` for the victim search.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from memgraph.eviction import NEVER, EvictionContext, Policy, Rank, Segment
from memgraph.nodes import Region

__all__ = ["TensorState", "Residents", "eviction_context"]


@dataclass(slots=True, eq=False)
class TensorState:
    """The planner's view of one storage root (a non-view task): where its bytes are.

    `uses` are the step positions that read it (plus `len(steps)` for a device output),
    `ptr` indexes the next one. On the device: `region`, its `alloc` node, the node
    that wrote it (`writer`: apply, reload or input; None while an output is allocated
    but not yet computed) and `users` (readers, offloads, outputs of this residency).
    On the host: `storage` and the node that wrote it (`storage_writer`). `recompute`:
    it was discarded (freed with no copy out) and is computed again when the step that
    next reads it is prepared (`memgraph.recompute`).
    """

    id: int
    nbytes: int
    size: int  # aligned
    uses: list[int] = field(default_factory=list)
    ptr: int = 0
    region: Region | None = None
    alloc: int | None = None
    writer: int | None = None
    users: list[int] = field(default_factory=list)
    storage: int | None = None
    storage_writer: int | None = None
    pins: int = 0
    last_use: int = -1
    version: int = 0  # bumped whenever its rank or residency changes (stale heap entries)
    rank: Rank = Rank(0)  # the eviction rank of its current heap entry
    recompute: bool = False  # discarded: recomputed at its next use instead of reloaded

    @property
    def next_use(self) -> int:
        return self.uses[self.ptr] if self.ptr < len(self.uses) else NEVER


def eviction_context(tensor: TensorState) -> EvictionContext:
    """What the eviction policy sees of a live tensor."""
    transfer = 0 if tensor.storage is not None else tensor.nbytes
    return EvictionContext(tensor.next_use, tensor.last_use, tensor.size, transfer, tensor.nbytes)


class Residents:
    """The live tensors of the arena: by offset, and by eviction rank for victim search.

    Implements `memgraph.eviction.Arena`. Ranks change only when a tensor is used or
    placed (`touch`). A `Rank(value, scale)` compares at step `now` by `(value - now) *
    2**scale`, so tensors of one scale keep their order whatever `now`: each scale has a
    max-heap of (value, id, version) entries with lazy deletion, and a search at step
    `now` merges the heaps (a handful: one per scale in use) to enumerate evictable
    tensors in decreasing key; entries popped during a search are pushed back by
    `restore`.
    """

    def __init__(self, size: int, rank: Policy, tensors: dict[int, TensorState]):
        self.size = size
        self.rank = rank
        self.tensors = tensors
        self.at: dict[int, TensorState] = {}  # offset -> live tensor
        self.offsets: list[int] = []  # sorted live offsets
        self.heaps: dict[int, list[tuple[int, int, int]]] = {}  # scale -> (-value, id, version)
        self.entries = 0  # heap entries, stale ones included
        self.popped: list[tuple[int, tuple[int, int, int]]] = []  # (scale, entry)
        self.now = 0  # the step whose allocation the current search makes room for

    def __len__(self) -> int:
        return len(self.offsets)

    def add(self, tensor: TensorState) -> None:
        offset = tensor.region.offset
        bisect.insort(self.offsets, offset)
        self.at[offset] = tensor
        self.touch(tensor, placed=True)

    def remove(self, tensor: TensorState) -> None:
        offset = tensor.region.offset
        del self.offsets[bisect.bisect_left(self.offsets, offset)]
        del self.at[offset]
        tensor.version += 1

    def ranked(self, tensor: TensorState) -> Rank:
        """The policy's rank of a live tensor, as a `Rank`."""
        rank = self.rank(eviction_context(tensor))
        return rank if isinstance(rank, Rank) else Rank(rank)

    def touch(self, tensor: TensorState, placed: bool = False) -> None:
        """Re-rank a live tensor after its next or last use changed (or it was `placed`)."""
        rank = self.ranked(tensor)
        if rank == tensor.rank and not placed:
            return  # its heap entry is still valid
        tensor.rank = rank
        tensor.version += 1
        heapq.heappush(
            self.heaps.setdefault(rank.scale, []), (-rank.value, tensor.id, tensor.version)
        )
        self.entries += 1
        if self.entries > 4 * len(self.offsets) + 1024:
            self.rebuild()

    def rebuild(self) -> None:
        """Drop the stale heap entries: one entry per live tensor."""
        self.heaps = {}
        for t in self.at.values():
            heapq.heappush(
                self.heaps.setdefault(t.rank.scale, []), (-t.rank.value, t.id, t.version)
            )
        self.entries = len(self.at)

    def segment(self, tensor: TensorState) -> Segment:
        return Segment(
            tensor.region.offset,
            tensor.region.size,
            tensor.id,
            self.ranked(tensor).key(self.now),
            0 if tensor.storage is not None else tensor.nbytes,
            tensor.pins == 0 and tensor.writer is not None,
        )

    def ranked_groups(self, now: int = 0) -> Iterator[list[Segment]]:
        """Evictable live tensors as segments, in groups of equal key at step `now`,
        decreasing (`Rank.key`)."""
        self.now = now
        heaps, popped = self.heaps, self.popped
        group: list[Segment] = []
        group_key = None
        while True:
            best = None  # (key, scale) of the largest valid top
            for scale, heap in heaps.items():
                while heap and self.stale(heap[0]):
                    heapq.heappop(heap)
                    self.entries -= 1
                if heap:
                    key = Rank(-heap[0][0], scale).key(now)
                    if best is None or key > best[0] or key == best[0] and scale < best[1]:
                        best = (key, scale)
            if best is None:
                break
            key, scale = best
            entry = heapq.heappop(heaps[scale])
            popped.append((scale, entry))
            tensor = self.tensors[entry[1]]
            if tensor.pins or tensor.writer is None:
                continue
            if group and key != group_key:
                yield group
                group = []
            group_key = key
            group.append(self.segment(tensor))
        if group:
            yield group

    def stale(self, entry: tuple[int, int, int]) -> bool:
        tensor = self.tensors[entry[1]]
        return tensor.version != entry[2] or tensor.region is None

    def restore(self) -> None:
        """Push back the entries a search popped (they are still valid)."""
        for scale, entry in self.popped:
            heapq.heappush(self.heaps[scale], entry)
        self.popped = []

    def neighbours(self, offset: int) -> tuple[int, int]:
        offsets = self.offsets
        i = bisect.bisect_left(offsets, offset)
        before = self.at[offsets[i - 1]].region.end if i else 0
        after = offsets[i + 1] if i + 1 < len(offsets) else self.size
        return before, after

    def segments(self, start: int = 0, end: int | None = None) -> list[Segment]:
        end = self.size if end is None else end
        offsets = self.offsets
        found = []
        cursor = start
        for i in range(bisect.bisect_left(offsets, start), len(offsets)):
            offset = offsets[i]
            if offset >= end:
                break
            if offset > cursor:
                found.append(Segment(cursor, offset - cursor))
            tensor = self.at[offset]
            found.append(self.segment(tensor))
            cursor = tensor.region.end
        if cursor < end:
            found.append(Segment(cursor, end - cursor))
        return found
