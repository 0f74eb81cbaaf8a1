"""Recomputation as an eviction choice: drop a tensor and compute it again before its next use.

When the planner evicts a tensor that has no host copy, the default is to offload it
and reload it before its next use: its bytes cross PCIe twice. With
`PlanOptions(recompute="auto")` (the default) the planner may instead *discard* it
(free it with no copy out) and, when the step that next reads it is prepared, apply its
task again – a *recompute*, an apply marked `recompute` (`memgraph.nodes`) – from its
operands, reloaded from their host copies where they are not resident. A tensor rebuilt
from int4 weights (their float copy) or a cheap elementwise result is cheaper to
rebuild than to move; the verifier, the simulator and the runtimes treat a recompute as
the apply it is.

`Recomputes.chooses(tensor)` decides, at the eviction, for one tensor. It recomputes
only in the clear case, where nothing can go wrong later:

* the tensor is computed by a step of the order (not an input, not a slice reloaded
  from its input), is no program output (an output must end somewhere: on the device
  or in a host copy), and its task declares no kernel workspace;
* its next use is a later step than the one being prepared – or that very step, when
  the step's operands are moved into one window (see `chooses`);
* every operand of its task (by storage root) has a host copy now – an input in host
  storage, or a tensor offloaded before. Host copies are never lost (tensors are
  immutable), so whatever happens in between, the operands can be brought back for the
  recompute; and such an operand is itself never discarded (only a tensor without a
  host copy is), so a recompute never waits for another;
* the step that next reads it can hold, at once, its working set and the operands of
  every tensor it recomputes (the packed window of `memgraph.horizon` then always
  exists: the planner never fails for a recompute);
* on the plan's cost model (`memgraph.cost`), applying the task again and reloading
  every operand (as if none were resident: the worst case) takes less time than
  copying the tensor out and back.

>>> import einpage as ep
>>> from memgraph import plan
>>> prog = ep.Program("rebuild")
>>> u = prog.input("u", (256,), role="weight")  # 1 KiB each
>>> v = prog.input("v", (256,), role="weight")
>>> x = prog.input("x", (256, 256))  # 256 KiB
>>> h = prog.einsum("i,j->ij", u, v)  # 256 KiB, cheap to rebuild from 2 KiB of weights
>>> prog.output(((x @ h) @ x) @ h, "y")
>>> tg = prog.build()
>>> s = plan(tg, "772KiB").stats  # h is evicted for the third product
>>> s.recompute_count, s.discard_bytes, s.offload_bytes
(1, 262144, 0)
>>> s = plan(tg, "772KiB", recompute="never").stats
>>> s.recompute_count, s.offload_bytes
(0, 262144)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from memgraph.cost import CostModel
from memgraph.residents import TensorState
from memgraph.steps import Step
from taskgraph.graph import TaskGraph

__all__ = ["Recomputes"]


class Recomputes:
    """The facts that decide recomputes in one planning run (see the module docstring).

    `tensors` are the planner's `TensorState`s by storage root, `root` each task's
    storage root, `working_set` each step's aligned bytes, `arena` the arena's size,
    `outputs` the storage roots of program outputs; `mode` is `PlanOptions.recompute`.
    """

    def __init__(
        self,
        tg: TaskGraph,
        steps: Sequence[Step],
        tensors: Mapping[int, TensorState],
        root: Sequence[int],
        working_set: Sequence[int],
        arena: int,
        outputs: Mapping[int, object],
        cost: CostModel,
        mode: str,
    ):
        self.tg = tg
        self.steps = steps
        self.tensors = tensors
        self.root = root
        self.working_set = working_set
        self.arena = arena
        self.outputs = outputs
        self.cost = cost
        self.enabled = mode == "auto"
        self.computed = {step.task for step in steps if not step.sliced}

    def operands(self, task: int) -> list[TensorState]:
        """The distinct storage roots task `task` reads, in operand order."""
        roots = dict.fromkeys(self.root[i] for i in self.tg[task].inputs)
        return [self.tensors[r] for r in roots]

    def extra(self, position: int) -> list[TensorState]:
        """The operands of the tensors step `position` recomputes that are not the step's
        own tensors (its operands and output): what the step needs besides its working set."""
        step = self.steps[position]
        own = {*step.roots, step.task}
        found: dict[int, TensorState] = {}
        for r in step.roots:
            if self.tensors[r].recompute:
                for operand in self.operands(r):
                    if operand.id not in own:
                        found[operand.id] = operand
        return list(found.values())

    def chooses(self, tensor: TensorState, now: int, moving: int | None = None) -> bool:
        """Whether to discard `tensor`, evicted while step `now` is prepared, and recompute
        it at its next use, instead of offloading it (see the module docstring).

        `moving` is step `now` when its resident operands are being moved into one window
        (`memgraph.horizon`: the packed window): an operand of that step may then be
        recomputed into the window instead of going out and back, when the operands of
        what the step recomputes fit where its output will be (the output is placed
        after the recomputes, once their operands are gone)."""
        position = tensor.next_use
        if (
            not self.enabled
            or tensor.storage is not None
            or tensor.id not in self.computed
            or tensor.id in self.outputs
            or self.tg[tensor.id].workspace
            or not now <= position < len(self.steps)
            or position == now
            and moving != now
        ):
            return False
        operands = self.operands(tensor.id)
        if any(operand.storage is None for operand in operands):
            return False
        cost = self.cost
        rebuild = cost.task_seconds(self.tg, tensor.id) + sum(
            cost.transfer_seconds(operand.nbytes, "h2d") for operand in operands
        )
        move = cost.transfer_seconds(tensor.nbytes, "d2h") + cost.transfer_seconds(
            tensor.nbytes, "h2d"
        )
        if rebuild >= move:
            return False
        tensor.recompute = True  # counted with the step's other recomputes
        extra = sum(t.size for t in self.extra(position))
        tensor.recompute = False
        if position == now:
            return extra <= self.tensors[self.steps[now].task].size
        return self.working_set[position] + extra <= self.arena

    def reload_seconds(self, tensor: TensorState) -> float:
        """The host-to-device seconds a recompute of `tensor` awaits: the reloads of its
        operands that are not resident now."""
        return sum(
            self.cost.transfer_seconds(operand.nbytes, "h2d")
            for operand in self.operands(tensor.id)
            if operand.region is None
        )
