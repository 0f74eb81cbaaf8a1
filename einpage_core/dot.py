"""Drawing helpers both graph renderers share: DOT text, escaping, styles, running Graphviz.

`taskgraph.render` and `memgraph.render` each draw their own IR with these: a
`DotGraph` (nodes in nested scope clusters, edges, a legend), `NodeStyle`s and the
common node/stub/note attributes, the selection of what a picture shows
(`select_ids`), and `render_source`/`svg_source`/`repr_svg`, which turn DOT into a
file, SVG text or a notebook picture. This module is a leaf (the standard library
and `einpage_core.errors` only), so memgraph draws without importing taskgraph's
rendering. `taskgraph.dot` is an alias of it, for code written before it moved.

DOT generation is pure Python and deterministic: the same graph and options give the
same text, byte for byte, with no Graphviz installed. Only turning DOT into SVG, PNG
or PDF needs the `dot` program; a missing one raises `GraphvizNotFoundError`, which
says how to install it and where the `.dot` source was written instead.

Node labels are Graphviz HTML-like labels (`html_label`): there only `&`, `<`, `>`
and `"` are special (escaped as entities), so braces and `|` are literal. Every other
string (tooltips, cluster labels) is a DOT quoted string (`quote`).

>>> quote('say "hi"\\nbye')
'"say \\\\"hi\\\\"\\\\nbye"'
>>> escape_html("a->b <&>")
'a-&gt;b &lt;&amp;&gt;'
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import warnings
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from einpage_core.errors import GraphvizNotFoundError, RenderError

__all__ = [
    "RenderError",
    "GraphvizNotFoundError",
    "FORMATS",
    "DEFAULT_MAX_NODES",
    "REPR_MAX_NODES",
    "NodeStyle",
    "GRAPH_ATTRS",
    "NODE_ATTRS",
    "STUB_ATTRS",
    "NOTE_ATTRS",
    "DotGraph",
    "Html",
    "Line",
    "quote",
    "escape_html",
    "html_label",
    "legend_cluster",
    "clip",
    "describe_ids",
    "in_scope",
    "Selection",
    "select_ids",
    "find_dot",
    "format_of",
    "render_source",
    "svg_source",
    "repr_svg",
]

FORMATS = ("svg", "png", "pdf", "dot", "gv")
"""Output formats by file suffix; `dot` and `gv` write the DOT text (no Graphviz needed)."""

INSTALL_HINT = (
    "install Graphviz: `sudo apt-get install graphviz` (Debian/Ubuntu), "
    "`brew install graphviz` (macOS), or `conda install -c conda-forge graphviz`"
)


DEFAULT_MAX_NODES = 400
"""Default cap on the nodes one picture shows (the rest are summarised in a note node)."""
REPR_MAX_NODES = 120
"""The cap used when a notebook displays a graph (`_repr_svg_`)."""


# -- styles ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeStyle:
    """How one kind of node looks: Graphviz `shape`, `style` and `fillcolor`, and what the
    legend calls it."""

    legend: str
    shape: str
    fillcolor: str
    style: str = "filled"

    def attrs(self) -> dict[str, object]:
        return {"shape": self.shape, "style": self.style, "fillcolor": self.fillcolor}


GRAPH_ATTRS: dict[str, object] = {
    "rankdir": "TB",
    "fontname": "Helvetica",
    "nodesep": 0.25,
    "ranksep": 0.35,
    "newrank": True,
}
"""Graph attributes of every picture (each renderer adds its `rankdir` and tooltip)."""
NODE_ATTRS: dict[str, object] = {"fontname": "Helvetica", "fontsize": 10, "margin": "0.08,0.04"}
"""Default node attributes of every picture."""
STUB_ATTRS: dict[str, object] = {
    "shape": "box",
    "style": "rounded,dashed",
    "color": "#999999",
    "fontcolor": "#666666",
    "fontsize": 9,
}
"""A node from outside the selection that a shown node depends on (a grey stub)."""
NOTE_ATTRS: dict[str, object] = {
    "shape": "note",
    "style": "filled",
    "fillcolor": "#ffffcc",
    "color": "#b8860b",
    "fontsize": 10,
}
"""The note that says which nodes the cap left out."""


# -- escaping ------------------------------------------------------------------------


def quote(text: str) -> str:
    """A DOT quoted string (an escString): backslashes, quotes and newlines escaped."""
    body = str(text).replace("\\", "\\\\").replace('"', '\\"')
    body = body.replace("\r\n", "\n").replace("\n", "\\n")
    return f'"{body}"'


def escape_html(text: str) -> str:
    """Text for a Graphviz HTML-like label: `& < > "` as entities, newlines as `<br/>`."""
    body = str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    body = body.replace('"', "&quot;")
    return body.replace("\r\n", "\n").replace("\n", '<br align="center"/>')


def clip(text: str, width: int = 56) -> str:
    """`text` cut to `width` characters with an ellipsis (labels stay narrow)."""
    return text if len(text) <= width else text[: width - 1] + "…"


class Html(str):
    """An HTML-like label (without the outer `<` `>`): written as `<...>`, never quoted."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Line:
    """One line of a node label: `text` in a `style` of "title", "mono", "note" or "plain"."""

    text: str
    style: str = "plain"


