"""How a task reads in a picture: the lines of its node label.

`taskgraph.render` labels each task with `task_lines`; `memgraph.render` labels an
apply with its task's `op_lines`, so an einsum reads the same in both pictures.
"""

from __future__ import annotations

from einpage_core.dot import Line, clip
from einpage_core.units import format_bytes, format_count
from taskgraph.nodes import Concat, Einsum, Fill, Input, Slice, Task

__all__ = ["op_lines", "task_lines"]


def op_lines(task: Task) -> list[Line]:
    """The attributes of a task's op, one per line (the spec, join and agg of an einsum)."""
    op = task.op
    if isinstance(op, Einsum):
        lines = [Line(clip(str(op.spec)), "mono")]
        if op.join is not None:
            lines.append(Line(clip(f"join: {op.join}"), "mono"))
        if op.agg != "sum" and op.spec.reduced:
            lines.append(Line(f"agg: {op.agg}", "mono"))
        return lines
    if isinstance(op, Input):
        return [Line(f"{op.role}, starts on {op.location}", "note")]
    if isinstance(op, Fill):
        origin = f" at {list(op.origin)}" if any(op.origin) else ""
        return [Line(f"{op.pattern} {op.value:g}{origin}", "mono")]
    if isinstance(op, Slice):
        return [Line(clip(f"starts {list(op.starts)}"), "mono")]
    if isinstance(op, Concat):
        return [Line(f"axis {op.axis}", "mono")]
    return []


def task_lines(task: Task) -> list[Line]:
    """The label of a task: id and kind, its op's attributes, its facts, type and size,
    FLOPs."""
    title = (
        f'%{task.id} input "{task.op.name}"'
        if isinstance(task.op, Input)
        else (f"%{task.id} {task.kind}")
    )
    if task.label:
        title += f" · {clip(task.label, 24)}"
    lines = [Line(title, "title"), *op_lines(task)]
    lines.extend(Line(clip(fact.describe()), "note") for fact in task.facts)
    lines.append(Line(f"{task.type_str}  {format_bytes(task.nbytes)}"))
    if task.flops and task.kind not in ("input", "view"):
        lines.append(Line(format_count(task.flops, "FLOP"), "note"))
    return lines
