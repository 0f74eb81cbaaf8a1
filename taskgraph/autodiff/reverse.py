"""Reverse accumulation over a TaskGraph: `grad(tg, loss, wrt)` and `backward(builder, ...)`.

The backward pass walks the forward tasks from the last to the first. A task is
*active* when it is a float tensor on a path from one of the `wrt` tensors to the loss;
only active tasks get gradients. When the walk reaches an active task, every task that
reads it has been visited, so its gradient – the sum of what its readers contributed,
added up as the contributions arrive (one running sum alive, not all of them) – is
complete: the task's gradient rule (`taskgraph.autodiff.rules.VJP_RULES`) then adds the
gradients of its operands – or, for the last task of a softmax or a log-sum-exp, the
rule of the whole group (`taskgraph.autodiff.patterns`), whose other tasks then pass
nothing on. The loss's gradient is a fill of ones.

Order is memory: gradient tasks are appended in the order of the walk, so an
activation's last reader in the backward pass comes soon after its gradient, and the
gradient of a `wrt` tensor is final as soon as the walk has visited every active task
that reads it (the first of them in program order), often long before the walk
reaches the tensor itself (weights declared up front). `on_gradient(tensor, gradient)`
is called right then – a training step appends its
optimizer update there, so each weight's gradient is consumed and freed at once
instead of all gradients living until the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from einpage_core.errors import GraphError
from taskgraph import dtypes
from taskgraph.autodiff.emitter import Emitter
from taskgraph.autodiff.patterns import find_groups
from taskgraph.autodiff.rules import VJP_RULES
from taskgraph.builder import GraphBuilder
from taskgraph.facts import Gradient
from taskgraph.graph import TaskGraph
from taskgraph.nodes import with_blocks

__all__ = ["grad", "backward", "GRAD_PREFIX"]

GRAD_PREFIX = "grad."
"""`grad` names the gradient of input `w` the output `"grad.w"`."""

OnGradient = Callable[[int, int], None]


def _active(builder: GraphBuilder, loss: int, wrt: Sequence[int]) -> set[int]:
    """Float tasks on a path from a `wrt` task to `loss`."""
    tasks = builder.tasks
    reached = set(wrt)
    for task in tasks[min(wrt, default=len(tasks)) : loss + 1]:
        if dtypes.is_float(task.dtype) and any(i in reached for i in task.inputs):
            reached.add(task.id)
    needed = {loss}
    for task in reversed(tasks[: loss + 1]):
        if task.id in needed:
            needed.update(task.inputs)
    return {t for t in reached & needed if dtypes.is_float(tasks[t].dtype)}


def _check(builder: GraphBuilder, loss: int, wrt: Sequence[int]) -> None:
    tasks = builder.tasks
    for what, ids in (("loss", [loss]), ("wrt", list(wrt))):
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tasks):
                raise GraphError(f"backward: {what} %{i} is not a task of the graph")
    task = tasks[loss]
    if not dtypes.is_float(task.dtype) or math.prod(task.shape) != 1:
        raise GraphError(
            f"backward: the loss must be a float tensor of one element, got {task.line()}"
        )
    for i in wrt:
        if not dtypes.is_float(tasks[i].dtype):
            raise GraphError(f"backward: cannot differentiate with respect to {tasks[i].line()}")


def backward(
    builder: GraphBuilder,
    loss: int,
    wrt: Sequence[int],
    on_gradient: OnGradient | None = None,
) -> dict[int, int]:
    """Append to `builder` the gradient of task `loss` (a float of one element) with
    respect to each task of `wrt`; returns {wrt task: its gradient task}, which carries
    the fact `Gradient(of=wrt task)` (`taskgraph.facts`).

    `on_gradient(task, gradient)` is called as soon as a gradient is final (see the
    module docstring) and may append tasks to `builder`. A `wrt` task the loss does not
    depend on gets a gradient of zeros.
    """
    wrt = list(dict.fromkeys(wrt))
    _check(builder, loss, wrt)
    em = Emitter(builder)
    forward = len(builder.tasks)
    active = _active(builder, loss, wrt)
    sums = em.sums
    if loss in active:
        source = builder.tasks[loss]
        sums[loss] = em.fill(source.shape, 1.0, source.dtype, source)
    result: dict[int, int] = {}
    # Active readers each wanted tensor still waits for; at zero its gradient is final.
    waiting = dict.fromkeys(wrt, 0)
    for t in active:
        for i in set(builder.tasks[t].inputs):
            if i in waiting:
                waiting[i] += 1

    def finish(w: int) -> None:
        task = builder.tasks[w]
        g = sums.get(w)
        if g is None:
            g = sums[w] = em.fill(task.shape, 0.0, task.dtype, task)
        result[w] = g
        builder.add_facts(g, [Gradient(w)])
        if on_gradient is not None:
            on_gradient(w, g)

    for w in wrt:
        if not waiting[w]:
            finish(w)
    groups = find_groups(builder.tasks[:forward], active, set(wrt))
    for t in reversed(range(forward)):
        if t not in active:
            continue
        task = builder.tasks[t]
        g = sums.pop(t, None)
        if g is not None and t in groups:
            groups[t].apply(em, g)
        elif g is not None and task.inputs:
            VJP_RULES.of(task.op)(em, task, g, active.__contains__)
        for i in dict.fromkeys(task.inputs):
            if i in waiting:
                waiting[i] -= 1
                if not waiting[i]:
                    finish(i)
    return result


def grad(
    tg: TaskGraph,
    loss: str | int,
    wrt: Sequence[str | int],
    *,
    prefix: str = GRAD_PREFIX,
) -> TaskGraph:
    """The gradient program of `tg`: its tasks and outputs, then the backward pass, with
    the gradient of the loss with respect to each `wrt` tensor as the output
    `prefix + name` (`"grad.w"` for the input `w`; `"grad.%7"` for task 7): a name for
    people; the tensor says what it is by its fact `Gradient(of=...)`.

    `loss` is an output name or a task id: a float tensor of one element. `wrt` are
    input names or task ids of float tensors.

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (3,))
    >>> prog.output(ep.reduce_sum(x * x), "loss")
    >>> g = grad(prog.build(), "loss", ["x"])
    >>> import numpy as np, taskgraph
    >>> taskgraph.evaluate(g, {"x": np.array([1, 2, 3], "float32")})["grad.x"]
    array([2., 4., 6.], dtype=float32)
    """
    wrt = list(dict.fromkeys(wrt))
    loss_id = _task_of(tg, loss, "loss", outputs=True)
    ids = [_task_of(tg, w, "wrt", outputs=False) for w in wrt]
    builder = GraphBuilder(tg.name)
    for task in tg.tasks:
        builder.add(
            task.op, task.inputs, task.shape, task.dtype, task.scope, task.label, task.facts
        )
    for name, task_id in tg.outputs.items():
        builder.output(task_id, name)
    gradients = backward(builder, loss_id, ids)
    for w, task_id in zip(wrt, ids, strict=True):
        name = w if isinstance(w, str) else f"%{w}"
        builder.output(gradients[task_id], prefix + name)
    built = builder.build()
    blocks = [t.block for t in tg.tasks] + [None] * (len(built.tasks) - len(tg.tasks))
    return TaskGraph(with_blocks(built.tasks, blocks), built.outputs, built.name)


def _task_of(tg: TaskGraph, name: str | int, what: str, outputs: bool) -> int:
    """The task id of an output (`outputs`) or input name, or a task id as given."""
    if isinstance(name, str):
        names = tg.outputs if outputs else tg.inputs
        if name not in names:
            kind = "output" if outputs else "input"
            known = ", ".join(map(repr, names)) or "none"
            raise GraphError(f"grad: {what} {name!r} is not an {kind} of the graph ({known})")
        return names[name]
    if isinstance(name, bool) or not isinstance(name, int) or not 0 <= name < len(tg):
        raise GraphError(f"grad: {what} must be a name or a task id, got {name!r}")
    return name
