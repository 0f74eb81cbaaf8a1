"""MemGraph pictures: DOT text (pure Python) and SVG/PNG/PDF through Graphviz.

Nodes are shaped and coloured by kind and labelled with the node id, the tensor, the
task's op (the einsum spec, join and agg for applies), type and size, the device
region `[offset, +size)` and the host storage id. Every dependency edge is classified
by the kinds at its ends (`classify_dep`) and drawn in that class's style:

* data (read-after-write), solid black: a reader waits for whatever put its data
  where it reads it (apply -> apply, reload -> apply, apply -> offload,
  offload -> reload through host storage, input -> reload, ... -> output);
* memory (write-after-read), dashed red: a free waits for the readers, writer and
  offload of the residency it ends; an alloc waits for the free of bytes it reuses;
* alloc, dotted grey: a writer (or a free) waits for the alloc of its region;
* order, dotted blue: any other edge a planner added.

Nodes sit in clusters by the scope of their tensor's task; a picture of a whole layered
plan folds each layer into one box (`fold_layers`). `collapse=True` folds each
alloc into the node that first writes its region and each free into the last node it
waits for, so the picture shows compute and transfers with memory reuse as dashed
edges between them (those a path of other edges already implies left out).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
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
    Selection,
    clip,
    describe_ids,
    html_label,
    legend_cluster,
    render_source,
    repr_svg,
    select_ids,
    svg_source,
)
from einpage_core.units import format_bytes
from memgraph.graph import MemGraph
from memgraph.nodes import MemNode, NodeKind
from taskgraph.facts import is_kv_page
from taskgraph.labels import op_lines

__all__ = [
    "DepKind",
    "classify_dep",
    "memgraph_dot",
    "memgraph_selection",
    "render_memgraph",
    "memgraph_svg",
    "memgraph_repr_svg",
    "MEM_STYLES",
    "DEP_STYLES",
]


class DepKind(str, enum.Enum):
    """The class of a MemGraph dependency edge, from the kinds of the nodes at its ends."""

    DATA = "data"  # read-after-write: a reader waits for the writer of its data
    MEMORY = "memory"  # write-after-read: a free waits for users; an alloc for a free
    ALLOC = "alloc"  # a writer (or free) waits for the alloc of its region
    ORDER = "order"  # any other edge (an ordering the planner chose)

    def __str__(self) -> str:
        return self.value


_PRODUCERS = frozenset(
    {NodeKind.INPUT, NodeKind.APPLY, NodeKind.RELOAD, NodeKind.OFFLOAD, NodeKind.RECV}
)
_READERS = frozenset(
    {NodeKind.APPLY, NodeKind.OFFLOAD, NodeKind.RELOAD, NodeKind.OUTPUT, NodeKind.SEND}
)


def classify_dep(src: MemNode, dst: MemNode) -> DepKind:
    """The class of the edge "`dst` depends on `src`".

    >>> from memgraph.nodes import Region
    >>> alloc = MemNode(0, NodeKind.ALLOC, tensor=1, region=Region(0, 256))
    >>> apply = MemNode(1, NodeKind.APPLY, (0,), tensor=1, region=Region(0, 256))
    >>> free = MemNode(2, NodeKind.FREE, (0, 1), tensor=1, region=Region(0, 256))
    >>> [str(classify_dep(a, b)) for a, b in [(alloc, apply), (apply, free), (free, alloc)]]
    ['alloc', 'memory', 'memory']
    """
    if src.kind is NodeKind.ALLOC:
        return DepKind.ALLOC
    if src.kind is NodeKind.FREE or dst.kind is NodeKind.FREE:
        return DepKind.MEMORY
    if src.kind in _PRODUCERS and dst.kind in _READERS:
        return DepKind.DATA
    return DepKind.ORDER


DEP_STYLES: dict[DepKind, tuple[str, dict[str, object]]] = {
    DepKind.DATA: (
        "data: read-after-write",
        {"color": "#222222", "penwidth": 1.3},
    ),
    DepKind.MEMORY: (
        "memory: write-after-read",
        {"color": "#cb181d", "style": "dashed", "arrowhead": "empty"},
    ),
    DepKind.ALLOC: (
        "region allocated before use",
        {"color": "#9e9e9e", "style": "dotted", "arrowhead": "vee"},
    ),
    DepKind.ORDER: (
        "other ordering",
        {"color": "#4292c6", "style": "dotted"},
    ),
}
"""Edge styles by class: (legend text, Graphviz edge attributes)."""

_PRIORITY = {DepKind.DATA: 0, DepKind.MEMORY: 1, DepKind.ALLOC: 2, DepKind.ORDER: 3}

MEM_STYLES: dict[str, NodeStyle] = {
    "input_host": NodeStyle("input on host", "cylinder", "#fdd49e"),
    "input_device": NodeStyle("input on device", "invhouse", "#c7e9c0"),
    "alloc": NodeStyle("alloc", "box", "#eeeeee"),
    "apply": NodeStyle("apply (compute)", "box", "#c6dbef", "rounded,filled"),
    "recompute": NodeStyle(
        "recompute (a dropped tensor computed again)", "box", "#9ecae1", "rounded,filled,dashed"
    ),
    "offload": NodeStyle("offload (device to host)", "invhouse", "#fcae91"),
    "reload": NodeStyle("reload (host to device)", "house", "#a1d99b"),
    "free": NodeStyle("free", "box", "#ffffff", "dashed"),
    "output": NodeStyle("output", "box", "#fff2ae", "rounded,filled,bold"),
    "send": NodeStyle("send (to another device)", "invtrapezium", "#fdae6b"),
    "recv": NodeStyle("recv (from another device)", "trapezium", "#74c476"),
    "reload_kv": NodeStyle("reload of a KV page", "house", "#d4b9da"),
    "offload_kv": NodeStyle("offload of a KV page", "invhouse", "#c994c7"),
    "layer": NodeStyle("a folded layer (open it with its scope)", "box3d", "#e5f5e0"),
}
"""Node styles by kind; inputs are split by where they start (and a folded layer)."""


def style_kind(node: MemNode, mg: MemGraph | None = None) -> str:
    """The style key of a node: its kind, with inputs split into host and device (and,
    given the plan, transfers of KV-cache pages apart: `taskgraph.facts.is_kv_page`);
    a recompute (an apply that computes its task again) is drawn apart from an apply."""
    if node.kind is NodeKind.APPLY and node.recompute:
        return "recompute"
    if node.kind is NodeKind.INPUT:
        return "input_host" if node.storage is not None else "input_device"
    if mg is not None and node.kind in (NodeKind.RELOAD, NodeKind.OFFLOAD):
        tg = mg.taskgraph
        if is_kv_page(tg[tg.storage_root(node.tensor)]):
            return f"{node.kind.value}_kv"
    return node.kind.value


def node_lines(mg: MemGraph, node: MemNode) -> list[Line]:
    """The label of a node: id, kind and tensor; what it does; where its bytes are."""
    kind = node.kind
    task = mg.taskgraph[node.tensor] if node.tensor is not None else None
    tensor = f"%{node.tensor}" if node.tensor is not None else ""
    name = f' "{node.name}"' if node.name else ""
    verb = "recompute" if node.recompute else str(kind)
    title = f"n{node.id} {verb}{name} {tensor}".rstrip()
    if task is not None and task.label and kind is NodeKind.APPLY:
        title += f" · {clip(task.label, 24)}"
    lines = [Line(title, "title")]
    if kind is NodeKind.APPLY and task is not None:
        is_einsum = task.kind == "einsum"
        lines.extend(op_lines(task) if is_einsum else [Line(clip(task.op.describe()), "mono")])
    if task is not None and kind in (NodeKind.APPLY, NodeKind.INPUT, NodeKind.OUTPUT):
        lines.append(Line(f"{task.type_str}  {format_bytes(task.nbytes)}"))
    host = f"host#{node.storage}" if node.storage is not None else ""
    if node.box is not None:  # a sliced copy: the box of the host storage it moves
        host += f"[{_box_text(node)}]"
    if node.into is not None:  # a sliced offload: into the host output's storage
        host += f" of %{node.into}"
    region = str(node.region) if node.region is not None else ""
    where = {
        NodeKind.OFFLOAD: f"{region} → {host}",
        NodeKind.RELOAD: f"{host} → {region}",
        NodeKind.APPLY: f"→ {region}",
        NodeKind.SEND: f"{region} → link#{node.link}",
        NodeKind.RECV: f"link#{node.link} → {region}",
    }.get(kind, host or region)
    if where:
        lines.append(Line(where, "mono"))
    if node.workspace is not None:  # a kernel's workspace, held during the apply
        lines.append(Line(f"workspace {node.workspace}", "mono"))
    return lines


def _box_text(node: MemNode) -> str:
    """`0:8, 0:256`: the box of its host storage a sliced copy moves (the node carries it:
    the plan holds every fact a picture needs)."""
    return str(node.box)[1:-1]


@dataclass(frozen=True, slots=True)
class _Folding:
    """Where collapsed alloc and free nodes went (`into`: node id -> the id that stands
    for it), and the nodes of folded layers (`layer_of`: node id -> the layer's first
    node, which is drawn as the layer's box; `layers`: that id -> the layer's name and
    node ids)."""

    into: dict[int, int]
    frees_at: dict[int, list[int]]  # representative -> tensors it frees
    layer_of: dict[int, int] = field(default_factory=dict)
    layers: dict[int, tuple[str, list[int]]] = field(default_factory=dict)

    def rep(self, node_id: int) -> int:
        node_id = self.into.get(node_id, node_id)
        return self.layer_of.get(node_id, node_id)

    @property
    def hidden(self) -> set[int]:
        return set(self.into) | set(self.layer_of)


def layer_scope(scope: str) -> str | None:
    """The layer a scope is in – its name up to its first numbered part – or None.

    >>> layer_scope("layers.3.attn"), layer_scope("layers.3"), layer_scope("head")
    ('layers.3', 'layers.3', None)
    """
    parts = scope.split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: k + 1])
    return None


def _fold_layers(mg: MemGraph, folding: _Folding) -> _Folding:
    """`folding` with each layer (`layer_scope`) folded into one node, its first visible
    one; unchanged when the plan has fewer than two layers."""
    members: dict[str, list[int]] = {}
    for i in range(len(mg)):
        if i not in folding.into:
            name = layer_scope(_scope_of(mg, i))
            if name is not None:
                members.setdefault(name, []).append(i)
    if len(members) < 2:
        return folding
    layer_of, layers = {}, {}
    for name, ids in members.items():
        layers[ids[0]] = (name, ids)
        layer_of.update((i, ids[0]) for i in ids[1:])
    return _Folding(folding.into, folding.frees_at, layer_of, layers)


def _fold(mg: MemGraph) -> _Folding:
    """Fold each alloc into its residency's first writer, each free into its latest dep
    that is neither an alloc nor a free."""
    writers = (NodeKind.APPLY, NodeKind.RELOAD, NodeKind.INPUT, NodeKind.RECV)
    into: dict[int, int] = {}
    frees_at: dict[int, list[int]] = {}
    for node in mg.nodes:
        for dep in node.deps:
            src = mg.nodes[dep]
            if src.kind is NodeKind.ALLOC and dep not in into and node.kind in writers:
                into[dep] = node.id
        if node.kind is NodeKind.FREE:
            users = [
                d for d in node.deps if mg.nodes[d].kind not in (NodeKind.ALLOC, NodeKind.FREE)
            ]
            if users:
                into[node.id] = max(users)
                frees_at.setdefault(max(users), []).append(node.tensor)
    return _Folding(into, frees_at)


def memgraph_dot(
    mg: MemGraph,
    *,
    select: Iterable[int] | Callable[[MemNode], bool] | None = None,
    scope: str | None = None,
    collapse: bool = False,
    fold_layers: bool | None = None,
    prune: bool | None = None,
    max_nodes: int | None = DEFAULT_MAX_NODES,
    clusters: bool | int = True,
    legend: bool = True,
    rankdir: str = "TB",
) -> str:
    """The DOT text of a MemGraph (pure Python, deterministic).

    `select`: node ids (e.g. `range(100, 160)`) or a predicate on a MemNode; `scope`:
    keep nodes whose tensor's task is in this scope (or nested in it). `collapse`:
    fold alloc and free nodes into the nodes they serve. `fold_layers`: draw each layer
    (a scope up to its first numbered part, `layers.3`) as one box counting its nodes,
    with a note on how to open one (`scope="layers.3"`); by default when the whole plan
    is drawn (no `select`, no `scope`) and it has two layers or more. `prune`: leave out memory,
    alloc and order edges already implied by a path of other drawn edges (the
    picture keeps the same partial order; by default only when collapsing, so an
    uncollapsed picture shows every dependency). Of the selected nodes the
    first `max_nodes` are drawn (None: all) and a note node lists the rest;
    dependencies from outside the selection end in grey stubs. `clusters`: box nodes
    by their task's scope (an int limits the depth). `legend`: node kinds and edge
    classes drawn. `rankdir`: "TB" or "LR".
    """
    folding, chosen = _choose(mg, select, scope, collapse, fold_layers, max_nodes)
    tg = mg.taskgraph
    graph = DotGraph(
        f"{tg.name} plan",
        graph_attrs={
            **GRAPH_ATTRS,
            "rankdir": rankdir,
            "tooltip": f"MemGraph {tg.name}: {len(mg)} nodes",
        },
        node_attrs={**NODE_ATTRS},
        edge_attrs={"arrowsize": 0.7},
        clusters=clusters,
    )
    kinds_drawn = _add_nodes(graph, mg, chosen.shown, folding)
    edges = _dep_edges(mg, set(chosen.shown), folding, collapse)
    if collapse if prune is None else prune:
        edges = _prune_implied(edges)
    classes_drawn = _add_edges(graph, mg, edges, set(chosen.shown))
    if chosen.omitted:
        _add_note(graph, mg, chosen, max_nodes, folding)
    if folding.layers:
        _add_layers_note(graph, folding)
    if legend and kinds_drawn:
        nodes = [(s.legend, s.attrs()) for k, s in MEM_STYLES.items() if k in kinds_drawn]
        edge_samples = [
            (text, attrs) for cls, (text, attrs) in DEP_STYLES.items() if cls in classes_drawn
        ]
        graph.add_raw(legend_cluster(nodes, edge_samples))
    return graph.source()


def memgraph_selection(
    mg: MemGraph,
    *,
    select: Iterable[int] | Callable[[MemNode], bool] | None = None,
    scope: str | None = None,
    collapse: bool = False,
    fold_layers: bool | None = None,
    max_nodes: int | None = DEFAULT_MAX_NODES,
) -> Selection:
    """What `memgraph_dot` with these options draws: `shown`, the nodes drawn (a folded
    layer counts as its one box), and `omitted`, those the `max_nodes` cap left out (so
    a caller can say how much of the plan a picture shows)."""
    return _choose(mg, select, scope, collapse, fold_layers, max_nodes)[1]


def _choose(
    mg: MemGraph,
    select: Iterable[int] | Callable[[MemNode], bool] | None,
    scope: str | None,
    collapse: bool,
    fold_layers: bool | None,
    max_nodes: int | None,
) -> tuple[_Folding, Selection]:
    """How nodes fold (`collapse`, `fold_layers`) and which are drawn."""
    folding = _fold(mg) if collapse else _Folding({}, {})
    if fold_layers if fold_layers is not None else select is None and scope is None:
        folding = _fold_layers(mg, folding)
    predicate = (lambda i: select(mg.nodes[i])) if callable(select) else None
    chosen = select_ids(
        len(mg),
        predicate or select,
        scope,
        lambda i: _scope_of(mg, i),
        max_nodes,
        "node",
        hidden=folding.hidden,
    )
    return folding, chosen


def _scope_of(mg: MemGraph, node_id: int) -> str:
    """The scope of the task whose tensor node `node_id` handles ("" for none)."""
    tensor = mg.nodes[node_id].tensor
    return mg.taskgraph[tensor].scope if tensor is not None else ""


def _add_nodes(
    graph: DotGraph, mg: MemGraph, shown: tuple[int, ...], folding: _Folding
) -> set[str]:
    """Draw the `shown` nodes (a folded free noted on the node it went into); returns
    the style kinds drawn."""
    kinds_drawn: set[str] = set()
    for i in shown:
        if i in folding.layers:
            _add_layer(graph, mg, i, folding)
            kinds_drawn.add("layer")
            continue
        node = mg.nodes[i]
        kind = style_kind(node, mg)
        kinds_drawn.add(kind)
        lines = node_lines(mg, node)
        freed = folding.frees_at.get(i)
        if freed:
            lines.append(Line(clip("then frees " + ", ".join(f"%{t}" for t in freed)), "note"))
        graph.add_node(
            f"n{i}",
            _scope_of(mg, i),
            label=html_label(lines),
            tooltip=node.line(),
            **MEM_STYLES[kind].attrs(),
        )
    return kinds_drawn


def _add_layer(graph: DotGraph, mg: MemGraph, first: int, folding: _Folding) -> None:
    """A folded layer's box: its name, its nodes by kind, how to open it."""
    name, ids = folding.layers[first]
    counts: dict[str, int] = {}
    for i in ids:
        kind = mg.nodes[i].kind.value
        counts[kind] = counts.get(kind, 0) + 1
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    lines = [
        Line(name, "title"),
        Line(clip(f"{len(ids)} nodes: {kinds}")),
        *_layer_copies(mg, ids),
        Line(f"open: scope={name!r} (--scope {name})", "note"),
    ]
    scope = name.rsplit(".", 1)[0]
    graph.add_node(
        f"n{first}",
        scope,
        label=html_label(lines),
        tooltip=f"layer {name}: nodes n{min(ids)}..n{max(ids)}",
        **MEM_STYLES["layer"].attrs(),
    )


