"""A NumPy replay of a MemGraph for tests, and the plan checks built on it.

`replay` executes a plan sequentially, in insertion order, on one `uint8` arena of
`budget` bytes; it shares no code with the planner or the runtime and checks plans
against `taskgraph.evaluate`:

* tensors are views of the arena at their planned offsets (a View task reads its
  storage root's bytes in its own shape);
* host storages are arrays; a reload whose tensor is not the one its storage holds
  is a sliced reload (a Slice of that tensor) and copies the slice's box;
* every alloc poisons its region with 0xFF bytes (NaN as floats) and every free with
  0xFE, so a plan that reads bytes never written or already released gives a wrong
  answer;
* outputs are read when the plan has ended, so an output overwritten or freed after
  its output node is wrong too.

`check_plan` asserts the invariants every plan has (it verifies and fits its budget);
`check_outputs` asserts the replay gives the reference outputs.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

import taskgraph
from memgraph import MemGraph, MemNode, NodeKind, Region, verify
from taskgraph import TaskGraph
from taskgraph.nodes import Slice

__all__ = ["replay", "random_inputs", "check_plan", "check_outputs", "POISON_ALLOC", "POISON_FREE"]

POISON_ALLOC = 0xFF
"""The bytes of a freshly allocated region (NaN as float16/32/64, -1 as ints)."""
POISON_FREE = 0xFE
"""The bytes of a released region (NaN or a huge negative float)."""


class _Replay:
    """The state of one replay: the arena, the host storages and what each holds."""

    def __init__(self, mg: MemGraph):
        self.tg = mg.taskgraph
        self.arena = np.full(mg.budget, POISON_ALLOC, dtype=np.uint8)
        self.host: dict[int, np.ndarray] = {}  # storage id -> its array
        self.holder: dict[int, int] = {}  # storage id -> the tensor whose bytes it holds
        self.outputs: dict[str, MemNode] = {}

    def view(self, task_id: int, region: Region) -> np.ndarray:
        """The arena's bytes at `region` as task `task_id` (a view reads its root's bytes)."""
        base = self.tg[self.tg.storage_root(task_id)]
        raw = self.arena[region.offset : region.offset + base.nbytes]
        return raw.view(base.dtype).reshape(self.tg[task_id].shape)

    def write(self, region: Region, value: np.ndarray) -> None:
        data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        self.arena[region.offset : region.offset + data.size] = data

    def store(self, storage: int, tensor: int, value: np.ndarray) -> None:
        self.host[storage] = value.copy()
        self.holder[storage] = tensor

    def reloaded(self, node: MemNode) -> np.ndarray:
        """What a reload copies to the device: the storage's array, or the box of a slice."""
        task, source = self.tg[node.tensor], self.host[node.storage]
        if self.holder[node.storage] == node.tensor:
            return source
        assert isinstance(task.op, Slice), f"reload n{node.id}: %{node.tensor} is not a slice"
        whole = source.reshape(self.tg[task.inputs[0]].shape)
        box = tuple(slice(s, s + n) for s, n in zip(task.op.starts, task.shape, strict=True))
        return whole[box]

    def step(self, node: MemNode, inputs: Mapping[str, np.ndarray]) -> None:
        kind, tg = node.kind, self.tg
        if kind is NodeKind.INPUT:
            task = tg[node.tensor]
            value = np.asarray(inputs[node.name], dtype=task.dtype).reshape(task.shape)
            if node.storage is not None:
                self.store(node.storage, node.tensor, value)
            else:
                self.write(node.region, value)
        elif kind is NodeKind.ALLOC:
            self.arena[node.region.offset : node.region.end] = POISON_ALLOC
        elif kind is NodeKind.APPLY:
            task = tg[node.tensor]
            reads = zip(task.inputs, node.reads, strict=True)
            operands = [self.view(i, region).copy() for i, region in reads]
            value = taskgraph.evaluate_task(task, operands)
            self.write(node.region, np.asarray(value, dtype=task.dtype))
        elif kind is NodeKind.OFFLOAD:
            assert node.into is None, f"offload n{node.id}: sliced offloads are not replayed"
            self.store(node.storage, node.tensor, self.view(node.tensor, node.region))
        elif kind is NodeKind.RELOAD:
            self.write(node.region, self.reloaded(node))
        elif kind is NodeKind.FREE:
            self.arena[node.region.offset : node.region.end] = POISON_FREE
        elif kind is NodeKind.OUTPUT:
            self.outputs[node.name] = node

    def output(self, node: MemNode) -> np.ndarray:
        task_id = self.tg.outputs[node.name]
        if node.region is not None:
            return self.view(task_id, node.region).copy()
        return self.host[node.storage].reshape(self.tg[task_id].shape).copy()


def replay(mg: MemGraph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute `mg` on `inputs` (name -> array) and return its outputs (name -> array)."""
    state = _Replay(mg)
    for node in mg.nodes:
        state.step(node, inputs)
    return {name: state.output(node) for name, node in state.outputs.items()}


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


def check_plan(mg: MemGraph) -> None:
    """The invariants every plan must have: it verifies and stays inside its budget."""
    report = verify(mg)
    stats = mg.stats
    assert report.peak_bytes == stats.peak_bytes <= mg.budget
    assert stats.high_water <= mg.budget


def check_outputs(mg: MemGraph, inputs: Mapping[str, np.ndarray]) -> None:
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
