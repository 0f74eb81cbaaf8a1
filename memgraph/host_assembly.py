"""Host assembly: split program outputs filled on the host by sliced offloads.

A partitioned graph rebuilds a split program output by Concats of kind "output"
(`taskgraph.partition`). When `taskgraph.assembly.output_assemblies` allows (nothing but
the Concats reads the blocks), those Concats never run on the device: the output is
*assembled on the host*. Each piece (a block, or the base of a View of one) is copied,
right after its apply, by a *sliced offload* (`MemNode.into`) into its box of the
output's host storage, and freed once that copy is done (the free depends on it). The
tree's Concats are not steps and `min_budget` does not count them. The output ends on
the host whatever the planner's `outputs` option says, its `output` node depending on
every sliced offload that fills it.

Whether the graph was partitioned by `einpage.compile` or by the user, `memgraph.plan`
assembles such outputs on the host; an output that cannot be (its blocks are read
elsewhere) is rebuilt on the device by its Concat, which then holds its blocks and the
whole output at once.
"""

from __future__ import annotations

from collections.abc import Callable

from memgraph.graph import MemGraphBuilder
from memgraph.residents import TensorState
from taskgraph.assembly import assembly_tasks, output_assemblies
from taskgraph.graph import TaskGraph

__all__ = ["HostAssembly"]


class HostAssembly:
    """The outputs of one graph that are assembled on the host, and their fills so far.

    `roots` are the output tasks assembled on the host, `tasks` the Concats that are
    therefore not steps, and `piece_of` maps each piece's base task to its output.
    """

    def __init__(self, tg: TaskGraph):
        assembled = output_assemblies(tg)
        self.roots = frozenset(assembled)
        self.tasks = assembly_tasks(tg)
        self.piece_of = {p.base: root for root, pieces in assembled.items() for p in pieces}
        self.storage: dict[int, int] = {}  # output root -> its host storage
        self.fills: dict[int, list[int]] = {}  # output root -> its sliced offloads

    def __contains__(self, task_id: int) -> bool:
        """Whether output task `task_id` is assembled on the host."""
        return task_id in self.roots

    def offload_piece(
        self, builder: MemGraphBuilder, piece: TensorState, new_storage: Callable[[], int]
    ) -> int:
        """Emit the sliced offload of a just-computed piece into its box of its output's
        host storage (made with `new_storage` on the first piece); returns the node."""
        root = self.piece_of[piece.id]
        if root not in self.storage:
            self.storage[root] = new_storage()
        node = builder.offload(
            piece.id, piece.region, self.storage[root], deps=[piece.writer], into=root
        )
        self.fills.setdefault(root, []).append(node)
        return node

    def output(self, builder: MemGraphBuilder, name: str, root: int) -> int:
        """Emit the `output` node of an output assembled on the host: its storage, once
        every sliced offload into it is done."""
        return builder.output(name, root, storage=self.storage[root], deps=self.fills[root])
