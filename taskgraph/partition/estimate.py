"""How many tasks partitioning makes, counted from the block sizes (steps 1-4) without
materializing a single block: `estimate_tasks(tg, limit)`.

Partitioning a graph to a tiny limit can make millions of blocks, which take minutes and
gigabytes to build and plan. The block sizes of step 4 are cheap to find (a few halvings
per class), and from them the count of blocks, partial aggregates, combines and the
Concats that rebuild split outputs follows by arithmetic. What the count leaves out is
assembly (copies where a consumer's region is not one producer block) and the finer
splits of further rounds of step 6, so it is a lower bound on `len(partition(tg, limit))`;
`partition(..., max_tasks=N)` stops materializing once it passes N, so a guard built on
the estimate never does unbounded work either.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import product

from einpage_core.units import parse_bytes
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Einsum, Input, Task
from taskgraph.partition.feasibility import tasks_over
from taskgraph.partition.geometry import Geometry, aligned, itemsize
from taskgraph.partition.materializing import MAX_COMBINE_FANIN
from taskgraph.partition.rules import geometries
from taskgraph.partition.sizing import block_sizes

__all__ = ["TaskEstimate", "estimate_tasks", "estimate_blocks", "count_from_sizes"]


@dataclass(frozen=True, slots=True)
class TaskEstimate:
    """What partitioning `tg` at block limit `limit` makes, counted from the block sizes:
    `blocks` (block tasks, partial aggregates included), `combines` (einsums combining
    partials), `outputs` (Concats rebuilding split program outputs), `whole` (tasks
    left as they are, inputs included) and `slices` (the regions of whole tasks that
    split einsums read: weights read block by block). `tasks` is their sum: a lower
    bound on the partitioned graph's length (other assembly comes on top)."""

    limit: int
    blocks: int
    combines: int
    outputs: int
    whole: int
    slices: int = 0

    @property
    def tasks(self) -> int:
        return self.blocks + self.combines + self.outputs + self.whole + self.slices


def estimate_tasks(
    tg: TaskGraph, limit: int | str, *, alignment: int = 1, absorb: bool = True
) -> TaskEstimate:
    """Count what `partition(tg, limit, alignment=..., absorb=...)` makes, without making it.

    Raises `BlockLimitError` when the limit is below the finest split (as `partition`).
    Cheap: the geometry of every task and the block sizes of step 4 (milliseconds for a
    LLaMA layer stack), then per split task a product of block counts.

    >>> import einpage as ep
    >>> from taskgraph.partition import partition
    >>> prog = ep.Program("mm")
    >>> a = prog.input("a", (4, 4096)); b = prog.input("b", (4096, 4))
    >>> prog.output(prog.einsum("ij,jk->ik", a, b), "c")
    >>> estimate_tasks(prog.build(), "40KiB")  # 4 partials, a combine, 8 slices of a and b
    TaskEstimate(limit=40960, blocks=4, combines=1, outputs=0, whole=2, slices=8)
    >>> len(partition(prog.build(), "40KiB"))
    15
    """
    limit_bytes = parse_bytes(limit)
    geoms = geometries(tg)
    forced = tasks_over(tg, geoms, limit_bytes, alignment)
    if not forced:
        return TaskEstimate(limit_bytes, 0, 0, 0, len(tg), 0)
    sizes = block_sizes(tg, geoms, forced, {}, limit_bytes, alignment, absorb)
    return count_from_sizes(tg, geoms, sizes, limit_bytes, alignment)


def count_from_sizes(
    tg: TaskGraph,
    geoms: Sequence[Geometry],
    sizes: Mapping[int, Sequence[int]],
    limit: int,
    alignment: int,
) -> TaskEstimate:
    """What materializing block sizes `sizes` (step 4's, per split task) makes, but for
    assembly (see `TaskEstimate`)."""
    blocks = combines = whole = 0
    for task in tg.tasks:
        if task.id not in sizes or isinstance(task.op, Input):
            whole += 1
            continue
        made, combined = _count_task(task, geoms[task.id], sizes[task.id], limit, alignment)
        blocks += made
        combines += combined
    outputs = 0
    for task_id in dict.fromkeys(tg.outputs.values()):
        counts = _grid(tg[task_id].shape, sizes.get(task_id))
        outputs += sum(math.prod(counts[:axis]) for axis, n in enumerate(counts) if n > 1)
    slices = _slices_of_whole(tg, geoms, sizes)
    return TaskEstimate(limit, blocks, combines, outputs, whole, slices)


