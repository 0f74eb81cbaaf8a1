"""MemGraph pictures: node styles, edge classes, collapse, selection, caps and clusters."""

from __future__ import annotations

import re

import pytest
from inspect_fixtures import cluster_labels, dot_edges, dot_nodes, mlp_graph, mlp_plan
from plans import reference_plan

from einpage_core.dot import find_dot
from memgraph import MemGraph, MemNode, NodeKind, Region, verify
from memgraph.render import (
    DEP_STYLES,
    MEM_STYLES,
    DepKind,
    classify_dep,
    memgraph_dot,
    render_memgraph,
    style_kind,
)

needs_dot = pytest.mark.skipif(find_dot() is None, reason="Graphviz's dot is not installed")

K = NodeKind
R = Region(0, 256)


@pytest.fixture(scope="module")
def plan() -> MemGraph:
    mg = mlp_plan()
    verify(mg)
    assert mg.stats.offload_count and mg.stats.reload_count
    return mg


def node(kind: NodeKind, node_id: int = 0) -> MemNode:
    storage = 0 if kind in (K.OFFLOAD, K.RELOAD) else None
    return MemNode(node_id, kind, tensor=1, region=R, storage=storage)


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        (K.APPLY, K.APPLY, DepKind.DATA),
        (K.RELOAD, K.APPLY, DepKind.DATA),
        (K.INPUT, K.APPLY, DepKind.DATA),
        (K.APPLY, K.OFFLOAD, DepKind.DATA),
        (K.OFFLOAD, K.RELOAD, DepKind.DATA),
        (K.INPUT, K.RELOAD, DepKind.DATA),
        (K.APPLY, K.OUTPUT, DepKind.DATA),
        (K.OFFLOAD, K.OUTPUT, DepKind.DATA),
        (K.FREE, K.ALLOC, DepKind.MEMORY),
        (K.APPLY, K.FREE, DepKind.MEMORY),
        (K.OFFLOAD, K.FREE, DepKind.MEMORY),
        (K.OUTPUT, K.FREE, DepKind.MEMORY),
        (K.ALLOC, K.APPLY, DepKind.ALLOC),
        (K.ALLOC, K.RELOAD, DepKind.ALLOC),
        (K.ALLOC, K.FREE, DepKind.ALLOC),
        (K.APPLY, K.ALLOC, DepKind.ORDER),
        (K.OUTPUT, K.APPLY, DepKind.ORDER),
    ],
)
def test_classify_dep(src, dst, expected):
    assert classify_dep(node(src), node(dst, 1)) is expected


def test_every_node_drawn_with_its_kind_style_and_label(plan):
    nodes = dot_nodes(memgraph_dot(plan, fold_layers=False, max_nodes=None))
    assert len(nodes) == len(plan)
    for n in plan:
        attrs = nodes[f"n{n.id}"]
        style = MEM_STYLES[style_kind(n)]
        assert f'shape="{style.shape}"' in attrs and f'fillcolor="{style.fillcolor}"' in attrs
        assert f"<b>n{n.id} {n.kind}" in attrs
        if n.region is not None:
            assert str(n.region) in attrs
        if n.storage is not None:
            assert f"host#{n.storage}" in attrs
    apply = next(n for n in plan if n.kind is K.APPLY and plan.taskgraph[n.tensor].kind == "einsum")
    spec = str(plan.taskgraph[apply.tensor].op.spec).replace(">", "&gt;")
    assert spec in nodes[f"n{apply.id}"]
    assert len({s.shape + s.fillcolor for s in MEM_STYLES.values()}) == len(MEM_STYLES)


def test_every_dependency_is_an_edge_styled_by_its_class(plan):
    edges = dot_edges(memgraph_dot(plan, fold_layers=False, max_nodes=None))
    expected = {}
    for n in plan:
        for d in n.deps:
            expected[(f"n{d}", f"n{n.id}")] = classify_dep(plan[d], n)
    assert set(edges) == set(expected)
    seen = set()
    for key, cls in expected.items():
        for name, value in DEP_STYLES[cls][1].items():
            assert f"{name}={value!r}".replace("'", '"') in edges[key] or (
                f"{name}={value}" in edges[key]
            ), (key, cls, edges[key])
        seen.add(cls)
    assert seen == {DepKind.DATA, DepKind.MEMORY, DepKind.ALLOC}
    styles = {tuple(sorted(attrs.items())) for _, attrs in DEP_STYLES.values()}
    assert len(styles) == len(DEP_STYLES)


