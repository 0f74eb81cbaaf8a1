"""Host assembly: which split program outputs a plan may rebuild in host memory.

`taskgraph.partition` rebuilds a split program output with Concat tasks whose `Block`
provenance has kind `"output"` (nested, one axis at a time). Applied on the device,
those Concats need the blocks and the whole output there at once. A planner can
instead copy each block, as soon as it is computed, straight into its box of the
output's host array (a *sliced offload*, see `memgraph.nodes`), so the Concats never
run and the output ends on the host. A planner decides this from the TaskGraph; the
plan then carries each piece's box on its sliced offload (`memgraph.nodes.HostBox`,
worked out by `memgraph.MemGraphBuilder` from `assembly_pieces`), so nothing after the
planner reads these trees again (the verifier rebuilds them to check the boxes).

`output_assemblies(tg)` says where that is possible: for each program output whose
task is the root of such a tree, the *pieces* – the tree's leaves, each a block or a
View of one, with its box in the output – provided that

* the leaves are whole tensors (not Slices) whose storage roots (*bases*) are computed
  tasks (not inputs, not Slices read from an input); each base feeds the tree through
  exactly one leaf and nothing else reads it (every task from the base up to the leaf,
  through Views, has exactly one reader, and the leaf's is a Concat of the tree); no
  leaf, base or View between them is itself a program output;
* the tree's Concats are read only by their parent in the tree, and the root by no
  task at all.

Otherwise (say a block is also read by another task, or the tree joins Slices of
blocks because block grids do not align) the output is left out and a planner
applies its Concats on the device as any other task.

>>> import einpage as ep
>>> from taskgraph.partition import partition
>>> prog = ep.Program()
>>> x = prog.input("x", (64, 256))
>>> prog.output(ep.exp(x), "y")
>>> tg = partition(prog.build(), "16KiB")
>>> ((root, pieces),) = output_assemblies(tg).items()
>>> root == tg.outputs["y"], len(pieces), pieces[0].box
(True, 8, ((0, 8), (0, 256)))
"""

from __future__ import annotations

from dataclasses import dataclass

from taskgraph.graph import TaskGraph
from taskgraph.nodes import Concat, Input, Slice

__all__ = [
    "AssemblyPiece",
    "Box",
    "output_assemblies",
    "assembly_tasks",
    "assembly_pieces",
    "is_output_concat",
]

Box = tuple[tuple[int, int], ...]
"""A box of an array: one `(start, size)` per axis."""


@dataclass(frozen=True, slots=True)
class AssemblyPiece:
    """One leaf of a host-assembled output: task `task` (a block, or a View of one) holds
    the output's `box`; `base` is its storage root, the tensor a sliced offload copies."""

    task: int
    base: int
    box: Box


def is_output_concat(tg: TaskGraph, task_id: int) -> bool:
    """Whether a task is a Concat that rebuilds a split program output (`Block` kind "output")."""
    task = tg[task_id]
    return isinstance(task.op, Concat) and task.block is not None and task.block.kind == "output"


def assembly_pieces(tg: TaskGraph, root: int) -> tuple[list[int], list[AssemblyPiece]]:
    """The tree of output Concats rooted at `root`: its Concats, and its leaves (every
    operand that is not such a Concat) with their boxes in `root`, sorted by box. Whether
    the tree may be assembled on the host is `output_assemblies`' business."""
    concats: list[int] = []
    pieces: list[AssemblyPiece] = []
    stack: list[tuple[int, tuple[int, ...]]] = [(root, (0,) * len(tg[root].shape))]
    while stack:
        task_id, starts = stack.pop()
        task = tg[task_id]
        if is_output_concat(tg, task_id):
            concats.append(task_id)
            axis = task.op.axis % len(task.shape)
            offset = 0
            for operand in task.inputs:
                shifted = starts[:axis] + (starts[axis] + offset,) + starts[axis + 1 :]
                stack.append((operand, shifted))
                offset += tg[operand].shape[axis]
            continue
        box = tuple(zip(starts, task.shape, strict=True))
        pieces.append(AssemblyPiece(task_id, tg.storage_root(task_id), box))
    pieces.sort(key=lambda p: p.box)
    return concats, pieces


def _qualifies(tg: TaskGraph, root: int, concats: list[int], pieces: list[AssemblyPiece]) -> bool:
    """The conditions of the module docstring."""
    outputs = tg.output_ids
    members = set(concats)
    if tg.consumers[root] or len(members) != len(concats):
        return False
    if any(c != root and (c in outputs or len(tg.consumers[c]) != 1) for c in concats):
        return False
    bases = [p.base for p in pieces]
    if len(set(bases)) != len(bases):
        return False
    for piece in pieces:
        base = tg[piece.base]
        if isinstance(tg[piece.task].op, Slice) or isinstance(base.op, Input):
            return False
        if tg.is_input_slice(base.id):
            return False  # made by sliced reloads: not a device tensor of its own
        chain = piece.task  # the leaf, then the views down to the base
        while True:
            if chain in outputs or len(tg.consumers[chain]) != 1:
                return False
            if chain == piece.base:
                break
            chain = tg[chain].inputs[0]
        if tg.consumers[piece.task][0] not in members:
            return False
    return True


def output_assemblies(tg: TaskGraph) -> dict[int, tuple[AssemblyPiece, ...]]:
    """Program outputs a plan may assemble on the host: root task -> its pieces, sorted
    by box (see the module docstring). The pieces tile the root's box exactly once."""
    found: dict[int, tuple[AssemblyPiece, ...]] = {}
    for task_id in dict.fromkeys(tg.outputs.values()):
        if not is_output_concat(tg, task_id):
            continue
        concats, pieces = assembly_pieces(tg, task_id)
        if _qualifies(tg, task_id, concats, pieces):
            found[task_id] = tuple(pieces)
    return found


def assembly_tasks(tg: TaskGraph) -> dict[int, int]:
    """Every task of the host-assembled trees (`output_assemblies`), Concats and leaf
    Views alike, mapped to its root: the tasks a plan that assembles on the host never
    applies on the device (a leaf that is a block is applied as usual and not listed)."""
    tasks: dict[int, int] = {}
    for root in output_assemblies(tg):
        concats, pieces = assembly_pieces(tg, root)
        tasks.update((c, root) for c in concats)
        for piece in pieces:
            chain = piece.task
            while chain != piece.base:
                tasks[chain] = root
                chain = tg[chain].inputs[0]
    return tasks
