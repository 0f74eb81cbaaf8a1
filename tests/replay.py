"""A tiny NumPy replay of a MemGraph, for tests: proves a plan computes the right thing.

It walks the nodes in insertion order over one `uint8` arena of `budget` bytes:
tensors are views at their planned offsets, host storages are dicts of arrays,
applies run `taskgraph.evaluate_task` on views of their read regions, and every
alloc and free poisons its region (0xFF bytes, NaN as floats), so a plan that reads
memory it does not own gives a wrong answer. It is not the runtime (which is being
written separately); it only checks plans made here against `taskgraph.evaluate`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from memgraph import MemGraph, NodeKind, Region
from taskgraph import TaskGraph
from taskgraph.evaluate import evaluate_task
from taskgraph.nodes import Task

POISON = 0xFF


def replay(mg: MemGraph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute `mg` on `inputs` (name -> array) and return its outputs (name -> array)."""
    tg = mg.taskgraph
    arena = np.full(mg.budget, POISON, dtype=np.uint8)
    host: dict[int, np.ndarray] = {}
    outputs: dict[str, np.ndarray] = {}

    def at(region: Region, task: Task) -> np.ndarray:
        raw = arena[region.offset : region.offset + task.nbytes]
        return raw.view(np.dtype(task.dtype)).reshape(task.shape)

    for node in mg.nodes:
        kind = node.kind
        if kind is NodeKind.INPUT:
            value = np.asarray(inputs[node.name], dtype=tg[node.tensor].dtype)
            if node.storage is not None:
                host[node.storage] = value.copy()
            else:
                at(node.region, tg[node.tensor])[...] = value
        elif kind in (NodeKind.ALLOC, NodeKind.FREE):
            arena[node.region.offset : node.region.end] = POISON
        elif kind is NodeKind.APPLY:
            task = tg[node.tensor]
            operands = [
                at(region, tg[i]).copy() for i, region in zip(task.inputs, node.reads, strict=True)
            ]
            at(node.region, task)[...] = evaluate_task(task, operands)
        elif kind is NodeKind.OFFLOAD:
            host[node.storage] = at(node.region, tg[node.tensor]).copy()
        elif kind is NodeKind.RELOAD:
            at(node.region, tg[node.tensor])[...] = host[node.storage]
        elif kind is NodeKind.OUTPUT:
            shape = tg[tg.outputs[node.name]].shape
            if node.storage is not None:
                value = host[node.storage]
            else:
                value = at(node.region, tg[node.tensor])
            outputs[node.name] = value.reshape(shape).copy()
    return outputs


def random_inputs(tg: TaskGraph, seed: int = 0, int_high: int = 8) -> dict[str, np.ndarray]:
    """Random inputs for `tg`: standard normal floats, integers in [0, int_high)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, t in tg.inputs.items():
        task = tg[t]
        if np.issubdtype(np.dtype(task.dtype), np.integer):
            arrays[name] = rng.integers(0, int_high, task.shape).astype(task.dtype)
        else:
            arrays[name] = rng.standard_normal(task.shape).astype(task.dtype)
    return arrays
