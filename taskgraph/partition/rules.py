"""Partition rules, one per op kind: the task's geometry, and how it makes one block.

A `PartitionRule` holds the two things partitioning does differently per op kind:

* `geometry(task, tasks) -> Geometry`: the task's dims (output axes, and an einsum's
  reduced indices), the tensors of a block's working set, and the links that align
  its dims with its operands' axes (see the package docstring, step 3);
* `emit(materializer, task, box, sizes) -> new task id`: the task(s) computing the
  block of the task's output at `box`, reading its operands' regions through the
  materializer (`fetch`, `assemble`, `combine`, `add`).

`RULES` is an `OpTable`, so an op kind without a rule fails at import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import product
from typing import TYPE_CHECKING

from taskgraph.dispatch import OpTable
from taskgraph.graph import TaskGraph
from taskgraph.nodes import (
    ArgReduce,
    Block,
    Concat,
    Einsum,
    Fill,
    Gather,
    Input,
    KthLargest,
    ScatterAdd,
    Shape,
    Slice,
    Task,
    View,
    is_input_slice,
)
from taskgraph.partition.geometry import (
    Box,
    ConcatPart,
    Dim,
    Geometry,
    Link,
    Range,
    Tensor,
    ViewGroup,
    box_sizes,
    box_starts,
    full_box,
    itemsize,
    out_tensor,
    tile,
)

if TYPE_CHECKING:
    from taskgraph.partition.materializing import Materializer

__all__ = ["PartitionRule", "RULES", "geometry_of", "geometries", "view_groups"]


# -- geometry ---------------------------------------------------------------------


def _input_geometry(task: Task, tasks: Sequence[Task]) -> Geometry:
    # Host storage: no limit applies; its finest block is one element.
    return Geometry(tuple(Dim(e) for e in task.shape), (out_tensor(task),), ())


def _einsum_geometry(task: Task, tasks: Sequence[Task]) -> Geometry:
    """One dim per distinct index. An operand whose term repeats an index (a diagonal)
    has two or more axes on that dim: a block reads the square (cube, ...) box of them,
    whose diagonal is the block's part of the diagonal; its links put two axes of one
    producer into one class, which alignment refuses, so such a region is assembled
    when the producer is split."""
    op: Einsum = task.op  # type: ignore[assignment]
    spec = op.spec
    sizes = spec.index_sizes([tasks[i].shape for i in task.inputs])
    letters = spec.output + spec.reduced
    dim_of = {c: d for d, c in enumerate(letters)}
    dims = tuple(Dim(sizes[c], reduced=c in spec.reduced) for c in letters)
    operand_dims = tuple(tuple(dim_of[c] for c in term) for term in spec.inputs)
    tensors: dict[tuple[int, tuple[int, ...]], Tensor] = {}
    for producer, term_dims in zip(task.inputs, operand_dims, strict=True):
        tensors.setdefault((producer, term_dims), Tensor(itemsize(tasks[producer]), term_dims))
    links = tuple(
        Link(d, position, axis)
        for position, term_dims in enumerate(operand_dims)
        for axis, d in enumerate(term_dims)
    )
    return Geometry(
        dims,
        (*tensors.values(), out_tensor(task)),
        links,
        combine=bool(spec.reduced),
        operand_dims=operand_dims,
    )


def _fill_geometry(task: Task, tasks: Sequence[Task]) -> Geometry:
    return Geometry(tuple(Dim(e) for e in task.shape), (out_tensor(task),), ())


def _gather_geometry(task: Task, tasks: Sequence[Task]) -> Geometry:
    table, ids = (tasks[i] for i in task.inputs)
    k = len(ids.shape)
    dims = tuple(Dim(e) for e in task.shape)
    table_tensor = Tensor(itemsize(table), tuple(range(k, len(task.shape))), table.shape[0])
    ids_tensor = Tensor(itemsize(ids), tuple(range(k)))
    links = tuple(Link(i, 1, i) for i in range(k)) + tuple(
        Link(k + j, 0, 1 + j) for j in range(len(table.shape) - 1)
    )
    # Every block reads all rows of its columns: a table that is not an input (loaded
    # by rows straight from host storage) may need those rows copied together.
    assembled = None if isinstance(table.op, Input) else table_tensor
    return Geometry(dims, (table_tensor, ids_tensor, out_tensor(task)), links, assembled=assembled)


def _scatter_add_geometry(task: Task, tasks: Sequence[Task]) -> Geometry:
    src, ids = (tasks[i] for i in task.inputs)
    k = len(ids.shape)
    dims = tuple(Dim(e) for e in task.shape)
    # Every block reads all of its columns' source rows (any id may land in its rows)
    # and all ids; blocks split the table's rows (by `start`) and its columns.
    src_tensor = Tensor(itemsize(src), tuple(range(1, len(task.shape))), math.prod(ids.shape))
    ids_tensor = Tensor(itemsize(ids), (), math.prod(ids.shape))
    links = tuple(Link(1 + j, 0, k + j) for j in range(len(task.shape) - 1))
    assembled = None if isinstance(src.op, Input) else src_tensor
    return Geometry(dims, (src_tensor, ids_tensor, out_tensor(task)), links, assembled=assembled)


def _last_axis_geometry(task: Task, tasks: Sequence[Task]) -> Geometry:
    # argreduce, kth_largest: blocks split the output (the operand's leading axes); each
    # reads its rows whole along the last axis, which a position cannot be combined over.
    (operand,) = (tasks[i] for i in task.inputs)
    rank = len(task.shape)
    rows = Tensor(itemsize(operand), tuple(range(rank)), operand.shape[-1])
    links = tuple(Link(a, 0, a) for a in range(rank))
    assembled = None if isinstance(operand.op, Input) else rows
    dims = tuple(Dim(e) for e in task.shape)
    return Geometry(dims, (rows, out_tensor(task)), links, assembled=assembled)


def view_groups(src: Shape, dst: Shape) -> tuple[ViewGroup, ...]:
    """The reshape `src -> dst` as groups of axes with equal products (size-1 axes alone)."""
    groups: list[ViewGroup] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            groups.append(ViewGroup((i,), ()))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            groups.append(ViewGroup((), (j,)))
            j += 1
            continue
        a, b = [i], [j]
        pa, pb = src[i], dst[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                if src[i] != 1:
                    a.append(i)
                    pa *= src[i]
                else:
                    groups.append(ViewGroup((i,), ()))
                i += 1
            else:
                if dst[j] != 1:
                    b.append(j)
                    pb *= dst[j]
                else:
                    groups.append(ViewGroup((), (j,)))
                j += 1
        groups.append(ViewGroup(tuple(a), tuple(b)))
    return tuple(groups)


def _view_geometry(task: Task, tasks: Sequence[Task]) -> Geometry:
    src = tasks[task.inputs[0]].shape
    dst = task.shape
    groups = view_groups(src, dst)
    dims = [Dim(e) for e in dst]
    links: list[Link] = []
    for g in groups:
        if not g.src or not g.dst:
            continue
        first = g.dst[0]
        if len(g.src) == 1 and len(g.dst) == 1:
            links.append(Link(first, 0, g.src[0]))
        elif len(g.src) == 1:  # split: src axis = dst[0] in units of the inner dst axes
            inner = math.prod(dst[a] for a in g.dst[1:])
            links.append(Link(first, 0, g.src[0], Fraction(1, inner)))
            for a in g.dst[1:]:
                dims[a] = Dim(dst[a], splittable=False)
        elif len(g.dst) == 1:  # merge: dst axis = src[0] in units of the inner src axes
            inner = math.prod(src[a] for a in g.src[1:])
            links.append(Link(first, 0, g.src[0], Fraction(inner)))
            dims[first] = Dim(dst[first], grain=inner)
        else:  # a regrouping: kept whole so that every block maps to a box
            for a in g.dst:
                dims[a] = Dim(dst[a], splittable=False)
    out = out_tensor(task)
    # Axes that cannot be cut to one element: the region even a finest block reads may
    # not be one producer block, and is then assembled by a copy.
    coarse = any(not d.splittable or d.grain > 1 for d in dims if d.extent > 1)
    return Geometry(
        tuple(dims), (out,), tuple(links), groups=groups, assembled=out if coarse else None
    )


def _slice_geometry(task: Task, tasks: Sequence[Task]) -> Geometry:
    op: Slice = task.op  # type: ignore[assignment]
    source = tasks[task.inputs[0]]
    out = out_tensor(task)
    links = tuple(
        Link(a, 0, a)
        for a, (start, size) in enumerate(zip(op.starts, task.shape, strict=True))
        if start == 0 and size == source.shape[a]
    )
    # A slice of an input reads its region straight from host storage: its output alone.
    tensors = (out,) if is_input_slice(task.op, source.op) else (out, out)
    return Geometry(tuple(Dim(e) for e in task.shape), tensors, links)


def _concat_geometry(task: Task, tasks: Sequence[Task]) -> Geometry:
    op: Concat = task.op  # type: ignore[assignment]
    links = tuple(
        Link(a, position, a)
        for position in range(len(task.inputs))
        for a in range(len(task.shape))
        if a != op.axis
    )
    parts, offset = [], 0
    for i in task.inputs:
        parts.append(ConcatPart(offset, tasks[i].shape[op.axis]))
        offset += tasks[i].shape[op.axis]
    dims = tuple(Dim(e) for e in task.shape)
    return Geometry(
        dims, (out_tensor(task),), links, concat_parts=tuple(parts), concat_axis=op.axis
    )


# -- emitting one block ---------------------------------------------------------------


def _emit_input(m: Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    block = Block(task.id, box_starts(box), box_sizes(box))
    return m.add(task.op, (), task.shape, task.dtype, task, block)


def _emit_einsum(m: Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    geometry = m.geometries[task.id]
    rank = len(task.shape)
    reduced = geometry.dims[rank:]
    rboxes = list(product(*(tile(d.extent, s) for d, s in zip(reduced, sizes[rank:], strict=True))))
    made = []
    for rbox in rboxes:
        full_box = box + rbox
        inputs = [
            m.fetch(producer, tuple(full_box[d] for d in dims))
            for producer, dims in zip(task.inputs, geometry.operand_dims, strict=True)
        ]
        kind, ranges = ("block", ()) if len(rboxes) == 1 else ("partial", rbox)
        block = Block(task.id, box_starts(box), box_sizes(box), kind, ranges)
        made.append((rbox, m.add(task.op, inputs, box_sizes(box), task.dtype, task, block)))
    if len(made) == 1:
        ((_, only),) = made
        return only
    return m.combine(task, box, made, reduced)


def _emit_fill(m: Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    op: Fill = task.op  # type: ignore[assignment]
    starts = box_starts(box)
    if op.pattern == "causal" and any(starts):
        origin = op.origin or (0,) * len(task.shape)
        op = Fill(op.value, op.pattern, tuple(o + s for o, s in zip(origin, starts, strict=True)))
    block = Block(task.id, starts, box_sizes(box))
    return m.add(op, (), box_sizes(box), task.dtype, task, block)


def _emit_gather(m: Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    table, ids = task.inputs
    k = len(m.tg[ids].shape)
    rows = m.tg[table].shape[0]
    inputs = (m.fetch(table, (Range(0, rows), *box[k:])), m.fetch(ids, box[:k]))
    block = Block(task.id, box_starts(box), box_sizes(box))
    return m.add(task.op, inputs, box_sizes(box), task.dtype, task, block)


def _emit_scatter_add(m: Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    op: ScatterAdd = task.op  # type: ignore[assignment]
    src, ids = task.inputs
    id_axes = full_box(m.tg[ids].shape)
    inputs = (m.fetch(src, (*id_axes, *box[1:])), m.fetch(ids, id_axes))
    block = Block(task.id, box_starts(box), box_sizes(box))
    rows = ScatterAdd(op.start + box[0].start)
    return m.add(rows, inputs, box_sizes(box), task.dtype, task, block)


def _view_source_region(geometry: Geometry, source: Shape, box: Box) -> Box:
    """The operand region a view block reads (a box: see `_view_geometry`)."""
    region = [Range(0, n) for n in source]
    for g in geometry.groups:
        if not g.src or not g.dst:
            continue
        start, size = box[g.dst[0]]
        if len(g.src) == 1 and len(g.dst) == 1:
            region[g.src[0]] = Range(start, size)
        elif len(g.src) == 1:  # the other axes of the group are whole
            inner = math.prod(box[a].size for a in g.dst[1:])
            region[g.src[0]] = Range(start * inner, size * inner)
        elif len(g.dst) == 1:  # start and size are multiples of the inner size
            inner = math.prod(source[a] for a in g.src[1:])
            region[g.src[0]] = Range(start // inner, size // inner)
    return tuple(region)


def _emit_view(m: Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    (producer,) = task.inputs
    region = _view_source_region(m.geometries[task.id], m.tg[producer].shape, box)
    block = Block(task.id, box_starts(box), box_sizes(box))
    return m.add(task.op, (m.fetch(producer, region),), box_sizes(box), task.dtype, task, block)


def _emit_slice(m: Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    op: Slice = task.op  # type: ignore[assignment]
    region = tuple(Range(start + r.start, r.size) for r, start in zip(box, op.starts, strict=True))
    block = Block(task.id, box_starts(box), box_sizes(box))
    return m.assemble(task.inputs[0], region, copy=True, top=block)


def _emit_concat(m: Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    op: Concat = task.op  # type: ignore[assignment]
    axis = op.axis
    lo, hi = box[axis].start, box[axis].start + box[axis].size
    parts, offset = [], 0
    for producer in task.inputs:
        extent = m.tg[producer].shape[axis]
        start, stop = max(lo, offset), min(hi, offset + extent)
        if start < stop:
            region = (*box[:axis], Range(start - offset, stop - start), *box[axis + 1 :])
            parts.append((producer, region))
        offset += extent
    block = Block(task.id, box_starts(box), box_sizes(box))
    if len(parts) == 1:
        ((producer, region),) = parts
        return m.assemble(producer, region, copy=True, top=block)
    inputs = [m.fetch(producer, region) for producer, region in parts]
    return m.add(Concat(axis), inputs, box_sizes(box), task.dtype, task, block)


def _emit_last_axis(m: Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    (operand,) = task.inputs
    rows = m.fetch(operand, (*box, Range(0, m.tg[operand].shape[-1])))
    block = Block(task.id, box_starts(box), box_sizes(box))
    return m.add(task.op, (rows,), box_sizes(box), task.dtype, task, block)


# -- the table ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PartitionRule:
    """How partitioning treats one op kind (see the module docstring)."""

    geometry: Callable[[Task, Sequence[Task]], Geometry]
    emit: Callable[[Materializer, Task, Box, Sequence[int]], int]


RULES: OpTable[PartitionRule] = OpTable(
    "partition rules",
    {
        Input: PartitionRule(_input_geometry, _emit_input),
        Einsum: PartitionRule(_einsum_geometry, _emit_einsum),
        Fill: PartitionRule(_fill_geometry, _emit_fill),
        Gather: PartitionRule(_gather_geometry, _emit_gather),
        View: PartitionRule(_view_geometry, _emit_view),
        Slice: PartitionRule(_slice_geometry, _emit_slice),
        Concat: PartitionRule(_concat_geometry, _emit_concat),
        ScatterAdd: PartitionRule(_scatter_add_geometry, _emit_scatter_add),
        ArgReduce: PartitionRule(_last_axis_geometry, _emit_last_axis),
        KthLargest: PartitionRule(_last_axis_geometry, _emit_last_axis),
    },
)
"""The partition rule of each op kind."""


def geometry_of(task: Task, tasks: Sequence[Task]) -> Geometry:
    """The geometry of `task` (in the graph whose tasks are `tasks`)."""
    return RULES.of(task.op).geometry(task, tasks)


def geometries(tg: TaskGraph) -> list[Geometry]:
    """The geometry of every task of `tg`, by id."""
    return [geometry_of(t, tg.tasks) for t in tg.tasks]
