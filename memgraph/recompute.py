"""Recomputation as an eviction choice: drop a tensor and compute it again before its next use.

When the planner evicts a tensor that has no host copy, the default is to offload it
and reload it before its next use: its bytes cross PCIe twice. With
`PlanOptions(recompute="auto")` (the default) the planner may instead *discard* it
(free it with no copy out) and, right before the step that next reads it, apply its
task again – a *recompute*, an apply marked `recompute` (`memgraph.nodes`) – from its
operands. A tensor rebuilt from int4 weights (their float copy), a cheap elementwise
result, or attention probabilities (a softmax of scores that are themselves gone) are
cheaper to rebuild than to move; the verifier, the simulator and the runtimes treat a
recompute as the apply it is.

A recompute may be a *chain* (Checkmate-style rematerialization): an operand that will
be gone by the reading step – freed after its last use, or discarded itself – is
applied again first, from its own operands, recursively, at most `MAX_CHAIN` tasks. So
the probabilities of an attention layer, read again in the backward pass, are rebuilt
there from q and k (which the backward pass reads anyway): the scores, their maximum
and sum, then the probabilities, each applied again, in topological order.

`Recomputes.chooses(tensor)` decides, at the eviction, for one tensor. It recomputes
only where nothing can go wrong later:

* the tensor (and each task of its chain) is computed by a step of the order (not an
  input, not a slice reloaded from its input), is no program output (an output must end
  somewhere: on the device or in a host copy), and declares no kernel workspace;
* its next use is a later step than the one being prepared – or that very step, when
  the step's operands are moved into one window (see `chooses`; the chain is then the
  tensor alone, from operands with host copies);
* every *leaf* of its chain (an operand that is not applied again) lasts until the
  reading step: it has a host copy (never lost: tensors are immutable), or it is read
  at or after that step and is not discarded now; such a leaf is *guarded*, never
  discarded before the chain has run (if evicted, it is offloaded), so it is then
  resident or on the host, and the chain found at that step (`rebuild`) is at most the
  one chosen;
* the step that next reads it can hold, at once, its working set and every tensor its
  recomputes apply or read (the packed window of `memgraph.horizon` then always exists:
  the planner never fails for a recompute);
* on the plan's cost model (`memgraph.cost`), applying the chain's tasks again and
  reloading every leaf (as if none were resident: the worst case) takes less time than
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
from dataclasses import dataclass

from einpage_core.errors import PlanError
from memgraph.cost import CostModel
from memgraph.residents import TensorState
from memgraph.steps import Step
from taskgraph.graph import TaskGraph

__all__ = ["Recomputes", "Rebuild", "MAX_CHAIN"]

MAX_CHAIN = 8
"""The most tasks one discarded tensor's recompute may apply again (itself included): a
bound on the chain, so a recompute never replays a long stretch of the program."""


@dataclass(frozen=True, slots=True)
class Rebuild:
    """What a step recomputes before its apply, as the tensors' states are now.

    `tasks`: the storage roots applied again, in topological order (their ids; each
    one's operands are either earlier in `tasks` or resident when it is applied); `extra`:
    the tensors the step needs besides its own working set – those of `tasks` that are
    not its operands, and the operands of `tasks` that are neither recomputed nor the
    step's own tensors."""

    tasks: tuple[int, ...] = ()
    extra: tuple[TensorState, ...] = ()


class Recomputes:
    """The facts that decide recomputes in one planning run (see the module docstring).

    `tensors` are the planner's `TensorState`s by storage root, `root` each task's
    storage root, `working_set` each step's aligned bytes, `arena` the arena's size,
    `outputs` the storage roots of program outputs; `mode` is `PlanOptions.recompute`.

    Besides the tensors' states it keeps, for the planner: `chains`, each discarded
    tensor's chain as decided (the ids of what its recompute applies and reads: the room
    it was granted), `guarded`, the tensors a pending chain reads that must not be
    discarded before its step (tensor -> the last such step), and `bound`, the tensors
    whose region is allocated for a recompute not yet emitted (tensor -> its step).
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
        self.chains: dict[int, tuple[int, ...]] = {}
        self.guarded: dict[int, int] = {}
        self.bound: dict[int, int] = {}

    def operands(self, task: int) -> list[TensorState]:
        """The distinct storage roots task `task` reads, in operand order."""
        roots = dict.fromkeys(self.root[i] for i in self.tg[task].inputs)
        return [self.tensors[r] for r in roots]

    # -- what a step recomputes, as things are now ----------------------------------------

    def rebuilt_at(self, tensor: TensorState, position: int) -> bool:
        """Whether step `position`'s preparation computes `tensor` again: it is allocated
        for that step's recompute, or it is not resident and has no host copy (discarded,
        or dead: freed after its last use). Meant for a step whose predecessors are all
        prepared (their outputs allocated): the step being prepared or applied."""
        if tensor.region is not None:
            return self.bound.get(tensor.id) == position
        dead = tensor.storage is None and tensor.last_use >= 0  # computed, then freed
        return tensor.recompute or dead

    def rebuild(self, position: int) -> Rebuild:
        """What step `position` recomputes: its discarded operands, and, recursively, the
        operands of those that are neither resident nor on the host (a chain)."""
        step = self.steps[position]
        rebuilt = {
            r: self.tensors[r] for r in step.roots if self.rebuilt_at(self.tensors[r], position)
        }
        if not rebuilt:
            return Rebuild()
        leaves: dict[int, TensorState] = {}
        stack = list(rebuilt.values())
        while stack:
            tensor = stack.pop()
            for operand in self.operands(tensor.id):
                if operand.id in rebuilt or operand.id in leaves:
                    continue
                if not self.rebuilt_at(operand, position):
                    leaves[operand.id] = operand
                    continue
                if operand.id not in self.computed:  # pragma: no cover - see `chain`
                    raise PlanError(
                        f"%{tensor.id} is recomputed for step %{step.task}, but its operand "
                        f"%{operand.id} is neither resident, nor on the host, nor computed"
                    )
                rebuilt[operand.id] = operand
                stack.append(operand)
        own = {*step.roots, step.task}
        extra = [t for t in (*rebuilt.values(), *leaves.values()) if t.id not in own]
        return Rebuild(tuple(sorted(rebuilt)), tuple(extra))

    def extra(self, position: int) -> list[TensorState]:
        """The tensors step `position` needs besides its working set for its recomputes
        (`Rebuild.extra`)."""
        return list(self.rebuild(position).extra)

    # -- the decision -----------------------------------------------------------------

    def lasts(self, tensor: TensorState, position: int) -> bool:
        """Whether `tensor` is sure to be resident or on the host at step `position`: it
        has a host copy (never lost), or it is read at or after that step and not
        discarded now (it is then not freed before, and `guarded` keeps it from being
        discarded until then)."""
        if tensor.storage is not None:
            return True
        return not tensor.recompute and bool(tensor.uses) and tensor.uses[-1] >= position

    def can_apply_again(self, tensor: TensorState) -> bool:
        """Whether `tensor`'s task may be applied again: computed by a step of the order (not
        an input, nor a slice reloaded from one), no program output, no kernel workspace."""
        return (
            tensor.id in self.computed
            and tensor.id not in self.outputs
            and not self.tg[tensor.id].workspace
        )

    def chain(self, tensor: TensorState, position: int) -> tuple[list, list] | None:
        """The chain that computes `tensor` again at step `position`: the tensors applied
        again (`tensor` and those of its operands, recursively, that may be gone by then)
        and the leaves they read (tensors that last: `lasts`); None when some operand
        neither lasts nor can be applied again, or the chain exceeds `MAX_CHAIN`."""
        members = {tensor.id: tensor}
        leaves: dict[int, TensorState] = {}
        stack = [tensor]
        while stack:
            for operand in self.operands(stack.pop().id):
                if operand.id in members or operand.id in leaves:
                    continue
                if self.lasts(operand, position):
                    leaves[operand.id] = operand
                elif self.can_apply_again(operand) and len(members) < MAX_CHAIN:
                    members[operand.id] = operand
                    stack.append(operand)
                else:
                    return None
        return list(members.values()), list(leaves.values())

    def chooses(self, tensor: TensorState, now: int, moving: int | None = None) -> bool:
        """Whether to discard `tensor`, evicted while step `now` is prepared, and recompute
        it at its next use, instead of offloading it (see the module docstring).

        `moving` is step `now` when its resident operands are being moved into one window
        (`memgraph.horizon`: the packed window): an operand of that step may then be
        recomputed into the window instead of going out and back, when its operands all
        have host copies and fit where its output will be (the output is placed after the
        recomputes, once their operands are gone)."""
        position = tensor.next_use
        if (
            not self.enabled
            or tensor.storage is not None
            or not self.can_apply_again(tensor)
            or self.guarded.get(tensor.id, -1) >= now
            or not now <= position < len(self.steps)
            or position == now
            and moving != now
        ):
            return False
        if position == now:  # into the packed window: from host copies only
            members, leaves = [tensor], self.operands(tensor.id)
            if any(operand.storage is None for operand in leaves):
                return False
        else:
            found = self.chain(tensor, position)
            if found is None:
                return False
            members, leaves = found
        cost = self.cost
        rebuild = sum(cost.task_seconds(self.tg, t.id) for t in members) + sum(
            cost.transfer_seconds(t.nbytes, "h2d") for t in leaves
        )
        move = cost.transfer_seconds(tensor.nbytes, "d2h") + cost.transfer_seconds(
            tensor.nbytes, "h2d"
        )
        if rebuild >= move:
            return False
        step = self.steps[position]
        own = {*step.roots, step.task}
        granted: set[int] = set()  # what the chains already chosen for that step take
        for r in step.roots:
            granted.update(self.chains.get(r, ()) if self.tensors[r].recompute else ())
        chain = tuple(t.id for t in (*members, *leaves))
        needed = sum(self.tensors[t].size for t in granted.union(chain) - own)
        if position == now:
            if needed > self.tensors[step.task].size:
                return False
        elif self.working_set[position] + needed > self.arena:
            return False
        self.chains[tensor.id] = chain
        for t in (*members[1:], *leaves):
            if t.storage is None:  # kept from being discarded until the chain has run
                self.guarded[t.id] = max(self.guarded.get(t.id, -1), position)
        return True

    def done(self, tensor: TensorState) -> None:
        """`tensor`'s recompute was emitted: forget its chain and its binding."""
        self.chains.pop(tensor.id, None)
        self.bound.pop(tensor.id, None)

    def reload_seconds(self, tensor: TensorState) -> float:
        """The host-to-device seconds a recompute of `tensor` awaits: the reloads of the
        tensors its chain reads that are not resident now."""
        return sum(
            self.cost.transfer_seconds(self.tensors[t].nbytes, "h2d")
            for t in self.chains.get(tensor.id, ())
            if self.tensors[t].region is None and self.tensors[t].storage is not None
        )
