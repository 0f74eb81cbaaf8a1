"""Reverse-mode differentiation of TaskGraphs: `taskgraph.grad(tg, loss, wrt)`.

The gradient program is another TaskGraph: the forward tasks, then gradient tasks
built by reverse accumulation (`reverse`), each an op of the same closed set – einsums
whose joins are symbolic derivatives of the forward joins (`derivatives`,
`einsum_rule`), and views, slices, concats, gathers and scatter-adds for the
structural ops (`rules`). It plans, partitions, serializes and runs like any program.

* `grad(tg, loss, wrt, prefix="grad.")`: the gradient program, with output
  `"grad.<name>"` per `wrt` input;
* `backward(builder, loss, wrt, on_gradient)`: the same pass appended to a
  `GraphBuilder` (what `einpage.Program.backward` uses), with a callback when each
  gradient is final;
* `diff(expr, operand)`: the derivative of a join expression.
"""

from taskgraph.autodiff.derivatives import diff
from taskgraph.autodiff.reverse import GRAD_PREFIX, backward, grad
from taskgraph.autodiff.rules import VJP_RULES

__all__ = ["grad", "backward", "diff", "GRAD_PREFIX", "VJP_RULES"]