_LINE_STYLES: dict[str, tuple[str, str]] = {
    "title": ("<b>", "</b>"),
    "mono": ('<font face="Courier">', "</font>"),
    "note": ('<font point-size="9" color="#555555">', "</font>"),
    "plain": ("", ""),
}


def html_label(lines: Iterable[Line]) -> Html:
    """An HTML-like label of `lines`, each escaped and styled."""
    parts = []
    for line in lines:
        opening, closing = _LINE_STYLES[line.style]
        parts.append(f"{opening}{escape_html(line.text)}{closing}")
    return Html("<br/>".join(parts))


def legend_cluster(
    nodes: Sequence[tuple[str, Mapping[str, object]]],
    edges: Sequence[tuple[str, Mapping[str, object]]],
    per_row: int = 4,
) -> str:
    """A `cluster_legend` subgraph: a sample node per (description, node attributes), in
    rows of `per_row`, and a sample edge per (description, edge attributes)."""
    out = [
        "subgraph cluster_legend {",
        '  label="legend"; style="rounded"; color="#999999"; fontname="Helvetica-Bold";',
        "  fontsize=11; labeljust=l;",
    ]
    names = []
    for k, (text, attrs) in enumerate(nodes):
        name = f"legend_node_{k}"
        names.append(quote(name))
        sample = {**attrs, "label": text, "tooltip": text}
        out.append(f"  {quote(name)}{_attrs(sample)};")
    for k, (text, attrs) in enumerate(edges):
        src, dst = quote(f"legend_edge_{k}_from"), quote(f"legend_edge_{k}_to")
        out.append(f'  {src} [shape=point, width=0.05, color="#999999"];')
        out.append(f"  {dst} [shape=plaintext, label={quote(text)}, fontsize=10];")
        out.append(f"  {src} -> {dst}{_attrs(attrs)};")
    rows = [names[k : k + per_row] for k in range(0, len(names), per_row)]
    for row in rows:
        if len(row) > 1:
            out.append(f"  {{rank=same; {'; '.join(row)};}}")
            out.append(f"  {' -> '.join(row)} [style=invis];")
    for upper, lower in zip(rows[:-1], rows[1:], strict=True):
        out.append(f"  {upper[0]} -> {lower[0]} [style=invis];")
    out.append("}")
    return "\n".join(out)


def _attr_value(value: object) -> str:
    if isinstance(value, Html):
        return f"<{value}>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return quote(str(value))


def _attrs(attrs: Mapping[str, object]) -> str:
    items = [f"{key}={_attr_value(value)}" for key, value in attrs.items() if value is not None]
    return f" [{', '.join(items)}]" if items else ""


# -- the graph -----------------------------------------------------------------------


@dataclass
class _Cluster:
    """A scope's subgraph: its nodes and its child scopes, by name."""

    name: str
    nodes: list[str] = field(default_factory=list)
    children: dict[str, _Cluster] = field(default_factory=dict)


