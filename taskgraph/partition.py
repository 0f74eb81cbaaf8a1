"""Partitioning (fine-grained paging): split large tasks into blocks that fit a byte limit.

Offloading whole tensors cannot help when one task's operands and output alone exceed
device memory (attention scores of LLaMA-7B at batch 8, sequence 4096 are 8 GiB each).
`partition(tg, limit)` rewrites a TaskGraph so that the *working set* of every task –
the bytes of its distinct operands plus its output – is at most `limit`, by cutting
large tasks into block tasks over boxes of their iteration space. The result is an
ordinary TaskGraph (built with `GraphBuilder`): the evaluator, the planner and the
runtime use it unchanged, and every task carries a `Block` saying which original task
and which region of it it holds.

Terms
-----
* The *dims* of a task are its output axes, plus, for an einsum, its reduced indices.
  A block is a box over the dims. Splitting a reduced index gives *partial* aggregates
  that a following einsum combines with the same `agg`; this is valid for sum, max,
  min and prod whatever the join, because the join is applied per point and only then
  aggregated.
* Working set (`working_set`): distinct operands (an operand read twice counts once)
  plus the output. A view aliases its operand, so it counts its bytes once. A Slice
  that reads an Input directly is an *input block*: it counts only its output, since a
  planner can load that region straight from host storage (an input that alone
  exceeds the limit must be consumed in such blocks). Input tasks themselves are host
  storage and have no limit.

Algorithm
---------
1. **Feasibility.** `min_block_bytes(tg, t)` is the working set of task t's finest
   block: every dim that may be split cut to one element (reduced dims too, so partials
   need a combine of three). When every task is split so, each region a block reads is
   exactly one producer block, so the finest split needs no assembly and always works.
   If the limit is below the largest, `BlockLimitError` says which task needs how much.
2. **Which tasks split.** Tasks over the limit are *forced*. A task that fits is split
   too (*absorbed*), unless it is a program output, when it reads a split task or when
   every task reading it is split: its blocks then take the producer blocks, or feed
   the consumer blocks, directly. Left whole, it would read the producer's blocks
   concatenated (a copy of all of it), or stay resident while every consumer block
   reads a slice of it (a copy each). Split tasks connected as producer and consumer
   form *components*.
3. **Alignment classes.** Within a component the dims that index the same data are
   unified with a weighted union-find: einsum letters, a concat's other axes, a slice's
   full axes, a gather's id and column axes, a view's unchanged axes, and a view's
   split/merged leading axes with a unit (`[b, s, h*e] -> [b, s, h, e]` links `h` to
   the merged axis in units of `e`). A class has one block size, so blocks flow from
   producer to consumer without reassembly. A link that would put two dims of one task
   into one class is refused – attention's query and key positions both come from the
   sequence axis of the residual stream – so those dims stay independent (and meet
   through assembly if both are split). Links are made core first (forced tasks in
   topological order, then absorbed tasks nearest to the core), so the refusal falls on
   the absorbed side.
4. **Block sizes,** per component. Start unsplit; while the worst task (largest working
   set relative to the limit) does not fit, halve one block size among its dims:

   * the split that shrinks that task's working set most wins; among near ties (within
     10%) the outermost dim (batch before heads before queries: outer blocks are
     contiguous bytes);
   * a class with a refused link counts half (a split there costs assembly), and so does
     a class that other tasks reduce (it gives them partial aggregates, and a softmax
     chain loses its block-by-block flow);
   * when more tasks reduce a class than the worst task has neighbours in it, the dim is
     split for that task alone (a *private* split, also counted half), costing assembly
     only where the task meets its neighbours: the embedding gather, whose table column
     must shrink, splits the hidden axis privately instead of giving every norm and
     projection of the residual stream partials, while attention's head axis, reduced
     only by the output projection, is split for the whole chain.

   Then *relax*: grow each class's block size, then each private one, as far as every
   task still fits – the largest blocks that fit, merging back blocks the greedy made
   needlessly small – and even the blocks out (`ceil(E / count)`). Attention ends up
   split by batch, heads and query blocks; the softmax's key index, reduced by three of
   its einsums, is split last of all.
5. **Materialize** in topological order. Each block reads, per operand, the region its
   box needs: the producer's block itself when aligned; otherwise explicit assembly
   (`Block.kind == "assembly"`): a Slice of one block (or of a whole task, or of an
   input), and Concats of several pieces, one axis at a time. Assembly is cached per
   region, so consumers that read the same region share it. A block of a Slice or
   Concat task that is exactly one producer block is a View of it (an alias, no copy).
   Partials are combined by
   einsums `"X,X,...->X"` whose join is `a + b + ...`, `max(max(a, b), ...)`, `min(...)`
   or the product, each with as many operands as fit the limit (at most 26).
6. **Check.** The working sets of all new tasks are measured. Assembly that does not fit
   (a Slice of a whole producer too large to sit beside the slice, a Concat of more
   pieces than fit) makes the responsible original task split, or split finer (its
   target is halved, and it is split on even where the model of step 4 sees no gain),
   and steps 2-5 run again; a LLaMA-like graph needs no second round.
7. **Order.** Tasks are emitted inputs first. Then, for each original task that reads a
   weight (in topological order), all its blocks run together – the weight is loaded
   once for all of them – each block pulling what it needs depth first; outputs and the
   rest follow likewise. So weight-free chains between weight-reading tasks (attention
   scores, mask, softmax, attention output) run block by block up to their consumer,
   and an 8 GiB intermediate is never live whole, while layers still run one after the
   other (a pure depth-first order from the outputs would run one batch block through
   all layers before the next and reload every weight once per block).

Program outputs keep their names. A split output is rebuilt by Concat tasks of kind
`"output"` (one axis at a time, nested; their leaves are the output's blocks): run on
the device they would need twice the output's bytes, and they are the one exception
to the limit. The planner runs them on the host instead when nothing else reads the
blocks (`taskgraph.assembly`): each block is copied into its box of the output's host
array as soon as it is computed, so the output is never on the device whole.

Views: a view block is a view of the operand region its box maps to. Axes of a view
that keep their size, and the leading axis of a split or merged group, may be split
(the merged axis only at multiples of the inner size); the other axes of such a group,
and every axis of a group that regroups dims (`[6, 4] -> [4, 6]`), stay whole, so that
the region is always a box. When the producer's blocks do not match that region, the
region is assembled.

>>> import einpage as ep
>>> prog = ep.Program("mm")
>>> a = prog.input("a", (4, 4096)); b = prog.input("b", (4096, 4))
>>> prog.output(prog.einsum("ij,jk->ik", a, b), "c")
>>> tg = partition(prog.build(), "40KiB")
>>> sorted({t.block.kind for t in tg if t.kind == "einsum"})
['block', 'partial']
>>> max(working_set(tg, t.id) for t in tg if t.kind != "input") <= 40 * 1024
True
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import product
from typing import Any

from einpage_core.errors import GraphError, InfeasibleBudgetError, PlanError
from einpage_core.units import format_bytes, parse_bytes
from taskgraph import dtypes
from taskgraph.builder import GraphBuilder
from taskgraph.einsum import EinsumSpec
from taskgraph.expr import VARIABLES
from taskgraph.expr import parse as parse_join
from taskgraph.graph import TaskGraph
from taskgraph.nodes import (
    Block,
    Concat,
    Einsum,
    Fill,
    Gather,
    Input,
    Op,
    Shape,
    Slice,
    Task,
    View,
    with_blocks,
)

__all__ = [
    "partition",
    "partition_for_budget",
    "BudgetPartition",
    "working_set",
    "min_block_bytes",
    "smallest_feasible_block_limit",
    "finest_block",
    "blocks_of",
    "BlockLimitError",
    "DEFAULT_BUDGET_FRACTION",
]

Box = tuple[tuple[int, int], ...]
"""A region: one `(start, size)` range per axis."""

DEFAULT_BUDGET_FRACTION = 0.25
"""`partition_for_budget`'s block limit as a fraction of the budget (see there)."""

