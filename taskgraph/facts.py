"""Tensor facts: what a tensor is, as typed data of the TaskGraph, never read from a name.

A task carries the facts stated about its tensor (`Task.facts`, a tuple: one tensor may
be two things at once, e.g. a KV page that is also the new keys a step plan returns).
They are set where the tensor is made – by the model, the optimizer, the generation
program, the backward pass (`einpage.Program.fact`, `GraphBuilder.add(..., facts=)`) –
and read wherever they are needed: memory maps, transfer counts, the step loop of a
generation, the hand-over of a training step's state, the autodiff's group rules.
Input and output names, labels and scopes are for people: no pass learns a fact by
parsing them or by matching the text of a join.

Fact kinds (`FACT_KINDS`, a closed set; each a small frozen record):

* `KVPage(layer, part, page)` – page `page` of layer `layer`'s key (`part` "k") or
  value ("v") cache. `page` is None for a page of the positions a decode step plan
  computes itself, whose place in the cache is known only when it runs.
* `KVEntries(layer, part)` – the keys or values of layer `layer` at the positions this
  program computes (a step plan's prompt, or its new positions), which the step loop
  writes into its pages in host memory.
* `ChosenIds(step)` – the token ids an unrolled generation chooses at step `step`
  (0: the prefill's choice, t: decode step t).
* `Gradient(of)` – the gradient of the loss with respect to task `of`.
* `Update(of)` – the new value, after a training step, of the input `of` (a weight or
  a state): the next step's value of that input.
* `OptimizerState(of, state)` – the optimizer's state `state` (e.g. "exp_avg") of the
  weight input `of`.
* `MasterWeight(of)` – the float32 master copy of the weight input `of` (mixed
  precision).
* `Softmax()` – the softmax of the task's operand 0 along the index its operands 1 and
  2 (the maximum and the sum of `einpage.program.ops.softmax`) reduce.
* `LogSumExp()` – the log-sum-exp of the input of its operands (the sum and the
  maximum of `einpage.program.ops.cross_entropy`) along the index they reduce.
* `Layer(index)` – the tensor belongs to decoder layer `index` of the model: stated by
  the models on the weight inputs of each layer (`einpage.Program.layer`), read by the
  pipeline placement, which keeps a layer's weights on one device
  (`memgraph.placement`).
* `Shard(axis)` – tensor parallelism may split this tensor along its axis `axis` (the
  head axis of attention's weights, the column axis of the MLP's): stated by the models
  where they declare the weights, read by `taskgraph.partition.tensor_split`, which
  splits the dims that axis links to into one block per device.
* `TensorPart(index, count)` – the tensor is part `index` of `count` of a tensor-parallel
  split (`tensor_split`): a block along a split dim, or the partial aggregate over one
  part of a split reduced dim; read by `memgraph.placement.tensor_placement`, which puts
  it on device `index`.

A fact that refers to another tensor (`of`) names it by task id, which no renaming
touches; it must be an earlier task (and an `Input` for `Update`, `OptimizerState` and
`MasterWeight`). A pass that renumbers tasks renumbers the facts (`Fact.renumbered`),
and drops a fact whose tensor it no longer has as one task. On a task that partitioning
made (one with a `Block`), the facts are those of the original task whose region (or
partial aggregate) the block holds.

>>> KVPage(0, "k", 3).describe(), Gradient(4).describe(), Layer(2).describe()
('kv_page(layer=0, part=k, page=3)', 'gradient(of=%4)', 'layer(index=2)')
>>> Update(4).renumbered({4: 9}), Update(4).renumbered({})
(Update(of=9), None)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, TypeVar

from einpage_core.errors import GraphError

__all__ = [
    "Fact",
    "KVPage",
    "KVEntries",
    "ChosenIds",
    "Gradient",
    "Update",
    "OptimizerState",
    "MasterWeight",
    "Softmax",
    "LogSumExp",
    "Layer",
    "Shard",
    "TensorPart",
    "FACT_KINDS",
    "KV_PARTS",
    "fact_of",
    "facts_of",
    "is_kv_page",
    "chosen_ids",
    "first_needing",
    "fact_from_attributes",
]

KV_PARTS = ("k", "v")
"""The parts of a layer's KV cache: its keys and its values."""

F = TypeVar("F", bound="Fact")


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Fact:
    """Base of the fact records; subclasses are frozen slotted dataclasses."""

    __slots__ = ()
    kind: ClassVar[str]
    references: ClassVar[tuple[str, ...]] = ()
    """The fields that name another task by id."""
    names_input: ClassVar[bool] = False
    """Whether the task it names must be an `Input`."""

    def refs(self) -> tuple[int, ...]:
        """The ids of the tasks this fact names."""
        return tuple(getattr(self, name) for name in self.references)

    def renumbered(self, new_id: Mapping[int, int]) -> Fact | None:
        """This fact with the tasks it names renumbered by `new_id` (old id -> new id), or
        None when one of them has no new id (the fact's subject is gone)."""
        if not self.references:
            return self
        changes = {}
        for name in self.references:
            old = getattr(self, name)
            if old not in new_id:
                return None
            changes[name] = new_id[old]
        return replace(self, **changes)  # type: ignore[type-var]

    def describe(self) -> str:
        """The fact on one line: `kind(field=value, ...)`, task ids as `%7`."""
        parts = []
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            parts.append(f"{f.name}={'%' if f.name in self.references else ''}{value}")
        return f"{self.kind}({', '.join(parts)})" if parts else self.kind

    def attributes(self) -> dict[str, Any]:
        """The JSON form: `{"kind": ..., field: value, ...}` (see `taskgraph.serialize`)."""
        return {"kind": self.kind, **{f.name: getattr(self, f.name) for f in fields(self)}}  # type: ignore[arg-type]


