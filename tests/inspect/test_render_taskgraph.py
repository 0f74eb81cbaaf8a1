"""TaskGraph pictures: node styles and labels per kind, clusters, selection, caps, output."""

from __future__ import annotations

import re

import pytest
from inspect_fixtures import all_kinds_graph, cluster_labels, dot_edges, dot_nodes, mlp_graph

from einpage_core.dot import find_dot
from taskgraph import TaskGraph
from taskgraph.render import TASK_STYLES, render_taskgraph, taskgraph_dot, taskgraph_svg

needs_dot = pytest.mark.skipif(find_dot() is None, reason="Graphviz's dot is not installed")

EXPECTED_KIND = {
    0: "activation",
    1: "weight",
    2: "activation",
    3: "einsum",
    4: "einsum",
    5: "einsum",
    6: "fill",
    7: "gather",
    8: "view",
    9: "slice",
    10: "concat",
}


@pytest.fixture(scope="module")
def kinds() -> TaskGraph:
    return all_kinds_graph()


def test_every_task_is_a_node_styled_by_kind(kinds):
    nodes = dot_nodes(taskgraph_dot(kinds))
    for task_id, kind in EXPECTED_KIND.items():
        attrs = nodes[f"t{task_id}"]
        style = TASK_STYLES[kind]
        assert f'shape="{style.shape}"' in attrs, (task_id, attrs)
        assert f'fillcolor="{style.fillcolor}"' in attrs
    assert len({TASK_STYLES[k].shape + TASK_STYLES[k].fillcolor for k in TASK_STYLES}) == len(
        TASK_STYLES
    )


def test_labels_say_spec_join_agg_type_size_and_flops(kinds):
    nodes = dot_nodes(taskgraph_dot(kinds))
    assert "bd,df-&gt;bf" in nodes["t3"] and "f32[4,8]  128 B" in nodes["t3"]
    assert "384 FLOP" in nodes["t3"] and "join:" not in nodes["t3"]
    assert "agg: max" in nodes["t4"]
    assert "join: exp(a - b)" in nodes["t5"]
    assert "input &quot;w&quot;" in nodes["t1"] and "weight, starts on host" in nodes["t1"]
    assert "causal -inf" in nodes["t6"]
    assert "starts [0, 2]" in nodes["t9"] and "axis 0" in nodes["t10"]
    assert "FLOP" not in nodes["t8"]  # a view costs nothing
    assert 'tooltip="%3 : f32[4,8] = einsum[\\"bd,df->bf\\"](%0, %1)' in nodes["t3"]


def test_weird_label_is_escaped(kinds):
    attrs = dot_nodes(taskgraph_dot(kinds))["t5"]
    assert "a &quot;q&quot; &lt;b&gt; {c|d} &amp; e\\f" in attrs
    label = re.search(r"label=<(.*)>, tooltip", attrs)[1]
    assert 'a "q"' not in label and "<b> {c" not in label and "& e" not in label


def test_edges_and_outputs(kinds):
    text = taskgraph_dot(kinds)
    edges = dot_edges(text)
    expected = {(f"t{i}", f"t{t.id}") for t in kinds for i in t.inputs}
    outputs = {(f"t{tid}", f"out_{k}") for k, tid in enumerate(kinds.outputs.values())}
    assert set(edges) == expected | outputs
    assert "dashed" in edges[("t5", "t8")]  # into a view
    nodes = dot_nodes(text)
    assert "output &quot;mask&quot;" in nodes["out_3"]


def test_clusters_per_scope(kinds):
    labels = cluster_labels(taskgraph_dot(kinds))
    assert labels == ["layers.0", "layers.0.attn", "layers.0.mlp"]
    assert cluster_labels(taskgraph_dot(kinds, clusters=2)) == ["layers.0"]
    assert cluster_labels(taskgraph_dot(kinds, clusters=False)) == []


def test_legend_lists_kinds_drawn(kinds):
    text = taskgraph_dot(mlp_graph())
    legend = dot_nodes(text, legend=True)
    names = [v for k, v in legend.items() if k.startswith("legend_node_")]
    assert any('label="weight input"' in v for v in names)
    assert not any('label="gather"' in v for v in names)
    assert "legend_node" not in taskgraph_dot(kinds, legend=False)


def test_scope_selection_draws_operands_from_outside_as_stubs():
    tg = mlp_graph(layers=3)
    text = taskgraph_dot(tg, scope="layers.1")
    nodes = dot_nodes(text)
    inside = {f"t{t.id}" for t in tg if t.scope == "layers.1"}
    stubs = {k for k, v in nodes.items() if "dashed" in v and k not in inside}
    assert inside <= set(nodes)
    assert stubs and all("outside the selection" in nodes[s] for s in stubs)
    assert set(nodes) == inside | stubs
    assert "omitted" not in nodes


def test_range_selection_and_predicate():
    tg = mlp_graph()
    nodes = dot_nodes(taskgraph_dot(tg, select=range(3, 5)))
    assert {"t3", "t4"} <= set(nodes)
    assert "t6" not in nodes
    by_kind = dot_nodes(taskgraph_dot(tg, select=lambda t: t.kind == "input"))
    assert set(by_kind) == {f"t{i}" for i in tg.inputs.values()}


def test_cap_adds_a_note_saying_what_was_left_out():
    tg = mlp_graph(layers=4)
    text = taskgraph_dot(tg, max_nodes=5)
    nodes = dot_nodes(text)
    drawn = [k for k in nodes if re.fullmatch(r"t\d+", k) and "outside" not in nodes[k]]
    assert len(drawn) == 5
    note = nodes["omitted"]
    assert f"{len(tg) - 5} more task(s) not shown: %5–%{len(tg) - 1}" in note
    assert "max_nodes=5" in note
    assert ("t4", "omitted") in dot_edges(text)


def test_dot_is_deterministic_and_survives_json(kinds):
    again = TaskGraph.from_json(kinds.to_json())
    assert taskgraph_dot(kinds) == taskgraph_dot(all_kinds_graph()) == taskgraph_dot(again)
    assert kinds.to_dot(rankdir="LR") == taskgraph_dot(kinds, rankdir="LR")


@needs_dot
@pytest.mark.parametrize("suffix", ["svg", "png", "pdf", "dot"])
def test_render_formats(tmp_path, kinds, suffix):
    out = render_taskgraph(kinds, tmp_path / f"kinds.{suffix}")
    data = out.read_bytes()
    magic = {"svg": b"<?xml", "png": b"\x89PNG", "pdf": b"%PDF", "dot": b"digraph"}
    assert data.startswith(magic[suffix])


@needs_dot
def test_svg_shows_escaped_text(kinds):
    svg = taskgraph_svg(kinds)
    assert "&lt;b&gt; {c|d} &amp; e\\f" in svg
    assert "bd,df&#45;&gt;bf" in svg or "bd,df-&gt;bf" in svg


@needs_dot
def test_repr_svg_is_svg_text(kinds):
    svg = kinds._repr_svg_()
    assert isinstance(svg, str) and "<svg" in svg and "</svg>" in svg


@needs_dot
def test_repr_svg_of_a_large_graph_is_capped():
    tg = mlp_graph(layers=80)
    assert len(tg) > 200
    svg = tg._repr_svg_()
    assert "more task(s) not shown" in svg