MAX_COMBINE_FANIN = len(VARIABLES)
"""Operands of one combine einsum at most: join variables are `a` to `z`."""

_MAX_ROUNDS = 64
_NEAR_TIE = 0.9


class BlockLimitError(InfeasibleBudgetError):
    """Even the finest split allowed does not fit the block limit.

    Attributes: `limit` (bytes asked for, also `budget`), `needed` (the smallest block
    limit that works for the whole graph), `task` (the id of a task that needs it).
    """

    def __init__(self, message: str, limit: int, needed: int, task: int | None):
        super().__init__(message, limit, needed, task)
        self.limit = limit


# -- working sets -----------------------------------------------------------------


def _aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


def _is_input_block(task: Task, tg_tasks: Sequence[Task]) -> bool:
    """A Slice reading an Input directly: counts only its output (see the module docstring)."""
    return isinstance(task.op, Slice) and isinstance(tg_tasks[task.inputs[0]].op, Input)


def working_set(tg: TaskGraph, task_id: int, alignment: int = 1) -> int:
    """Bytes a task needs on the device at once: distinct operands plus output.

    Each tensor is rounded up to `alignment`. A view counts its bytes once (it aliases
    its operand), an input block (a Slice reading an Input) only its output, and an
    Input its own bytes.

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (8, 8))
    >>> prog.output(prog.einsum("ij,ij->ij", x, x), "y")
    >>> working_set(prog.build(), 1)   # x read twice counts once: 256 + 256
    512
    """
    task = tg[task_id]
    own = _aligned(task.nbytes, alignment)
    if not task.is_compute or _is_input_block(task, tg.tasks):
        return own
    return own + sum(_aligned(tg[i].nbytes, alignment) for i in dict.fromkeys(task.inputs))


# -- per-op geometry: dims, working-set model, alignment links, operand regions ---


@dataclass(frozen=True, slots=True)
class _Dim:
    """One dim of a task's iteration space. `grain`: block starts must be multiples of it."""

    extent: int
    splittable: bool = True
    reduced: bool = False
    grain: int = 1


@dataclass(frozen=True, slots=True)
class _Tensor:
    """One tensor of a block's working set: `itemsize * fixed * prod(block size of dims)`."""

    itemsize: int
    dims: tuple[int, ...]
    fixed: int = 1


@dataclass(frozen=True, slots=True)
class _Link:
    """Dim `dim` of a task indexes the same data as axis `axis` of operand `position`:
    block boundaries of the dim are `ratio` times those of the axis."""

    dim: int
    position: int
    axis: int
    ratio: Fraction = Fraction(1)


