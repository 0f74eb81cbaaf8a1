"""A tiny, obviously-correct plan maker for tests of the verifier and the runtime.

It is not the planner: it walks tasks in program order, allocates first-fit from
freed regions (else at the top of the arena) – a task's kernel workspace too, held for
its apply and then free again, released by it –, optionally offloads chosen tensors
right after they are produced and reloads them before each use, and drops
host-resident inputs after each use. Every dependency it adds is required by a rule
of the verifier (none is implied by another), which the tests rely on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import einpage as ep
from memgraph import MemGraph, MemGraphBuilder, Region
from taskgraph import TaskGraph
from taskgraph.nodes import Block, Concat, Input, Task, View, with_blocks


@dataclass
class _Resident:
    alloc: int
    region: Region
    writer: int
    users: list[int] = field(default_factory=list)


def reference_plan(
    tg: TaskGraph,
    offload: frozenset[int] = frozenset(),
    reuse: bool = True,
    alignment: int = 256,
    outputs_to_host: bool = False,
) -> MemGraph:
    """A plan of `tg` in program order: first-fit allocation from freed regions (none
    with `reuse=False`), the tensors in `offload` offloaded right after they are made
    and reloaded before each use, outputs left on the device (or offloaded to the host
    with `outputs_to_host`). The budget is the arena's top."""
    maker = _ReferencePlanner(tg, alignment, reuse)
    for task in tg:
        if isinstance(task.op, Input):
            maker.input(task)
        elif not isinstance(task.op, View):
            maker.apply(task, offload=task.id in offload)
    for name, t in tg.outputs.items():
        maker.output(name, maker.root[t], outputs_to_host)
    maker.b.budget = max(maker.top, alignment)
    return maker.b.build({"planner": "tests.reference_plan"})


