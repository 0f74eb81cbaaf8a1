"""Victim choice: which contiguous window of the arena to clear for an allocation.

When an allocation of `n` bytes does not fit at the execution horizon, the planner
describes the arena as `Segment`s (live tensors and free blocks, tiling it in offset
order) and asks `choose_window` for the best window `[start, start + n)`:

* a window starts at a segment's start (windows starting inside a segment are never
  better: sliding one left to the segment start covers the same occupants or fewer),
  lies inside the arena, and may only cover *evictable* segments;
* its score is the smallest `rank` among the live tensors it covers (free bytes rank
  as "never used again", above every tensor); the best window has the largest score;
* ties go to fewer bytes that actually need a transfer (tensors without a valid host
  copy must be offloaded; tensors with one are dropped for free), then fewer bytes
  evicted at all, then the lowest offset (so choices are deterministic).

The rank is the policy, looked up by name in `POLICIES` (larger = evict sooner):

* `"belady"` (the default): the position of the tensor's next use, so the window
  whose soonest-needed occupant is needed furthest in the future wins (Belady's MIN
  generalised to contiguous windows);
* `"lru"`: minus the position of the tensor's last use, so the window whose most
  recently used occupant was used longest ago wins (the classic baseline).

One sweep with two pointers and a monotonic deque for the window minimum costs
O(segments) per request.

>>> segs = [Segment(0, 256, tensor=1, rank=5), Segment(256, 256, tensor=2, rank=9),
...         Segment(512, 256)]
>>> choose_window(segs, 512)
Window(offset=256, victims=(2,), score=9, transfer_bytes=0, evicted_bytes=256)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from einpage.errors import PlanError

__all__ = [
    "NEVER",
    "POLICIES",
    "Policy",
    "Segment",
    "Window",
    "belady",
    "choose_window",
    "get_policy",
    "lru",
]

NEVER = 1 << 62
"""The rank of free bytes, and the next-use position of a tensor never used again."""

Policy = Callable[[int, int], int]
"""`rank(next_use, last_use) -> int`: larger means a better victim."""


def belady(next_use: int, last_use: int) -> int:
    """Evict what is needed furthest in the future (reuse distance)."""
    return next_use


def lru(next_use: int, last_use: int) -> int:
    """Evict what was used longest ago (least recently used)."""
    return -last_use


POLICIES: dict[str, Policy] = {"belady": belady, "lru": lru}
"""Victim-choice policies by name."""


def get_policy(name: str) -> Policy:
    """The policy registered under `name`; an unknown name lists the valid ones."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        valid = ", ".join(repr(known) for known in POLICIES)
        raise PlanError(f"unknown eviction policy {name!r}; valid policies: {valid}") from None


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of the arena: a free block (`tensor` None) or a live tensor.

    `rank` is the policy's rank of the tensor, `transfer` the bytes evicting it must copy
    to the host (0 when a host copy exists), `evictable` whether it may be evicted at all.
    """

    offset: int
    size: int
    tensor: int | None = None
    rank: int = NEVER
    transfer: int = 0
    evictable: bool = True


@dataclass(frozen=True, slots=True)
class Window:
    """The chosen window: where the allocation goes and the tensors to evict first."""

    offset: int
    victims: tuple[int, ...]
    score: int
    transfer_bytes: int
    evicted_bytes: int


def choose_window(segments: Sequence[Segment], nbytes: int) -> Window | None:
    """The best window of `nbytes` over `segments` (offset order, tiling the arena), or
    None when every window would cover a segment that is not evictable."""
    best_key: tuple[int, int, int, int] | None = None
    best: tuple[int, int] | None = None  # (first, last) segment index of the best window
    count = len(segments)
    low: deque[int] = deque()  # indices of live segments in the window, ranks increasing
    first = last = 0  # the window covers segments [first, last)
    covered = transfer = evicted = 0
    while first < count:
        if not segments[first].evictable:
            first += 1
            last, covered, transfer, evicted = first, 0, 0, 0
            low.clear()
            continue
        while covered < nbytes and last < count and segments[last].evictable:
            seg = segments[last]
            covered += seg.size
            if seg.tensor is not None:
                transfer += seg.transfer
                evicted += seg.size
                while low and segments[low[-1]].rank >= seg.rank:
                    low.pop()
                low.append(last)
            last += 1
        if covered < nbytes:
            if last == count:
                break  # no window starting here or later fits in the arena
            first = last  # segments[last] is pinned: restart after it
            continue
        score = segments[low[0]].rank if low else NEVER
        key = (score, -transfer, -evicted, -segments[first].offset)
        if best_key is None or key > best_key:
            best_key, best = key, (first, last)
        seg = segments[first]  # slide: drop the first segment
        covered -= seg.size
        if seg.tensor is not None:
            transfer -= seg.transfer
            evicted -= seg.size
            if low and low[0] == first:
                low.popleft()
        first += 1
    if best is None:
        return None
    start, stop = best
    score, neg_transfer, neg_evicted, _ = best_key
    victims = tuple(s.tensor for s in segments[start:stop] if s.tensor is not None)
    return Window(segments[start].offset, victims, score, -neg_transfer, -neg_evicted)