def _check_index(fact: Fact, name: str, none: bool = False) -> None:
    value = getattr(fact, name)
    if value is None and none:
        return
    if not _is_index(value):
        what = "an int >= 0" + (" or None" if none else "")
        raise GraphError(f"{fact.kind}: {name} must be {what}, got {value!r}")


def _check_part(fact: KVPage | KVEntries) -> None:
    if fact.part not in KV_PARTS:
        raise GraphError(f"{fact.kind}: part must be one of {KV_PARTS}, got {fact.part!r}")


@dataclass(frozen=True, slots=True)
class KVPage(Fact):
    """Page `page` of layer `layer`'s cache of keys (`part` "k") or values ("v"); `page`
    None: a page of a decode step plan's own new positions (placed when it runs)."""

    kind: ClassVar[str] = "kv_page"
    layer: int
    part: str
    page: int | None

    def __post_init__(self) -> None:
        _check_index(self, "layer")
        _check_part(self)
        _check_index(self, "page", none=True)


@dataclass(frozen=True, slots=True)
class KVEntries(Fact):
    """The keys (`part` "k") or values ("v") of layer `layer` at the positions the program
    computes, which a step loop writes into its cache."""

    kind: ClassVar[str] = "kv_entries"
    layer: int
    part: str

    def __post_init__(self) -> None:
        _check_index(self, "layer")
        _check_part(self)


@dataclass(frozen=True, slots=True)
class ChosenIds(Fact):
    """The token ids a generation chooses at step `step` (0: the prefill's choice)."""

    kind: ClassVar[str] = "chosen_ids"
    step: int

    def __post_init__(self) -> None:
        _check_index(self, "step")


@dataclass(frozen=True, slots=True)
class Gradient(Fact):
    """The gradient of the loss with respect to task `of`."""

    kind: ClassVar[str] = "gradient"
    references: ClassVar[tuple[str, ...]] = ("of",)
    of: int

    def __post_init__(self) -> None:
        _check_index(self, "of")


@dataclass(frozen=True, slots=True)
class Update(Fact):
    """The new value of the input `of` after a training step (its next value)."""

    kind: ClassVar[str] = "update"
    references: ClassVar[tuple[str, ...]] = ("of",)
    names_input: ClassVar[bool] = True
    of: int

    def __post_init__(self) -> None:
        _check_index(self, "of")


@dataclass(frozen=True, slots=True)
class OptimizerState(Fact):
    """The optimizer's state `state` (e.g. "exp_avg") of the weight input `of`."""

    kind: ClassVar[str] = "optimizer_state"
    references: ClassVar[tuple[str, ...]] = ("of",)
    names_input: ClassVar[bool] = True
    of: int
    state: str

    def __post_init__(self) -> None:
        _check_index(self, "of")
        if not isinstance(self.state, str) or not self.state:
            raise GraphError(f"{self.kind}: state must be a non-empty string, got {self.state!r}")


@dataclass(frozen=True, slots=True)
class MasterWeight(Fact):
    """The float32 master copy of the weight input `of` (mixed-precision training)."""

    kind: ClassVar[str] = "master_weight"
    references: ClassVar[tuple[str, ...]] = ("of",)
    names_input: ClassVar[bool] = True
    of: int

    def __post_init__(self) -> None:
        _check_index(self, "of")


@dataclass(frozen=True, slots=True)
class Softmax(Fact):
    """The softmax of operand 0 along the index operands 1 and 2 reduce (the maximum and
    the sum of `einpage.program.ops.softmax`): `taskgraph.autodiff.patterns`."""

    kind: ClassVar[str] = "softmax"


@dataclass(frozen=True, slots=True)
class LogSumExp(Fact):
    """The log-sum-exp of the input of its operands (the sum and the maximum of
    `einpage.program.ops.cross_entropy`) along the index they reduce."""

    kind: ClassVar[str] = "log_sum_exp"


@dataclass(frozen=True, slots=True)
class Layer(Fact):
    """The tensor belongs to decoder layer `index` of the model (a weight of that layer):
    a pipeline stage holds whole layers."""

    kind: ClassVar[str] = "layer"
    index: int

    def __post_init__(self) -> None:
        _check_index(self, "index")


