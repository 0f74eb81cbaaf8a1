"""TaskGraph pictures: DOT text (pure Python) and SVG/PNG/PDF through Graphviz.

Nodes are shaped and coloured by kind (weight and activation inputs, einsum, fill,
gather, view, slice, concat) and say what a person needs: the spec (and join/agg
when not plain), shape, dtype, size and FLOPs; program outputs get an output node.
Tasks sit in nested clusters by scope (`layers.3.attn`). Large graphs stay readable:
`select=range(...)` or `scope="layers.3"` picks tasks, operands from outside the
selection appear as small grey stubs, and `max_nodes` caps the picture with a note
saying what was left out.

>>> import einpage as ep
>>> prog = ep.Program("tiny")
>>> y = prog.einsum("ij,jk->ik", prog.input("x", (2, 3)), prog.input("w", (3, 4), role="weight"))
>>> prog.output(y, "y")
>>> text = taskgraph_dot(prog.build())
>>> text.startswith('digraph "tiny"') and '"t2" -> "out_0"' in text
True
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from einpage_core.dot import (
    DEFAULT_MAX_NODES,
    GRAPH_ATTRS,
    NODE_ATTRS,
    NOTE_ATTRS,
    REPR_MAX_NODES,
    STUB_ATTRS,
    DotGraph,
    Line,
    NodeStyle,
    describe_ids,
    html_label,
    legend_cluster,
    render_source,
    repr_svg,
    select_ids,
    svg_source,
)
from taskgraph.graph import TaskGraph
from taskgraph.labels import op_lines, task_lines
from taskgraph.nodes import Input, Task

__all__ = [
    "taskgraph_dot",
    "render_taskgraph",
    "taskgraph_svg",
    "taskgraph_repr_svg",
    "TASK_STYLES",
    "NodeStyle",
    "op_lines",
    "task_lines",
    "DEFAULT_MAX_NODES",
    "REPR_MAX_NODES",
]

TASK_STYLES: dict[str, NodeStyle] = {
    "weight": NodeStyle("weight input", "cylinder", "#fdd49e"),
    "activation": NodeStyle("activation input", "invhouse", "#c7e9c0"),
    "state": NodeStyle("state input", "cylinder", "#d9d9d9"),
    "einsum": NodeStyle("einsum", "box", "#c6dbef", "rounded,filled"),
    "fill": NodeStyle("fill (constant)", "note", "#e5e5e5"),
    "gather": NodeStyle("gather", "hexagon", "#dadaeb"),
    "view": NodeStyle("view (no copy)", "box", "#ffffff", "rounded,dashed"),
    "slice": NodeStyle("slice", "invtrapezium", "#fcc5c0"),
    "concat": NodeStyle("concat", "trapezium", "#fcc5c0"),
    "scatter_add": NodeStyle("scatter-add", "hexagon", "#bcbddc"),
    "argreduce": NodeStyle("argmax / argmin (ids)", "octagon", "#bcbddc"),
    "kth_largest": NodeStyle("k-th largest", "doubleoctagon", "#bcbddc"),
    "output": NodeStyle("program output", "box", "#fff2ae", "rounded,filled,bold"),
}
"""Node styles by kind; inputs are split into weights and activations."""


def style_kind(task: Task) -> str:
    """The style key of a task: its op kind, with inputs split into weight/activation."""
    return task.op.role if isinstance(task.op, Input) else task.kind


def _tooltip(task: Task) -> str:
    extra = "  ".join(x for x in (task.scope, repr(task.label) if task.label else "") if x)
    return task.line() + (f"\n{extra}" if extra else "")


def taskgraph_dot(
    tg: TaskGraph,
    *,
    select: Iterable[int] | Callable[[Task], bool] | None = None,
    scope: str | None = None,
    max_nodes: int | None = DEFAULT_MAX_NODES,
    clusters: bool | int = True,
    legend: bool = True,
    rankdir: str = "TB",
) -> str:
    """The DOT text of a TaskGraph (pure Python, deterministic).

    `select`: task ids (e.g. `range(10, 40)`) or a predicate on a Task; `scope`: keep
    tasks in this scope or nested in it. Of those, the first `max_nodes` are drawn
    (None: all) and a note node lists the rest. Operands from outside the selection
    are drawn as grey stubs. `clusters`: box tasks by scope (an int limits the depth,
    e.g. 2 groups `layers.3.attn` under `layers.3`). `legend`: a legend of the node
    kinds drawn. `rankdir`: "TB" (top to bottom) or "LR".
    """
    predicate = (lambda i: select(tg[i])) if callable(select) else None
    chosen = select_ids(
        len(tg), predicate or select, scope, lambda i: tg[i].scope, max_nodes, "task"
    )
    shown = set(chosen.shown)
    graph = DotGraph(
        tg.name,
        graph_attrs={**GRAPH_ATTRS, "rankdir": rankdir, "tooltip": f"TaskGraph {tg.name}"},
        node_attrs={**NODE_ATTRS},
        edge_attrs={"color": "#444444", "arrowsize": 0.7},
        clusters=clusters,
    )
    kinds_drawn: dict[str, None] = {}
    for i in chosen.shown:
        task = tg[i]
        kind = style_kind(task)
        kinds_drawn[kind] = None
        graph.add_node(
            f"t{i}",
            task.scope,
            label=html_label(task_lines(task)),
            tooltip=_tooltip(task),
            **TASK_STYLES[kind].attrs(),
        )
    for i in chosen.shown:
        for j in dict.fromkeys(tg[i].inputs):
            if j not in shown and f"t{j}" not in graph:
                graph.add_node(
                    f"t{j}",
                    label=f"%{j} {tg[j].type_str}",
                    tooltip="outside the selection: " + _tooltip(tg[j]),
                    **STUB_ATTRS,
                )
            dashed = {"style": "dashed"} if tg[i].kind == "view" else {}
            graph.add_edge(f"t{j}", f"t{i}", **dashed)
    for k, (name, task_id) in enumerate(tg.outputs.items()):
        if task_id in shown:
            kinds_drawn["output"] = None
            graph.add_node(
                f"out_{k}",
                tg[task_id].scope,
                label=html_label([Line(f'output "{name}"', "title")]),
                tooltip=f'output "{name}" = %{task_id}',
                **TASK_STYLES["output"].attrs(),
            )
            graph.add_edge(f"t{task_id}", f"out_{k}")
    if chosen.omitted:
        _add_note(graph, tg, chosen.shown, chosen.omitted, max_nodes)
    if legend and kinds_drawn:
        samples = [(s.legend, s.attrs()) for k, s in TASK_STYLES.items() if k in kinds_drawn]
        graph.add_raw(legend_cluster(samples, []))
    return graph.source()


def _add_note(
    graph: DotGraph,
    tg: TaskGraph,
    shown: tuple[int, ...],
    omitted: tuple[int, ...],
    max_nodes: int | None,
) -> None:
    text = (
        f"{len(omitted)} more task(s) not shown: {describe_ids(omitted, '%')}\n"
        f"(max_nodes={max_nodes}; pass select=range(...), scope=... or a larger max_nodes)"
    )
    graph.add_node("omitted", label=text, tooltip=text, **NOTE_ATTRS)
    left_out = set(omitted)
    for i in shown:
        if any(c in left_out for c in tg.consumers[i]):
            graph.add_edge(f"t{i}", "omitted", style="dotted", color="#b8860b")


def render_taskgraph(tg: TaskGraph, path: str | os.PathLike[str], **options: object) -> Path:
    """Draw `tg` to `path`; the suffix picks the format (svg, png, pdf, or dot/gv for the
    DOT text). Options are those of `taskgraph_dot`. Without Graphviz's `dot` program,
    raises `GraphvizNotFoundError` after writing the `.dot` source beside `path`."""
    return render_source(taskgraph_dot(tg, **options), path)


def taskgraph_svg(tg: TaskGraph, **options: object) -> str:
    """`tg` as SVG text (needs `dot`); capped at `REPR_MAX_NODES` tasks unless told."""
    options.setdefault("max_nodes", REPR_MAX_NODES)
    return svg_source(taskgraph_dot(tg, **options))


def taskgraph_repr_svg(tg: TaskGraph) -> str | None:
    """What a notebook shows: SVG capped at `REPR_MAX_NODES` tasks, or None (then the
    text repr) with a warning when Graphviz is missing or too slow."""
    return repr_svg(lambda: taskgraph_dot(tg, max_nodes=REPR_MAX_NODES))
