"""Checks shared by the planner tests: a NumPy replay of a plan, and plan invariants.

`replay` executes a MemGraph sequentially on a byte arena of `budget` bytes, with
host storages as byte copies: each apply reads its operands from the regions the plan
names (views reinterpret their base's bytes) and writes its output region; allocs
and frees poison their region, so reading bytes that were never written or were
released shows up as a wrong answer. A sliced reload (a Slice task reloaded from its
input's storage) copies the slice's box. It shares no code with the planner.
"""

from __future__ import annotations

import numpy as np

import taskgraph
from memgraph import MemGraph, NodeKind, verify

POISON_ALLOC = 0xAB
POISON_FREE = 0xCD


def replay(mg: MemGraph, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run `mg` on a NumPy arena and return its outputs (name -> array)."""
    tg = mg.taskgraph
    arena = np.full(mg.budget, POISON_ALLOC, dtype=np.uint8)
    host: dict[int, bytes] = {}
    holder: dict[int, int] = {}  # host storage -> the tensor whose bytes it holds
    outputs: dict[str, tuple] = {}

    def read(task_id: int, region) -> np.ndarray:
        base = tg[tg.storage_root(task_id)]
        raw = arena[region.offset : region.offset + base.nbytes].copy()
        return raw.view(base.dtype).reshape(tg[task_id].shape)

    for node in mg.nodes:
        kind, tensor, region = node.kind, node.tensor, node.region
        if kind is NodeKind.INPUT:
            data = np.ascontiguousarray(inputs[node.name]).tobytes()
            if node.storage is not None:
                host[node.storage] = data
                holder[node.storage] = tensor
            else:
                arena[region.offset : region.offset + len(data)] = np.frombuffer(data, np.uint8)
        elif kind is NodeKind.ALLOC:
            arena[region.offset : region.end] = POISON_ALLOC
        elif kind is NodeKind.APPLY:
            task = tg[tensor]
            operands = [read(i, r) for i, r in zip(task.inputs, node.reads, strict=True)]
            value = taskgraph.evaluate_task(task, operands)
            data = np.ascontiguousarray(value).tobytes()
            arena[region.offset : region.offset + len(data)] = np.frombuffer(data, np.uint8)
        elif kind is NodeKind.OFFLOAD:
            host[node.storage] = arena[region.offset : region.offset + tg[tensor].nbytes].tobytes()
            holder[node.storage] = tensor
        elif kind is NodeKind.RELOAD:
            data = host[node.storage]
            if holder[node.storage] != tensor:  # a sliced reload: the slice's box
                source, task = tg[holder[node.storage]], tg[tensor]
                whole = np.frombuffer(data, source.dtype).reshape(source.shape)
                box = tuple(
                    slice(s, s + n) for s, n in zip(task.op.starts, task.shape, strict=True)
                )
                data = np.ascontiguousarray(whole[box]).tobytes()
            arena[region.offset : region.offset + len(data)] = np.frombuffer(data, np.uint8)
        elif kind is NodeKind.FREE:
            arena[region.offset : region.end] = POISON_FREE
        elif kind is NodeKind.OUTPUT:
            outputs[node.name] = (tensor, region, node.storage)
    result = {}
    for name, (tensor, region, storage) in outputs.items():
        task = tg[tg.outputs[name]]
        if region is not None:
            result[name] = read(task.id, region)
        else:
            base = tg[tensor]
            result[name] = np.frombuffer(host[storage], base.dtype).reshape(task.shape).copy()
    return result


def check_plan(mg: MemGraph) -> None:
    """The invariants every plan must have: it verifies and stays inside its budget."""
    report = verify(mg)
    stats = mg.stats
    assert report.peak_bytes == stats.peak_bytes <= mg.budget
    assert stats.high_water <= mg.budget


def check_outputs(mg: MemGraph, inputs: dict[str, np.ndarray]) -> None:
    """Replaying the plan gives the reference evaluator's outputs (up to summation order:
    the evaluator may read strided views where the replay reads contiguous bytes)."""
    with np.errstate(all="ignore"):  # random joins may overflow, identically in both
        expected = taskgraph.evaluate(mg.taskgraph, inputs)
        got = replay(mg, inputs)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        finite = np.abs(value[np.isfinite(value)])
        scale = max(1.0, float(finite.max(initial=0.0)))
        np.testing.assert_allclose(
            got[name], value, rtol=1e-5, atol=1e-5 * scale, err_msg=f"output {name!r}"
        )
