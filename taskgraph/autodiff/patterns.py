"""Gradient rules for groups of tasks: the softmax and the log-sum-exp of the op library.

`einpage.program.ops.softmax` is three einsums over an input x with the class axis k (L the
input's indices, R = L without k): `m = max_k x`, `s = sum_k exp(x - m)` and
`p = exp(x - m) / s`; `cross_entropy`'s log-sum-exp is `m`, `s` and `lse = log(s) + m`.
The maximum only shifts the exponent: the function does not depend on it, and the
gradient it receives is zero in exact arithmetic. Differentiated task by task, though,
the backward pass would route that zero to the arg-maximum through a tie count – two
passes over x – and, worse, read x itself (to compare it with the maximum and to
recompute `exp(x - m)`), keeping the input of every softmax alive from the forward to
the backward pass: in attention, the masked scores beside the probabilities.

So a group that is exactly one of these is differentiated as one function, the way
frameworks write a softmax's backward:

* softmax: `dx = p * (g - sum_k g p)`: two einsums that read the output p and its
  gradient g, not x;
* log-sum-exp: `dx = exp(x - lse) * g`: one einsum (x is read here, but `lse` is the
  last use of the log-sum-exp's input anyway: a loss).

A group is found by what the program states, not by how its joins are spelled: the op
library marks the last task of each with a fact (`taskgraph.facts.Softmax`,
`LogSumExp`), and the rule then checks only the group's structure – the maximum and the
sum reduce one index of the same input, with the specs and aggregations above, and
nothing outside the group reads them. The joins are the marker's word (a marked task
whose joins compute something else would get this gradient). The same einsums written
unmarked, or a maximum read elsewhere, take the task-by-task rules, which give the same
gradient up to rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from taskgraph.autodiff.emitter import Emitter, Operands
from taskgraph.einsum import EinsumSpec
from taskgraph.expr import BinOp, Call
from taskgraph.facts import LogSumExp, Softmax, fact_of
from taskgraph.nodes import Einsum, Task

__all__ = ["GroupRule", "find_groups"]


@dataclass(frozen=True)
class GroupRule:
    """Tasks differentiated as one: `anchor` (the last, whose gradient the rule reads),
    `helpers` (the others: they get no gradient of their own), and `apply(em, g)`,
    which contributes the gradient of the group's input."""

    anchor: int
    helpers: tuple[int, ...]
    apply: Callable[[Emitter, int], None]


def _einsum(task: Task, inputs: int, agg: str = "sum") -> Einsum | None:
    """`task`'s op when it is an einsum of `inputs` operands with that agg (its join is
    not read: see the module docstring)."""
    op = task.op
    if not isinstance(op, Einsum) or len(task.inputs) != inputs or op.agg != agg:
        return None
    return op


def _shift(tasks: Sequence[Task], x: int, m: int, s: int) -> tuple[str, str] | None:
    """(L, R) when `m` reduces x's index k by max (terms L -> R = L \\ k) and `s` sums
    (x, m) over k (terms L, R -> R): the maximum and the sum of a marked group."""
    t_max, t_sum = tasks[m], tasks[s]
    max_op = _einsum(t_max, 1, "max")
    sum_op = _einsum(t_sum, 2)
    if max_op is None or sum_op is None or t_max.inputs != (x,) or t_sum.inputs != (x, m):
        return None
    full, rest = max_op.spec.inputs[0], max_op.spec.output
    if len(full) != len(rest) + 1 or "".join(c for c in full if c in rest) != rest:
        return None
    if sum_op.spec != EinsumSpec((full, rest), rest):
        return None
    return full, rest


def _softmax(
    tasks: Sequence[Task], task: Task, readers: Sequence[Sequence[int]]
) -> GroupRule | None:
    op = _einsum(task, 3)
    if op is None or fact_of(task, Softmax) is None:
        return None
    x, m, s = task.inputs
    terms = _shift(tasks, x, m, s)
    if terms is None or len({x, m, s}) != 3:
        return None
    full, rest = terms
    if op.spec != EinsumSpec((full, rest, rest), full):
        return None
    if set(readers[m]) - {s, task.id} or set(readers[s]) - {task.id}:
        return None

    def apply(em: Emitter, g: int) -> None:
        dot = em.add(Einsum(EinsumSpec((full, full), rest)), (g, task.id), task)
        operands = Operands()
        a, b, c = operands.var(g, full), operands.var(task.id, full), operands.var(dot, rest)
        join = BinOp("*", b, BinOp("-", a, c))  # p * (g - sum_k g p)
        space = dict(zip(full, task.shape, strict=True))
        em.einsum(operands, join, full, space, "sum", task, task.dtype, into=x)

    return GroupRule(task.id, (m, s), apply)


def _log_sum_exp(
    tasks: Sequence[Task], task: Task, readers: Sequence[Sequence[int]]
) -> GroupRule | None:
    op = _einsum(task, 2)
    if op is None or fact_of(task, LogSumExp) is None:
        return None
    s, m = task.inputs
    x = tasks[s].inputs[0] if tasks[s].inputs else -1
    terms = _shift(tasks, x, m, s)
    if terms is None or len({x, m, s}) != 3:
        return None
    full, rest = terms
    if op.spec != EinsumSpec((rest, rest), rest):
        return None
    if set(readers[m]) - {s, task.id} or set(readers[s]) - {task.id}:
        return None

    def apply(em: Emitter, g: int) -> None:
        operands = Operands()
        a, b, c = operands.var(x, full), operands.var(task.id, rest), operands.var(g, rest)
        join = BinOp("*", Call("exp", (BinOp("-", a, b),)), c)  # softmax(x) * g
        space = dict(zip(full, tasks[x].shape, strict=True))
        em.einsum(operands, join, full, space, "sum", task, task.dtype, into=x)

    return GroupRule(task.id, (m, s), apply)


_MATCHERS = (_softmax, _log_sum_exp)


def find_groups(tasks: Sequence[Task], active: set[int], wanted: set[int]) -> dict[int, GroupRule]:
    """The groups among the active `tasks` (the forward pass), by anchor; a group whose
    helpers are themselves wanted gradients is left to the task-by-task rules."""
    readers: list[list[int]] = [[] for _ in tasks]
    for task in tasks:
        for i in dict.fromkeys(task.inputs):
            readers[i].append(task.id)
    groups: dict[int, GroupRule] = {}
    for t in sorted(active):
        for match in _MATCHERS:
            rule = match(tasks, tasks[t], readers)
            if rule is not None and not wanted & set(rule.helpers):
                groups[t] = rule
                break
    return groups
