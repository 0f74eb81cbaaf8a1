"""Feasibility: working sets, the model of a block's working set, and the finest block
(the smallest block limit a graph allows, step 1)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from einpage_core.errors import InfeasibleBudgetError
from einpage_core.units import format_bytes
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input
from taskgraph.partition.geometry import Geometry, aligned
from taskgraph.partition.rules import geometries, geometry_of

__all__ = [
    "BlockLimitError",
    "working_set",
    "model_load",
    "finest_sizes",
    "min_block_bytes",
    "FeasibleLimit",
    "feasible_limit",
    "smallest_feasible_block_limit",
    "finest_block",
    "limit_error",
    "tasks_over",
]


class BlockLimitError(InfeasibleBudgetError):
    """Even the finest split allowed does not fit the block limit.

    Attributes: `limit` (bytes asked for, also `budget`), `needed` (the smallest block
    limit that works for the whole graph), `task` (the id of a task that needs it).
    """

    def __init__(self, message: str, limit: int, needed: int, task: int | None):
        super().__init__(message, limit, needed, task)
        self.limit = limit


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
    own = aligned(task.nbytes, alignment)
    if not task.is_compute or tg.is_input_slice(task_id):
        return own
    return own + sum(aligned(tg[i].nbytes, alignment) for i in dict.fromkeys(task.inputs))


def _concat_pieces(geometry: Geometry, sizes: Sequence[int], alignment: int) -> int:
    """The largest total of the pieces a concat block reads (each rounded up on its own):
    an inner block reads one piece; only blocks across an operand boundary differ."""
    out = geometry.tensors[-1]
    axis = geometry.concat_axis
    size = sizes[axis]
    row = out.itemsize * math.prod(s for d, s in enumerate(sizes) if d != axis)
    extent = geometry.dims[axis].extent
    parts = geometry.concat_parts
    starts = {(part.offset // size) * size for part in parts}
    worst = aligned(row * min(size, max(part.extent for part in parts)), alignment)
    for start in starts:
        stop = min(start + size, extent)
        total = sum(
            aligned(row * (min(stop, o + n) - max(start, o)), alignment)
            for o, n in parts
            if max(start, o) < min(stop, o + n)
        )
        worst = max(worst, total)
    return worst


def _model_ws(geometry: Geometry, sizes: Sequence[int], alignment: int) -> int:
    """Working set of the largest block whose dims have `sizes`."""
    total = _concat_pieces(geometry, sizes, alignment) if geometry.concat_parts else 0
    for tensor in geometry.tensors:
        n = tensor.fixed
        for d in tensor.dims:
            n *= sizes[d]
        total += aligned(n * tensor.itemsize, alignment)
    return total


def model_load(geometry: Geometry, sizes: Sequence[int], alignment: int) -> int:
    """Largest working set of the blocks, including the combine of partials (at least
    two partials and the result) when a reduced dim is split."""
    ws = _model_ws(geometry, sizes, alignment)
    if geometry.combine and any(
        dim.reduced and size < dim.extent for dim, size in zip(geometry.dims, sizes, strict=True)
    ):
        out = geometry.tensors[-1]
        ws = max(ws, 3 * aligned(out.itemsize * math.prod(sizes[d] for d in out.dims), alignment))
    return ws


def finest_sizes(geometry: Geometry) -> list[int]:
    """Block sizes of the finest split: every splittable dim cut to its grain."""
    return [dim.grain if dim.splittable else dim.extent for dim in geometry.dims]


def _copy_bytes(elements: int, itemsize: int, alignment: int) -> int:
    """A copy of a region of `elements`, assembled in the worst case from one-element
    pieces: the pieces (each rounded up) and the result."""
    return aligned(elements * itemsize, alignment) + elements * aligned(itemsize, alignment)


def _min_block(geometry: Geometry, alignment: int) -> int:
    """The working set of a task's finest block: every dim split to its grain, reduced
    dims too (then a combine of three partials). At that split every block of every
    task is one element along each splittable dim, so regions are whole producer blocks
    and need no assembly – except regions with dims that cannot be split (a view's
    regrouped axes, a gather's table rows: `Geometry.assembled`), counted here as a
    worst-case copy."""
    sizes = finest_sizes(geometry)
    need = model_load(geometry, sizes, alignment)
    copied = geometry.assembled
    if copied is not None:
        elements = copied.fixed * math.prod(sizes[d] for d in copied.dims)
        need = max(need, _copy_bytes(elements, copied.itemsize, alignment))
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
    return _min_block(geometry_of(tg[task_id], tg.tasks), alignment)


class FeasibleLimit(NamedTuple):
    """The smallest block limit a graph allows, and a task that needs it (-1: none)."""

    needed: int
    task: int


def feasible_limit(tg: TaskGraph, geoms: Sequence[Geometry], alignment: int) -> FeasibleLimit:
    """The largest finest block of any task but inputs (host storage, never limited);
    `geoms` are the tasks' geometries."""
    needed, culprit = 0, -1
    for task, geometry in zip(tg.tasks, geoms, strict=True):
        if isinstance(task.op, Input):
            continue
        need = _min_block(geometry, alignment)
        if need > needed:
            needed, culprit = need, task.id
    return FeasibleLimit(needed, culprit)


def smallest_feasible_block_limit(tg: TaskGraph, alignment: int = 1) -> int:
    """The smallest `max_block_bytes` for which `partition` succeeds: the largest
    `min_block_bytes` of any non-input task."""
    return feasible_limit(tg, geometries(tg), alignment).needed


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
    found = feasible_limit(tg, geometries(tg), alignment)
    return found.needed, (found.task if found.task >= 0 else None)


def limit_error(tg: TaskGraph, limit: int, found: FeasibleLimit) -> BlockLimitError:
    """The error for a block limit below `found` (the graph's `feasible_limit`)."""
    needed, culprit = found
    return BlockLimitError(
        f"block limit {format_bytes(limit)} ({limit} B) is below the smallest that works, "
        f"{format_bytes(needed)} ({needed} B): task %{culprit} needs that much even when "
        f"split as finely as allowed: {tg[culprit].line()}",
        limit,
        needed,
        culprit,
    )


def tasks_over(tg: TaskGraph, geoms: Sequence[Geometry], limit: int, alignment: int) -> set[int]:
    """The tasks whose working set exceeds `limit` (the ones partitioning must split),
    after checking the limit is one the graph allows (`BlockLimitError` otherwise)."""
    found = feasible_limit(tg, geoms, alignment)
    if limit < found.needed:
        raise limit_error(tg, limit, found)
    return {
        t.id
        for t in tg.tasks
        if not isinstance(t.op, Input) and working_set(tg, t.id, alignment) > limit
    }
