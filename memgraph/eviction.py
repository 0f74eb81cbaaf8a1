"""Victim choice: which contiguous window of the arena to clear for an allocation.

When an allocation of `n` bytes does not fit at the execution horizon, the planner
asks for the best window `[start, start + n)` of the arena, made of free blocks and
live tensors (`Segment`s):

* a window starts at a segment's start (windows starting inside a segment are never
  better: sliding one left to the segment start covers the same occupants or fewer),
  lies inside the arena, and may only cover *evictable* segments;
* its score is the smallest `rank` among the live tensors it covers (free bytes rank
  as "never used again", above every tensor); the best window has the largest score;
* ties go to fewer bytes that actually need a transfer (tensors without a valid host
  copy must be offloaded; tensors with one are dropped for free), then fewer bytes
  evicted at all, then the lowest offset (so choices are deterministic).

The rank is the policy, looked up by name in `POLICIES` (larger = evict sooner). A
policy is a function of an `EvictionContext` (the tensor's next and last use, its size
in the arena and its bytes, and the bytes evicting it would copy to the host: 0 when a
host copy exists) returning an int, or a `Rank` whose order depends on the step at which
ranks are compared; `register_policy(name, fn)` adds one:

* `"belady"` (the default): the position of the tensor's next use, so the window
  whose soonest-needed occupant is needed furthest in the future wins (Belady's MIN
  generalised to contiguous windows);
* `"lru"`: minus the position of the tensor's last use, so the window whose most
  recently used occupant was used longest ago wins (the classic baseline);
* `"belady-cost"`: Belady weighted by what evicting costs. At step `now` a tensor's key
  is the steps until its next use times the arena bytes it frees per byte its eviction
  moves (its reload, and its offload when it has no host copy), rounded down to a power
  of two: so an activation that must be offloaded first counts half as far away as a
  weight that is dropped for free, and a tiny tensor in a whole alignment unit counts
  as far as the room it frees (`Rank(next_use, scale)`).

A `Rank(value, scale)` compares at step `now` by `(value - now) * 2**scale` (an int is
`Rank(value, 0)`: the order of the values themselves, whatever `now`). The planner ranks
a tensor when it is placed or used, and again when it gains a host copy while resident
(its `transfer_bytes` drops to 0), and compares ranks at the step whose allocation it
is making room for.

Two searches give the same answer:

* `choose_window(segments, n)`: one sweep over all segments in offset order, with two
  pointers and a monotonic deque for the window minimum. O(segments) per request:
  simple, and the reference the other is tested against.
* `choose_window_ranked(arena, groups, n)`: the planner's. It *activates* evictable
  tensors in decreasing rank (groups of equal rank), merging each with its free
  neighbours and with active neighbours into runs of contiguous clearable bytes
  (interval union by endpoint dictionaries). The first group after which some run
  holds `n` bytes fixes the best score (every window inside such a run scores exactly
  that rank: a higher-scoring one would have formed a run earlier); the tie-breaks
  are then settled by `choose_window` over the segments of those runs only. Cost:
  O(k log live) for the k tensors activated, usually a few, instead of O(live).

>>> segs = [Segment(0, 256, tensor=1, rank=5), Segment(256, 256, tensor=2, rank=9),
...         Segment(512, 256)]
>>> choose_window(segs, 512)
Window(offset=256, victims=(2,), score=9, transfer_bytes=0, evicted_bytes=256)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from einpage_core.errors import PlanError

__all__ = [
    "NEVER",
    "POLICIES",
    "EvictionContext",
    "Rank",
    "Policy",
    "Segment",
    "Window",
    "belady",
    "belady_cost",
    "choose_window",
    "choose_window_ranked",
    "Arena",
    "get_policy",
    "lru",
    "register_policy",
]

NEVER = 1 << 62
"""The rank of free bytes, and the next-use position of a tensor never used again."""


@dataclass(frozen=True, slots=True)
class EvictionContext:
    """What a policy knows of a live tensor when it ranks it.

    `next_use` and `last_use` are step positions (`NEVER`: not used again; -1: not used
    yet); `size` the bytes it occupies in the arena (aligned); `transfer_bytes` the bytes
    evicting it would copy to the host (its bytes, or 0 when a host copy exists and it
    is simply dropped); `nbytes` its bytes (what a reload moves; None: `size`).
    """

    next_use: int
    last_use: int
    size: int
    transfer_bytes: int
    nbytes: int | None = None

    @property
    def moved_bytes(self) -> int:
        """The bytes evicting it moves in all: its reload, and its offload if it needs one."""
        return (self.size if self.nbytes is None else self.nbytes) + self.transfer_bytes


@dataclass(frozen=True, slots=True)
class Rank:
    """A rank compared at a step: at step `now` the key is `(value - now) * 2**scale`,
    larger = evict sooner (`scale` >= 0). A policy returning a plain int `v` means
    `Rank(v, 0)`, whose order is that of the values at any step.

    >>> weight, activation = Rank(40, 1), Rank(50, 0)  # next uses 40 and 50
    >>> weight.key(now=20) > activation.key(now=20)  # 40 vs 30: the weight goes first
    True
    >>> weight.key(now=35) > activation.key(now=35)  # 10 vs 15: now the activation
    False
    """

    value: int
    scale: int = 0

    def key(self, now: int) -> int:
        """The comparable key at step `now` (`NEVER` stays `NEVER`)."""
        if self.value >= NEVER:
            return NEVER
        return (self.value - now) << self.scale


Policy = Callable[[EvictionContext], "int | Rank"]
"""`rank(context) -> int | Rank`: larger means a better victim."""


def belady(context: EvictionContext) -> int:
    """Evict what is needed furthest in the future (reuse distance)."""
    return context.next_use


def belady_cost(context: EvictionContext) -> Rank:
    """Evict what is needed furthest in the future per byte its eviction moves (see the
    module docstring): the scale is log2 of twice the bytes freed per byte moved, rounded
    down, so a weight (dropped: 1 byte moved per byte freed) weighs twice an activation
    that must also be offloaded.

    >>> belady_cost(EvictionContext(9, 1, size=1024, transfer_bytes=0, nbytes=1024))
    Rank(value=9, scale=1)
    >>> belady_cost(EvictionContext(9, 1, size=1024, transfer_bytes=1024, nbytes=1024))
    Rank(value=9, scale=0)
    >>> belady_cost(EvictionContext(9, 1, size=256, transfer_bytes=4, nbytes=4)).scale
    6
    """
    freed_per_moved = 2 * context.size // max(1, context.moved_bytes)
    return Rank(context.next_use, max(0, freed_per_moved.bit_length() - 1))


def lru(context: EvictionContext) -> int:
    """Evict what was used longest ago (least recently used)."""
    return -context.last_use


POLICIES: dict[str, Policy] = {"belady": belady, "lru": lru, "belady-cost": belady_cost}
"""Victim-choice policies by name (add one with `register_policy`)."""


def register_policy(name: str, policy: Policy) -> None:
    """Make `policy` available as `plan(..., eviction=name)`.

    A policy maps an `EvictionContext` to an int rank (larger: evict sooner) or a `Rank`;
    ranks must not depend on anything but the context, so that plans stay deterministic. A name
    already registered to another function is refused (`PlanError`).

    >>> def biggest_first(context):
    ...     return context.size
    >>> register_policy("biggest-first", biggest_first)
    >>> get_policy("biggest-first") is biggest_first
    True
    >>> del POLICIES["biggest-first"]
    """
    if not isinstance(name, str) or not name:
        raise PlanError(f"a policy name must be a non-empty string, got {name!r}")
    if not callable(policy):
        raise PlanError(f"policy {name!r} must be a function of an EvictionContext")
    known = POLICIES.get(name)
    if known is not None and known is not policy:
        raise PlanError(f"eviction policy {name!r} is already registered ({known!r})")
    POLICIES[name] = policy


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


class Arena(Protocol):
    """What `choose_window_ranked` needs to know of the arena's layout."""

    def neighbours(self, offset: int) -> tuple[int, int]:
        """For the live block at `offset`: the end of the live block before it (0 if
        none) and the start of the live block after it (the arena size if none)."""

    def segments(self, start: int, end: int) -> list[Segment]:
        """The live blocks and free blocks tiling `[start, end)` (whose ends are block
        boundaries), in offset order, ranked and marked evictable as for `choose_window`."""


