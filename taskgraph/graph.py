"""The TaskGraph: a DAG of tasks in topological order, plus named outputs.

A TaskGraph is immutable: passes build a new one (with `GraphBuilder`). It prints
itself one task per line, serializes to JSON (`taskgraph.serialize`), and is the
input of the planner and of the reference evaluator.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from einpage_core.errors import GraphError, InputError
from einpage_core.units import format_bytes, format_count
from taskgraph import dtypes
from taskgraph.nodes import Input, Task, is_input_slice

__all__ = ["TaskGraph"]


@dataclass(frozen=True, eq=False)
class TaskGraph:
    """Tasks (id == position, inputs before users) and the output names mapped to task ids.

    Build one with `Program.build()` or `GraphBuilder`; the constructor trusts its
    arguments (the builder validates).
    """

    tasks: tuple[Task, ...]
    outputs: Mapping[str, int]
    name: str = "program"

    def __post_init__(self) -> None:
        object.__setattr__(self, "outputs", MappingProxyType(dict(self.outputs)))

    # -- container ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def __getitem__(self, task_id: int) -> Task:
        return self.tasks[task_id]

    # -- queries -----------------------------------------------------------------

    @cached_property
    def inputs(self) -> Mapping[str, int]:
        """Input names mapped to their task ids, in program order."""
        return MappingProxyType({t.op.name: t.id for t in self.tasks if isinstance(t.op, Input)})

    @cached_property
    def consumers(self) -> tuple[tuple[int, ...], ...]:
        """For each task, the ids of the tasks that read it (in order, without repeats)."""
        users: list[list[int]] = [[] for _ in self.tasks]
        for task in self.tasks:
            for i in dict.fromkeys(task.inputs):
                users[i].append(task.id)
        return tuple(tuple(u) for u in users)

    @cached_property
    def output_ids(self) -> frozenset[int]:
        """Ids of tasks that are program outputs."""
        return frozenset(self.outputs.values())

    def storage_root(self, task_id: int) -> int:
        """The task whose bytes `task_id` occupies: itself, or for a view its base (recursively)."""
        task = self.tasks[task_id]
        while task.op.aliases_input:
            task = self.tasks[task.inputs[0]]
        return task.id

    def is_input_slice(self, task_id: int) -> bool:
        """Whether task `task_id` is a Slice reading an Input directly (see
        `taskgraph.nodes.is_input_slice`)."""
        task = self.tasks[task_id]
        source = self.tasks[task.inputs[0]].op if task.inputs else None
        return is_input_slice(task.op, source)

    def with_workspaces(self, sizes: Mapping[int, int]) -> TaskGraph:
        """This graph with the workspaces `sizes` (task id -> bytes, `Task.workspace`) on
        those tasks, the others unchanged; the graph itself when nothing changes (so a pass
        that declares workspaces twice makes one graph). Checked as `GraphBuilder` checks
        them: bytes >= 0, on tasks the device computes."""
        from taskgraph.builder import check_workspace  # the builder imports this module

        tasks = list(self.tasks)
        for task_id, nbytes in sizes.items():
            if isinstance(task_id, bool) or not isinstance(task_id, int):
                raise GraphError(f"workspaces are given by task id, got {task_id!r}")
            if not 0 <= task_id < len(tasks):
                raise GraphError(f"a workspace for %{task_id}, which is not a task of the graph")
            task = tasks[task_id]
            check_workspace(nbytes, task_id, task.op)
            if task.workspace != nbytes:
                tasks[task_id] = replace(task, workspace=nbytes)
        if all(new is old for new, old in zip(tasks, self.tasks, strict=True)):
            return self
        return TaskGraph(tuple(tasks), self.outputs, self.name)

    @property
    def workspace_bytes(self) -> int:
        """The largest workspace of any task (0: no kernel needs one)."""
        return max((t.workspace for t in self.tasks), default=0)

    @property
    def total_flops(self) -> int:
        return sum(t.flops for t in self.tasks)

    def bytes_by_dtype(self) -> dict[str, int]:
        """The bytes of the graph's tensors per dtype, most first."""
        by_dtype: dict[str, int] = {}
        for task in self.tasks:
            by_dtype[task.dtype] = by_dtype.get(task.dtype, 0) + task.nbytes
        return dict(sorted(by_dtype.items(), key=lambda item: -item[1]))

    def main_dtype(self) -> str:
        """The dtype holding most of the graph's bytes (what its figures are in)."""
        return next(iter(self.bytes_by_dtype()), "no tensors")

    @property
    def input_bytes(self) -> int:
        """Bytes of all inputs (weights and activations)."""
        return sum(self.tasks[i].nbytes for i in self.inputs.values())

    def conform_inputs(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        """`arrays` checked as `check_inputs` checks them, except that an array of another
        dtype of the same kind is converted to the one the program declares: floats to
        the input's float type (rounded to nearest, as `astype`), integers to its integer
        type. What runs is what the program says, so a float32 RoPE table feeds a float16
        program as it would after `astype("float16")`. Refused with `InputError`: another
        kind (floats for integer ids, or the reverse), and values the declared type cannot
        hold (a finite float that overflows to infinity, an integer out of range) – the
        message names the input, how many values and the first one.
        """
        if not isinstance(arrays, Mapping):
            raise InputError(
                f"inputs must be a mapping of name to array, got {type(arrays).__name__}"
            )
        converted = dict(arrays)
        for name, task_id in self.inputs.items():
            value = arrays.get(name)
            given = getattr(value, "dtype", None)
            if given is None or np.dtype(given).name == self.tasks[task_id].dtype:
                continue
            if getattr(value, "shape", None) != self.tasks[task_id].shape:
                continue  # check_inputs names the shape
            converted[name] = _converted(name, np.asarray(value), self.tasks[task_id].dtype)
        self.check_inputs(converted)
        return converted

    def check_inputs(self, arrays: Mapping[str, Any]) -> None:
        """Raise `InputError` unless `arrays` has exactly this graph's inputs with their shapes
        and dtypes (the message names the first offending input)."""
        if not isinstance(arrays, Mapping):
            raise InputError(
                f"inputs must be a mapping of name to array, got {type(arrays).__name__}"
            )
        missing = [name for name in self.inputs if name not in arrays]
        extra = [name for name in arrays if name not in self.inputs]
        if missing:
            raise InputError(f"missing input(s): {', '.join(map(repr, missing))}")
        if extra:
            known = ", ".join(map(repr, self.inputs))
            raise InputError(f"unknown input(s) {', '.join(map(repr, extra))}; inputs are {known}")
        for name, task_id in self.inputs.items():
            task = self.tasks[task_id]
            value = arrays[name]
            shape, dtype = tuple(getattr(value, "shape", ())), getattr(value, "dtype", None)
            if shape != task.shape:
                raise InputError(f"input {name!r}: expected shape {task.shape}, got {shape}")
            if dtype is None or np.dtype(dtype).name != task.dtype:
                raise InputError(f"input {name!r}: expected dtype {task.dtype}, got {dtype}")

    # -- printing ----------------------------------------------------------------

    def __repr__(self) -> str:
        return (
            f"<TaskGraph {self.name!r} tasks={len(self.tasks)} inputs={len(self.inputs)} "
            f"outputs={len(self.outputs)} flops={format_count(self.total_flops, 'FLOP')} "
            f"inputs_size={format_bytes(self.input_bytes)}>"
        )

    def lines(self) -> list[str]:
        """The listing: one line per task (with size, FLOPs and scope), then the outputs."""
        width = max((len(t.line()) for t in self.tasks), default=0)
        out = []
        for task in self.tasks:
            notes = [format_bytes(task.nbytes)]
            if task.flops and task.is_compute:
                notes.append(format_count(task.flops, "FLOP"))
            if task.scope:
                notes.append(task.scope)
            if task.label:
                notes.append(repr(task.label))
            out.append(f"  {task.line():<{width}}  # {'  '.join(notes)}")
        out.extend(f'  output "{name}" = %{task_id}' for name, task_id in self.outputs.items())
        return out

    def __str__(self) -> str:
        header = (
            f"TaskGraph {self.name!r}: {len(self.tasks)} tasks, "
            f"{format_count(self.total_flops, 'FLOP')}, inputs {format_bytes(self.input_bytes)}"
        )
        return "\n".join([header, *self.lines()])

    # -- pictures (taskgraph.render) ----------------------------------------------

    def to_dot(self, **options: Any) -> str:
        """The graph as DOT text; options as `taskgraph.render.taskgraph_dot`."""
        from taskgraph.render import taskgraph_dot

        return taskgraph_dot(self, **options)

    def render(self, path: str | os.PathLike[str], **options: Any) -> Path:
        """Draw the graph to `path` (svg, png, pdf or dot by suffix); see `taskgraph.render`."""
        from taskgraph.render import render_taskgraph

        return render_taskgraph(self, path, **options)

    def _repr_svg_(self) -> str | None:
        from taskgraph.render import taskgraph_repr_svg

        return taskgraph_repr_svg(self)

    # -- serialization -----------------------------------------------------------

    def to_json(self, indent: int | None = None) -> str:
        """The graph as JSON (schema in `taskgraph.serialize`)."""
        from taskgraph.serialize import taskgraph_to_json

        return taskgraph_to_json(self, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> TaskGraph:
        """Load and validate a graph written by `to_json`; raises `SerializationError`."""
        from taskgraph.serialize import taskgraph_from_json

        return taskgraph_from_json(text)


def _converted(name: str, value: np.ndarray, dtype: str) -> np.ndarray:
    """`value` as `dtype` when both are floats or both integers (see
    `TaskGraph.conform_inputs`); the array unchanged otherwise (check_inputs refuses it)."""
    is_float = dtypes.is_float_array(value.dtype)
    is_int = np.issubdtype(value.dtype, np.integer)
    if dtypes.is_float(dtype) != is_float or not (is_float or is_int):
        return value
    target = dtypes.numpy_dtype(dtype)
    if is_float:
        with np.errstate(over="ignore"):
            result = value.astype(target)
        lost = np.isfinite(value) & ~np.isfinite(result)
    else:
        limits = np.iinfo(target)
        lost = (value < limits.min) | (value > limits.max)
        result = value.astype(target)
    if lost.any():
        where = tuple(int(i) for i in np.argwhere(lost)[0])
        raise InputError(
            f"input {name!r}: {int(lost.sum())} value(s) of the {value.dtype} array do not fit "
            f"the program's {dtype} (e.g. {value[where]!r} at {list(where)}); scale them, or "
            f"build the program in a wider dtype"
        )
    return result