def test_legend_has_node_kinds_and_edge_classes(plan):
    legend = dot_nodes(memgraph_dot(plan), legend=True)
    texts = " ".join(v for k, v in legend.items() if k.startswith("legend_"))
    for words in ("reload (host to device)", "offload (device to host)", "free", "alloc"):
        assert f'label="{words}"' in texts
    for words in ("data: read-after-write", "memory: write-after-read"):
        assert words in texts


def test_collapse_folds_allocs_and_frees(plan):
    text = memgraph_dot(plan, fold_layers=False, collapse=True, max_nodes=None)
    nodes = dot_nodes(text)
    kinds = {plan[int(k[1:])].kind for k in nodes}
    assert K.ALLOC not in kinds and K.FREE not in kinds
    assert {K.APPLY, K.RELOAD, K.OFFLOAD, K.INPUT, K.OUTPUT} <= kinds
    frees = sum(len(re.findall(r"%\d+", m)) for m in re.findall(r"then frees ([^<]*)", text))
    assert frees == len(plan.of_kind(K.FREE))
    edges = dot_edges(text)
    assert all(int(s[1:]) < int(d[1:]) for s, d in edges)  # forward, no self-loops
    assert all(s in nodes and d in nodes for s, d in edges)
    assert not any('color="#9e9e9e"' in a for a in edges.values())  # no alloc edges left
    unpruned = dot_edges(
        memgraph_dot(plan, fold_layers=False, collapse=True, prune=False, max_nodes=None)
    )
    assert any('color="#cb181d"' in a for a in unpruned.values())  # region reuse edges


def _reaches(edges, src, dst):
    stack, seen = [src], {src}
    while stack:
        here = stack.pop()
        if here == dst:
            return True
        for s, d in edges:
            if s == here and d not in seen:
                seen.add(d)
                stack.append(d)
    return False


@pytest.mark.parametrize("collapse", [False, True])
def test_pruning_keeps_the_partial_order_and_all_data_edges(plan, collapse):
    full = dot_edges(
        memgraph_dot(plan, fold_layers=False, collapse=collapse, prune=False, max_nodes=None)
    )
    pruned = dot_edges(
        memgraph_dot(plan, fold_layers=False, collapse=collapse, prune=True, max_nodes=None)
    )
    assert set(pruned) < set(full)
    data = DEP_STYLES[DepKind.DATA][1]["color"]
    assert {k for k, a in full.items() if data in a} <= set(pruned)
    for src, dst in set(full) - set(pruned):
        assert _reaches(pruned, src, dst), (src, dst)
    default = dot_edges(memgraph_dot(plan, fold_layers=False, collapse=collapse, max_nodes=None))
    assert default == (pruned if collapse else full)


def test_scope_selection_and_clusters():
    tg = mlp_graph(layers=3)
    mg = reference_plan(tg, offload=frozenset({4}))
    text = memgraph_dot(mg, scope="layers.1", max_nodes=None)
    nodes = dot_nodes(text)
    inside = {f"n{n.id}" for n in mg if tg[n.tensor].scope == "layers.1"}
    assert inside and inside <= set(nodes)
    for extra in set(nodes) - inside:
        assert "outside the selection" in nodes[extra] and "dashed" in nodes[extra]
    assert cluster_labels(text) == ["layers.1"]
    everything = memgraph_dot(mg, fold_layers=False, max_nodes=None)
    assert cluster_labels(everything) == ["layers", "layers.0", "layers.1", "layers.2"]


def test_a_whole_layered_plan_folds_each_layer_into_a_box_with_a_note():
    tg = mlp_graph(layers=3)
    mg = reference_plan(tg, offload=frozenset({4}))
    text = memgraph_dot(mg, max_nodes=None)
    nodes = dot_nodes(text)
    boxes = {k: v for k, v in nodes.items() if "box3d" in v}
    assert len(boxes) == 3
    for layer in ("layers.0", "layers.1", "layers.2"):
        ids = [n.id for n in mg if n.tensor is not None and tg[n.tensor].scope == layer]
        (box,) = [v for v in boxes.values() if f">{layer}<" in v]
        assert f"{len(ids)} nodes:" in box and f"--scope {layer}" in box
        assert f"n{ids[0]}" in boxes  # the box stands where the layer's first node was
        assert not any(f"n{i}" in nodes for i in ids[1:])  # its other nodes are folded
    note = nodes["layers_note"]
    assert "3 layers folded" in note and "scope='layers.0'" in note and "--unfold" in note
    legend = dot_nodes(text, legend=True)
    assert any("a folded layer" in v for k, v in legend.items() if k.startswith("legend_"))
    # nodes outside any layer are drawn as they are, and every edge ends at a drawn node
    outside = [n.id for n in mg if n.tensor is None or not tg[n.tensor].scope]
    assert all(f"n{i}" in nodes for i in outside)
    assert all(src in nodes and dst in nodes for src, dst in dot_edges(text))
    # a selection, a scope or fold_layers=False draws nodes, not boxes
    for options in ({"fold_layers": False}, {"scope": "layers.1"}, {"select": range(40)}):
        assert "box3d" not in memgraph_dot(mg, max_nodes=None, **options).split("legend")[0]