def choose_window_ranked(
    arena: Arena, groups: Iterable[Sequence[Segment]], nbytes: int
) -> Window | None:
    """The same window as `choose_window` over the whole arena, found by activating the
    evictable tensors in `groups` (each a list of equal-rank segments, in decreasing
    rank) until a run of clearable bytes holds `nbytes` (see the module docstring).

    Precondition: no free block holds `nbytes` (that block would be the best window;
    the planner searches only after the allocator found none).
    """
    end_of: dict[int, int] = {}  # run start -> run end
    start_of: dict[int, int] = {}  # run end -> run start
    for group in groups:
        formed = []
        for seg in group:
            # A run is active tensors plus the free gaps beside them: an active tensor's
            # run reaches to the neighbouring live blocks' edges. So the run of an active
            # left neighbour ends at this segment's start, and the run of an active right
            # neighbour starts at this segment's end.
            start, end = seg.offset, seg.offset + seg.size
            before_end, after_start = arena.neighbours(start)
            left = start_of.pop(start) if start in start_of else before_end
            right = end_of.pop(end) if end in end_of else after_start
            end_of.pop(left, None)
            start_of.pop(right, None)
            end_of[left], start_of[right] = right, left
            formed.append((left, right))
        runs = sorted({(lo, hi) for lo, hi in formed if end_of.get(lo) == hi and hi - lo >= nbytes})
        if not runs:
            continue
        best: Window | None = None
        for lo, hi in runs:
            found = choose_window(arena.segments(lo, hi), nbytes)
            if found is not None and (best is None or _key(found) > _key(best)):
                best = found
        return best
    return None


def _key(window: Window) -> tuple[int, int, int, int]:
    return (window.score, -window.transfer_bytes, -window.evicted_bytes, -window.offset)
