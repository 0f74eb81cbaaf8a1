"""Pictures of memory plans (matplotlib): the memory map, live bytes, and stream timelines.

* `memory_map(mg)`: arena offset against plan step, one rectangle per residency of a
  tensor (alloc to free), coloured by kind (weight, activation, output; the legend
  says what each colour is), kernels' workspaces hatched over their applies, with
  offloads, reloads and drops marked, the budget drawn and the largest residencies
  numbered and named beside the legend. It shows fragmentation and eviction at a
  glance. A device's plan of several (`memgraph.multi`) has its direct
  copies marked too: each `recv` (the residency it fills) and each `send` (the residency
  it reads), and its title says the bytes sent and received. Residencies, drops and live
  bytes come from the one residency analysis (`memgraph.residency`, `MemGraph.residencies`).
* `live_bytes_timeline(mg, compare=...)`: device bytes allocated against step, with
  other plans (e.g. a no-offload baseline) or curves beside it, and the budget.
* `stream_timeline(events)`: compute / H2D / D2H lanes (and the "peer" lane of direct
  copies between devices, `memgraph.trace.PEER_STREAM`, and the disk lanes of a plan
  with a host tier, `memgraph.trace.DISK_STREAMS`) from `StreamEvent`s, which a
  simulator can make directly and a runtime can write and read as a Chrome trace
  (`to_chrome_trace`, `read_chrome_trace`).

The step axis (`x=`) is the node index ("node"), the number of applies done
("apply"), or simulated/measured time (`times=`, node id -> time in seconds, or
(start, end)). Each plotting function returns the matplotlib `Figure` (made without
pyplot, so notebooks show it once and scripts leak nothing) and saves it when given
`path` (png, svg or pdf by suffix). matplotlib is imported on first use.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from einpage_core.errors import RenderError
from einpage_core.optional import require
from einpage_core.units import format_bytes
from memgraph.graph import MemGraph
from memgraph.nodes import NodeKind
from memgraph.residency import Residency, Workspace, residencies
from memgraph.trace import (
    DISK_STREAMS,
    PEER_STREAM,
    StreamEvent,
    lane_name,
    ordered_lanes,
    read_chrome_trace,
    to_chrome_trace,
)
from memgraph.trace import busy as timeline_busy

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "Residency",
    "residencies",
    "step_positions",
    "live_bytes",
    "memory_map",
    "live_bytes_timeline",
    "StreamEvent",
    "read_chrome_trace",
    "to_chrome_trace",
    "stream_timeline",
    "TENSOR_KINDS",
    "KIND_MEANINGS",
    "WORKSPACE_COLOR",
    "WORKSPACE_MEANING",
    "SHADES_NOTE",
    "LABELS",
    "residency_label",
    "PLOT_FORMATS",
]

PLOT_FORMATS = ("png", "svg", "pdf")
"""Formats a plot can be saved in, by file suffix."""

TENSOR_KINDS: dict[str, tuple[str, ...]] = {
    "weight": ("#f28e2b", "#f5a65b", "#e07b14"),
    "activation": ("#4e79a7", "#7196c0", "#3b6590"),
    "output": ("#59a14f", "#7dbb73", "#468a3d"),
    "kv": ("#b07aa1", "#c699bb", "#95648a"),
}
"""Residency colours by tensor kind: the legend colour, then shades for neighbours."""

KIND_MEANINGS: dict[str, str] = {
    "weight": "weight: an input that starts on the host",
    "activation": "activation: computed on the device",
    "output": "output: a program output",
    "kv": "kv: a page of the KV cache",
}
"""What each colour of the memory map stands for (its legend entries)."""

WORKSPACE_COLOR = "#bab0ac"
WORKSPACE_MEANING = "workspace: a kernel's, held during its apply"
"""How the memory map draws kernels' workspaces (`MemNode.workspace`), and its legend."""

SHADES_NOTE = "shades of a colour only tell neighbours apart"
"""The legend's title: the shades within one kind carry no meaning."""

LABELS = 8
"""The residencies `memory_map` names by default: the largest, by bytes × steps."""

