"""`GraphBuilder`: appends validated tasks and produces a `TaskGraph`.

Every way of making a TaskGraph goes through it – the `Program` frontend, JSON
loading and graph passes – so the same checks guard them all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from einpage_core.errors import GraphError
from taskgraph import dtypes
from taskgraph.facts import Fact, checked_facts
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input, Op, Operand, Shape, Task

__all__ = ["GraphBuilder", "check_workspace", "fresh_name"]


def fresh_name(name: str, taken: set[str]) -> str:
    """`name`, or `name#1`, `name#2`, ...: the first not in `taken` (then added to it) –
    how a pass that adds inputs or outputs to a graph keeps their names unique.

    >>> taken = {"y"}
    >>> fresh_name("y", taken), fresh_name("y", taken), sorted(taken)
    ('y#1', 'y#2', ['y', 'y#1', 'y#2'])
    """
    candidate, k = name, 0
    while candidate in taken:
        k += 1
        candidate = f"{name}#{k}"
    taken.add(candidate)
    return candidate


def check_workspace(workspace: object, task_id: int, op: Op) -> None:
    """`GraphError` unless `workspace` is a number of bytes (an int >= 0) that task
    `task_id` of `op` may have: only a task the device computes has a kernel."""
    if isinstance(workspace, bool) or not isinstance(workspace, int) or workspace < 0:
        raise GraphError(
            f"task %{task_id} ({op.kind}): a workspace is a number of bytes >= 0, got {workspace!r}"
        )
    if workspace and not op.is_compute:
        raise GraphError(
            f"task %{task_id} ({op.kind}) is not computed by the device, so it has no kernel "
            f"and no workspace (got {workspace} bytes)"
        )


class GraphBuilder:
    """Appends tasks in topological order, checking each against its operands.

    >>> from taskgraph.nodes import Input, View
    >>> b = GraphBuilder("demo")
    >>> x = b.add(Input("x"), (), shape=(2, 3), dtype="float32")
    >>> y = b.add(View(), (x,), shape=(6,))
    >>> b.output(y, "y")
    >>> print(b.build().tasks[1].line())
    %1 : f32[6] = view(%0)
    """

    def __init__(self, name: str = "program"):
        self.name = name
        self.tasks: list[Task] = []
        self.outputs: dict[str, int] = {}
        self.input_names: set[str] = set()
        self._is_input: list[bool] = []

    def add(
        self,
        op: Op,
        inputs: Sequence[int],
        shape: Shape | None = None,
        dtype: str | None = None,
        scope: str = "",
        label: str = "",
        facts: Iterable[Fact] = (),
        workspace: int = 0,
    ) -> int:
        """Append `op` applied to the tasks `inputs`; returns the new task's id.

        `shape`/`dtype` are required for ops that cannot infer them (input, fill,
        view, slice) and, when given for the others, must match what is inferred.
        `facts` (`taskgraph.facts`) say what the tensor is; a fact may name only earlier
        tasks. `workspace` is the bytes of device memory its kernel needs besides its
        operands and output (`Task.workspace`; only a compute task can have one).
        """
        task_id = len(self.tasks)
        for i in inputs:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < task_id:
                raise GraphError(
                    f"task %{task_id} ({op.kind}) reads %{i}, which is not an earlier task"
                )
        if isinstance(op, Input):
            if op.name in self.input_names:
                raise GraphError(f"duplicate input name {op.name!r}")
            self.input_names.add(op.name)
        operands = [Operand(self.tasks[i].shape, self.tasks[i].dtype) for i in inputs]
        requested_dtype = None if dtype is None else dtypes.canonical(dtype)
        out_shape, out_dtype = op.infer(operands, shape, requested_dtype)
        if shape is not None and tuple(shape) != out_shape:
            raise GraphError(
                f"task %{task_id} ({op.describe()}): shape {tuple(shape)} does not match the "
                f"inferred {out_shape}"
            )
        if requested_dtype is not None and requested_dtype != out_dtype:
            raise GraphError(
                f"task %{task_id} ({op.describe()}): dtype {requested_dtype} does not match the "
                f"inferred {out_dtype}"
            )
        flops = op.flops(operands, out_shape)
        stated = checked_facts(facts, task_id, self._is_input, len(out_shape)) if facts else ()
        check_workspace(workspace, task_id, op)
        task = Task(
            task_id,
            op,
            tuple(inputs),
            out_shape,
            out_dtype,
            flops,
            scope,
            label,
            None,
            stated,
            workspace,
        )
        self.tasks.append(task)
        self._is_input.append(isinstance(op, Input))
        return task_id

    def add_facts(self, task_id: int, facts: Iterable[Fact]) -> None:
        """State more `facts` about the tensor of task `task_id` (an earlier task, whose
        record is replaced by one with them: tasks are immutable)."""
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            raise GraphError(f"facts must be stated about a task id, got {task_id!r}")
        if not 0 <= task_id < len(self.tasks):
            raise GraphError(f"facts stated about %{task_id}, which does not exist")
        task = self.tasks[task_id]
        stated = checked_facts((*task.facts, *facts), task_id, self._is_input, len(task.shape))
        if stated != task.facts:
            self.tasks[task_id] = replace(task, facts=stated)

    def output(self, task_id: int, name: str) -> None:
        """Mark task `task_id` as the program output `name`."""
        if not isinstance(name, str) or not name:
            raise GraphError(f"output name must be a non-empty string, got {name!r}")
        if name in self.outputs:
            raise GraphError(f"duplicate output name {name!r}")
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            raise GraphError(f"output {name!r} must name a task id, got {task_id!r}")
        if not 0 <= task_id < len(self.tasks):
            raise GraphError(f"output {name!r} names %{task_id}, which does not exist")
        self.outputs[name] = task_id

    def build(self) -> TaskGraph:
        """The graph built so far (the builder stays usable)."""
        return TaskGraph(tuple(self.tasks), dict(self.outputs), self.name)