@dataclass(frozen=True, slots=True)
class _ViewGroup:
    """Axes of a view's operand (`src`) and output (`dst`) with equal products; one side
    is empty for a size-1 axis."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Info:
    """What partitioning needs to know of one task (computed once per task)."""

    dims: tuple[_Dim, ...]
    tensors: tuple[_Tensor, ...]  # the output last
    links: tuple[_Link, ...]
    combine: bool = False  # an einsum with reduced dims
    operand_dims: tuple[tuple[int, ...], ...] = ()  # einsum: the dim of each operand axis
    groups: tuple[_ViewGroup, ...] = ()  # view: the reshape's groups
    concat_parts: tuple[tuple[int, int], ...] = ()  # concat: (offset, extent) per operand
    concat_axis: int = -1


def _itemsize(task: Task) -> int:
    return dtypes.itemsize(task.dtype)


def _out_tensor(task: Task) -> _Tensor:
    return _Tensor(_itemsize(task), tuple(range(len(task.shape))))


def _input_info(task: Task, tasks: Sequence[Task]) -> _Info:
    return _Info(tuple(_Dim(e) for e in task.shape), (), ())


def _einsum_info(task: Task, tasks: Sequence[Task]) -> _Info:
    op: Einsum = task.op  # type: ignore[assignment]
    spec = op.spec
    sizes = spec.index_sizes([tasks[i].shape for i in task.inputs])
    letters = spec.output + spec.reduced
    dim_of = {c: d for d, c in enumerate(letters)}
    dims = tuple(_Dim(sizes[c], reduced=c in spec.reduced) for c in letters)
    operand_dims = tuple(tuple(dim_of[c] for c in term) for term in spec.inputs)
    tensors: dict[tuple[int, tuple[int, ...]], _Tensor] = {}
    for producer, term_dims in zip(task.inputs, operand_dims, strict=True):
        tensors.setdefault((producer, term_dims), _Tensor(_itemsize(tasks[producer]), term_dims))
    links = tuple(
        _Link(d, position, axis)
        for position, term_dims in enumerate(operand_dims)
        for axis, d in enumerate(term_dims)
    )
    return _Info(
        dims,
        (*tensors.values(), _out_tensor(task)),
        links,
        combine=bool(spec.reduced),
        operand_dims=operand_dims,
    )


def _fill_info(task: Task, tasks: Sequence[Task]) -> _Info:
    return _Info(tuple(_Dim(e) for e in task.shape), (_out_tensor(task),), ())


def _gather_info(task: Task, tasks: Sequence[Task]) -> _Info:
    table, ids = (tasks[i] for i in task.inputs)
    k = len(ids.shape)
    dims = tuple(_Dim(e) for e in task.shape)
    table_tensor = _Tensor(_itemsize(table), tuple(range(k, len(task.shape))), table.shape[0])
    ids_tensor = _Tensor(_itemsize(ids), tuple(range(k)))
    links = tuple(_Link(i, 1, i) for i in range(k)) + tuple(
        _Link(k + j, 0, 1 + j) for j in range(len(table.shape) - 1)
    )
    return _Info(dims, (table_tensor, ids_tensor, _out_tensor(task)), links)


def _view_groups(src: Shape, dst: Shape) -> tuple[_ViewGroup, ...]:
    """The reshape `src -> dst` as groups of axes with equal products (size-1 axes alone)."""
    groups: list[_ViewGroup] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            groups.append(_ViewGroup((i,), ()))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            groups.append(_ViewGroup((), (j,)))
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
                    groups.append(_ViewGroup((i,), ()))
                i += 1
            else:
                if dst[j] != 1:
                    b.append(j)
                    pb *= dst[j]
                else:
                    groups.append(_ViewGroup((), (j,)))
                j += 1
        groups.append(_ViewGroup(tuple(a), tuple(b)))
    return tuple(groups)


def _view_info(task: Task, tasks: Sequence[Task]) -> _Info:
    src = tasks[task.inputs[0]].shape
    dst = task.shape
    groups = _view_groups(src, dst)
    dims = [_Dim(e) for e in dst]
    links: list[_Link] = []
    for g in groups:
        if not g.src or not g.dst:
            continue
        first = g.dst[0]
        if len(g.src) == 1 and len(g.dst) == 1:
            links.append(_Link(first, 0, g.src[0]))
        elif len(g.src) == 1:  # split: src axis = dst[0] in units of the inner dst axes
            inner = math.prod(dst[a] for a in g.dst[1:])
            links.append(_Link(first, 0, g.src[0], Fraction(1, inner)))
            for a in g.dst[1:]:
                dims[a] = _Dim(dst[a], splittable=False)
        elif len(g.dst) == 1:  # merge: dst axis = src[0] in units of the inner src axes
            inner = math.prod(src[a] for a in g.src[1:])
            links.append(_Link(first, 0, g.src[0], Fraction(inner)))
            dims[first] = _Dim(dst[first], grain=inner)
        else:  # a regrouping: kept whole so that every block maps to a box
            for a in g.dst:
                dims[a] = _Dim(dst[a], splittable=False)
    return _Info(tuple(dims), (_out_tensor(task),), tuple(links), groups=groups)


def _slice_info(task: Task, tasks: Sequence[Task]) -> _Info:
    op: Slice = task.op  # type: ignore[assignment]
    source = tasks[task.inputs[0]]
    out = _out_tensor(task)
    links = tuple(
        _Link(a, 0, a)
        for a, (start, size) in enumerate(zip(op.starts, task.shape, strict=True))
        if start == 0 and size == source.shape[a]
    )
    tensors = (out,) if isinstance(source.op, Input) else (out, out)
    return _Info(tuple(_Dim(e) for e in task.shape), tensors, links)


def _concat_info(task: Task, tasks: Sequence[Task]) -> _Info:
    op: Concat = task.op  # type: ignore[assignment]
    links = tuple(
        _Link(a, position, a)
        for position in range(len(task.inputs))
        for a in range(len(task.shape))
        if a != op.axis
    )
    parts, offset = [], 0
    for i in task.inputs:
        parts.append((offset, tasks[i].shape[op.axis]))
        offset += tasks[i].shape[op.axis]
    dims = tuple(_Dim(e) for e in task.shape)
    return _Info(dims, (_out_tensor(task),), links, concat_parts=tuple(parts), concat_axis=op.axis)


_INFO: dict[type[Op], Callable[[Task, Sequence[Task]], _Info]] = {
    Input: _input_info,
    Einsum: _einsum_info,
    Fill: _fill_info,
    Gather: _gather_info,
    View: _view_info,
    Slice: _slice_info,
    Concat: _concat_info,
}
"""Geometry of each op kind."""


def _infos(tg: TaskGraph) -> list[_Info]:
    return [_INFO[type(t.op)](t, tg.tasks) for t in tg.tasks]


def _concat_pieces(info: _Info, sizes: Sequence[int], alignment: int) -> int:
    """The largest total of the pieces a concat block reads (each rounded up on its own):
    an inner block reads one piece; only blocks across an operand boundary differ."""
    out = info.tensors[-1]
    axis = info.concat_axis
    size = sizes[axis]
    row = out.itemsize * math.prod(s for d, s in enumerate(sizes) if d != axis)
    extent = info.dims[axis].extent
    starts = {(offset // size) * size for offset, _ in info.concat_parts}
    worst = _aligned(row * min(size, max(n for _, n in info.concat_parts)), alignment)
    for start in starts:
        stop = min(start + size, extent)
        total = sum(
            _aligned(row * (min(stop, o + n) - max(start, o)), alignment)
            for o, n in info.concat_parts
            if max(start, o) < min(stop, o + n)
        )
        worst = max(worst, total)
    return worst


def _model_ws(info: _Info, sizes: Sequence[int], alignment: int) -> int:
    """Working set of the largest block whose dims have `sizes`."""
    total = _concat_pieces(info, sizes, alignment) if info.concat_parts else 0
    for tensor in info.tensors:
        n = tensor.fixed
        for d in tensor.dims:
            n *= sizes[d]
        total += _aligned(n * tensor.itemsize, alignment)
    return total


def _model_load(info: _Info, sizes: Sequence[int], alignment: int) -> int:
    """Largest working set of the blocks, including the combine of partials (at least
    two partials and the result) when a reduced dim is split."""
    ws = _model_ws(info, sizes, alignment)
    if info.combine and any(
        dim.reduced and size < dim.extent for dim, size in zip(info.dims, sizes, strict=True)
    ):
        out = info.tensors[-1]
        ws = max(ws, 3 * _aligned(out.itemsize * math.prod(sizes[d] for d in out.dims), alignment))
    return ws


def _finest_sizes(info: _Info) -> list[int]:
    return [dim.grain if dim.splittable else dim.extent for dim in info.dims]


def _copy_bytes(elements: int, itemsize: int, alignment: int) -> int:
    """A copy of a region of `elements`, assembled in the worst case from one-element
    pieces: the pieces (each rounded up) and the result."""
    return _aligned(elements * itemsize, alignment) + elements * _aligned(itemsize, alignment)


def _min_block(task: Task, info: _Info, tasks: Sequence[Task], alignment: int) -> int:
    """The working set of the task's finest block: every dim split to its grain, reduced
    dims too (then a combine of three partials). At that split every block of every
    task is one element along each splittable dim, so regions are whole producer blocks
    and need no assembly – except regions with dims that cannot be split (a view's
    regrouped axes, a gather's table rows), counted here as a worst-case copy."""
    if isinstance(task.op, Input):
        return _aligned(_itemsize(task), alignment)
    sizes = _finest_sizes(info)
    need = _model_load(info, sizes, alignment)
    if isinstance(task.op, View) and any(
        not d.splittable or d.grain > 1 for d in info.dims if d.extent > 1
    ):
        need = max(need, _copy_bytes(math.prod(sizes), _itemsize(task), alignment))
    if isinstance(task.op, Gather) and not isinstance(tasks[task.inputs[0]].op, Input):
        table = info.tensors[0]
        rows = table.fixed * math.prod(sizes[d] for d in table.dims)
        need = max(need, _copy_bytes(rows, table.itemsize, alignment))
    return need


def min_block_bytes(tg: TaskGraph, task_id: int, alignment: int = 1) -> int:
    """The smallest working set a block of task `task_id` is guaranteed: split as finely
    as allowed (every dim to one element, or to its grain; reduced dims too, with a
    combine of three partials), plus, for a region with dims that cannot be split, the
    copy that may assemble it.

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> a = prog.input("a", (64, 64), "float64"); b = prog.input("b", (64, 64), "float64")
    >>> prog.output(prog.einsum("ij,jk->ik", a, b), "c")
    >>> min_block_bytes(prog.build(), 2)   # one element of a, b and c
    24
    """
    task = tg[task_id]
    return _min_block(task, _INFO[type(task.op)](task, tg.tasks), tg.tasks, alignment)


def _feasible_limit(tg: TaskGraph, infos: Sequence[_Info], alignment: int) -> tuple[int, int]:
    needed, culprit = 0, -1
    for task, info in zip(tg.tasks, infos, strict=True):
        if isinstance(task.op, Input):
            continue
        need = _min_block(task, info, tg.tasks, alignment)
        if need > needed:
            needed, culprit = need, task.id
    return needed, culprit


def smallest_feasible_block_limit(tg: TaskGraph, alignment: int = 1) -> int:
    """The smallest `max_block_bytes` for which `partition` succeeds: the largest
    `min_block_bytes` of any non-input task."""
    return _feasible_limit(tg, _infos(tg), alignment)[0]


def finest_block(tg: TaskGraph, alignment: int = 1) -> tuple[int, int | None]:
    """`smallest_feasible_block_limit` and the task that needs it (None when the graph
    has no task but inputs, when the limit is 0).

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (64, 64), "float64")
    >>> prog.output(prog.einsum("ij->i", x), "s")
    >>> finest_block(prog.build())   # one element of x, and three partial sums to combine
    (24, 1)
    """
    needed, culprit = _feasible_limit(tg, _infos(tg), alignment)
    return needed, (culprit if culprit >= 0 else None)


# -- which tasks split: forced, absorbed, components ------------------------------


def _components(
    tg: TaskGraph, members: set[int], absorb: bool
) -> tuple[list[list[int]], dict[int, int]]:
    """Grow `members` by absorption (step 2); return the components (in topological
    order) and, for each absorbed task, the order in which it was absorbed."""
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
    return sorted(groups.values()), absorbed


# -- alignment classes and block sizes ----------------------------------------------


class _Classes:
    """Weighted union-find over dims (alignment classes).

    Node x has a parent and `up[x]`: block boundaries of x are `up[x]` times those of
    its parent, an int >= 1, so a root is the coarsest node of its class and every
    node's unit (the product along its path) is an int. `owners[root]` maps each task
    with a dim in the class to that dim's node: a class never holds two dims of a task.
    """

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.up: list[int] = []
        self.extent: list[int] = []
        self.owners: list[dict[int, int]] = []
        self.refused: list[bool] = []

    def add(self, extent: int, task: int | None) -> int:
        x = len(self.parent)
        self.parent.append(x)
        self.up.append(1)
        self.extent.append(extent)
        self.owners.append({} if task is None else {task: x})
        self.refused.append(False)
        return x

    def find(self, x: int) -> tuple[int, int]:
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
        return x, (self.up[path[0]] if path else 1)

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


@dataclass(frozen=True, slots=True)
class _Member:
    """A dim of a component task in terms of its class: size = min(extent, s[root] * unit)."""

    root: int
    unit: int
    extent: int


def _link_order(
    tg: TaskGraph, tasks: Sequence[int], forced: set[int], absorbed: dict[int, int]
) -> list[tuple[int, int, int]]:
    """(consumer, position, producer) edges inside a component, core first (see step 3)."""
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
            keyed.append((key, (c, position, p)))
    keyed.sort()
    return [edge for _, edge in keyed]


class _Sizer:
    """Block sizes for the tasks of one component (steps 3 and 4).

    `size[root]` is a class's block size in the units of its root; `private[t][d]` a
    block size of task t's dim d of its own (a private split, in the dim's units).
    """

    def __init__(
        self,
        tg: TaskGraph,
        infos: Sequence[_Info],
        tasks: Sequence[int],
        forced: set[int],
        absorbed: dict[int, int],
        factors: dict[int, float],
        limit: int,
        alignment: int,
    ):
        self.tg, self.infos, self.tasks = tg, infos, tasks
        self.factors, self.limit, self.alignment = factors, limit, alignment
        self.classes = classes = _Classes()
        nodes: dict[int, list[int]] = {}
        for t in tasks:
            ids = []
            for dim in infos[t].dims:
                x = classes.add(dim.extent, t)
                if dim.grain > 1:
                    grain_node = classes.add(dim.extent // dim.grain, None)
                    classes.link(x, grain_node, Fraction(dim.grain))
                ids.append(x)
            nodes[t] = ids
        for c, position, p in _link_order(tg, tasks, forced, absorbed):
            for link in infos[c].links:
                if link.position != position:
                    continue
                ends = (infos[c].dims[link.dim], infos[p].dims[link.axis])
                if all(dim.splittable for dim in ends):
                    classes.link(nodes[c][link.dim], nodes[p][link.axis], link.ratio)

        self.members: dict[int, list[_Member]] = {}  # task -> its dims as class members
        self.splittable: dict[int, bool] = {}  # root -> whether the class may be split
        self.reducers: dict[int, set[int]] = {}  # root -> the tasks that reduce the class
        users: dict[int, dict[int, None]] = {}  # root -> the tasks with a dim in the class
        for t in tasks:
            row = []
            for dim, x in zip(infos[t].dims, nodes[t], strict=True):
                root, unit = classes.find(x)
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
        self.size = {root: classes.extent[root] for root in self.splittable}
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
        return _model_load(self.infos[t], self.sizes_of(t, **change), self.alignment)

    def target(self, t: int) -> float:
        return self.limit * self.factors.get(t, 1.0)

    def options(self, t: int, current: int) -> list[tuple[float, int, int, int]]:
        """(score, dim, root or -1 for a private split, new size) for each way to halve a
        block of t (step 4)."""
        blocks = self.sizes_of(t)
        options = []
        for d, m in enumerate(self.members[t]):
            grain = self.infos[t].dims[d].grain
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
                options.append((gain * weight, d, m.root, new))
                continue
            # More tasks reduce this class than t has neighbours in it (a split would give
            # them all partials), or the class cannot shrink further in t's units: split
            # only t's dim, with assembly where t meets its neighbours.
            mine = -(-blocks[d] // (2 * grain)) * grain
            if mine < blocks[d]:
                gain = current - self.load(t, dim=d, dim_size=mine)
                options.append((gain * 0.5, d, -1, mine))
        # Splits that help, if any; otherwise split on all the same: the finest split
        # fits, and on the way a concat's pieces may first grow (a block across an
        # operand boundary reads two), or step 6 found t's real blocks too large.
        return [o for o in options if o[0] > 0] or options

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
            best = max(score for score, *_ in options)
            near = [o for o in options if o[0] >= best - (1 - _NEAR_TIE) * abs(best)]
            _, d, root, new = min(near, key=lambda o: o[1])  # the outermost near tie
            if root < 0:
                self.private.setdefault(t, {})[d] = new
                self.privately.append((t, d))
                changed = [t]
            else:
                self.size[root] = new
                self.halved.append(root)
                changed = self.users[root]
            for u in changed:
                heapq.heappush(heap, (-self.load(u) / self.target(u), u))

    def relax(self) -> None:
        """Grow each class's block size, latest halved first, then each private one, as far
        as all its tasks still fit, and even the blocks out; a private split that reaches
        its class's size is dropped. A task left above its target keeps its blocks."""

        def even(extent: int, block: int) -> int:
            return -(-extent // -(-extent // block))  # as many blocks, evened out

        for root in reversed(list(dict.fromkeys(reversed(self.halved)))):
            users = self.users[root]
            if any(u in self.accepted for u in users):
                continue

            def fits(size: int, root: int = root, users: list[int] = users) -> bool:
                return all(self.load(u, root=root, root_size=size) <= self.target(u) for u in users)

            extent = self.classes.extent[root]
            best = _largest(self.size[root], extent, fits)
            self.size[root] = even(extent, best) if fits(even(extent, best)) else best
        for t, d in reversed(list(dict.fromkeys(reversed(self.privately)))):
            if t in self.accepted:
                continue
            m = self.members[t][d]
            grain = self.infos[t].dims[d].grain  # sizes in whole grains

            def fits_own(grains: int, t: int = t, d: int = d, grain: int = grain) -> bool:
                return self.load(t, dim=d, dim_size=grains * grain) <= self.target(t)

            shared = min(m.extent, self.size[m.root] * m.unit) // grain
            best = _largest(min(self.private[t][d] // grain, shared), shared, fits_own)
            if best >= shared:
                del self.private[t][d]
            else:
                evened = even(m.extent // grain, best)
                self.private[t][d] = (evened if fits_own(evened) else best) * grain

    def result(self) -> dict[int, tuple[int, ...]]:
        return {t: tuple(self.sizes_of(t)) for t in self.tasks}


def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """The largest size in [lo, hi] that `fits`, by bisection (`lo` fits)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _plan(
    tg: TaskGraph,
    infos: Sequence[_Info],
    forced: set[int],
    factors: dict[int, float],
    limit: int,
    alignment: int,
    absorb: bool,
) -> dict[int, tuple[int, ...]]:
    """Block sizes (per dim) of every task that may be split (steps 2-4)."""
    members = set(forced) | set(factors)
    components, absorbed = _components(tg, members, absorb)
    sizes: dict[int, tuple[int, ...]] = {}
    for tasks in components:
        sizer = _Sizer(tg, infos, tasks, forced, absorbed, factors, limit, alignment)
        sizer.split()
        sizer.relax()
        sizes.update(sizer.result())
    return sizes


# -- materialization ------------------------------------------------------------------


def _full(shape: Shape) -> Box:
    return tuple((0, n) for n in shape)


def _starts(box: Box) -> tuple[int, ...]:
    return tuple(start for start, _ in box)


def _sizes(box: Box) -> tuple[int, ...]:
    return tuple(size for _, size in box)


def _ranges(extent: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(size, extent - start)) for start in range(0, extent, size)]


@dataclass(slots=True)
class _New:
    """A task of the partitioned graph before it is numbered."""

    op: Op
    inputs: tuple[int, ...]
    shape: Shape
    dtype: str
    scope: str
    label: str
    block: Block
    made_for: int  # the original task being materialized when this one was made


@dataclass(frozen=True, slots=True)
class _Piece:
    """The part of one producer block that a region covers, along one axis."""

    index: int  # the block's index along the axis
    offset: int  # where the part starts inside the block
    start: int  # where it starts in the producer
    size: int
    exact: bool  # the part is the whole block


class _Materializer:
    """Emits the new tasks (step 5): blocks, partials and combines, and assembly."""

    def __init__(
        self,
        tg: TaskGraph,
        infos: Sequence[_Info],
        sizes: dict[int, tuple[int, ...]],
        limit: int,
        alignment: int,
    ):
        self.tg = tg
        self.infos = infos
        self.sizes = sizes
        self.limit = limit
        self.alignment = alignment
        self.new: list[_New] = []
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
        self.new.append(
            _New(
                op,
                tuple(inputs),
                tuple(shape),
                dtype,
                source.scope,
                source.label,
                block,
                self.current,
            )
        )
        return len(self.new) - 1

    def run(self) -> dict[str, int]:
        """Materialize every task in topological order; return the outputs' new tasks."""
        for task in self.tg.tasks:
            self.current = task.id
            dims = self.infos[task.id].dims
            sizes = self.sizes.get(task.id, tuple(d.extent for d in dims))
            out_sizes = sizes[: len(task.shape)]
            emit = _EMIT[type(task.op)]
            table = {}
            grid = [range(-(-e // b)) for e, b in zip(task.shape, out_sizes, strict=True)]
            for index in product(*grid):
                box = tuple(
                    (i * b, min(b, e - i * b))
                    for i, b, e in zip(index, out_sizes, task.shape, strict=True)
                )
                table[index] = emit(self, task, box, sizes)
            self.grid[task.id] = out_sizes
            self.blocks[task.id] = table
        outputs = {}
        for name, task_id in self.tg.outputs.items():
            self.current = task_id
            outputs[name] = self.fetch(task_id, _full(self.tg[task_id].shape), "output")
        return outputs

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
            top = Block(producer, _starts(region), _sizes(region), kind)
        if all(len(parts) == 1 for parts in per_axis):
            parts = [p[0] for p in per_axis]
            source = table[tuple(p.index for p in parts)]
            if exact:  # copy the block: alias it
                return self.add(View(), (source,), _sizes(region), task.dtype, task, top)
            offsets = tuple(p.offset for p in parts)
            return self.add(Slice(offsets), (source,), _sizes(region), task.dtype, task, top)
        items: dict[tuple[int, ...], tuple[int, Box]] = {}
        for combo in product(*(list(enumerate(parts)) for parts in per_axis)):
            parts = [p for _, p in combo]
            source = table[tuple(p.index for p in parts)]
            box = tuple((p.start, p.size) for p in parts)
            if not all(p.exact for p in parts):
                offsets = tuple(p.offset for p in parts)
                piece = Block(producer, _starts(box), _sizes(box), kind)
                source = self.add(Slice(offsets), (source,), _sizes(box), task.dtype, task, piece)
            items[tuple(j for j, _ in combo)] = (source, box)
        last = min(a for a, parts in enumerate(per_axis) if len(parts) > 1)
        for axis in reversed(range(len(per_axis))):
            if len(per_axis[axis]) == 1:
                continue
            groups: dict[tuple[int, ...], list[tuple[int, Box]]] = {}
            for key in sorted(items):
                groups.setdefault(key[:axis] + key[axis + 1 :], []).append(items[key])
            items = {}
            for rest, members in groups.items():
                first = members[0][1]
                length = sum(box[axis][1] for _, box in members)
                union = first[:axis] + ((first[axis][0], length),) + first[axis + 1 :]
                block = (
                    top if axis == last else Block(producer, _starts(union), _sizes(union), kind)
                )
                vid = self.add(
                    Concat(axis), [v for v, _ in members], _sizes(union), task.dtype, task, block
                )
                items[rest[:axis] + (0,) + rest[axis:]] = (vid, union)
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
        self, task: Task, box: Box, partials: list[tuple[Box, int]], reduced: Sequence[_Dim]
    ) -> int:
        """Combine partials (keyed by their reduced box) into the block, one reduced dim at
        a time from the last, at most `fanin` operands per combine."""
        op: Einsum = task.op  # type: ignore[assignment]
        out = _aligned(math.prod(_sizes(box)) * _itemsize(task), self.alignment)
        fanin = max(2, min(MAX_COMBINE_FANIN, self.limit // out - 1))
        items = dict(partials)
        for d in reversed(range(len(reduced))):
            groups: dict[Box, list[tuple[tuple[int, int], int]]] = {}
            for rbox, vid in items.items():
                groups.setdefault(rbox[:d] + rbox[d + 1 :], []).append((rbox[d], vid))
            items = {}
            for rest, entries in groups.items():
                entries.sort()
                while len(entries) > 1:
                    merged = []
                    for c in range(0, len(entries), fanin):
                        chunk = entries[c : c + fanin]
                        if len(chunk) == 1:
                            merged.append(chunk[0])
                            continue
                        span = (chunk[0][0][0], sum(r[1] for r, _ in chunk))
                        rbox = rest[:d] + (span,) + rest[d:]
                        full = all(
                            r == (0, dim.extent) for r, dim in zip(rbox, reduced, strict=True)
                        )
                        kind, ranges = ("block", ()) if full else ("partial", rbox)
                        block = Block(task.id, _starts(box), _sizes(box), kind, ranges)
                        combine = self.combine_op(op, len(chunk))
                        vid = self.add(
                            combine, [v for _, v in chunk], _sizes(box), task.dtype, task, block
                        )
                        merged.append((span, vid))
                    entries = merged
                items[rest[:d] + (entries[0][0],) + rest[d:]] = entries[0][1]
        (vid,) = items.values()
        return vid


def _emit_input(m: _Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    block = Block(task.id, _starts(box), _sizes(box))
    return m.add(task.op, (), task.shape, task.dtype, task, block)


def _emit_einsum(m: _Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    info = m.infos[task.id]
    rank = len(task.shape)
    reduced = info.dims[rank:]
    rboxes = list(
        product(*(_ranges(d.extent, s) for d, s in zip(reduced, sizes[rank:], strict=True)))
    )
    made = []
    for rbox in rboxes:
        full_box = box + rbox
        inputs = [
            m.fetch(producer, tuple(full_box[d] for d in dims))
            for producer, dims in zip(task.inputs, info.operand_dims, strict=True)
        ]
        kind, ranges = ("block", ()) if len(rboxes) == 1 else ("partial", rbox)
        block = Block(task.id, _starts(box), _sizes(box), kind, ranges)
        made.append((rbox, m.add(task.op, inputs, _sizes(box), task.dtype, task, block)))
    if len(made) == 1:
        return made[0][1]
    return m.combine(task, box, made, reduced)


def _emit_fill(m: _Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    op: Fill = task.op  # type: ignore[assignment]
    if op.pattern == "causal" and any(_starts(box)):
        origin = op.origin or (0,) * len(task.shape)
        op = Fill(
            op.value, op.pattern, tuple(o + s for o, s in zip(origin, _starts(box), strict=True))
        )
    block = Block(task.id, _starts(box), _sizes(box))
    return m.add(op, (), _sizes(box), task.dtype, task, block)


def _emit_gather(m: _Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    table, ids = task.inputs
    k = len(m.tg[ids].shape)
    rows = m.tg[table].shape[0]
    inputs = (m.fetch(table, ((0, rows),) + box[k:]), m.fetch(ids, box[:k]))
    block = Block(task.id, _starts(box), _sizes(box))
    return m.add(task.op, inputs, _sizes(box), task.dtype, task, block)


def _view_source_region(info: _Info, source: Shape, box: Box) -> Box:
    """The operand region a view block reads (a box: see `_view_info`)."""
    region: list[tuple[int, int]] = [(0, n) for n in source]
    for g in info.groups:
        if not g.src or not g.dst:
            continue
        start, size = box[g.dst[0]]
        if len(g.src) == 1 and len(g.dst) == 1:
            region[g.src[0]] = (start, size)
        elif len(g.src) == 1:  # the other axes of the group are whole
            inner = math.prod(box[a][1] for a in g.dst[1:])
            region[g.src[0]] = (start * inner, size * inner)
        elif len(g.dst) == 1:  # start and size are multiples of the inner size
            inner = math.prod(source[a] for a in g.src[1:])
            region[g.src[0]] = (start // inner, size // inner)
    return tuple(region)


def _emit_view(m: _Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    (producer,) = task.inputs
    region = _view_source_region(m.infos[task.id], m.tg[producer].shape, box)
    block = Block(task.id, _starts(box), _sizes(box))
    return m.add(task.op, (m.fetch(producer, region),), _sizes(box), task.dtype, task, block)


def _emit_slice(m: _Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    op: Slice = task.op  # type: ignore[assignment]
    region = tuple((start + s, n) for (s, n), start in zip(box, op.starts, strict=True))
    block = Block(task.id, _starts(box), _sizes(box))
    return m.assemble(task.inputs[0], region, copy=True, top=block)


def _emit_concat(m: _Materializer, task: Task, box: Box, sizes: Sequence[int]) -> int:
    op: Concat = task.op  # type: ignore[assignment]
    axis = op.axis
    lo, hi = box[axis][0], box[axis][0] + box[axis][1]
    parts, offset = [], 0
    for producer in task.inputs:
        extent = m.tg[producer].shape[axis]
        start, stop = max(lo, offset), min(hi, offset + extent)
        if start < stop:
            region = box[:axis] + ((start - offset, stop - start),) + box[axis + 1 :]
            parts.append((producer, region))
        offset += extent
    block = Block(task.id, _starts(box), _sizes(box))
    if len(parts) == 1:
        return m.assemble(parts[0][0], parts[0][1], copy=True, top=block)
    inputs = [m.fetch(producer, region) for producer, region in parts]
    return m.add(Concat(axis), inputs, _sizes(box), task.dtype, task, block)


_EMIT: dict[type[Op], Callable[[_Materializer, Task, Box, Sequence[int]], int]] = {
    Input: _emit_input,
    Einsum: _emit_einsum,
    Fill: _emit_fill,
    Gather: _emit_gather,
    View: _emit_view,
    Slice: _emit_slice,
    Concat: _emit_concat,
}
"""How each op kind makes the task for one block."""


# -- checking, ordering, building ------------------------------------------------------


def _violations(m: _Materializer, limit: int, alignment: int) -> set[int]:
    """Original tasks to split, or split finer, because a new task's working set exceeds
    the limit (step 6): the task whose block it is, or for a copy, the reader whose
    region is too large and, for a Slice, the task it slices."""
    new = m.new
    nbytes = [_aligned(math.prod(n.shape) * dtypes.itemsize(n.dtype), alignment) for n in new]
    culprits: set[int] = set()
    for v, n in enumerate(new):
        if isinstance(n.op, Input) or n.block.kind == "output":
            continue
        alias = isinstance(n.op, View) or (
            isinstance(n.op, Slice) and isinstance(new[n.inputs[0]].op, Input)
        )
        ws = nbytes[v] + (0 if alias else sum(nbytes[u] for u in dict.fromkeys(n.inputs)))
        if ws <= limit:
            continue
        if not isinstance(n.op, Slice | Concat):
            culprits.add(n.block.of)
            continue
        culprits.add(n.block.of if n.block.kind == "block" else n.made_for)
        if isinstance(n.op, Slice) and not isinstance(new[n.inputs[0]].op, Input):
            culprits.add(new[n.inputs[0]].block.of)
    return culprits


def _reads_weight(task: Task, tasks: Sequence[Task]) -> bool:
    return any(isinstance(tasks[i].op, Input) and tasks[i].op.role == "weight" for i in task.inputs)


def _schedule(tg: TaskGraph, new: Sequence[_New], outputs: Sequence[int]) -> list[int]:
    """Inputs first; then, for each original task that reads a weight (in topological
    order), all its blocks, each pulling what it needs depth first; then the outputs and
    the rest likewise (step 7)."""
    order = [v for v, n in enumerate(new) if isinstance(n.op, Input)]
    done = set(order)
    weighty = {t.id for t in tg.tasks if _reads_weight(t, tg.tasks)}
    roots = [v for v, n in enumerate(new) if n.made_for in weighty and n.block.of == n.made_for]
    roots.sort(key=lambda v: new[v].made_for)  # stable: blocks of a task in the order made
    for root in [*roots, *outputs, *range(len(new))]:
        if root in done:
            continue
        stack = [(root, 0)]
        while stack:
            v, i = stack[-1]
            inputs = new[v].inputs
            if i < len(inputs):
                stack[-1] = (v, i + 1)
                if inputs[i] not in done:
                    stack.append((inputs[i], 0))
            else:
                stack.pop()
                if v not in done:
                    done.add(v)
                    order.append(v)
    return order


def _build(tg: TaskGraph, new: Sequence[_New], outputs: dict[str, int]) -> TaskGraph:
    builder = GraphBuilder(tg.name)
    number: dict[int, int] = {}
    blocks = []
    for v in _schedule(tg, new, list(outputs.values())):
        n = new[v]
        inputs = [number[u] for u in n.inputs]
        number[v] = builder.add(n.op, inputs, n.shape, n.dtype, n.scope, n.label)
        blocks.append(n.block)
    for name, v in outputs.items():
        builder.output(number[v], name)
    built = builder.build()
    return TaskGraph(with_blocks(built.tasks, blocks), built.outputs, built.name)


# -- the passes ---------------------------------------------------------------------------


def _check_alignment(alignment: Any) -> int:
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise GraphError(f"alignment must be a positive int (bytes), got {alignment!r}")
    return alignment


def partition(
    tg: TaskGraph, max_block_bytes: int | str, *, alignment: int = 1, absorb: bool = True
) -> TaskGraph:
    """Split the tasks of `tg` so that every working set is at most `max_block_bytes`.

    `max_block_bytes` is bytes or a size string (`"1GiB"`); each tensor counts rounded up
    to `alignment` bytes. With `absorb` (the default), tasks that fit but read a split task,
    or feed only split tasks, are split with them (see the module docstring). A graph
    in which every task fits is returned as is; otherwise every task of the result
    carries a `Block` naming its original task and region, and the outputs keep their
    names and shapes.

    Raises `BlockLimitError` (an `InfeasibleBudgetError`) when the limit is below
    `smallest_feasible_block_limit(tg)`.
    """
    if not isinstance(tg, TaskGraph):
        raise GraphError(f"partition needs a TaskGraph, got {type(tg).__name__}")
    limit = parse_bytes(max_block_bytes)
    alignment = _check_alignment(alignment)
    infos = _infos(tg)
    needed, culprit = _feasible_limit(tg, infos, alignment)
    if limit < needed:
        raise BlockLimitError(
            f"block limit {format_bytes(limit)} ({limit} B) is below the smallest that works, "
            f"{format_bytes(needed)} ({needed} B): task %{culprit} needs that much even when "
            f"split as finely as allowed: {tg[culprit].line()}",
            limit,
            needed,
            culprit,
        )
    forced = {
        t.id
        for t in tg.tasks
        if not isinstance(t.op, Input) and working_set(tg, t.id, alignment) > limit
    }
    if not forced:
        return tg
    factors: dict[int, float] = {}
    for _ in range(_MAX_ROUNDS):
        sizes = _plan(tg, infos, forced, factors, limit, alignment, absorb)
        m = _Materializer(tg, infos, sizes, limit, alignment)
        outputs = m.run()
        culprits = _violations(m, limit, alignment)
        if not culprits:
            return _build(tg, m.new, outputs)
        for t in culprits:
            if t in sizes:  # split already: split finer
                factors[t] = factors.get(t, 1.0) / 2
            else:
                forced.add(t)
    raise PlanError(
        f"partition found no split of {tg.name!r} within {format_bytes(limit)} after "
        f"{_MAX_ROUNDS} rounds (tasks still over the limit: {sorted(culprits)[:10]})"
    )


@dataclass(frozen=True, slots=True)
class BudgetPartition:
    """What `partition_for_budget` chose: the graph, its block limit, and the smallest
    block limit the graph allows (all in bytes)."""

    graph: TaskGraph
    limit: int
    needed: int

    def __repr__(self) -> str:
        return (
            f"<BudgetPartition tasks={len(self.graph)} limit={format_bytes(self.limit)} "
            f"needed={format_bytes(self.needed)}>"
        )


def partition_for_budget(
    tg: TaskGraph,
    budget: int | str,
    alignment: int = 256,
    fraction: float = DEFAULT_BUDGET_FRACTION,
) -> BudgetPartition:
    """Partition `tg` for a device of `budget` bytes: what a planner calls when a task
    cannot fit.

    The block limit is `fraction * budget` (a quarter by default: the running task's
    block, the next one's operands being prefetched, and the outputs waiting to be
    offloaded fit together), rounded down to `alignment`, but never below the smallest
    limit the graph allows – so a budget that can hold one finest block always works,
    if with little room to overlap transfers. Raises `InfeasibleBudgetError` when even
    that does not fit the budget (`needed` is the smallest budget that could work).

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (256, 1024))
    >>> prog.output(ep.softmax(x), "p")
    >>> chosen = partition_for_budget(prog.build(), "1MiB")
    >>> chosen.limit, len(chosen.graph) > 5
    (262144, True)
    """
    budget_bytes = parse_bytes(budget)
    alignment = _check_alignment(alignment)
    if not 0 < fraction <= 1:
        raise GraphError(f"fraction must be in (0, 1], got {fraction!r}")
    needed, culprit = _feasible_limit(tg, _infos(tg), alignment)
    if needed > budget_bytes:
        raise InfeasibleBudgetError(
            f"budget {format_bytes(budget_bytes)} ({budget_bytes} B) cannot hold even the "
            f"finest block of task %{culprit}, which needs {format_bytes(needed)} "
            f"({needed} B): {tg[culprit].line()}",
            budget_bytes,
            needed,
            culprit,
        )
    limit = max(needed, int(budget_bytes * fraction) // alignment * alignment)
    return BudgetPartition(partition(tg, limit, alignment=alignment), limit, needed)


def blocks_of(tg: TaskGraph) -> dict[int, tuple[int, ...]]:
    """For a partitioned graph: each original task id -> the ids of its blocks (the tasks
    with `block.kind == "block"`), which tile its output exactly once."""
    result: dict[int, list[int]] = {}
    for task in tg.tasks:
        if task.block is not None and task.block.kind == "block":
            result.setdefault(task.block.of, []).append(task.id)
    return {of: tuple(ids) for of, ids in result.items()}