def _layer_copies(mg: MemGraph, ids: Sequence[int]) -> list[Line]:
    """A folded layer's direct copies between devices, by link: `sends link#0, link#2`,
    `receives link#1` (one line each, none without them)."""
    lines = []
    for kind, verb in ((NodeKind.SEND, "sends"), (NodeKind.RECV, "receives")):
        links = [f"link#{mg.nodes[i].link}" for i in ids if mg.nodes[i].kind is kind]
        if links:
            lines.append(Line(clip(f"{verb} {', '.join(links)}")))
    return lines


def _add_layers_note(graph: DotGraph, folding: _Folding) -> None:
    """The note that says the layers are folded and how to open one or unfold all."""
    names = [name for name, _ in folding.layers.values()]
    text = (
        f"{len(names)} layers folded into one box each ({names[0]} ... {names[-1]}):\n"
        f"open one with scope={names[0]!r} (CLI: --scope {names[0]}),\n"
        "or draw every node with fold_layers=False (einpage render --unfold)"
    )
    graph.add_node("layers_note", label=text, tooltip=text, **NOTE_ATTRS)


def _dep_edges(
    mg: MemGraph, shown: set[int], folding: _Folding, collapse: bool
) -> dict[tuple[int, int], DepKind]:
    """The edges into shown nodes, (src, dst) -> class, between the nodes that stand for
    the ends after folding; of several deps folded onto one edge, the highest-priority
    class wins."""
    folded = folding.into
    edges: dict[tuple[int, int], DepKind] = {}
    for i in range(len(mg)):
        dst_node = mg.nodes[i]
        if collapse and dst_node.kind is NodeKind.FREE and i in folded:
            continue  # a folded free's own waits are implied by where it was folded
        dst = folding.rep(i)
        if dst not in shown:
            continue
        for dep in dst_node.deps:
            src = folding.rep(dep)
            if src == dst:
                continue
            if dep in folded and mg.nodes[dep].kind is NodeKind.ALLOC:
                continue  # an alloc folded into its writer: the writer owns the region
            cls = classify_dep(mg.nodes[dep], dst_node)
            old = edges.get((src, dst))
            if old is None or _PRIORITY[cls] < _PRIORITY[old]:
                edges[(src, dst)] = cls
    return edges


