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

from memgraph.eviction import NEVER, EvictionContext, Policy, Segment
from memgraph.nodes import Region

__all__ = ["TensorState", "Residents", "eviction_context"]


@dataclass(slots=True, eq=False)
class TensorState:
    """The planner's view of one storage root (a non-view task): where its bytes are.

    `uses` are the step positions that read it (plus `len(steps)` for a device output),
    `ptr` indexes the next one. On the device: `region`, its `alloc` node, the node
    that wrote it (`writer`: apply, reload or input; None while an output is allocated
    but not yet computed) and `users` (readers, offloads, outputs of this residency).
    On the host: `storage` and the node that wrote it (`storage_writer`).
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
    rank: int = 0  # the eviction rank of its current heap entry

    @property
    def next_use(self) -> int:
        return self.uses[self.ptr] if self.ptr < len(self.uses) else NEVER


def eviction_context(tensor: TensorState) -> EvictionContext:
    """What the eviction policy sees of a live tensor."""
    transfer = 0 if tensor.storage is not None else tensor.nbytes
    return EvictionContext(tensor.next_use, tensor.last_use, tensor.size, transfer)


class Residents:
    """The live tensors of the arena: by offset, and by eviction rank for victim search.

    Implements `memgraph.eviction.Arena`. Ranks change only when a tensor is used or
    placed (`touch`), so a max-heap of (rank, id, version) entries with lazy deletion
    enumerates evictable tensors in decreasing rank; entries popped during a search
    are pushed back by `restore`.
    """

    def __init__(self, size: int, rank: Policy, tensors: dict[int, TensorState]):
        self.size = size
        self.rank = rank
        self.tensors = tensors
        self.at: dict[int, TensorState] = {}  # offset -> live tensor
        self.offsets: list[int] = []  # sorted live offsets
        self.heap: list[tuple[int, int, int]] = []  # (-rank, tensor id, version)
        self.popped: list[tuple[int, int, int]] = []

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

    def touch(self, tensor: TensorState, placed: bool = False) -> None:
        """Re-rank a live tensor after its next or last use changed (or it was `placed`)."""
        rank = self.rank(eviction_context(tensor))
        if rank == tensor.rank and not placed:
            return  # its heap entry is still valid
        tensor.rank = rank
        tensor.version += 1
        heapq.heappush(self.heap, (-rank, tensor.id, tensor.version))
        if len(self.heap) > 4 * len(self.offsets) + 1024:
            self.heap = [
                (-self.rank(eviction_context(t)), t.id, t.version) for t in self.at.values()
            ]
            heapq.heapify(self.heap)

    def segment(self, tensor: TensorState) -> Segment:
        return Segment(
            tensor.region.offset,
            tensor.region.size,
            tensor.id,
            self.rank(eviction_context(tensor)),
            0 if tensor.storage is not None else tensor.nbytes,
            tensor.pins == 0 and tensor.writer is not None,
        )

    def ranked_groups(self) -> Iterator[list[Segment]]:
        """Evictable live tensors as segments, in groups of equal rank, decreasing."""
        heap, popped = self.heap, self.popped
        group: list[Segment] = []
        group_key = None
        while heap:
            entry = heapq.heappop(heap)
            key, tensor_id, version = entry
            tensor = self.tensors[tensor_id]
            if tensor.version != version or tensor.region is None:
                continue  # stale
            popped.append(entry)
            if tensor.pins or tensor.writer is None:
                continue
            if group and key != group_key:
                yield group
                group = []
            group_key = key
            group.append(self.segment(tensor))
        if group:
            yield group

    def restore(self) -> None:
        """Push back the entries a search popped (they are still valid)."""
        for entry in self.popped:
            heapq.heappush(self.heap, entry)
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
