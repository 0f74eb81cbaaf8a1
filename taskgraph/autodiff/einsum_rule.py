"""The gradient of a generalized einsum with respect to its operands.

For `out[O] = AGG over R of J(x0[I0], x1[I1], ...)` (iteration space S = O ∪ R) and the
output's gradient `g[O]`, the gradient of the operands that are one tensor read with
the same indices `I` (positions P) is one einsum over S with output `I`:

* AGG = sum (or nothing reduced): `gx[I] = sum over S \\ I of g[O] * D`, where
  D = Σ_{k in P} ∂J/∂x_k (`taskgraph.autodiff.derivatives.diff`). It reads g and only
  the operands D reads: the gradient of a plain product is again a plain product
  (a matmul's gradients are the two matmuls), and an index that none of them reads
  contributes its size as a factor.
* AGG = max / min: the gradient goes to the points where J equals the result, split
  evenly among ties (as `torch.amax`/`torch.amin`): `gx[I] = sum over S \\ I of
  where(J == out, g * D / count, 0)` with `count[O] = sum over R of (J == out)`, one
  more einsum per task.
* AGG = prod, zeros handled exactly: with `nz[O]` the product of the nonzero factors
  and `zeros[O]` their number, ∂out/∂J at a point is `nz / J` when no factor is zero,
  `nz` at the one zero factor when there is exactly one, and 0 otherwise (two zeros
  leave the product zero whatever one factor does) – two more einsums per task.

Operands of another dtype than the output (an einsum that casts) get the gradient
cast back to theirs. An operand read with a repeated index (`ii`: its diagonal) gets
the gradient of the diagonal, placed onto the diagonal of a zero tensor
(`Emitter.onto_diagonal`).
"""

from __future__ import annotations

from collections.abc import Callable

from taskgraph import dtypes
from taskgraph.autodiff.derivatives import (
    ONE,
    ZERO,
    add,
    compare,
    diff,
    div,
    is_zero,
    mul,
    substitute,
    where,
)
from taskgraph.autodiff.emitter import Emitter, Operands
from taskgraph.expr import Expr
from taskgraph.nodes import Einsum, Task

__all__ = ["einsum_gradients"]


class _TaskGradient:
    """What the gradients of one einsum task share: its spec and join, the output's
    gradient and, made on first use, the helpers of max/min (`count`) and prod (`nz`,
    `zeros`)."""

    def __init__(self, em: Emitter, task: Task, grad: int):
        op: Einsum = task.op  # type: ignore[assignment]
        self.em, self.task, self.op = em, task, op
        self.spec = op.spec
        self.join = op.join_expr
        sizes = self.spec.index_sizes([em.tasks[i].shape for i in task.inputs])
        self.space = {c: sizes[c] for c in self.spec.indices}
        self.agg = op.agg if self.spec.reduced else "sum"
        self.dtype = em.tasks[task.inputs[0]].dtype
        self.grad = em.cast(grad, self.dtype, task)
        self._helpers: dict[str, int] = {}

    def output(self) -> int:
        """The forward output in the operands' dtype (cast once when the einsum casts)."""
        if "out" not in self._helpers:
            self._helpers["out"] = self.em.cast(self.task.id, self.dtype, self.task)
        return self._helpers["out"]

    def operand_vars(self, operands: Operands, expr: Expr) -> dict[int, Expr]:
        """Join variables of `operands` for the forward operands that `expr` reads."""
        return {k: operands.var(self.task.inputs[k], self.spec.inputs[k]) for k in expr.variables()}

    def helper(self, name: str) -> int:
        """The max/min tie count or the prod helpers, over the forward iteration space."""
        if name not in self._helpers:
            operands = Operands()
            joined = substitute(self.join, self.operand_vars(operands, self.join))
            if name == "count":
                out = operands.var(self.output(), self.spec.output)
                body, agg = where(compare("==", joined, out), ONE, ZERO), "sum"
            elif name == "nz":
                body, agg = where(compare("==", joined, ZERO), ONE, joined), "prod"
            else:  # zeros
                body, agg = where(compare("==", joined, ZERO), ONE, ZERO), "sum"
            self._helpers[name] = self.em.einsum(
                operands, body, self.spec.output, self.space, agg, self.task, self.dtype
            )
        return self._helpers[name]

    def contribute(self, producer: int, positions: list[int]) -> None:
        """Add the gradient of the operand at `positions` (the tensor `producer`, read
        with one term) to its running sum; nothing when it is zero everywhere."""
        derivative: Expr = ZERO
        for k in positions:
            derivative = add(derivative, diff(self.join, k))
        if is_zero(derivative):
            return
        term = self.spec.inputs[positions[0]]
        operands = Operands()
        g = operands.var(self.grad, self.spec.output)
        if self.agg == "sum":
            d = substitute(derivative, self.operand_vars(operands, derivative))
            join = mul(g, d)
            if not self.spec.reduced and _passes_through(join, operands, term, self.spec.output):
                self.em.contribute(producer, self.grad, self.task)
                return
        else:
            values = self.operand_vars(operands, self.join)
            d, joined = substitute(derivative, values), substitute(self.join, values)
            join = self._extremum_or_product(operands, g, d, joined)
        if len(set(term)) == len(term):
            self.em.einsum(
                operands, join, term, self.space, "sum", self.task, self.dtype, into=producer
            )
            return
        distinct = "".join(dict.fromkeys(term))
        diagonal = self.em.einsum(
            operands, join, distinct, self.space, "sum", self.task, self.dtype
        )
        part = self.em.onto_diagonal(diagonal, distinct, term, self.space, self.task)
        self.em.contribute(producer, part, self.task)

    def _extremum_or_product(self, operands: Operands, g: Expr, d: Expr, joined: Expr) -> Expr:
        output = self.spec.output
        if self.agg in ("max", "min"):
            out = operands.var(self.output(), output)
            count = operands.var(self.helper("count"), output)
            return where(compare("==", joined, out), div(mul(g, d), count), ZERO)
        nz = operands.var(self.helper("nz"), output)
        zeros = operands.var(self.helper("zeros"), output)
        only_zero = where(compare("==", joined, ZERO), nz, ZERO)
        factor = where(
            compare("==", zeros, ZERO),
            div(nz, joined),
            where(compare("==", zeros, ONE), only_zero, ZERO),
        )
        return mul(mul(g, d), factor)


def _passes_through(join: Expr, operands: Operands, term: str, output: str) -> bool:
    """Whether the gradient is the output's gradient itself: the join is `g` alone and
    the operand has the output's indices in the same order."""
    return len(operands.items) == 1 and join == operands.var(*operands.items[0]) and term == output


def einsum_gradients(em: Emitter, task: Task, grad: int, wanted: Callable[[int], bool]) -> None:
    """Contribute the gradient of each float operand of the einsum `task` that `wanted`
    names, given the gradient `grad` of its output; an operand read at several positions
    with the same indices gets one contribution for all of them."""
    groups: dict[tuple[int, str], list[int]] = {}
    op: Einsum = task.op  # type: ignore[assignment]
    for k, (producer, term) in enumerate(zip(task.inputs, op.spec.inputs, strict=True)):
        if wanted(producer) and dtypes.is_float(em.tasks[producer].dtype):
            groups.setdefault((producer, term), []).append(k)
    if not groups:
        return
    shared = _TaskGradient(em, task, grad)
    for (producer, _), positions in groups.items():
        shared.contribute(producer, positions)
