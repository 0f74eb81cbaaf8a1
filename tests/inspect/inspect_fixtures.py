"""Small programs and plans for the rendering and plotting tests, and DOT-reading helpers."""

from __future__ import annotations

import re

import einpage as ep
from memgraph import MemGraph
from taskgraph import TaskGraph

WEIRD = 'a "q" <b> {c|d} & e\\f\nline2'
"""A label with every character DOT and HTML-like labels treat specially."""


def mlp_graph(layers: int = 2) -> TaskGraph:
    """A small MLP with one scope per layer (`layers.0`, ...) and a softmax head."""
    prog = ep.Program("mlp")
    h = prog.input("x", (8, 32))
    for i in range(layers):
        with prog.scope(f"layers.{i}"):
            w = prog.input(f"w{i}", (32, 32), role="weight")
            h = ep.gelu(h @ w)
    prog.output(ep.softmax(h), "y")
    return prog.build()


def mlp_plan(offload: bool = True) -> MemGraph:
    from plans import reference_plan

    tg = mlp_graph()
    chosen = frozenset(t.id for t in tg if t.kind == "einsum" and t.id % 3 == 0)
    return reference_plan(tg, offload=chosen if offload else frozenset())


def all_kinds_graph() -> TaskGraph:
    """Every task kind, nested scopes, a weird label and an einsum with join and agg."""
    prog = ep.Program("kinds")
    x = prog.input("x", (4, 6))
    w = prog.input("w", (6, 8), role="weight")
    ids = prog.input("ids", (3,), dtype="int32")
    with prog.scope("layers.0.attn"):
        h = prog.einsum("bd,df->bf", x, w)
        m = prog.einsum("bf->b", h, agg="max")
        e = prog.einsum("bf,b->bf", h, m, join="exp(a - b)", label=WEIRD)
    with prog.scope("layers.0.mlp"):
        mask = prog.fill((8, 8), float("-inf"), pattern="causal")
        g = prog.gather(w, ids)
        v = prog.view(e, (32,))
        s = prog.slice(e, (0, 2), (2, 4))
        c = prog.concat([g, e], axis=0)
    prog.output(c, "c")
    prog.output(v, "v")
    prog.output(s, "s")
    prog.output(mask, "mask")
    return prog.build()


_NODE = re.compile(r'^\s*"(?P<id>[^"]+)" \[(?P<attrs>.*)\];$')
_EDGE = re.compile(r'^\s*"(?P<src>[^"]+)" -> "(?P<dst>[^"]+)"(?: \[(?P<attrs>.*)\])?;$')


def dot_nodes(text: str, legend: bool = False) -> dict[str, str]:
    """Node id -> its attribute text, from DOT written by einpage (legend samples left
    out unless asked for)."""
    out = {}
    for line in text.splitlines():
        match = _NODE.match(line)
        if match and (legend or not match["id"].startswith("legend_")):
            out[match["id"]] = match["attrs"]
    return out


def dot_edges(text: str) -> dict[tuple[str, str], str]:
    """(src, dst) -> attribute text of the edges, legend samples left out."""
    out = {}
    for line in text.splitlines():
        match = _EDGE.match(line)
        if match and not match["src"].startswith("legend_"):
            out[(match["src"], match["dst"])] = match["attrs"] or ""
    return out


def cluster_labels(text: str) -> list[str]:
    return re.findall(r'^\s*label="((?:[^"\\]|\\.)*)"; tooltip=', text, flags=re.M)
