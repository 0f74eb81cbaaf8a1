"""How the backward pass adds tasks: `Emitter` wraps the `GraphBuilder` being extended.

Gradient tasks take the scope of the forward task they differentiate and the label
`grad.<its label>` (or `grad`), so listings, renderings and reports group them with
their layer. `Emitter.einsum` adds one generalized einsum that stands for a sum (or
product) over a forward einsum's whole iteration space, whatever subset of the
forward operands it reads (see its docstring).

Gradients are summed as they arrive: `contribute(task, part)` adds `part` to the
running sum of `task`'s gradient (`sums`). An elementwise gradient einsum (nothing
reduced) takes the running sum as one more operand instead (`einsum(..., into=task)`:
`join + sum`), which saves a pass over the tensor for each residual connection,
softmax and norm that reads it twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from taskgraph.autodiff.derivatives import mul, product_vars
from taskgraph.builder import GraphBuilder
from taskgraph.einsum import LETTERS, EinsumSpec
from taskgraph.expr import BinOp, Const, Expr, Var
from taskgraph.nodes import Einsum, Fill, Op, Shape, Task

__all__ = ["Emitter", "Operands", "grad_label"]


def grad_label(task: Task) -> str:
    """The label of a gradient task made for `task`: `grad.<label>`, or `grad`."""
    return f"grad.{task.label}" if task.label else "grad"


@dataclass
class Operands:
    """The operands of an einsum being made: (task id, index term) pairs, each once.

    `var(task, term)` returns the join variable of that operand, adding it when new,
    so that a forward tensor read twice with the same indices is one operand.
    """

    items: list[tuple[int, str]] = field(default_factory=list)

    def var(self, task: int, term: str) -> Var:
        key = (task, term)
        if key not in self.items:
            self.items.append(key)
        return Var(self.items.index(key))


class Emitter:
    """Adds the backward pass's tasks to `builder` (which holds the forward tasks)."""

    def __init__(self, builder: GraphBuilder):
        self.builder = builder
        self.sums: dict[int, int] = {}
        """The running sum of each task's gradient so far (task -> gradient task)."""
        self._fills: dict[tuple[Shape, float, str], int] = {}

    @property
    def tasks(self) -> list[Task]:
        return self.builder.tasks

    def add(
        self,
        op: Op,
        inputs: Sequence[int],
        source: Task,
        shape: Shape | None = None,
        dtype: str | None = None,
    ) -> int:
        """Append `op` on `inputs`, in `source`'s scope, labelled as its gradient."""
        return self.builder.add(op, inputs, shape, dtype, source.scope, grad_label(source))

    def fill(self, shape: Shape, value: float, dtype: str, source: Task) -> int:
        """A constant tensor (made once per shape, value and dtype and then shared)."""
        key = (tuple(shape), float(value), dtype)
        if key not in self._fills:
            self._fills[key] = self.add(Fill(float(value)), (), source, tuple(shape), dtype)
        return self._fills[key]

    def eye(self, size: int, dtype: str, source: Task) -> int:
        """The identity matrix of `size`: 1 - C - Cᵀ with C the strictly upper
        triangle of ones (a causal fill), made once per size and dtype."""
        key = ((size, size), -1.0, dtype)
        if key not in self._fills:
            upper = self.add(Fill(1.0, "causal"), (), source, (size, size), dtype)
            spec = EinsumSpec(("ab", "ba"), "ab")
            join = BinOp("-", BinOp("-", Const(1.0), Var(0)), Var(1))
            self._fills[key] = self.add(Einsum(spec, join), (upper, upper), source)
        return self._fills[key]

    def onto_diagonal(
        self, diagonal: int, distinct: str, term: str, space: Mapping[str, int], source: Task
    ) -> int:
        """The tensor read as `term` (an index repeated: a diagonal) that is zero off its
        diagonal and `diagonal` (indexed by `distinct`, the term's indices once) on it:
        each repeat of an index gets a fresh letter tied to the first by an identity."""
        spare = iter(c for c in LETTERS if c not in space)
        seen: set[str] = set()
        out, eyes = "", []
        for c in term:
            if c not in seen:
                seen.add(c)
                out += c
                continue
            fresh = next(spare)
            out += fresh
            eyes.append((self.eye(space[c], self.tasks[diagonal].dtype, source), c + fresh))
        operands = [diagonal] + [eye for eye, _ in eyes]
        spec = EinsumSpec((distinct, *(pair for _, pair in eyes)), out)
        return self.add(Einsum(spec), operands, source)

    def cast(self, task_id: int, dtype: str, source: Task) -> int:
        """`task_id` converted to `dtype` (itself when it already is)."""
        task = self.tasks[task_id]
        if task.dtype == dtype:
            return task_id
        letters = LETTERS[: len(task.shape)]
        return self.add(Einsum(EinsumSpec((letters,), letters)), (task_id,), source, dtype=dtype)

    def contribute(self, task: int, part: int, source: Task) -> None:
        """Add `part` (made from `source`'s gradient) to the running sum of `task`'s."""
        total = self.sums.get(task)
        if total is None:
            self.sums[task] = part
            return
        letters = LETTERS[: len(self.tasks[total].shape)]
        spec = EinsumSpec((letters, letters), letters)
        self.sums[task] = self.add(Einsum(spec, BinOp("+", Var(0), Var(1))), (total, part), source)

    def einsum(
        self,
        operands: Operands,
        join: Expr,
        out: str,
        space: Mapping[str, int],
        agg: str,
        source: Task,
        dtype: str,
        into: int | None = None,
    ) -> int:
        """One einsum `out = agg over space \\ out of join(operands)` over the iteration
        `space` (index -> size) of a forward einsum, though the operands may not read
        every index of it:

        * an output index no operand reads is bound by a fill of ones multiplied in
          (the result is broadcast along it);
        * a reduced index no operand reads multiplies a sum by its size (every point
          along it contributes the same), and is bound by a fill of ones in a product
          (every point is a factor).

        A product join of every operand once, summed, is emitted as a plain einsum.

        `into`: the result is a contribution to the gradient of that task, added to its
        running sum – inside this einsum when it reduces nothing – and the id returned
        is the new running sum.
        """
        covered = set("".join(term for _, term in operands.items))
        missing = [c for c in space if c not in covered and c not in out]
        bind = [c for c in out if c not in covered] + (missing if agg == "prod" else [])
        if bind:
            shape = tuple(space[c] for c in bind)
            ones = operands.var(self.fill(shape, 1.0, dtype, source), "".join(bind))
            join = mul(join, ones)
        if agg == "sum" and missing:
            join = mul(Const(float(math.prod(space[c] for c in missing))), join)
        total = None if into is None else self.sums.get(into)
        elementwise = set("".join(term for _, term in operands.items)) <= set(out)
        if total is not None and agg == "sum" and elementwise:
            join = BinOp("+", join, operands.var(total, out))
            into, fused = None, into
        else:
            fused = None
        terms = tuple(term for _, term in operands.items)
        spec = EinsumSpec(terms, out)
        ids = [task for task, _ in operands.items]
        factors = product_vars(join)
        plain = agg == "sum" and factors is not None and sorted(factors) == list(range(len(ids)))
        op = Einsum(spec, None if plain else join, agg)
        made = self.add(op, ids, source, dtype=dtype)
        if fused is not None:
            self.sums[fused] = made
        elif into is not None:
            self.contribute(into, made, source)
            return self.sums[into]
        return made