@dataclass(frozen=True, slots=True)
class Shard(Fact):
    """Tensor parallelism may split this tensor along its axis `axis` (attention's head
    axis, the MLP's column axis): `taskgraph.partition.tensor_split`."""

    kind: ClassVar[str] = "shard"
    axis: int

    def __post_init__(self) -> None:
        _check_index(self, "axis")


@dataclass(frozen=True, slots=True)
class TensorPart(Fact):
    """The tensor is part `index` of `count` of a tensor-parallel split (a block along a
    split dim, or the partial aggregate of one part of a split reduced dim): it goes to
    device `index` (`memgraph.placement.tensor_placement`)."""

    kind: ClassVar[str] = "tensor_part"
    index: int
    count: int

    def __post_init__(self) -> None:
        _check_index(self, "index")
        _check_index(self, "count")
        if self.index >= self.count:
            raise GraphError(
                f"{self.kind}: index must be below count ({self.count}), got {self.index}"
            )


FACT_KINDS: dict[str, type[Fact]] = {
    cls.kind: cls
    for cls in (
        KVPage,
        KVEntries,
        ChosenIds,
        Gradient,
        Update,
        OptimizerState,
        MasterWeight,
        Softmax,
        LogSumExp,
        Layer,
        Shard,
        TensorPart,
    )
}
"""Every fact kind by name."""


def facts_of(task: Any, kind: type[F]) -> list[F]:
    """The facts of `kind` that `task` (a `Task`) carries, in order."""
    return [fact for fact in task.facts if isinstance(fact, kind)]


def fact_of(task: Any, kind: type[F]) -> F | None:
    """The first fact of `kind` that `task` carries, or None."""
    for fact in task.facts:
        if isinstance(fact, kind):
            return fact
    return None


def is_kv_page(task: Any) -> bool:
    """Whether `task` holds a page of a KV cache (a `KVPage` fact): reports and memory
    maps show such tensors as their own kind."""
    return fact_of(task, KVPage) is not None


def chosen_ids(tg: Any) -> list[tuple[int, int]]:
    """(step, task id) of each task of `tg` stating `ChosenIds`, in step order: the
    choices of ids of an unrolled generation."""
    return sorted(
        (fact.step, task.id) for task in tg for fact in task.facts if isinstance(fact, ChosenIds)
    )


def first_needing(tg: Any, roots: Iterable[tuple[int, int]]) -> list[int | None]:
    """Per task of `tg`, the label of the first of `roots` ((label, task id), in the order
    given) that it is or is an ancestor of; None when it is none's. A task needed by a
    root has its operands needed by it too."""
    label: list[int | None] = [None] * len(tg)
    for mark, root in roots:
        stack = [root]
        while stack:
            i = stack.pop()
            if label[i] is None:
                label[i] = mark
                stack.extend(tg[i].inputs)
    return label


def fact_from_attributes(attrs: Any) -> Fact:
    """A fact from its JSON form (`Fact.attributes`), validated; `GraphError` naming what
    is wrong: not an object, an unknown kind (listing the valid ones), other fields."""
    if not isinstance(attrs, dict):
        raise GraphError(f"a fact must be an object with a 'kind', got {attrs!r}")
    kind = attrs.get("kind")
    if kind not in FACT_KINDS:
        raise GraphError(f"unknown fact kind {kind!r}; valid: {', '.join(FACT_KINDS)}")
    cls = FACT_KINDS[kind]
    expected = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    given = set(attrs) - {"kind"}
    if given != expected:
        raise GraphError(
            f"{kind} fact: fields must be exactly {sorted(expected)}, got {sorted(given)}"
        )
    return cls(**{name: attrs[name] for name in expected})


def checked_facts(
    facts: Iterable[Any],
    task_id: int,
    is_input: Sequence[bool] | Mapping[int, bool],
    rank: int | None = None,
) -> tuple[Fact, ...]:
    """`facts` as a tuple without repeats, each checked to be a `Fact` that names only
    earlier tasks (ids below `task_id`), inputs where its kind says so (`is_input[i]`:
    whether task i is an `Input`) and, with the task's `rank` known, a `Shard` axis below
    it; `GraphError` naming the task and the fact otherwise."""
    result: list[Fact] = []
    for fact in facts:
        if not isinstance(fact, Fact):
            kinds = ", ".join(cls.__name__ for cls in FACT_KINDS.values())
            raise GraphError(f"task %{task_id}: a fact must be one of {kinds}, got {fact!r}")
        if isinstance(fact, Shard) and rank is not None and fact.axis >= rank:
            raise GraphError(
                f"task %{task_id}: fact {fact.describe()} names axis {fact.axis} of a tensor "
                f"of rank {rank}; valid axes: 0..{rank - 1}"
            )
        for ref in fact.refs():
            if ref >= task_id:
                raise GraphError(
                    f"task %{task_id}: fact {fact.describe()} names %{ref}, which is not an "
                    f"earlier task"
                )
            if fact.names_input and not is_input[ref]:
                raise GraphError(
                    f"task %{task_id}: fact {fact.describe()} names %{ref}, which is not an input"
                )
        if fact not in result:
            result.append(fact)
    return tuple(result)
