"""Grouping: which tasks split (forced and absorbed, step 2), the components they form,
and the alignment classes that unify the dims indexing the same data (step 3)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input, Task
from taskgraph.partition.geometry import Geometry

__all__ = [
    "Components",
    "components",
    "Classes",
    "ClassOf",
    "Edge",
    "link_order",
    "link_dims",
]


@dataclass(frozen=True, slots=True)
class Components:
    """The split tasks grouped into components (each in topological order, the
    components by their first task), and for each absorbed task the order in which it
    was absorbed (forced tasks are not in `absorbed`)."""

    groups: list[list[int]]
    absorbed: dict[int, int]


def components(tg: TaskGraph, members: set[int], absorb: bool) -> Components:
    """Grow `members` (in place) by absorption (step 2) and group them into components:
    tasks connected as producer and consumer."""
    absorbed: dict[int, int] = {}

    def eligible(task: Task) -> bool:
        return not (task.id in members or isinstance(task.op, Input) or task.id in tg.output_ids)

    grew = absorb
    while grew:
        size = len(members)
        for task in tg.tasks:  # reads a split task
            if eligible(task) and any(i in members for i in task.inputs):
                members.add(task.id)
                absorbed[task.id] = len(absorbed)
        for task in reversed(tg.tasks):  # feeds split tasks only
            users = tg.consumers[task.id]
            if eligible(task) and users and all(u in members for u in users):
                members.add(task.id)
                absorbed[task.id] = len(absorbed)
        grew = len(members) > size
    parent = {t: t for t in members}

    def find(t: int) -> int:
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    for t in sorted(members):
        for i in tg[t].inputs:
            if i in members:
                parent[find(i)] = find(t)
    groups: dict[int, list[int]] = {}
    for t in sorted(members):
        groups.setdefault(find(t), []).append(t)
    return Components(sorted(groups.values()), absorbed)


class ClassOf(NamedTuple):
    """A node's class: its root, and the node's unit relative to the root."""

    root: int
    unit: int


class Classes:
    """Weighted union-find over dims (alignment classes).

    Node x has a parent and `up[x]`: block boundaries of x are `up[x]` times those of
    its parent, an int >= 1, so a root is the coarsest node of its class and every
    node's unit (the product along its path) is an int. `owners[root]` maps each task
    with a dim in the class to that dim's node: a class never holds two dims of a task.
    `refused[root]`: a link into the class was refused (its dims meet through assembly).
    """

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.up: list[int] = []
        self.extent: list[int] = []
        self.owners: list[dict[int, int]] = []
        self.refused: list[bool] = []

    def add(self, extent: int, task: int | None) -> int:
        """A new node of `extent` (a dim of `task`, or a grain node of none)."""
        x = len(self.parent)
        self.parent.append(x)
        self.up.append(1)
        self.extent.append(extent)
        self.owners.append({} if task is None else {task: x})
        self.refused.append(False)
        return x

    def find(self, x: int) -> ClassOf:
        """The root of x's class and x's unit relative to it."""
        path = []
        while self.parent[x] != x:
            path.append(x)
            x = self.parent[x]
        unit = 1
        for node in reversed(path):
            unit *= self.up[node]
            self.parent[node] = x
            self.up[node] = unit
        return ClassOf(x, self.up[path[0]] if path else 1)

    def link(self, x: int, y: int, ratio: Fraction) -> None:
        """Put x and y in one class with boundaries of x = ratio * boundaries of y, unless
        that would give a class two dims of one task or non-integral units."""
        rx, ux = self.find(x)
        ry, uy = self.find(y)
        q = ratio * uy / ux  # boundaries of rx = q * boundaries of ry
        if rx == ry:
            if q != 1:
                self.refused[rx] = True
            return
        if q.denominator == 1:
            child, parent, w = rx, ry, q.numerator
        elif q.numerator == 1:
            child, parent, w = ry, rx, q.denominator
        else:
            self.refused[rx] = self.refused[ry] = True
            return
        small, big = self.owners[child], self.owners[parent]
        if len(small) > len(big):
            small, big = big, small
        if self.extent[child] != w * self.extent[parent] or any(t in big for t in small):
            self.refused[rx] = self.refused[ry] = True
            return
        big.update(small)
        self.parent[child] = parent
        self.up[child] = w
        self.owners[parent], self.owners[child] = big, {}
        self.refused[parent] = self.refused[parent] or self.refused[child]


class Edge(NamedTuple):
    """Operand `position` of task `consumer` is task `producer`."""

    consumer: int
    position: int
    producer: int


def link_order(
    tg: TaskGraph, tasks: Sequence[int], forced: set[int], absorbed: dict[int, int]
) -> list[Edge]:
    """The producer-consumer edges inside a component, core first (see step 3): between
    forced tasks in topological order, then those of absorbed tasks, nearest to the
    core (earliest absorbed) first."""
    inside = set(tasks)
    keyed = []
    for c in tasks:
        for position, p in enumerate(tg[c].inputs):
            if p not in inside:
                continue
            if c in forced and p in forced:
                key: tuple[int, ...] = (0, 0, c, position)
            else:
                rank = max(absorbed.get(c, -1), absorbed.get(p, -1))
                key = (1, rank, c, position)
            keyed.append((key, Edge(c, position, p)))
    keyed.sort()
    return [edge for _, edge in keyed]


def link_dims(
    tg: TaskGraph,
    geoms: Sequence[Geometry],
    tasks: Sequence[int],
    forced: set[int],
    absorbed: dict[int, int],
    classes: Classes,
) -> dict[int, list[int]]:
    """A node of `classes` per dim of each of `tasks` (a dim with a grain linked to a node
    of its grains), linked along the edges between them in `link_order` (step 3); the
    nodes by task. A link between dims that are not both splittable is not made."""
    nodes: dict[int, list[int]] = {}
    for t in tasks:
        ids = []
        for dim in geoms[t].dims:
            x = classes.add(dim.extent, t)
            if dim.grain > 1:
                grain_node = classes.add(dim.extent // dim.grain, None)
                classes.link(x, grain_node, Fraction(dim.grain))
            ids.append(x)
        nodes[t] = ids
    for edge in link_order(tg, tasks, forced, absorbed):
        c, p = edge.consumer, edge.producer
        for link in geoms[c].links:
            if link.position != edge.position:
                continue
            ends = (geoms[c].dims[link.dim], geoms[p].dims[link.axis])
            if all(dim.splittable for dim in ends):
                classes.link(nodes[c][link.dim], nodes[p][link.axis], link.ratio)
    return nodes