_MARKERS: dict[str, dict[str, Any]] = {
    "offload": {"marker": "v", "color": "#d62728", "label": "offload (device to host)"},
    "reload": {"marker": "^", "color": "#17becf", "label": "reload (host to device)"},
    "drop": {"marker": "x", "color": "#7f7f7f", "label": "drop (host copy kept)"},
    "send": {"marker": ">", "color": "#ff7f0e", "label": "send (to another device)"},
    "recv": {"marker": "<", "color": "#2ca02c", "label": "recv (from another device)"},
}
_STREAM_COLORS = {
    "compute": "#4e79a7",
    "h2d": "#59a14f",
    "d2h": "#e15759",
    PEER_STREAM: "#f28e2b",
    DISK_STREAMS[0]: "#b07aa1",
    DISK_STREAMS[1]: "#9c755f",
}


# -- what a plan holds, step by step --------------------------------------------------


def step_positions(
    mg: MemGraph,
    x: str = "node",
    times: Mapping[int, float | tuple[float, float]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of every node on the step axis.

    `x="node"`: node i spans [i, i + 1). `x="apply"`: a node starts at the number of
    applies before it and an apply lasts 1, so allocs and frees between two applies
    share a position. `times`: node id -> time, or -> (start, end), e.g. from the
    simulator; nodes missing from it take the end of the node before them.
    """
    n = len(mg.nodes)
    if times is not None:
        start, end = np.zeros(n), np.zeros(n)
        last = 0.0
        for i in range(n):
            value = times.get(i)
            if value is None:
                s = e = last
            elif isinstance(value, tuple | list):
                s, e = float(value[0]), float(value[1])
            else:
                s = e = float(value)
            start[i], end[i] = s, e
            last = max(last, e)
        return start, end
    if x == "node":
        start = np.arange(n, dtype=float)
        return start, start + 1
    if x == "apply":
        is_apply = np.fromiter((nd.kind is NodeKind.APPLY for nd in mg.nodes), bool, n)
        done = np.cumsum(is_apply) - is_apply
        return done.astype(float), (done + is_apply).astype(float)
    raise RenderError(f"x must be 'node' or 'apply' (or pass times=...), got {x!r}")


def live_bytes(
    mg: MemGraph,
    x: str = "node",
    times: Mapping[int, float | tuple[float, float]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The device bytes allocated, as a step curve (xs, ys) for `drawstyle="steps-post"`.

    An alloc counts from its node's start, a free releases at its node's end; the
    events at one position (e.g. the frees and allocs between two applies) are
    folded into the level they end at, or a higher one an alloc reached on the way,
    so `ys.max()` is the plan's peak.
    """
    start, end = step_positions(mg, x, times)
    if not len(start):
        return np.zeros(1), np.zeros(1)
    at: list[float] = []
    order: list[int] = []
    delta: list[int] = []
    for stay in mg.residencies.stays:
        at.append(start[stay.alloc])
        delta.append(stay.region.size)
        order.append(stay.alloc)
        if stay.free is not None:
            at.append(end[stay.free])
            delta.append(-stay.region.size)
            order.append(stay.free)
    for workspace in mg.residencies.workspaces:  # held from its apply's start to its end
        at.extend((start[workspace.apply], end[workspace.apply]))
        delta.extend((workspace.region.size, -workspace.region.size))
        order.extend((workspace.apply, workspace.apply))
    first, last = float(start[0]), float(end.max())
    if not at:
        return np.array([first, last]), np.zeros(2)
    sort = np.lexsort((np.array(order), np.array(at)))
    positions = np.array(at, dtype=float)[sort]
    steps = np.array(delta, dtype=np.int64)[sort]
    levels = np.cumsum(steps).astype(float)
    xs, index = np.unique(positions, return_index=True)
    # A position's value: the level its events end at, or a higher one an alloc reached
    # on the way (a free never makes a new high).
    after_alloc = np.where(steps > 0, levels, -np.inf)
    final = levels[np.append(index[1:], len(levels)) - 1]
    ys = np.maximum(np.maximum.reduceat(after_alloc, index), final)
    if xs[0] > first:
        xs, ys = np.concatenate([[first], xs]), np.concatenate([[0.0], ys])
    return np.concatenate([xs, [max(last, xs[-1])]]), np.concatenate([ys, [levels[-1]]])


# -- shared plotting helpers ----------------------------------------------------------


def _byte_unit(n: float) -> tuple[float, str]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= 2 * scale:
            return float(scale), unit
    return 1.0, "B"


def _time_unit(seconds: float) -> tuple[float, str]:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= 2 * scale:
            return scale, unit
    return 1e-9, "ns"


def _figure(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    Figure = require("matplotlib.figure", extra="viz").Figure

    fig = Figure(figsize=figsize, dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def _save(fig: Figure, path: str | os.PathLike[str] | None) -> None:
    if path is None:
        return
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise RenderError(
            f"cannot save a plot to {str(path)!r}: unknown format {suffix!r}; "
            f"use a suffix among {', '.join('.' + f for f in PLOT_FORMATS)}"
        )
    fig.savefig(path, format=suffix)


def _x_axis(mg: MemGraph, x: str, times: Any) -> tuple[str, float]:
    """The x-axis label and the factor that scales positions to its unit."""
    if times is not None:
        _, end = step_positions(mg, x, times)
        scale, unit = _time_unit(float(end.max()) if len(end) else 0.0)
        return f"time ({unit})", scale
    return ("plan step (node index)" if x == "node" else "plan step (applies done)"), 1.0


def _stats_line(mg: MemGraph) -> str:
    s = mg.stats
    pct = 100.0 * s.peak_bytes / s.budget if s.budget else 0.0
    return (
        f"budget {format_bytes(s.budget)} · peak {format_bytes(s.peak_bytes)} ({pct:.0f}%) · "
        f"offloaded {format_bytes(s.offload_bytes)} ({s.offload_count}) · "
        f"reloaded {format_bytes(s.reload_bytes)} ({s.reload_count}) · "
        f"dropped {format_bytes(s.drop_bytes)} ({s.drop_count}) · {s.node_count} nodes"
        + _direct_copies(mg)
    )


def _direct_copies(mg: MemGraph) -> str:
    """The title's line of a plan's direct copies between devices (its sends and
    receives: no offload or reload counts them), "" if it has none."""
    tg = mg.taskgraph
    sends = mg.of_kind(NodeKind.SEND)
    receives = mg.of_kind(NodeKind.RECV)
    if not sends and not receives:
        return ""
    return (
        f"\ndirect to other devices: sent {format_bytes(sum(tg[n.tensor].nbytes for n in sends))}"
        f" ({len(sends)}) · received {format_bytes(sum(tg[n.tensor].nbytes for n in receives))}"
        f" ({len(receives)})"
    )


# -- the memory map -------------------------------------------------------------------


def memory_map(
    mg: MemGraph,
    path: str | os.PathLike[str] | None = None,
    *,
    x: str = "node",
    times: Mapping[int, float | tuple[float, float]] | None = None,
    ax: Axes | None = None,
    figsize: tuple[float, float] = (12.0, 6.0),
    title: str | None = None,
    transfers: bool = True,
    annotate: bool | None = None,
    labels: int = LABELS,
) -> Figure:
    """The arena over the plan: offset (y) against step (x), one rectangle per residency.

    Rectangles are coloured by tensor kind (weight, activation, output, KV page: the
    legend says what each colour is); offloads (▼), reloads (▲), drops (×), and a
    device's direct copies in a plan for several devices, sends (▶) and receives (◀),
    are marked at their step when `transfers` (gid `"transfers:<kind>"`); the budget is
    a dashed line. The `labels` largest residencies (bytes × steps on the plot; 0: none)
    are named with their task (`%12 layers.0.mlp.w_up`), numbered by size in their
    rectangles and listed beside the legend. `annotate` writes tensor ids into rectangles
    large enough (by default when there are at most 80 residencies). The rectangles are one
    `PolyCollection` per kind (gid `"residencies:<kind>"`), so plans with tens of
    thousands of nodes draw quickly.
    """
    Line2D = require("matplotlib.lines", extra="viz").Line2D
    Patch = require("matplotlib.patches", extra="viz").Patch

    fig, ax = _figure(ax, figsize)
    stays = residencies(mg)
    start, end = step_positions(mg, x, times)
    plan_end = float(end.max()) if len(end) else 1.0
    top = max(mg.budget, mg.stats.high_water, 1)
    yscale, yunit = _byte_unit(top)
    xlabel, xscale = _x_axis(mg, x, times)
    scale = _Scale(start, end, plan_end, xscale, yscale)
    _rectangles(ax, stays, scale)
    workspaces = mg.residencies.workspaces
    _workspace_rectangles(ax, workspaces, scale)

    received = {r.kind for r in stays if r.arrival == "received"}
    handles: list[Any] = [
        Patch(
            facecolor=shades[0],
            label=KIND_MEANINGS.get(kind, kind)
            + (" or received from another device" if kind in received else ""),
        )
        for kind, shades in TENSOR_KINDS.items()
        if any(r.kind == kind for r in stays)
    ]
    if workspaces:
        handles.append(Patch(facecolor=WORKSPACE_COLOR, hatch="////", label=WORKSPACE_MEANING))
    if transfers:
        handles += _transfer_markers(ax, mg, stays, scale)
    ax.axhline(mg.budget / yscale, color="#d62728", linestyle="--", linewidth=1.2, zorder=3)
    handles.append(
        Line2D([], [], color="#d62728", linestyle="--", label=f"budget {format_bytes(mg.budget)}")
    )
    if annotate if annotate is not None else len(stays) <= 80:
        _annotate(ax, stays, scale, top)
    named = _largest(stays, scale, labels)
    if named:
        _name_largest(ax, mg, named, scale)

    lo = float(start[0]) if len(start) else 0.0
    margin = 0.01 * (plan_end - lo)
    ax.set_xlim((lo - margin) / xscale, (plan_end + margin) / xscale)
    ax.set_ylim(0, top * 1.04 / yscale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"arena offset ({yunit})")
    ax.grid(True, axis="y", color="#dddddd", linewidth=0.6, zorder=0)
    ax.set_title(title or f"{mg.taskgraph.name}: memory map\n{_stats_line(mg)}", fontsize=10)
    legend = ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        title=SHADES_NOTE,
        title_fontsize=7,
    )
    if named:
        _list_largest(ax, mg, named, legend)
    _save(fig, path)
    return fig


def residency_label(mg: MemGraph, tensor: int, width: int = 40) -> str:
    """A residency's name for a picture: `%12 layers.0.mlp.w_up` (an input's name, else
    the task's label or kind, then its scope), at most `width` characters."""
    task = mg.taskgraph[tensor]
    op = task.op
    name = getattr(op, "name", None) if task.kind == "input" else None
    words = [f"%{tensor}", name or task.label or task.kind]
    if name is None and task.scope:
        words.append(task.scope)
    text = " ".join(words)
    return text if len(text) <= width else text[: width - 1] + "…"


def _largest(stays: list[Residency], scale: _Scale, count: int) -> list[Residency]:
    """The `count` residencies with the largest area on the plot (ties: the earliest)."""
    if count <= 0 or not stays:
        return []

    def area(r: Residency) -> float:
        x0, x1 = scale.span(r)
        return (x1 - x0) * r.region.size

    ranked = sorted(range(len(stays)), key=lambda k: (-area(stays[k]), k))
    return [stays[k] for k in ranked[:count]]


def _name_largest(ax: Axes, mg: MemGraph, named: list[Residency], scale: _Scale) -> None:
    """Number the largest residencies in their rectangles (1 = the largest)."""
    for rank, r in enumerate(named, 1):
        x0, x1 = scale.span(r)
        ax.text(
            (x0 + x1) / 2 / scale.xscale,
            (r.region.offset + r.region.size / 2) / scale.yscale,
            f"{rank}",
            ha="center",
            va="center",
            fontsize=8,
            fontweight="bold",
            color="black",
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
            clip_on=True,
            zorder=6,
            gid=f"largest:{rank}",
        )


def _list_largest(ax: Axes, mg: MemGraph, named: list[Residency], legend: Any) -> None:
    """The numbered residencies' names and sizes, under the legend."""
    lines = ["largest residencies:"] + [
        f"{rank}. {residency_label(mg, r.tensor)} ({format_bytes(r.region.size)})"
        for rank, r in enumerate(named, 1)
    ]
    ax.text(
        1.01,
        0.0,
        "\n".join(lines),
        transform=ax.transAxes,
        ha="left",
        va="bottom",
        fontsize=7,
        family="monospace",
        gid="largest:list",
    )


@dataclass(frozen=True, slots=True)
class _Scale:
    """Where nodes lie on the x axis (`start`, `end`, `plan_end`) and the units of both axes."""

    start: np.ndarray
    end: np.ndarray
    plan_end: float
    xscale: float
    yscale: float

    def span(self, r: Residency) -> tuple[float, float]:
        """A residency's (x0, x1), unscaled: its alloc's start to its free's end."""
        return self.start[r.alloc], self.end[r.free] if r.free is not None else self.plan_end


def _rectangles(ax: Axes, stays: list[Residency], scale: _Scale) -> None:
    """One PolyCollection of rectangles per tensor kind (gid `residencies:<kind>`)."""
    PolyCollection = require("matplotlib.collections", extra="viz").PolyCollection

    for kind, shades in TENSOR_KINDS.items():
        mine = [r for r in stays if r.kind == kind]
        if not mine:
            continue
        spans = np.array([scale.span(r) for r in mine], dtype=float) / scale.xscale
        x0, x1 = spans[:, 0], spans[:, 1]
        y0 = np.array([r.region.offset for r in mine], dtype=float) / scale.yscale
        y1 = np.array([r.region.end for r in mine], dtype=float) / scale.yscale
        verts = np.stack(
            [
                np.stack([x0, y0], 1),
                np.stack([x0, y1], 1),
                np.stack([x1, y1], 1),
                np.stack([x1, y0], 1),
            ],
            axis=1,
        )
        colors = [shades[r.tensor % len(shades)] for r in mine]
        edge = 0.4 if len(stays) <= 2000 else 0.0
        ax.add_collection(
            PolyCollection(
                verts,
                facecolors=colors,
                edgecolors="white",
                linewidths=edge,
                gid=f"residencies:{kind}",
                zorder=2,
            )
        )


def _workspace_rectangles(ax: Axes, workspaces: Sequence[Workspace], scale: _Scale) -> None:
    """Each kernel workspace as a hatched rectangle over its apply (gid `workspaces`)."""
    if not workspaces:
        return
    PolyCollection = require("matplotlib.collections", extra="viz").PolyCollection

    x0 = np.array([scale.start[w.apply] for w in workspaces], dtype=float) / scale.xscale
    x1 = np.array([scale.end[w.apply] for w in workspaces], dtype=float) / scale.xscale
    y0 = np.array([w.region.offset for w in workspaces], dtype=float) / scale.yscale
    y1 = np.array([w.region.end for w in workspaces], dtype=float) / scale.yscale
    verts = np.stack(
        [np.stack([x0, y0], 1), np.stack([x0, y1], 1), np.stack([x1, y1], 1),
         np.stack([x1, y0], 1)],
        axis=1,
    )  # fmt: skip
    ax.add_collection(
        PolyCollection(
            verts,
            facecolors=WORKSPACE_COLOR,
            edgecolors="#79706e",
            hatch="////",
            linewidths=0.4,
            gid="workspaces",
            zorder=2,
        )
    )


def _transfer_markers(ax: Axes, mg: MemGraph, stays: list[Residency], scale: _Scale) -> list[Any]:
    """Offloads, reloads, drops, sends and receives of the residencies, at their steps, in
    their regions."""
    Line2D = require("matplotlib.lines", extra="viz").Line2D

    points: dict[str, list[tuple[float, float]]] = {name: [] for name in _MARKERS}
    start, end = scale.start, scale.end
    for stay in stays:
        centre = stay.region.offset + stay.region.size / 2
        if stay.arrival in ("reloaded", "received"):
            name = "reload" if stay.arrival == "reloaded" else "recv"
            points[name].append(((start[stay.writer] + end[stay.writer]) / 2, centre))
        for node in stay.offloads:
            points["offload"].append(((start[node] + end[node]) / 2, centre))
        for node in stay.readers:
            if mg.nodes[node].kind is NodeKind.SEND:
                points["send"].append(((start[node] + end[node]) / 2, centre))
        if stay.dropped and stay.free is not None:
            points["drop"].append((end[stay.free], centre))
    handles = []
    for name, style in _MARKERS.items():
        if not points[name]:
            continue
        xy = np.array(sorted(points[name]), dtype=float)
        ax.scatter(
            xy[:, 0] / scale.xscale,
            xy[:, 1] / scale.yscale,
            marker=style["marker"],
            c=style["color"],
            s=28 if len(xy) < 500 else 8,
            alpha=1.0 if len(xy) < 500 else 0.6,
            linewidths=1.0,
            zorder=4,
            gid=f"transfers:{name}",
        )
        handles.append(
            Line2D(
                [],
                [],
                linestyle="",
                marker=style["marker"],
                color=style["color"],
                label=f"{style['label']}: {len(xy)}",
            )
        )
    return handles


def _annotate(ax: Axes, stays: list[Residency], scale: _Scale, top: int) -> None:
    """Tensor ids written into rectangles large enough to hold them."""
    span = scale.plan_end - float(scale.start[0]) if len(scale.start) else 1.0
    for r in stays:
        x0, x1 = scale.span(r)
        height = r.region.size
        if x1 - x0 >= 0.04 * span and height >= 0.05 * top:
            ax.text(
                (x0 + x1) / 2 / scale.xscale,
                (r.region.offset + height / 2) / scale.yscale,
                f"%{r.tensor}",
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
                zorder=5,
            )


# -- live bytes -----------------------------------------------------------------------


Curve = tuple[Sequence[float], Sequence[float]]


def live_bytes_timeline(
    mg: MemGraph,
    path: str | os.PathLike[str] | None = None,
    *,
    compare: Mapping[str, MemGraph | Curve] | None = None,
    label: str | None = None,
    x: str = "apply",
    times: Mapping[int, float | tuple[float, float]] | None = None,
    ax: Axes | None = None,
    figsize: tuple[float, float] = (12.0, 4.5),
    title: str | None = None,
) -> Figure:
    """Device bytes allocated against step for `mg`, other plans or curves beside it.

    `compare` maps a legend label to another plan of the same program (drawn on the
    same `x`; `x="apply"`, the default, lines plans with different node counts up)
    or to a curve `(xs, ys)` in bytes, e.g. a no-offload baseline. `times` applies to
    `mg` only. The budget of `mg` is a dashed line; the peak is marked.
    """
    Line2D = require("matplotlib.lines", extra="viz").Line2D

    fig, ax = _figure(ax, figsize)
    curves: list[tuple[str, np.ndarray, np.ndarray]] = []
    xs, ys = live_bytes(mg, x, times)
    curves.append((label or mg.info.get("planner", "this plan"), xs, ys))
    for name, other in (compare or {}).items():
        if isinstance(other, MemGraph):
            cx, cy = live_bytes(other, x)
        else:
            cx, cy = np.asarray(other[0], dtype=float), np.asarray(other[1], dtype=float)
            if cx.shape != cy.shape:
                raise RenderError(
                    f"compare[{name!r}]: xs and ys differ in length ({cx.shape} vs {cy.shape})"
                )
        curves.append((str(name), cx, cy))
    top = max([mg.budget, 1] + [float(c[2].max()) for c in curves if len(c[2])])
    yscale, yunit = _byte_unit(top)
    xlabel, xscale = _x_axis(mg, x, times)
    colors = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#9c755f", "#76b7b2"]
    for k, (name, cx, cy) in enumerate(curves):
        color = colors[k % len(colors)]
        peak = float(cy.max()) if len(cy) else 0.0
        ax.plot(
            cx / xscale,
            cy / yscale,
            drawstyle="steps-post",
            color=color,
            linewidth=1.6 if k == 0 else 1.3,
            linestyle="-" if k == 0 else (0, (4, 2 + k)),
            label=f"{name} (peak {format_bytes(peak)})",
            zorder=3 + k,  # comparisons dashed on top: equal curves stay visible
        )
        if k == 0:
            ax.fill_between(cx / xscale, cy / yscale, step="post", color=color, alpha=0.15)
        if len(cy):
            at = int(np.argmax(cy))
            ax.plot([cx[at] / xscale], [peak / yscale], "o", color=color, markersize=4)
    ax.axhline(mg.budget / yscale, color="#d62728", linestyle="--", linewidth=1.2)
    handles, _ = ax.get_legend_handles_labels()
    handles.append(
        Line2D([], [], color="#d62728", linestyle="--", label=f"budget {format_bytes(mg.budget)}")
    )
    ax.set_ylim(0, top * 1.08 / yscale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"device bytes allocated ({yunit})")
    ax.grid(True, color="#e5e5e5", linewidth=0.6)
    ax.set_title(title or f"{mg.taskgraph.name}: live device bytes\n{_stats_line(mg)}", fontsize=10)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    _save(fig, path)
    return fig


# -- streams --------------------------------------------------------------------------


def _as_events(events: Any) -> list[StreamEvent]:
    if isinstance(events, str | os.PathLike | Mapping):
        return read_chrome_trace(events)
    events = list(events)
    if events and isinstance(events[0], Mapping):
        return read_chrome_trace(events)
    out = []
    for e in events:
        if isinstance(e, StreamEvent):
            out.append(e)
        else:
            stream, s, t, *rest = e
            out.append(
                StreamEvent(lane_name(stream), float(s), float(t), str(rest[0]) if rest else "")
            )
    return out


def stream_timeline(
    events: Iterable[StreamEvent | tuple[str, float, float, str]]
    | str
    | os.PathLike[str]
    | Mapping[str, Any],
    path: str | os.PathLike[str] | None = None,
    *,
    ax: Axes | None = None,
    figsize: tuple[float, float] = (12.0, 3.5),
    title: str | None = None,
    labels: bool | None = None,
) -> Figure:
    """Compute / H2D / D2H lanes, the peer lane of direct copies between devices (a
    device of a plan for several: its sends and receives), and any other streams, from
    events.

    `events`: StreamEvents, `(stream, start, end, label)` tuples (seconds), or a Chrome
    trace (a path or the loaded JSON). Time starts at the earliest event. `labels`
    writes event labels into bars wide enough (default: up to 300 events). The title
    gives the makespan and each stream's busy time.
    """
    fig, ax = _figure(ax, figsize)
    events = _as_events(events)
    lanes = ordered_lanes(e.stream for e in events)
    t0 = min((e.start for e in events), default=0.0)
    span = max((e.end for e in events), default=0.0) - t0
    scale, unit = _time_unit(span)
    busy = {}
    for row, lane in enumerate(lanes):
        mine = [e for e in events if e.stream == lane]
        bars = [((e.start - t0) / scale, max(e.duration, 0.0) / scale) for e in mine]
        color = _STREAM_COLORS.get(lane, "#9c9c9c")
        ax.broken_barh(
            bars,
            (row - 0.4, 0.8),
            facecolors=color,
            edgecolors="white",
            linewidths=0.3 if len(mine) < 2000 else 0.0,
            gid=f"stream:{lane}",
        )
        busy[lane] = timeline_busy(mine, lane)
        if labels if labels is not None else len(events) <= 300:
            _bar_labels(ax, fig, mine, t0, scale, span / scale, row)
    ax.set_yticks(range(len(lanes)), [_LANE_TITLES.get(s, s) for s in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, span / scale if span > 0 else 1.0)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(True, axis="x", color="#e5e5e5", linewidth=0.6)
    ax.set_axisbelow(True)
    parts = [f"makespan {span / scale:.4g} {unit}"] + [
        f"{lane} busy {busy[lane] / scale:.4g} {unit} ({100 * busy[lane] / span:.0f}%)"
        if span > 0
        else f"{lane} busy 0"
        for lane in lanes
    ]
    ax.set_title(title or "streams: " + " · ".join(parts), fontsize=10)
    _save(fig, path)
    return fig


_LANE_TITLES = {
    "compute": "compute",
    "h2d": "H2D (reload)",
    "d2h": "D2H (offload)",
    PEER_STREAM: "peer (send/recv)",
    DISK_STREAMS[0]: "disk -> host (read)",
    DISK_STREAMS[1]: "host -> disk (write)",
}


def _bar_labels(
    ax: Axes,
    fig: Figure,
    events: list[StreamEvent],
    t0: float,
    scale: float,
    span: float,
    row: int,
) -> None:
    width_pt = fig.get_figwidth() * 72 * 0.85
    for e in events:
        if not e.label or span <= 0:
            continue
        bar_pt = e.duration / scale / span * width_pt
        if bar_pt >= 4.2 * len(e.label) + 4:
            ax.text(
                (e.start - t0 + e.duration / 2) / scale,
                row,
                e.label,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
            )
