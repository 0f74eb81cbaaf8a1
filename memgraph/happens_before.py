"""Happens-before for the verifier: does node u wait, through its dependencies, for node v?

`waits_for(deps, questions)` answers a batch of such questions about one MemGraph
exactly, in one forward sweep: node u *waits for* node v when v is reachable from u
through `deps` (u depends on v directly, or on a node that waits for v). Nothing
else orders two nodes here – not their insertion order, not a shared stream.

How (near-linear time for the questions a verifier asks):

* A question whose target is a direct dependency of its source is answered at once.
* Every other target gets a bit. Each node's *reach* is the set of target bits it
  waits for: the union of its dependencies' reach, plus its own bit. A target is
  only asked about by sources at most its *lifetime* later (known: the questions
  come as a batch), so a node's reach only needs the targets born within the
  longest lifetime before it. Targets are grouped in classes by lifetime (class k:
  at most `WINDOW * GROWTH**k` nodes); within a class, a node keeps the bits of the
  class's targets born in its window only, as an integer shifted so that its lowest
  bit is the window's first target. The bits of a dependency are shifted into the
  node's (later, never earlier) window by one shift, and those that left the window
  fall off the end. So the work per node is one shift-and-or per dependency and
  class, on integers as wide as the number of targets born in a window – small when,
  as in memory plans, most questions ask about recent nodes, and never wrong when
  they do not (only slower).

>>> deps = [(), (0,), (1,), (), (2, 3)]      # 0 <- 1 <- 2 <- 4 -> 3
>>> waits_for(deps, [(4, 0), (4, 3), (2, 3), (3, 0), (1, 1)])
[True, True, False, False, False]
"""

from __future__ import annotations

from collections.abc import Sequence

from einpage_core.errors import EinpageError

__all__ = ["waits_for", "WINDOW", "GROWTH"]

WINDOW = 512
"""Lifetime (in nodes) of the shortest-lived class of targets."""

GROWTH = 8
"""Each class of targets lives `GROWTH` times longer than the one before."""


def _lifetime_class(lifetime: int, window: int, growth: int) -> int:
    """The class of a target asked about at most `lifetime` nodes after it is born."""
    k, span = 0, window
    while lifetime > span:
        k, span = k + 1, span * growth
    return k


class _Class:
    """The targets of one lifetime class: their births (sorted node ids) and window."""

    def __init__(self, span: int, births: list[int]):
        self.span = span
        self.births = births
        self.ordinal = {v: i for i, v in enumerate(births)}
        self.first = 0  # the first ordinal inside the current node's window
        self.born = 0  # how many targets are born at or before the current node

    def advance(self, node: int) -> None:
        """Move the window to end at `node`."""
        births, oldest = self.births, node - self.span
        while self.first < len(births) and births[self.first] < oldest:
            self.first += 1
        while self.born < len(births) and births[self.born] <= node:
            self.born += 1


def waits_for(
    deps: Sequence[Sequence[int]],
    questions: Sequence[tuple[int, int]],
    *,
    window: int = WINDOW,
    growth: int = GROWTH,
) -> list[bool]:
    """For each `(source, target)`, whether node `source` waits for node `target`.

    `deps[i]` are the dependencies of node i, all earlier nodes (ids below i). A node
    does not wait for itself, nor for a later node. `window` and `growth` shape the
    lifetime classes (see the module docstring; the answers do not depend on them).
    """
    if window < 1 or growth < 2:
        raise EinpageError(f"window must be >= 1 and growth >= 2, not {window} and {growth}")
    answers = [False] * len(questions)
    lifetime: dict[int, int] = {}
    asked: dict[int, list[int]] = {}  # source -> its questions that need the sweep
    for i, (source, target) in enumerate(questions):
        if not 0 <= target < source < len(deps):
            continue
        if target in deps[source]:
            answers[i] = True
            continue
        lifetime[target] = max(lifetime.get(target, 0), source - target)
        asked.setdefault(source, []).append(i)
    if not lifetime:
        return answers
    births_of: dict[int, list[int]] = {}
    for target in sorted(lifetime):
        k = _lifetime_class(lifetime[target], window, growth)
        births_of.setdefault(k, []).append(target)
    classes = [_Class(window * growth**k, births) for k, births in sorted(births_of.items())]
    _sweep(deps, questions, classes, asked, min(lifetime), max(asked), answers)
    return answers


def _sweep(
    deps: Sequence[Sequence[int]],
    questions: Sequence[tuple[int, int]],
    classes: list[_Class],
    asked: dict[int, list[int]],
    lo: int,
    hi: int,
    answers: list[bool],
) -> None:
    """Compute every node's reach from `lo` to `hi` and answer the questions asked there.

    `reach[k][x - lo]` holds, for class k, the bits of the class's targets that node x
    waits for (or is), shifted right by `first[k][x - lo]`, the first ordinal of x's
    window.
    """
    count = hi - lo + 1
    reach = [[0] * count for _ in classes]
    first = [[0] * count for _ in classes]
    for x in range(lo, hi + 1):
        row = x - lo
        near = [d - lo for d in deps[x] if d >= lo]
        for k, cls in enumerate(classes):
            cls.advance(x)
            start = cls.first
            if start == cls.born:  # no target of this class in x's window
                continue
            bits, bases = reach[k], first[k]
            r = 0
            for d in near:
                held = bits[d]
                if held:
                    r |= held >> (start - bases[d])
            own = cls.ordinal.get(x)
            if own is not None:
                r |= 1 << (own - start)
            bits[row], bases[row] = r, start
        for i in asked.get(x, ()):
            answers[i] = _holds(classes, reach, first, questions[i][1], row)


def _holds(
    classes: list[_Class], reach: list[list[int]], first: list[list[int]], target: int, row: int
) -> bool:
    """Whether the node at `row` has the bit of `target` (a target of exactly one class)."""
    for k, cls in enumerate(classes):
        own = cls.ordinal.get(target)
        if own is not None:
            shift = own - first[k][row]
            return shift >= 0 and bool(reach[k][row] >> shift & 1)
    raise AssertionError(f"n{target} is not a target")  # pragma: no cover