@dataclass
class DotGraph:
    """A directed graph being written as DOT: nodes (optionally in a scope), edges, defaults.

    Scopes are dotted names (`"layers.3.attn"`); with `clusters` true each scope becomes
    a nested cluster (an int limits the nesting depth). A cluster holding only one
    child cluster and no nodes is merged into it, so `layers` > `layers.3` chains do
    not box a lone layer twice.
    """

    name: str = "G"
    graph_attrs: dict[str, object] = field(default_factory=dict)
    node_attrs: dict[str, object] = field(default_factory=dict)
    edge_attrs: dict[str, object] = field(default_factory=dict)
    clusters: bool | int = True

    def __post_init__(self) -> None:
        self._nodes: dict[str, dict[str, object]] = {}
        self._scope: dict[str, str] = {}
        self._edges: list[tuple[str, str, dict[str, object]]] = []
        self._tail: list[str] = []

    def add_node(self, node_id: str, scope: str = "", **attrs: object) -> None:
        self._nodes[node_id] = attrs
        self._scope[node_id] = self._cluster_scope(scope)

    def add_edge(self, src: str, dst: str, **attrs: object) -> None:
        self._edges.append((src, dst, attrs))

    def add_raw(self, text: str) -> None:
        """A statement written after the nodes and edges (e.g. `{rank=sink; legend}`)."""
        self._tail.append(text)

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._nodes

    @property
    def node_count(self) -> int:
        return len(self._nodes)

    def _cluster_scope(self, scope: str) -> str:
        if not scope or self.clusters is False:
            return ""
        if self.clusters is True:
            return scope
        return ".".join(scope.split(".")[: int(self.clusters)])

    def _tree(self) -> _Cluster:
        root = _Cluster("")
        for node_id, scope in self._scope.items():
            cluster = root
            if scope:
                parts = scope.split(".")
                for depth in range(1, len(parts) + 1):
                    name = ".".join(parts[:depth])
                    cluster = cluster.children.setdefault(name, _Cluster(name))
            cluster.nodes.append(node_id)
        return root

    def source(self) -> str:
        """The DOT text."""
        out = [f"digraph {quote(self.name)} {{"]
        for keyword, attrs in (
            ("graph", self.graph_attrs),
            ("node", self.node_attrs),
            ("edge", self.edge_attrs),
        ):
            if attrs:
                out.append(f"  {keyword}{_attrs(attrs)};")
        counter = [0]
        self._write_cluster(self._tree(), out, "  ", counter, top=True)
        for src, dst, attrs in self._edges:
            out.append(f"  {quote(src)} -> {quote(dst)}{_attrs(attrs)};")
        out.extend(f"  {text}" for text in self._tail)
        out.append("}")
        return "\n".join(out) + "\n"

    def _write_cluster(
        self, cluster: _Cluster, out: list[str], indent: str, counter: list[int], top: bool
    ) -> None:
        while not top and not cluster.nodes and len(cluster.children) == 1:
            cluster = next(iter(cluster.children.values()))
        inner = indent
        if not top:
            counter[0] += 1
            out.append(f"{indent}subgraph cluster_{counter[0]} {{")
            inner = indent + "  "
            out.append(f"{inner}label={quote(cluster.name)}; tooltip={quote(cluster.name)};")
            out.append(
                f'{inner}style="rounded,filled"; fillcolor="#f7f7f7"; color="#bbbbbb"; '
                'fontname="Helvetica-Bold"; fontsize=11; labeljust=l;'
            )
        for node_id in cluster.nodes:
            out.append(f"{inner}{quote(node_id)}{_attrs(self._nodes[node_id])};")
        for child in cluster.children.values():
            self._write_cluster(child, out, inner, counter, top=False)
        if not top:
            out.append(f"{indent}}}")


# -- selection and caps --------------------------------------------------------------


def in_scope(task_scope: str, scope: str) -> bool:
    """Whether `task_scope` is `scope` or nested in it (`layers.3.attn` is in `layers.3`,
    `layers.30` is not)."""
    return task_scope == scope or task_scope.startswith(scope + ".")


def describe_ids(ids: Sequence[int], prefix: str, runs: int = 3) -> str:
    """Sorted ids as ranges: `%4–%9, %12`; with more than `runs` ranges, the first ones
    and a count."""
    spans: list[tuple[int, int]] = []
    for i in sorted(ids):
        if spans and i == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], i)
        else:
            spans.append((i, i))
    text = [f"{prefix}{a}" if a == b else f"{prefix}{a}–{prefix}{b}" for a, b in spans[:runs]]
    if len(spans) > runs:
        text.append(f"… ({len(spans)} ranges)")
    return ", ".join(text)


@dataclass(frozen=True, slots=True)
class Selection:
    """Which ids a picture shows: `shown` (in order), and `omitted`, the selected ids left
    out by the node cap."""

    shown: tuple[int, ...]
    omitted: tuple[int, ...]


def select_ids(
    count: int,
    select: Iterable[int] | Callable[[int], bool] | None,
    scope: str | None,
    scope_of: Callable[[int], str],
    max_nodes: int | None,
    what: str,
    hidden: Container[int] = (),
) -> Selection:
    """Ids `0..count-1` kept by `select` (ids, or a predicate on an id) and `scope`, less
    the `hidden` ones; the first `max_nodes` of them shown and the rest omitted."""
    if max_nodes is not None and (not isinstance(max_nodes, int) or max_nodes < 1):
        raise RenderError(f"max_nodes must be a positive int or None, got {max_nodes!r}")
    if select is None:
        chosen: Iterable[int] = range(count)
    elif callable(select):
        chosen = (i for i in range(count) if select(i))
    else:
        chosen = sorted(set(select))
        bad = [i for i in chosen if not (isinstance(i, int) and 0 <= i < count)]
        if bad:
            raise RenderError(
                f"select: {what} id {bad[0]!r} is out of range; valid ids are 0..{count - 1}"
            )
    chosen = list(chosen)
    kept = [
        i for i in chosen if i not in hidden and (scope is None or in_scope(scope_of(i), scope))
    ]
    if scope is not None and not any(in_scope(scope_of(i), scope) for i in chosen):
        raise RenderError(unknown_scope(scope, {scope_of(i) for i in range(count)}))
    if max_nodes is None or len(kept) <= max_nodes:
        return Selection(tuple(kept), ())
    return Selection(tuple(kept[:max_nodes]), tuple(kept[max_nodes:]))


