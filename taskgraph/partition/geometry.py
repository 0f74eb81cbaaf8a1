"""Partition geometry: boxes of a task's output and iteration space, and the records that
say what partitioning knows of one task (its dims, working-set tensors and links)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from taskgraph import dtypes
from taskgraph.nodes import Shape, Task

__all__ = [
    "Range",
    "Box",
    "full_box",
    "box_starts",
    "box_sizes",
    "tile",
    "aligned",
    "itemsize",
    "Dim",
    "Tensor",
    "Link",
    "ViewGroup",
    "ConcatPart",
    "Geometry",
    "out_tensor",
]


class Range(NamedTuple):
    """One axis of a box: `size` elements from `start`."""

    start: int
    size: int


Box = tuple[Range, ...]
"""A region: one `Range` per axis."""


def full_box(shape: Shape) -> Box:
    """The box of a whole tensor of `shape`."""
    return tuple(Range(0, n) for n in shape)


def box_starts(box: Box) -> tuple[int, ...]:
    return tuple(r.start for r in box)


def box_sizes(box: Box) -> tuple[int, ...]:
    return tuple(r.size for r in box)


def tile(extent: int, size: int) -> list[Range]:
    """`[0, extent)` cut into ranges of `size` (the last one may be shorter)."""
    return [Range(start, min(size, extent - start)) for start in range(0, extent, size)]


def aligned(nbytes: int, alignment: int) -> int:
    """`nbytes` rounded up to a multiple of `alignment`."""
    return -(-nbytes // alignment) * alignment


def itemsize(task: Task) -> int:
    return dtypes.itemsize(task.dtype)


@dataclass(frozen=True, slots=True)
class Dim:
    """One dim of a task's iteration space. `grain`: block starts must be multiples of it."""

    extent: int
    splittable: bool = True
    reduced: bool = False
    grain: int = 1


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor of a block's working set: `itemsize * fixed * prod(block size of dims)`."""

    itemsize: int
    dims: tuple[int, ...]
    fixed: int = 1


@dataclass(frozen=True, slots=True)
class Link:
    """Dim `dim` of a task indexes the same data as axis `axis` of operand `position`:
    block boundaries of the dim are `ratio` times those of the axis."""

    dim: int
    position: int
    axis: int
    ratio: Fraction = Fraction(1)


@dataclass(frozen=True, slots=True)
class ViewGroup:
    """Axes of a view's operand (`src`) and output (`dst`) with equal products; one side
    is empty for a size-1 axis."""

    src: tuple[int, ...]
    dst: tuple[int, ...]


class ConcatPart(NamedTuple):
    """Where one operand of a concat lies along its axis."""

    offset: int
    extent: int


@dataclass(frozen=True, slots=True)
class Geometry:
    """What partitioning needs to know of one task (computed once per task by its op
    kind's rule, `taskgraph.partition.rules`).

    `tensors` are the working set of a block (the output last); `assembled` is a
    tensor a region of which even the finest block may have to copy together (its dims
    cannot all be split: a view's regrouped axes, a gather's table rows), or None.
    """

    dims: tuple[Dim, ...]
    tensors: tuple[Tensor, ...]
    links: tuple[Link, ...]
    combine: bool = False  # an einsum with reduced dims
    operand_dims: tuple[tuple[int, ...], ...] = ()  # einsum: the dim of each operand axis
    groups: tuple[ViewGroup, ...] = ()  # view: the reshape's groups
    concat_parts: tuple[ConcatPart, ...] = ()  # concat: where each operand lies
    concat_axis: int = -1
    assembled: Tensor | None = None


def out_tensor(task: Task) -> Tensor:
    """The task's output as a working-set tensor over its output dims."""
    return Tensor(itemsize(task), tuple(range(len(task.shape))))
