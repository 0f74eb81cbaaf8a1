"""Materializing a partition (step 5): the new tasks of every block, partial aggregates
and their combines, and the assembly copies that give a consumer exactly the region it
reads."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from typing import NamedTuple

from taskgraph.einsum import EinsumSpec
from taskgraph.expr import VARIABLES
from taskgraph.expr import parse as parse_join
from taskgraph.facts import Fact
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Block, Concat, Einsum, Op, Shape, Slice, Task, View
from taskgraph.partition.geometry import (
    Box,
    Dim,
    Geometry,
    Range,
    aligned,
    box_sizes,
    box_starts,
    full_box,
    itemsize,
)
from taskgraph.partition.rules import RULES

__all__ = ["MAX_COMBINE_FANIN", "NewTask", "Materializer", "TaskCapReached"]

MAX_COMBINE_FANIN = len(VARIABLES)
"""Operands of one combine einsum at most: join variables are `a` to `z`."""


class TaskCapReached(Exception):
    """Raised by `Materializer.add` when it would make more than `max_tasks` tasks (the
    partition driver turns it into a `BlockCountError`)."""


@dataclass(slots=True)
class NewTask:
    """A task of the partitioned graph before it is numbered."""

    op: Op
    inputs: tuple[int, ...]
    shape: Shape
    dtype: str
    scope: str
    label: str
    block: Block
    made_for: int  # the original task being materialized when this one was made
    facts: tuple[Fact, ...] = ()  # the original's (ids still the original graph's)


@dataclass(frozen=True, slots=True)
class _Piece:
    """The part of one producer block that a region covers, along one axis."""

    index: int  # the block's index along the axis
    offset: int  # where the part starts inside the block
    start: int  # where it starts in the producer
    size: int
    exact: bool  # the part is the whole block


class _Part(NamedTuple):
    """A new task holding `box` of a producer, while a region is assembled."""

    task: int
    box: Box


class _Partial(NamedTuple):
    """A new task aggregating the reduced range `span` (of the dim being combined)."""

    span: Range
    task: int


class Materializer:
    """Emits the new tasks (step 5): blocks, partials and combines, and assembly.

    `sizes` holds the block size of every dim of each task that is split (others are
    one block); `new` collects the tasks made, in the order made. With `max_tasks`,
    making more than that many raises `TaskCapReached` (bounded work whatever the sizes).
    """

    def __init__(
        self,
        tg: TaskGraph,
        geometries: Sequence[Geometry],
        sizes: dict[int, tuple[int, ...]],
        limit: int,
        alignment: int,
        max_tasks: int | None = None,
    ):
        self.tg = tg
        self.max_tasks = max_tasks
        self.geometries = geometries
        self.sizes = sizes
        self.limit = limit
        self.alignment = alignment
        self.new: list[NewTask] = []
        self.grid: dict[int, tuple[int, ...]] = {}  # original -> block size per output axis
        self.blocks: dict[int, dict[tuple[int, ...], int]] = {}  # original -> index -> new
        self.cache: dict[tuple[int, Box], int] = {}  # (original, region) -> new
        self.combine_ops: dict[tuple[str, int, str], Einsum] = {}
        self.current = -1

    def add(
        self,
        op: Op,
        inputs: Sequence[int],
        shape: Shape,
        dtype: str,
        source: Task,
        block: Block,
    ) -> int:
        """Make a new task computing `op` for `block` of the original task `source`."""
        if self.max_tasks is not None and len(self.new) >= self.max_tasks:
            raise TaskCapReached
        self.new.append(
            NewTask(
                op,
                tuple(inputs),
                tuple(shape),
                dtype,
                source.scope,
                source.label,
                block,
                self.current,
                source.facts,
            )
        )
        return len(self.new) - 1

    def run(self) -> dict[str, int]:
        """Materialize every task in topological order; return the outputs' new tasks."""
        for task in self.tg.tasks:
            self.current = task.id
            dims = self.geometries[task.id].dims
            sizes = self.sizes.get(task.id, tuple(d.extent for d in dims))
            out_sizes = sizes[: len(task.shape)]
            emit = RULES.of(task.op).emit
            table = {}
            grid = [range(-(-e // b)) for e, b in zip(task.shape, out_sizes, strict=True)]
            for index in product(*grid):
                box = tuple(
                    Range(i * b, min(b, e - i * b))
                    for i, b, e in zip(index, out_sizes, task.shape, strict=True)
                )
                table[index] = emit(self, task, box, sizes)
            self.grid[task.id] = out_sizes
            self.blocks[task.id] = table
        outputs = {}
        for name, task_id in self.tg.outputs.items():
            self.current = task_id
            outputs[name] = self.fetch(task_id, full_box(self.tg[task_id].shape), "output")
        return outputs

    def whole(self) -> dict[int, int]:
        """Original task -> the new task that holds all of it, for the tasks that are one
        block (every input; a split task has no such task): what the ids that facts name
        become."""
        return {
            original: next(iter(table.values()))
            for original, table in self.blocks.items()
            if len(table) == 1
        }

    # -- reading regions of producers --

    def _pieces(self, producer: int, region: Box) -> list[list[_Piece]]:
        """Per axis, the parts of the producer's blocks that `region` covers."""
        shape = self.tg[producer].shape
        per_axis = []
        for (start, size), b, extent in zip(region, self.grid[producer], shape, strict=True):
            parts = []
            for i in range(start // b, (start + size - 1) // b + 1):
                lo, hi = max(start, i * b), min(start + size, (i + 1) * b, extent)
                parts.append(_Piece(i, lo - i * b, lo, hi - lo, hi - lo == min(b, extent - i * b)))
            per_axis.append(parts)
        return per_axis

    def fetch(self, producer: int, region: Box, kind: str = "assembly") -> int:
        """The new task holding exactly `region` of the original task `producer`: one of
        its blocks, or assembly made (once per region) from its blocks."""
        key = (producer, region)
        found = self.cache.get(key)
        if found is None:
            index = self._block_index(producer, region)
            if index is None:
                found = self.assemble(producer, region, kind=kind)
            else:  # the common case, without `_pieces`
                found = self.blocks[producer][index]
            self.cache[key] = found
        return found

    def _block_index(self, producer: int, region: Box) -> tuple[int, ...] | None:
        """The index of the producer's block that is exactly `region`, or None."""
        index = []
        for (start, size), b, extent in zip(
            region, self.grid[producer], self.tg[producer].shape, strict=True
        ):
            if start % b or size != min(b, extent - start):
                return None
            index.append(start // b)
        return tuple(index)

    def assemble(
        self,
        producer: int,
        region: Box,
        *,
        copy: bool = False,
        top: Block | None = None,
        kind: str = "assembly",
    ) -> int:
        """`region` of `producer` from its blocks: a Slice of one block, or Slices and
        Concats (one axis at a time) whose provenance is of `kind`, except the last,
        which gets `top` when given. With `copy`, a task is made even when the region is
        exactly one block: a View of it (an alias, no data moves)."""
        task = self.tg[producer]
        table = self.blocks[producer]
        per_axis = self._pieces(producer, region)
        exact = all(len(parts) == 1 and parts[0].exact for parts in per_axis)
        if exact and not copy:  # the region is one block
            return table[tuple(parts[0].index for parts in per_axis)]
        if top is None:
            top = Block(producer, box_starts(region), box_sizes(region), kind)
        if all(len(parts) == 1 for parts in per_axis):
            parts = [p[0] for p in per_axis]
            source = table[tuple(p.index for p in parts)]
            if exact:  # copy the block: alias it
                return self.add(View(), (source,), box_sizes(region), task.dtype, task, top)
            offsets = tuple(p.offset for p in parts)
            return self.add(Slice(offsets), (source,), box_sizes(region), task.dtype, task, top)
        return self._join_pieces(task, per_axis, top, kind)

    def _join_pieces(self, task: Task, per_axis: list[list[_Piece]], top: Block, kind: str) -> int:
        """A region spanning several blocks of `task`: a Slice of each block it covers in
        part, then Concats along each axis that has more than one piece, the last axis
        first; the final Concat gets `top`, the others provenance of `kind`."""
        table = self.blocks[task.id]
        items: dict[tuple[int, ...], _Part] = {}
        for combo in product(*(list(enumerate(parts)) for parts in per_axis)):
            parts = [p for _, p in combo]
            source = table[tuple(p.index for p in parts)]
            box = tuple(Range(p.start, p.size) for p in parts)
            if not all(p.exact for p in parts):
                offsets = tuple(p.offset for p in parts)
                piece = Block(task.id, box_starts(box), box_sizes(box), kind)
                shape = box_sizes(box)
                source = self.add(Slice(offsets), (source,), shape, task.dtype, task, piece)
            items[tuple(j for j, _ in combo)] = _Part(source, box)
        last = min(a for a, parts in enumerate(per_axis) if len(parts) > 1)
        for axis in reversed(range(len(per_axis))):
            if len(per_axis[axis]) == 1:
                continue
            groups: dict[tuple[int, ...], list[_Part]] = {}
            for key in sorted(items):
                groups.setdefault(key[:axis] + key[axis + 1 :], []).append(items[key])
            items = {}
            for rest, members in groups.items():
                first = members[0].box
                length = sum(part.box[axis].size for part in members)
                union = (*first[:axis], Range(first[axis].start, length), *first[axis + 1 :])
                block = (
                    top
                    if axis == last
                    else Block(task.id, box_starts(union), box_sizes(union), kind)
                )
                vid = self.add(
                    Concat(axis),
                    [part.task for part in members],
                    box_sizes(union),
                    task.dtype,
                    task,
                    block,
                )
                items[(*rest[:axis], 0, *rest[axis:])] = _Part(vid, union)
        ((vid, _),) = items.values()
        return vid

    # -- partial aggregates --

    def combine_op(self, op: Einsum, count: int) -> Einsum:
        """`"X,X,...->X"` combining `count` partials with `op.agg`."""
        key = (op.agg, count, op.spec.output)
        if key not in self.combine_ops:
            names = VARIABLES[:count]
            if op.agg == "sum":
                join: str | None = " + ".join(names)
            elif op.agg == "prod":
                join = None  # the plain product
            else:
                join = names[0]
                for name in names[1:]:
                    join = f"{op.agg}({join}, {name})"
            spec = EinsumSpec((op.spec.output,) * count, op.spec.output)
            parsed = None if join is None else parse_join(join, count)
            self.combine_ops[key] = Einsum(spec, parsed)
        return self.combine_ops[key]

    def combine(
        self, task: Task, box: Box, partials: list[tuple[Box, int]], reduced: Sequence[Dim]
    ) -> int:
        """Combine partials (keyed by their reduced box) into the block, one reduced dim at
        a time from the last, at most `fanin` operands per combine."""
        out = aligned(math.prod(box_sizes(box)) * itemsize(task), self.alignment)
        fanin = max(2, min(MAX_COMBINE_FANIN, self.limit // out - 1))
        items = dict(partials)
        for d in reversed(range(len(reduced))):
            groups: dict[Box, list[_Partial]] = {}
            for rbox, vid in items.items():
                groups.setdefault(rbox[:d] + rbox[d + 1 :], []).append(_Partial(rbox[d], vid))
            items = {}
            for rest, entries in groups.items():
                entries.sort()
                while len(entries) > 1:
                    entries = [
                        self._combine_chunk(task, box, rest, d, reduced, entries[c : c + fanin])
                        for c in range(0, len(entries), fanin)
                    ]
                (only,) = entries
                items[(*rest[:d], only.span, *rest[d:])] = only.task
        (vid,) = items.values()
        return vid

    def _combine_chunk(
        self,
        task: Task,
        box: Box,
        rest: Box,
        d: int,
        reduced: Sequence[Dim],
        chunk: list[_Partial],
    ) -> _Partial:
        """One combine of `chunk` (partials adjacent along reduced dim `d`, the other
        reduced dims at `rest`), or the partial itself when it is alone."""
        if len(chunk) == 1:
            return chunk[0]
        span = Range(chunk[0].span.start, sum(p.span.size for p in chunk))
        rbox = (*rest[:d], span, *rest[d:])
        full = all(r == (0, dim.extent) for r, dim in zip(rbox, reduced, strict=True))
        kind, ranges = ("block", ()) if full else ("partial", rbox)
        block = Block(task.id, box_starts(box), box_sizes(box), kind, ranges)
        combine = self.combine_op(task.op, len(chunk))  # type: ignore[arg-type]
        vid = self.add(combine, [p.task for p in chunk], box_sizes(box), task.dtype, task, block)
        return _Partial(span, vid)