class _ReferencePlanner:
    """The state of `reference_plan`: the builder, the free list, what is resident and
    what has a host copy, and how many uses each tensor has left."""

    def __init__(self, tg: TaskGraph, alignment: int, reuse: bool):
        self.tg = tg
        self.alignment = alignment
        self.reuse = reuse
        self.b = MemGraphBuilder(tg, budget=1, alignment=alignment)
        self.free_list: list[tuple[Region, int]] = []  # (region, the free that released it)
        self.top = 0
        self.resident: dict[int, _Resident] = {}
        self.storage: dict[int, tuple[int, int]] = {}  # tensor -> (storage id, writer node)
        self.root = [tg.storage_root(t.id) for t in tg]
        self.uses = {t.id: 0 for t in tg}
        for task in tg:
            for i in task.inputs:
                self.uses[self.root[i]] += 1
        for t in tg.outputs.values():
            self.uses[self.root[t]] += 1

    def take(self, nbytes: int) -> tuple[Region, list[int]]:
        """A region of `nbytes` (aligned): the first freed region that fits, with the node
        that released it, else the top (no node to wait for)."""
        alignment = self.alignment
        size = -(-max(nbytes, 1) // alignment) * alignment
        if self.reuse:
            for k, (region, freed_by) in enumerate(self.free_list):
                if region.size >= size:
                    del self.free_list[k]
                    if region.size > size:
                        rest = Region(region.offset + size, region.size - size)
                        self.free_list.insert(k, (rest, freed_by))
                    return Region(region.offset, size), [freed_by]
        chosen = Region(self.top, size)
        self.top += size
        return chosen, []

    def allocate(self, tensor: int) -> tuple[int, Region]:
        """An alloc node for `tensor`, in the region `take` finds."""
        chosen, deps = self.take(self.tg[tensor].nbytes)
        return self.b.alloc(tensor, chosen, deps=deps), chosen

    def release(self, tensor: int) -> None:
        r = self.resident.pop(tensor)
        node = self.b.free(tensor, r.region, deps=[r.alloc, r.writer, *r.users])
        self.free_list.append((r.region, node))

    def ensure(self, tensor: int) -> _Resident:
        """`tensor` on the device: reloaded from its host copy when it is not."""
        if tensor not in self.resident:
            sid, writer = self.storage[tensor]
            alloc, region = self.allocate(tensor)
            node = self.b.reload(tensor, sid, region, deps=[alloc, writer])
            self.resident[tensor] = _Resident(alloc, region, node)
        return self.resident[tensor]

    def after_use(self, tensor: int) -> None:
        self.uses[tensor] -= 1
        if self.uses[tensor] == 0 or tensor in self.storage:
            self.release(tensor)

    def new_storage(self, tensor: int, writer: int) -> int:
        sid = len(self.storage)
        self.storage[tensor] = (sid, writer)
        return sid

    def input(self, task: Task) -> None:
        name = task.op.name
        if task.op.location == "host":
            sid = len(self.storage)
            self.storage[task.id] = (sid, self.b.input(name, task.id, storage=sid))
        else:
            alloc, region = self.allocate(task.id)
            node = self.b.input(name, task.id, region=region, deps=[alloc])
            self.resident[task.id] = _Resident(alloc, region, node)

    def apply(self, task: Task, offload: bool) -> None:
        operands = [self.ensure(self.root[i]) for i in task.inputs]
        alloc, region = self.allocate(task.id)
        workspace, freed = self.take(task.workspace) if task.workspace else (None, [])
        node = self.b.apply(
            task.id,
            [o.region for o in operands],
            region,
            deps=[alloc, *(o.writer for o in operands), *freed],
            workspace=workspace,
        )
        if workspace is not None:  # free again once the apply ends
            self.free_list.append((workspace, node))
        for o in operands:
            o.users.append(node)
        self.resident[task.id] = _Resident(alloc, region, node)
        for i in dict.fromkeys(self.root[i] for i in task.inputs):
            self.after_use(i)
        if offload and self.uses[task.id] > 0:
            off = self.b.offload(task.id, region, len(self.storage), deps=[node])
            self.resident[task.id].users.append(off)
            self.new_storage(task.id, off)
            self.release(task.id)

    def output(self, name: str, base: int, to_host: bool) -> None:
        if not to_host:
            r = self.ensure(base)
            node = self.b.output(name, base, region=r.region, deps=[r.writer])
            r.users.append(node)
            return
        if base not in self.storage:
            r = self.ensure(base)
            off = self.b.offload(base, r.region, len(self.storage), deps=[r.writer])
            r.users.append(off)
            self.new_storage(base, off)
        sid, writer = self.storage[base]
        self.b.output(name, base, storage=sid, deps=[writer])


def two_output_mlp() -> TaskGraph:
    """A small MLP, `softmax(gelu(x @ w1) @ w2 + x)` with two weights, whose hidden layer
    is also an output through a view (`h_flat`)."""
    prog = ep.Program("mlp")
    x = prog.input("x", (4, 8))
    w1 = prog.input("w1", (8, 16), role="weight")
    w2 = prog.input("w2", (16, 8), role="weight")
    h = ep.gelu(x @ w1)
    y = ep.softmax(h @ w2 + x)
    prog.output(y, "y")
    prog.output(h.reshape(64), "h_flat")
    return prog.build()


def sliced_weight_plan(reload_tensor=None):
    """A weight read only through a slice, produced by a sliced reload of its box."""
    prog = ep.Program("sliced")
    w = prog.input("w", (64, 8), role="weight")
    part = prog.slice(w, (16, 0), (8, 8))
    prog.output(ep.exp(part), "y")
    tg = prog.build()
    b = MemGraphBuilder(tg, budget=1024)
    stored = b.input("w", 0, storage=0)
    alloc = b.alloc(1, Region(0, 256))
    reload = b.reload(
        reload_tensor if reload_tensor is not None else 1, 0, Region(0, 256), deps=[stored, alloc]
    )
    out_alloc = b.alloc(2, Region(256, 256))
    apply = b.apply(2, [Region(0, 256)], Region(256, 256), deps=[reload, out_alloc])
    b.free(1, Region(0, 256), deps=[alloc, reload, apply])
    b.output("y", 2, region=Region(256, 256), deps=[apply])
    return b.build()


def hand_assembled(slice_leaf: bool = False) -> TaskGraph:
    """y [6, 32] = concat0(concat1(view(exp(x)), view(exp(2x))), exp(z)), its Concats
    marked as output assembly (as `taskgraph.partition` marks them). With `slice_leaf`,
    the last piece is a Slice of a larger block instead (grids that do not align)."""
    prog = ep.Program("hand")
    x = prog.input("x", (4, 8))
    z = prog.input("z", (6, 32) if slice_leaf else (4, 32))
    left = prog.view(ep.exp(x), (2, 16))
    right = prog.view(ep.exp(x * 2.0), (2, 16))
    top = prog.concat([left, right], axis=1)
    bottom = ep.exp(z)
    if slice_leaf:
        bottom = prog.slice(bottom, (2, 0), (4, 32))
    prog.output(prog.concat([top, bottom], axis=0), "y")
    tg = prog.build()
    blocks = [
        Block(t.id, (0,) * len(t.shape), t.shape, "output") if isinstance(t.op, Concat) else None
        for t in tg
    ]
    return TaskGraph(with_blocks(tg.tasks, blocks), tg.outputs, tg.name)