def unknown_scope(scope: str, scopes: Iterable[str]) -> str:
    """The message for a `scope` no node is in: the scopes there are, closest first."""
    every: set[str] = set()
    for name in scopes:
        parts = name.split(".") if name else []
        every.update(".".join(parts[: k + 1]) for k in range(len(parts)))
    if not every:
        return f"scope {scope!r}: this graph has no scopes"
    close = difflib.get_close_matches(scope, sorted(every), n=5, cutoff=0.0)
    return f"scope {scope!r} holds no node; closest scopes: {', '.join(close)}"


# -- running Graphviz ----------------------------------------------------------------


def find_dot() -> str | None:
    """The path of Graphviz's `dot` program on PATH, or None."""
    return shutil.which("dot")


def format_of(path: str | os.PathLike[str]) -> str:
    """The output format named by `path`'s suffix; raises `RenderError` for unknown ones."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in FORMATS:
        raise RenderError(
            f"cannot render to {str(path)!r}: unknown format {suffix!r}; "
            f"use a suffix among {', '.join('.' + f for f in FORMATS)}"
        )
    return suffix


def _run_dot(source: str, fmt: str, timeout: float) -> bytes:
    exe = find_dot()
    if exe is None:
        raise GraphvizNotFoundError(f"Graphviz's `dot` program is not on PATH; {INSTALL_HINT}")
    try:
        done = subprocess.run(
            [exe, f"-T{fmt}"],
            input=source.encode("utf-8"),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RenderError(
            f"`dot -T{fmt}` took longer than {timeout:g} s; show fewer nodes "
            "(max_nodes=, select=, scope=, collapse=True) or render to .dot"
        ) from None
    if done.returncode != 0:
        message = done.stderr.decode("utf-8", "replace").strip()
        raise RenderError(f"`dot -T{fmt}` failed (exit {done.returncode}): {message}")
    return done.stdout


def render_source(source: str, path: str | os.PathLike[str], timeout: float = 120.0) -> Path:
    """Write DOT `source` to `path` in the format its suffix names; returns the path.

    `.dot`/`.gv` write the text. Other formats run `dot`; when it is missing, the
    source is written next to `path` with a `.dot` suffix and `GraphvizNotFoundError`
    says where.
    """
    path = Path(path)
    fmt = format_of(path)
    if fmt in ("dot", "gv"):
        _write_whole(path, source.encode("utf-8"))
        return path
    try:
        data = _run_dot(source, fmt, timeout)
    except RenderError as err:
        fallback = path.with_suffix(".dot")
        fallback.write_text(source, encoding="utf-8")
        message = (
            f"cannot render {path}: {err}\nThe DOT source was written to {fallback}; "
            f"render it later with `dot -T{fmt} {fallback} -o {path}`."
        )
        if isinstance(err, GraphvizNotFoundError):
            raise GraphvizNotFoundError(message, fallback) from None
        raise RenderError(message) from None
    _write_whole(path, data)
    return path


def _write_whole(path: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, then rename it over `path`: a
    failed write never leaves part of a picture there."""
    temporary = path.with_name(f".{path.stem}.einpage-{os.getpid()}{path.suffix}")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def svg_source(source: str, timeout: float = 30.0) -> str:
    """DOT `source` rendered to SVG text (needs `dot`)."""
    return _run_dot(source, "svg", timeout).decode("utf-8")


REPR_TIMEOUT = 20.0
"""Seconds a notebook display may spend in `dot` before giving up."""


def repr_svg(make_source: Callable[[], str]) -> str | None:
    """SVG for a notebook's `_repr_svg_`, or None (the notebook then shows the text repr)
    with a warning when `dot` is missing, fails or takes longer than `REPR_TIMEOUT`."""
    if find_dot() is None:
        warnings.warn(
            f"cannot draw this graph: Graphviz's `dot` program is not on PATH; {INSTALL_HINT}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    try:
        return svg_source(make_source(), timeout=REPR_TIMEOUT)
    except RenderError as err:
        warnings.warn(f"cannot draw this graph: {err}", RuntimeWarning, stacklevel=3)
        return None