def test_a_plan_with_one_layer_is_not_folded():
    mg = reference_plan(mlp_graph(layers=1), offload=frozenset())
    assert memgraph_dot(mg) == memgraph_dot(mg, fold_layers=False)


def test_range_selection_with_collapse(plan):
    text = memgraph_dot(plan, select=range(5, 20), collapse=True)
    nodes = dot_nodes(text)
    drawn = {k for k, v in nodes.items() if "outside the selection" not in v}
    assert drawn and all(5 <= int(k[1:]) < 20 for k in drawn)
    assert all(plan[int(k[1:])].kind not in (K.ALLOC, K.FREE) for k in drawn)


def test_predicate_selection(plan):
    nodes = dot_nodes(memgraph_dot(plan, select=lambda n: n.kind is K.RELOAD))
    drawn = {k for k, v in nodes.items() if "outside the selection" not in v}
    assert drawn == {f"n{n.id}" for n in plan.of_kind(K.RELOAD)}


def test_cap_note(plan):
    text = memgraph_dot(plan, fold_layers=False, max_nodes=10)
    nodes = dot_nodes(text)
    drawn = [k for k in nodes if re.fullmatch(r"n\d+", k)]
    assert sorted(drawn, key=lambda k: int(k[1:])) == [f"n{i}" for i in range(10)]
    assert f"{len(plan) - 10} more node(s) not shown: n10–n{len(plan) - 1}" in nodes["omitted"]
    assert any(d == "omitted" for _, d in dot_edges(text))


def test_deterministic_and_stable_through_json(plan):
    again = MemGraph.from_json(plan.to_json())
    assert memgraph_dot(plan) == memgraph_dot(mlp_plan()) == memgraph_dot(again)
    assert plan.to_dot(collapse=True) == memgraph_dot(plan, collapse=True)


@needs_dot
@pytest.mark.parametrize("collapse", [False, True])
def test_render_svg_and_png(tmp_path, plan, collapse):
    svg = render_memgraph(plan, tmp_path / "plan.svg", collapse=collapse)
    png = plan.render(tmp_path / "plan.png", collapse=collapse)
    assert svg.read_text().lstrip().startswith("<?xml") and "</svg>" in svg.read_text()
    assert png.read_bytes().startswith(b"\x89PNG")


@needs_dot
def test_repr_svg(plan):
    svg = plan._repr_svg_()
    assert "<svg" in svg and "n0 alloc" in svg


def test_collapsed_picture_keeps_the_region_reuse_that_orders_a_prefetch():
    from einpage.cli.demo import mlp_program

    mg = reference_plan(mlp_program(layers=3).build(), offload=frozenset({5, 10}))
    edges = dot_edges(memgraph_dot(mg, fold_layers=False, collapse=True))
    memory = [(int(s[1:]), int(d[1:])) for (s, d), a in edges.items() if "#cb181d" in a]
    assert memory
    # e.g. the reload of w2 waits for the apply that last read w1's region
    assert any(mg[s].kind is K.APPLY and mg[d].kind is K.RELOAD for s, d in memory)


def test_collapse_keeps_allocs_and_frees_it_cannot_fold():
    from memgraph import MemGraphBuilder

    tg = mlp_graph()
    b = MemGraphBuilder(tg, budget=4096)
    alloc = b.alloc(0, Region(0, 1024))
    b.free(0, Region(0, 1024), deps=[alloc])  # nothing wrote the region: nothing to fold into
    edges = dot_edges(memgraph_dot(b.build(), collapse=True))
    assert set(edges) == {("n0", "n1")}
