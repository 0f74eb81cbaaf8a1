"""The verifier's sets: live device regions, the latest free of every freed byte, written boxes.

Each answers the one question the verifier asks of it in a binary search or one
vectorized test, so that a replay of hundreds of thousands of nodes stays fast:
`LiveRegions` which live region a new one overlaps, `LatestFrees` which free last
released the bytes an alloc reuses, `WrittenBoxes` which box written into a host
storage a new box overlaps. They belong to `memgraph.verify` and share no code with
the planner's allocator.
"""

from __future__ import annotations

import bisect

import numpy as np

from memgraph.nodes import HostBox, Region

__all__ = ["LiveRegions", "LatestFrees", "WrittenBoxes"]


class WrittenBoxes:
    """The boxes written into one storage so far, as arrays, so that finding one a new box
    overlaps is one vectorized test (host outputs can have thousands of boxes)."""

    def __init__(self) -> None:
        self.count = 0
        self.lo = np.empty((0, 0), dtype=np.int64)
        self.hi = np.empty((0, 0), dtype=np.int64)
        self.writers: list[int] = []
        self.boxes: list[HostBox] = []

    def overlapping(self, box: HostBox) -> int | None:
        """The position of a written box that `box` overlaps, if any."""
        if not self.count:
            return None
        lo, hi = np.array(box.starts), np.array(box.starts) + np.array(box.sizes)
        hits = np.all((self.lo[: self.count] < hi) & (lo < self.hi[: self.count]), axis=1)
        return int(np.argmax(hits)) if hits.any() else None

    def add(self, box: HostBox, writer: int) -> None:
        if self.count == len(self.lo):
            grown = max(16, 2 * self.count)
            rank = len(box.starts)
            self.lo = np.resize(self.lo, (grown, rank))
            self.hi = np.resize(self.hi, (grown, rank))
        self.lo[self.count] = box.starts
        self.hi[self.count] = np.array(box.starts) + np.array(box.sizes)
        self.count += 1
        self.writers.append(writer)
        self.boxes.append(box)


class LiveRegions:
    """The device regions allocated now (disjoint), sorted by offset: which one a new
    region overlaps is one binary search."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.held: dict[int, tuple[int, int]] = {}  # offset -> (end, tensor)

    def overlapping(self, region: Region) -> tuple[int, Region] | None:
        """A live region that `region` overlaps, as (its tensor, itself), if any.

        Only the last region starting before `region` and the first starting at or after
        it can overlap it without an earlier one overlapping too."""
        i = bisect.bisect_left(self.starts, region.offset)
        for offset in self.starts[max(0, i - 1) : i + 1]:
            end, tensor = self.held[offset]
            if offset < region.end and region.offset < end:
                return tensor, Region(offset, end - offset)
        return None

    def add(self, region: Region, tensor: int) -> None:
        bisect.insort(self.starts, region.offset)
        self.held[region.offset] = (region.end, tensor)

    def remove(self, region: Region) -> None:
        del self.starts[bisect.bisect_left(self.starts, region.offset)]
        del self.held[region.offset]


class LatestFrees:
    """For every arena byte freed so far, the latest free node that released it: sorted,
    disjoint ranges `[starts[i], ends[i])` last freed by `nodes[i]`."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.nodes: list[int] = []

    def _first_at(self, offset: int) -> int:
        """Index of the first range that may contain bytes at or after `offset`."""
        i = bisect.bisect_left(self.starts, offset)
        return i - 1 if i > 0 and self.ends[i - 1] > offset else i

    def overlapping(self, region: Region) -> list[int]:
        """The latest free of each freed byte range that `region` overlaps."""
        i = self._first_at(region.offset)
        stop = bisect.bisect_left(self.starts, region.end, lo=i)
        return self.nodes[i:stop]

    def record(self, region: Region, free_node: int) -> None:
        """Remember that `free_node` is now the latest free of every byte of `region`."""
        start = self._first_at(region.offset)
        stop = bisect.bisect_left(self.starts, region.end, lo=start)
        starts, ends, nodes = [region.offset], [region.end], [free_node]
        if start < stop and self.starts[start] < region.offset:
            starts.insert(0, self.starts[start])
            ends.insert(0, region.offset)
            nodes.insert(0, self.nodes[start])
        if start < stop and self.ends[stop - 1] > region.end:
            starts.append(region.end)
            ends.append(self.ends[stop - 1])
            nodes.append(self.nodes[stop - 1])
        self.starts[start:stop] = starts
        self.ends[start:stop] = ends
        self.nodes[start:stop] = nodes
