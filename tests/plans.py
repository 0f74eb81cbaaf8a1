"""A tiny, obviously-correct plan maker for tests of the verifier and the runtime.

It is not the planner: it walks tasks in program order, allocates first-fit from
freed regions (else at the top of the arena), optionally offloads chosen tensors
right after they are produced and reloads them before each use, and drops
host-resident inputs after each use. Every dependency it adds is required by a rule
of the verifier (none is implied by another), which the tests rely on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import einpage as ep
from memgraph import MemGraph, MemGraphBuilder, Region
from taskgraph import TaskGraph
from taskgraph.nodes import Input, View


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
    b = MemGraphBuilder(tg, budget=1, alignment=alignment)
    free_list: list[tuple[Region, int]] = []
    top = 0
    resident: dict[int, _Resident] = {}
    storage: dict[int, tuple[int, int]] = {}  # tensor -> (storage id, writer node)
    root = [tg.storage_root(t.id) for t in tg]
    uses = {t.id: 0 for t in tg}
    for task in tg:
        for i in task.inputs:
            uses[root[i]] += 1
    for t in tg.outputs.values():
        uses[root[t]] += 1

    def allocate(tensor: int) -> tuple[int, Region]:
        nonlocal top
        size = -(-max(tg[tensor].nbytes, 1) // alignment) * alignment
        if reuse:
            for k, (region, freed_by) in enumerate(free_list):
                if region.size >= size:
                    del free_list[k]
                    if region.size > size:
                        rest = Region(region.offset + size, region.size - size)
                        free_list.insert(k, (rest, freed_by))
                    chosen = Region(region.offset, size)
                    return b.alloc(tensor, chosen, deps=[freed_by]), chosen
        chosen = Region(top, size)
        top += size
        return b.alloc(tensor, chosen), chosen

    def release(tensor: int) -> None:
        r = resident.pop(tensor)
        node = b.free(tensor, r.region, deps=[r.alloc, r.writer, *r.users])
        free_list.append((r.region, node))

    def ensure(tensor: int) -> _Resident:
        if tensor not in resident:
            sid, writer = storage[tensor]
            alloc, region = allocate(tensor)
            node = b.reload(tensor, sid, region, deps=[alloc, writer])
            resident[tensor] = _Resident(alloc, region, node)
        return resident[tensor]

    def after_use(tensor: int) -> None:
        uses[tensor] -= 1
        if uses[tensor] == 0 or tensor in storage:
            release(tensor)

    for task in tg:
        if isinstance(task.op, Input):
            if task.op.location == "host":
                sid = len(storage)
                storage[task.id] = (sid, b.input(task.op.name, task.id, storage=sid))
            else:
                alloc, region = allocate(task.id)
                node = b.input(task.op.name, task.id, region=region, deps=[alloc])
                resident[task.id] = _Resident(alloc, region, node)
            continue
        if isinstance(task.op, View):
            continue
        operands = []
        for i in task.inputs:
            operands.append(ensure(root[i]))
        alloc, region = allocate(task.id)
        node = b.apply(
            task.id,
            [o.region for o in operands],
            region,
            deps=[alloc, *(o.writer for o in operands)],
        )
        for o in operands:
            o.users.append(node)
        resident[task.id] = _Resident(alloc, region, node)
        for i in dict.fromkeys(root[i] for i in task.inputs):
            after_use(i)
        if task.id in offload and uses[task.id] > 0:
            sid = len(storage)
            off = b.offload(task.id, region, sid, deps=[node])
            resident[task.id].users.append(off)
            storage[task.id] = (sid, off)
            release(task.id)

    for name, t in tg.outputs.items():
        base = root[t]
        if outputs_to_host:
            if base not in storage:
                r = ensure(base)
                sid = len(storage)
                off = b.offload(base, r.region, sid, deps=[r.writer])
                r.users.append(off)
                storage[base] = (sid, off)
            sid, writer = storage[base]
            b.output(name, base, storage=sid, deps=[writer])
        else:
            r = ensure(base)
            node = b.output(name, base, region=r.region, deps=[r.writer])
            r.users.append(node)
    b.budget = max(top, alignment)
    return b.build({"planner": "tests.reference_plan"})


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
