"""Tensor-parallel split (Megatron style): the dims that `Shard` facts name, cut into one
block per part, so that each part computes its heads and its MLP columns.

`tensor_split(tg, parts)` links the dims of every task that is not an `Input` into
alignment classes exactly as the partition pass does (`grouping.link_dims`: einsum
letters, views' unchanged or merged axes, ...). A `taskgraph.facts.Shard(axis)` stated
on a task names its dim `axis`; stated on an `Input` (a weight), it names the dim of each
task reading it that the input's axis links to. The classes of the named dims are cut
into `parts` equal blocks; every other dim stays whole. The graph is then materialized
and built by the partition pass's own `Materializer` and `build_blocks`, with no limit:
a task of a split class becomes `parts` blocks, a task that reduces a split class
`parts` partials and their combine (the all-reduce point), and a task that reads a
split tensor whole reads it assembled.

Every task of the result holding one part of a split class states
`taskgraph.facts.TensorPart(index, parts)`: a block by its block index along its split
dim, a partial by its reduced range. A combine, an assembly and every task not split
state none. What each part is goes with the task as facts do, so a split graph can
still be partitioned for a budget (`partition`: blocks keep their original task's
facts) and placed afterwards (`memgraph.placement.tensor_placement`).

>>> import einpage as ep
>>> from taskgraph.facts import Shard, TensorPart, fact_of
>>> prog = ep.Program("mlp")
>>> x = prog.input("x", (2, 4))
>>> w1 = prog.fact(prog.input("w1", (8, 4), role="weight"), Shard(0))
>>> w2 = prog.fact(prog.input("w2", (8, 4), role="weight"), Shard(0))
>>> h = prog.einsum("bd,md->bm", x, w1)
>>> prog.output(prog.einsum("bm,md->bd", h, w2), "y")
>>> tg = tensor_split(prog.build(), 2)
>>> [(t.block.kind, fact_of(t, TensorPart)) for t in tg if t.kind == "einsum"]
[('block', TensorPart(index=0, count=2)), ('block', TensorPart(index=1, count=2)),
 ('partial', TensorPart(index=0, count=2)), ('partial', TensorPart(index=1, count=2)),
 ('block', None)]
"""

from __future__ import annotations

from dataclasses import dataclass

from einpage_core.errors import PlanError, expect_graph
from taskgraph.facts import Shard, TensorPart, facts_of
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input, Task
from taskgraph.partition.driver import build_blocks
from taskgraph.partition.geometry import Geometry
from taskgraph.partition.grouping import Classes, link_dims
from taskgraph.partition.materializing import Materializer, NewTask
from taskgraph.partition.rules import geometries

__all__ = ["tensor_split", "TensorSplitError"]

UNBOUNDED = 2**62
"""The block limit of the materializer: a tensor-parallel split has no limit (it only
decides how many operands one combine takes, all of them)."""


class TensorSplitError(PlanError):
    """`tensor_split` cannot split the graph (no `Shard` facts, a class whose extent the
    parts do not divide, a bad count, a graph split already for another count)."""


@dataclass(frozen=True, slots=True)
class _Named:
    """A dim a `Shard` fact names: dim `dim` of task `task`, from the fact stated on
    tensor `tensor` (the task itself, or the input it reads)."""

    tensor: int
    axis: int
    task: int
    dim: int


def _tensor_name(task: Task) -> str:
    if isinstance(task.op, Input):
        return f"{task.op.name!r} (%{task.id})"
    return f"%{task.id}" + (f" ({task.label})" if task.label else "")


def _named_dims(tg: TaskGraph, geoms: list[Geometry]) -> list[_Named]:
    """The dims each `Shard` fact of `tg` names (see the module docstring)."""
    named = []
    for task in tg:
        for fact in facts_of(task, Shard):
            if not isinstance(task.op, Input):
                named.append(_Named(task.id, fact.axis, task.id, fact.axis))
                continue
            for reader in tg.consumers[task.id]:
                inputs = tg[reader].inputs
                for link in geoms[reader].links:
                    if inputs[link.position] == task.id and link.axis == fact.axis:
                        named.append(_Named(task.id, fact.axis, reader, link.dim))
    return named


_PARTITIONED = (
    "; the graph is partitioned already (its blocks state the Shard facts of their "
    "tensors): split the unpartitioned graph for tensor parallelism first (tensor_split), "
    "then partition that"
)