def _add_edges(
    graph: DotGraph, mg: MemGraph, edges: dict[tuple[int, int], DepKind], shown: set[int]
) -> set[DepKind]:
    """Draw `edges` in their class's style (a grey stub for a source outside the
    selection), by destination then source; returns the classes drawn."""
    classes_drawn: set[DepKind] = set()
    for (src, dst), cls in sorted(edges.items(), key=lambda item: (item[0][1], item[0][0])):
        if src not in shown and f"n{src}" not in graph:
            node = mg.nodes[src]
            graph.add_node(
                f"n{src}",
                label=clip(f"n{src} {node.kind} %{node.tensor}"),
                tooltip="outside the selection: " + node.line(),
                **STUB_ATTRS,
            )
        classes_drawn.add(cls)
        graph.add_edge(f"n{src}", f"n{dst}", **DEP_STYLES[cls][1])
    return classes_drawn


PRUNE_LIMIT = 20_000
"""Above this many drawn nodes `prune` is skipped (its ancestor sets grow quadratically)."""


def _prune_implied(edges: dict[tuple[int, int], DepKind]) -> dict[tuple[int, int], DepKind]:
    """`edges` without the non-data edges u -> v that another path u -> ... -> v implies.

    Edges go from lower to higher ids, so one sweep in id order gives every node's
    ancestors (a bitset over the nodes' positions in that order).
    """
    ids = sorted({i for edge in edges for i in edge})
    if len(ids) > PRUNE_LIMIT or any(src >= dst for src, dst in edges):
        return edges  # too large, or folded layers (a layer's box has its first node's id)
    position = {node: k for k, node in enumerate(ids)}
    preds: dict[int, list[int]] = {}
    for src, dst in edges:
        preds.setdefault(dst, []).append(src)
    ancestors: dict[int, int] = {}
    for dst in ids:
        reach = 0
        for src in preds.get(dst, ()):
            reach |= ancestors[src] | (1 << position[src])
        ancestors[dst] = reach
    kept = {}
    for (src, dst), cls in edges.items():
        bit = 1 << position[src]
        others = (p for p in preds[dst] if p != src)
        if cls is DepKind.DATA or not any(ancestors[p] & bit for p in others):
            kept[(src, dst)] = cls
    return kept