def _slices_of_whole(
    tg: TaskGraph, geoms: Sequence[Geometry], sizes: Mapping[int, Sequence[int]]
) -> int:
    """Slices that split einsums read of tasks left whole (inputs above all: a weight
    read block by block): per whole task, the most distinct regions any one einsum
    reads of it (consumers cut alike share their slices, so the most is a lower bound)."""
    most: dict[int, int] = {}
    for task in tg.tasks:
        if task.id not in sizes or not isinstance(task.op, Einsum):
            continue
        counts = _grid([d.extent for d in geoms[task.id].dims], sizes[task.id])
        for producer, dims in zip(task.inputs, geoms[task.id].operand_dims, strict=True):
            if producer in sizes and not isinstance(tg[producer].op, Input):
                continue
            regions = math.prod(counts[d] for d in dict.fromkeys(dims))
            if regions > 1:
                most[producer] = max(most.get(producer, 0), regions)
    return sum(most.values())


def estimate_blocks(tg: TaskGraph, limit: int | str, *, alignment: int = 1) -> int:
    """`estimate_tasks(tg, limit).tasks`: about how many tasks `partition` makes (at
    least this many)."""
    return estimate_tasks(tg, limit, alignment=alignment).tasks


def _grid(shape: Sequence[int], sizes: Sequence[int] | None) -> list[int]:
    """Blocks along each axis of `shape` cut into `sizes` (None: whole)."""
    if sizes is None:
        return [1] * len(shape)
    return [-(-extent // size) for extent, size in zip(shape, sizes, strict=False)]


def _block_shapes(shape: Sequence[int], sizes: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(elements of a block, how many blocks have that many): along each axis the blocks
    are full but for a shorter last one."""
    per_axis = []
    for extent, size in zip(shape, sizes, strict=False):
        full, rest = divmod(extent, size)
        per_axis.append([(size, full)] + ([(rest, 1)] if rest else []))
    for combo in product(*per_axis):
        yield math.prod(n for n, _ in combo), math.prod(count for _, count in combo)


def _count_task(
    task: Task, geometry: Geometry, sizes: Sequence[int], limit: int, alignment: int
) -> tuple[int, int]:
    """(block tasks with partials, combines) of one split task (`Materializer.run` and
    `combine`: one task per block, or per block one partial per box of the reduced dims
    and a tree of combines of at most `fanin` partials each)."""
    rank = len(task.shape)
    out = math.prod(_grid(task.shape, sizes[:rank]))
    if not (isinstance(task.op, Einsum) and geometry.combine):
        return out, 0
    reduced = [d.extent for d in geometry.dims[rank:]]
    per_dim = _grid(reduced, sizes[rank:])
    partials = math.prod(per_dim)
    if partials == 1:
        return out, 0
    combines = 0
    for elements, count in _block_shapes(task.shape, sizes[:rank]):
        nbytes = aligned(elements * itemsize(task), alignment)
        fanin = max(2, min(MAX_COMBINE_FANIN, limit // nbytes - 1))
        per_block = sum(
            math.prod(per_dim[:d]) * _tree(n, fanin) for d, n in enumerate(per_dim) if n > 1
        )
        combines += count * per_block
    return out * partials, combines


def _tree(n: int, fanin: int) -> int:
    """Combines reducing `n` partials, at most `fanin` at a time (a lone last chunk passes
    through without a task)."""
    made = 0
    while n > 1:
        chunks = -(-n // fanin)
        made += chunks - (1 if n % fanin == 1 else 0)
        n = chunks
    return made