def _partitioned(tg: TaskGraph) -> bool:
    return any(task.block is not None for task in tg)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _Split:
    """The alignment classes of `tg`'s tasks (all but its inputs) and the classes the
    `Shard` facts name (`roots`), checked: splittable, divisible by `parts`, at most
    one per task."""

    def __init__(self, tg: TaskGraph, parts: int):
        self.tg, self.parts = tg, parts
        self.geoms = geometries(tg)
        tasks = [t.id for t in tg if not isinstance(t.op, Input)]
        self.classes = Classes()
        self.nodes = link_dims(tg, self.geoms, tasks, set(tasks), {}, self.classes)
        self.roots: dict[int, _Named] = {}  # split class -> the first dim naming it
        for named in _named_dims(tg, self.geoms):
            self._check(named)
            self.roots.setdefault(self.classes.find(self.nodes[named.task][named.dim]).root, named)

    def _check(self, named: _Named) -> None:
        tensor = self.tg[named.tensor]
        where = f"tensor {_tensor_name(tensor)}'s axis {named.axis}"
        dim = self.geoms[named.task].dims[named.dim]
        if not dim.splittable:
            raise TensorSplitError(
                f"{where} (Shard) cannot be split in task %{named.task} "
                f"({self.tg[named.task].line()}): a view regroups it"
            )
        root, _ = self.classes.find(self.nodes[named.task][named.dim])
        extent = self.classes.extent[root]
        if extent % self.parts:
            axis_extent = tensor.shape[named.axis]
            through = "" if extent == axis_extent else f" (in units of its class: {extent})"
            raise TensorSplitError(
                f"{where} (Shard) has extent {axis_extent}{through}, which {self.parts} parts "
                f"do not divide: use a count that divides {extent} ({_divisors(extent)}), at "
                f"most {extent}{_PARTITIONED if _partitioned(self.tg) else ''}"
            )

    def split_dims(self, t: int) -> list[tuple[int, int]]:
        """(dim, block size) of each dim of task t in a split class."""
        found = []
        for d, x in enumerate(self.nodes[t]):
            root, unit = self.classes.find(x)
            if root in self.roots:
                found.append((d, self.classes.extent[root] // self.parts * unit))
        return found

    def sizes(self) -> dict[int, tuple[int, ...]]:
        """The block size of every dim of each task with a dim in a split class; a
        `TensorSplitError` for a task with dims in two (its blocks would be a grid, not
        one part each)."""
        sizes = {}
        for t in self.nodes:
            split = self.split_dims(t)
            if not split:
                continue
            if len(split) > 1:
                dims = ", ".join(str(d) for d, _ in split)
                firsts = {self.classes.find(self.nodes[t][d]).root: None for d, _ in split}
                tensors = ", ".join(
                    f"{_tensor_name(self.tg[self.roots[r].tensor])} axis {self.roots[r].axis}"
                    for r in firsts
                )
                raise TensorSplitError(
                    f"task %{t} ({self.tg[t].line()}) has dims {dims} in split classes of "
                    f"{tensors}: a tensor-parallel block belongs to one part; state Shard on "
                    f"tensors whose split dims do not meet"
                )
            blocks = [dim.extent for dim in self.geoms[t].dims]
            for d, size in split:
                blocks[d] = size
            sizes[t] = tuple(blocks)
        return sizes

    def part_of(self, n: NewTask, sizes: dict[int, tuple[int, ...]]) -> int | None:
        """The part a new task holds: a block's index along its split output dim, a
        partial's along its split reduced dim (None: a combine of several, an assembly,
        a task not split)."""
        of = n.block.of
        if of not in sizes or n.block.kind not in ("block", "partial"):
            return None
        rank = len(self.tg[of].shape)
        for d, size in self.split_dims(of):
            if d < rank and n.block.kind == "block":
                return n.block.starts[d] // size
            if d >= rank and n.block.kind == "partial":
                start, length = n.block.reduced[d - rank]
                return start // size if length == size else None
        return None


def tensor_split(tg: TaskGraph, parts: int) -> TaskGraph:
    """`tg` split for `parts`-way tensor parallelism (see the module docstring): the
    classes of the dims its `Shard` facts name cut into `parts` equal blocks, each task
    holding one part stating `TensorPart(index, parts)`.

    A graph whose tasks state `TensorPart` facts for `parts` already is returned as is.
    Raises `TensorSplitError` (a `PlanError`) for `parts` < 1, a graph without `Shard`
    facts, a split class whose extent `parts` does not divide (naming the tensor, its
    axis and the counts that would), a task with dims in two split classes, and a graph
    split already for another count.
    """
    expect_graph(tg, TaskGraph, "taskgraph.partition.tensor_split")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise TensorSplitError(f"tensor_split: parts must be an int >= 1, got {parts!r}")
    counts = sorted({f.count for t in tg for f in facts_of(t, TensorPart)})
    if counts:
        if counts == [parts]:
            return tg
        raise TensorSplitError(
            f"graph {tg.name!r} is split already for {' and '.join(map(str, counts))} parts "
            f"(its tasks state TensorPart facts); it cannot be split for {parts}: split the "
            f"graph before its tensor split"
        )
    if not any(facts_of(t, Shard) for t in tg):
        raise TensorSplitError(
            f"tensor placement needs tensors stating Shard facts (the axes tensor "
            f"parallelism may split: attention's heads, the MLP's columns); graph "
            f"{tg.name!r} states none; use pipeline"
        )
    split = _Split(tg, parts)
    if not split.roots:
        raise TensorSplitError(
            f"graph {tg.name!r} states Shard facts, but no task reads the axes they name; "
            f"use pipeline"
        )
    sizes = split.sizes()
    m = Materializer(tg, split.geoms, sizes, UNBOUNDED, 1)
    outputs = m.run()
    for n in m.new:
        index = split.part_of(n, sizes)
        if index is not None:
            n.facts = (*n.facts, TensorPart(index, parts))
    return build_blocks(tg, m.new, outputs, m.whole())