def _add_note(
    graph: DotGraph,
    mg: MemGraph,
    chosen: Selection,
    max_nodes: int | None,
    folding: _Folding,
) -> None:
    omitted = chosen.omitted
    text = (
        f"{len(omitted)} more node(s) not shown: {describe_ids(omitted, 'n')}\n"
        f"(max_nodes={max_nodes}; pass select=range(...), scope=..., collapse=True "
        "or a larger max_nodes)"
    )
    graph.add_node("omitted", label=text, tooltip=text, **NOTE_ATTRS)
    left_out = set(omitted)
    users: set[int] = set()
    for i in omitted:
        users.update(folding.rep(d) for d in mg.nodes[i].deps)
    for i in chosen.shown:
        if i in users and i not in left_out:
            graph.add_edge(f"n{i}", "omitted", style="dotted", color="#b8860b")


def render_memgraph(mg: MemGraph, path: str | os.PathLike[str], **options: object) -> Path:
    """Draw the plan `mg` to `path`; the suffix picks the format (svg, png, pdf, or dot/gv
    for the DOT text). Options are those of `memgraph_dot`. Without Graphviz's `dot`
    program, raises `GraphvizNotFoundError` after writing the `.dot` source beside
    `path`."""
    return render_source(memgraph_dot(mg, **options), path)


def memgraph_svg(mg: MemGraph, **options: object) -> str:
    """`mg` as SVG text (needs `dot`); capped at `REPR_MAX_NODES` nodes unless told."""
    options.setdefault("max_nodes", REPR_MAX_NODES)
    return svg_source(memgraph_dot(mg, **options))


def memgraph_repr_svg(mg: MemGraph) -> str | None:
    """What a notebook shows: SVG capped at `REPR_MAX_NODES` nodes, or None (then the
    text repr) with a warning when Graphviz is missing or too slow."""
    return repr_svg(lambda: memgraph_dot(mg, max_nodes=REPR_MAX_NODES))
