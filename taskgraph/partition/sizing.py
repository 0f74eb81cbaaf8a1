"""Block sizes (step 4): per component, halve the worst task's blocks until every task
fits, then relax – grow each block size as far as every task still fits."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from einpage_core.errors import PlanError
from einpage_core.units import format_bytes
from taskgraph.graph import TaskGraph
from taskgraph.partition.feasibility import model_load
from taskgraph.partition.geometry import Geometry
from taskgraph.partition.grouping import Classes, components, link_dims

__all__ = ["Sizer", "SplitOption", "block_sizes"]

NEAR_TIE = 0.9
"""Splits scoring within 10% of the best are near ties: the outermost dim wins."""


@dataclass(frozen=True, slots=True)
class _Member:
    """A dim of a component task in terms of its class: size = min(extent, s[root] * unit)."""

    root: int
    unit: int
    extent: int


class SplitOption(NamedTuple):
    """One way to halve a block of a task: `dim` of the task, of class `root` (-1: a
    private split of the task's dim alone) to `size`, scored by what it saves."""

    score: float
    dim: int
    root: int
    size: int


class Sizer:
    """Block sizes for the tasks of one component (steps 3 and 4).

    `size[root]` is a class's block size in the units of its root; `private[t][d]` a
    block size of task t's dim d of its own (a private split, in the dim's units).
    """

    def __init__(
        self,
        tg: TaskGraph,
        geoms: Sequence[Geometry],
        tasks: Sequence[int],
        forced: set[int],
        absorbed: dict[int, int],
        factors: dict[int, float],
        limit: int,
        alignment: int,
    ):
        self.tg, self.geoms, self.tasks = tg, geoms, tasks
        self.factors, self.limit, self.alignment = factors, limit, alignment
        self.classes = Classes()
        nodes = link_dims(tg, geoms, tasks, forced, absorbed, self.classes)
        self.members: dict[int, list[_Member]] = {}  # task -> its dims as class members
        self.splittable: dict[int, bool] = {}  # root -> whether the class may be split
        self.reducers: dict[int, set[int]] = {}  # root -> the tasks that reduce the class
        users: dict[int, dict[int, None]] = {}  # root -> the tasks with a dim in the class
        for t in tasks:
            row = []
            for dim, x in zip(geoms[t].dims, nodes[t], strict=True):
                root, unit = self.classes.find(x)
                row.append(_Member(root, unit, dim.extent))
                self.splittable[root] = self.splittable.get(root, True) and dim.splittable
                self.reducers.setdefault(root, set()).update((t,) if dim.reduced else ())
                users.setdefault(root, {})[t] = None
            self.members[t] = row
        self.users = {root: list(ts) for root, ts in users.items()}
        inside = set(tasks)
        self.neighbours = {
            t: {u for u in (*tg[t].inputs, *tg.consumers[t]) if u in inside and u != t}
            for t in tasks
        }
        self.size = {root: self.classes.extent[root] for root in self.splittable}
        self.private: dict[int, dict[int, int]] = {}
        self.accepted: set[int] = set()  # tasks left above their target, split finest
        self.halved: list[int] = []  # roots, in the order they were halved
        self.privately: list[tuple[int, int]] = []  # (task, dim), in the order split

    def sizes_of(
        self, t: int, root: int = -1, root_size: int = 0, dim: int = -1, dim_size: int = 0
    ) -> list[int]:
        """Block sizes of t's dims; with class `root` resized to `root_size`, or t's own
        `dim` to `dim_size`."""
        out = []
        own = self.private.get(t, {})
        for d, m in enumerate(self.members[t]):
            if not self.splittable[m.root]:
                out.append(m.extent)
                continue
            shared = root_size if m.root == root else self.size[m.root]
            mine = dim_size if d == dim else own.get(d)
            block = min(m.extent, shared * m.unit)
            out.append(block if mine is None else min(block, mine))
        return out

    def load(self, t: int, **change: int) -> int:
        """The largest working set of t's blocks (with a change as in `sizes_of`)."""
        return model_load(self.geoms[t], self.sizes_of(t, **change), self.alignment)

    def target(self, t: int) -> float:
        return self.limit * self.factors.get(t, 1.0)

    def options(self, t: int, current: int) -> list[SplitOption]:
        """Each way to halve a block of t (step 4), scored."""
        blocks = self.sizes_of(t)
        options = []
        for d, m in enumerate(self.members[t]):
            grain = self.geoms[t].dims[d].grain
            if not self.splittable[m.root] or blocks[d] <= grain:
                continue
            reducers = len(self.reducers[m.root] - {t})
            if self.size[m.root] > 1 and reducers <= len(
                self.neighbours[t] & set(self.users[m.root])
            ):
                new = -(-self.size[m.root] // 2)
                gain = current - self.load(t, root=m.root, root_size=new)
                weight = 0.5 if reducers else 1.0
                weight *= 0.5 if self.classes.refused[m.root] else 1.0
                options.append(SplitOption(gain * weight, d, m.root, new))
                continue
            # More tasks reduce this class than t has neighbours in it (a split would give
            # them all partials), or the class cannot shrink further in t's units: split
            # only t's dim, with assembly where t meets its neighbours.
            mine = -(-blocks[d] // (2 * grain)) * grain
            if mine < blocks[d]:
                gain = current - self.load(t, dim=d, dim_size=mine)
                options.append(SplitOption(gain * 0.5, d, -1, mine))
        # Splits that help, if any; otherwise split on all the same: the finest split
        # fits, and on the way a concat's pieces may first grow (a block across an
        # operand boundary reads two), or step 6 found t's real blocks too large.
        return [o for o in options if o.score > 0] or options

    def split(self) -> None:
        """Halve blocks of the worst task until every task fits its target."""
        heap = [(-self.load(t) / self.target(t), t) for t in self.tasks]
        heapq.heapify(heap)
        while heap:
            key, t = heapq.heappop(heap)
            current = self.load(t)
            if t in self.accepted or -key != current / self.target(t):
                continue  # stale entry
            if current <= self.target(t):
                break
            options = self.options(t, current)
            if not options:
                if current > self.limit:  # cannot happen above the feasible limit
                    raise PlanError(
                        f"internal: task %{t} ({self.tg[t].line()}) is split as finely as "
                        f"allowed but needs {format_bytes(current)} > {format_bytes(self.limit)}"
                    )
                self.accepted.add(t)
                continue
            best = max(o.score for o in options)
            near = [o for o in options if o.score >= best - (1 - NEAR_TIE) * abs(best)]
            chosen = min(near, key=lambda o: o.dim)  # the outermost near tie
            if chosen.root < 0:
                self.private.setdefault(t, {})[chosen.dim] = chosen.size
                self.privately.append((t, chosen.dim))
                changed = [t]
            else:
                self.size[chosen.root] = chosen.size
                self.halved.append(chosen.root)
                changed = self.users[chosen.root]
            for u in changed:
                heapq.heappush(heap, (-self.load(u) / self.target(u), u))

    def relax(self) -> None:
        """Grow each class's block size, latest halved first, then each private one, as far
        as all its tasks still fit, and even the blocks out; a private split that reaches
        its class's size is dropped. A task left above its target keeps its blocks."""
        for root in reversed(list(dict.fromkeys(reversed(self.halved)))):
            users = self.users[root]
            if any(u in self.accepted for u in users):
                continue

            def fits(size: int, root: int = root, users: list[int] = users) -> bool:
                return all(self.load(u, root=root, root_size=size) <= self.target(u) for u in users)

            extent = self.classes.extent[root]
            best = _largest(self.size[root], extent, fits)
            self.size[root] = _even(extent, best) if fits(_even(extent, best)) else best
        for t, d in reversed(list(dict.fromkeys(reversed(self.privately)))):
            if t in self.accepted:
                continue
            m = self.members[t][d]
            grain = self.geoms[t].dims[d].grain  # sizes in whole grains

            def fits_own(grains: int, t: int = t, d: int = d, grain: int = grain) -> bool:
                return self.load(t, dim=d, dim_size=grains * grain) <= self.target(t)

            shared = min(m.extent, self.size[m.root] * m.unit) // grain
            best = _largest(min(self.private[t][d] // grain, shared), shared, fits_own)
            if best >= shared:
                del self.private[t][d]
            else:
                evened = _even(m.extent // grain, best)
                self.private[t][d] = (evened if fits_own(evened) else best) * grain

    def result(self) -> dict[int, tuple[int, ...]]:
        """The block size of every dim of each task of the component."""
        return {t: tuple(self.sizes_of(t)) for t in self.tasks}


def _even(extent: int, block: int) -> int:
    """As many blocks as `block` gives, evened out."""
    return -(-extent // -(-extent // block))


def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """The largest size in [lo, hi] that `fits`, by bisection (`lo` fits)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def block_sizes(
    tg: TaskGraph,
    geoms: Sequence[Geometry],
    forced: set[int],
    factors: dict[int, float],
    limit: int,
    alignment: int,
    absorb: bool,
) -> dict[int, tuple[int, ...]]:
    """Block sizes (per dim) of every task that may be split (steps 2-4)."""
    members = set(forced) | set(factors)
    found = components(tg, members, absorb)
    sizes: dict[int, tuple[int, ...]] = {}
    for tasks in found.groups:
        sizer = Sizer(tg, geoms, tasks, forced, found.absorbed, factors, limit, alignment)
        sizer.split()
        sizer.relax()
        sizes.update(sizer.result())
    return sizes
