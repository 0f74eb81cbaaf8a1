"""The shared DOT helper: escaping, clusters, selection, and running (or missing) `dot`."""

from __future__ import annotations

import pytest
from inspect_fixtures import WEIRD, mlp_graph

from einpage.errors import EinpageError
from einpage_core.dot import (
    DotGraph,
    GraphvizNotFoundError,
    Html,
    Line,
    RenderError,
    describe_ids,
    escape_html,
    find_dot,
    format_of,
    html_label,
    in_scope,
    quote,
    render_source,
    repr_svg,
    select_ids,
)

needs_dot = pytest.mark.skipif(find_dot() is None, reason="Graphviz's dot is not installed")


def test_quote_escapes_backslashes_quotes_and_newlines():
    assert quote('say "hi"') == r'"say \"hi\""'
    assert quote("a\\b") == r'"a\\b"'
    assert quote("one\ntwo\r\nthree") == r'"one\ntwo\nthree"'
    assert quote("{x|<y>}") == '"{x|<y>}"'  # only special in record labels, not used here


def test_html_escaping_leaves_braces_and_bars_literal():
    assert escape_html("ab,b->a") == "ab,b-&gt;a"
    assert escape_html('<&">') == "&lt;&amp;&quot;&gt;"
    assert escape_html("{c|d}") == "{c|d}"
    assert escape_html("1\n2") == '1<br align="center"/>2'


def test_html_label_styles_lines():
    label = html_label([Line("%3 einsum", "title"), Line("ij->i", "mono"), Line("x", "note")])
    assert isinstance(label, Html)
    assert label.startswith("<b>%3 einsum</b><br/>")
    assert '<font face="Courier">ij-&gt;i</font>' in label
    assert 'point-size="9"' in label


def test_html_attribute_is_written_in_angle_brackets_and_strings_quoted():
    graph = DotGraph("g", clusters=False)
    graph.add_node("a", label=Html("<b>x</b>"), tooltip=WEIRD, width=0.5, fixedsize=True)
    text = graph.source()
    assert '"a" [label=<<b>x</b>>, tooltip=' in text
    assert r'tooltip="a \"q\" <b> {c|d} & e\\f\nline2"' in text
    assert "width=0.5, fixedsize=true" in text


def test_clusters_nest_by_scope_and_merge_lone_wrappers():
    graph = DotGraph("g")
    graph.add_node("a", "layers.0.attn")
    graph.add_node("b", "layers.0.mlp")
    graph.add_node("c", "layers.1")
    graph.add_node("d", "")
    text = graph.source()
    labels = [line.strip() for line in text.splitlines() if line.strip().startswith("label=")]
    assert [lab.split(";")[0] for lab in labels] == [
        'label="layers"',
        'label="layers.0"',
        'label="layers.0.attn"',
        'label="layers.0.mlp"',
        'label="layers.1"',
    ]
    lone = DotGraph("g")
    lone.add_node("a", "layers.3.attn")
    assert lone.source().count("subgraph cluster_") == 1
    assert 'label="layers.3.attn"' in lone.source()


def test_cluster_depth_and_no_clusters():
    deep = DotGraph("g", clusters=2)
    deep.add_node("a", "layers.0.attn")
    deep.add_node("b", "layers.0.mlp")
    assert deep.source().count("subgraph cluster_") == 1
    assert 'label="layers.0"' in deep.source()
    flat = DotGraph("g", clusters=False)
    flat.add_node("a", "layers.0.attn")
    assert "subgraph" not in flat.source()


def test_in_scope_matches_whole_components():
    assert in_scope("layers.3", "layers.3")
    assert in_scope("layers.3.attn", "layers.3")
    assert not in_scope("layers.30", "layers.3")
    assert not in_scope("", "layers")


def test_describe_ids_as_ranges():
    assert describe_ids([4, 5, 6, 9], "%") == "%4–%6, %9"
    assert describe_ids([1, 3, 5, 7, 9], "n", runs=2) == "n1, n3, … (5 ranges)"


def test_select_ids_caps_and_validates():
    scopes = ["", "a", "a.b", "b", "a"]
    picked = select_ids(5, None, "a", scopes.__getitem__, 2, "task")
    assert picked.shown == (1, 2) and picked.omitted == (4,)
    assert select_ids(5, range(1, 3), None, scopes.__getitem__, None, "task").shown == (1, 2)
    assert select_ids(5, lambda i: i % 2 == 0, None, scopes.__getitem__, None, "t").shown == (
        0,
        2,
        4,
    )
    assert select_ids(5, None, None, scopes.__getitem__, None, "t", hidden={0, 1}).shown == (
        2,
        3,
        4,
    )
    with pytest.raises(RenderError, match=r"task id 7 is out of range; valid ids are 0..4"):
        select_ids(5, [7], None, scopes.__getitem__, None, "task")
    with pytest.raises(RenderError, match="max_nodes must be a positive int"):
        select_ids(5, None, None, scopes.__getitem__, 0, "task")


def test_format_from_suffix():
    assert format_of("plan.SVG") == "svg"
    assert format_of("a/b/plan.gv") == "gv"
    with pytest.raises(RenderError, match=r"unknown format 'jpeg'.*\.svg, \.png, \.pdf"):
        format_of("plan.jpeg")


def test_dot_suffix_needs_no_graphviz(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_dot() is None
    out = render_source("digraph g { a -> b }\n", tmp_path / "g.dot")
    assert out.read_text() == "digraph g { a -> b }\n"


@pytest.mark.parametrize("suffix", ["svg", "png", "pdf"])
def test_missing_dot_raises_typed_error_and_leaves_dot_source(tmp_path, monkeypatch, suffix):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    target = tmp_path / f"tg.{suffix}"
    with pytest.raises(GraphvizNotFoundError) as info:
        mlp_graph().render(target)
    err = info.value
    assert isinstance(err, EinpageError) and isinstance(err, RenderError)
    assert "apt-get install graphviz" in str(err) and "brew install graphviz" in str(err)
    assert err.dot_path == tmp_path / "tg.dot"
    assert str(err.dot_path) in str(err)
    assert err.dot_path.read_text().startswith('digraph "mlp" {')
    assert not target.exists()


def test_repr_svg_without_dot_warns_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.warns(RuntimeWarning, match="apt-get install graphviz"):
        assert mlp_graph()._repr_svg_() is None


@needs_dot
def test_dot_failure_is_a_render_error(tmp_path):
    with pytest.raises(RenderError, match=r"dot -Tsvg.*failed") as info:
        render_source("digraph { this is not dot", tmp_path / "bad.svg")
    assert not isinstance(info.value, GraphvizNotFoundError)
    assert (tmp_path / "bad.dot").exists()


@needs_dot
def test_repr_svg_returns_none_on_dot_errors():
    with pytest.warns(RuntimeWarning, match="cannot draw this graph"):
        assert repr_svg(lambda: "digraph { broken") is None


# -- where the helpers live ------------------------------------------------------------


def test_taskgraph_dot_is_an_alias_of_the_shared_helpers():
    import einpage_core.dot
    import taskgraph.dot
    import taskgraph.render

    for name in einpage_core.dot.__all__:
        assert getattr(taskgraph.dot, name) is getattr(einpage_core.dot, name), name
    for name in ("DEFAULT_MAX_NODES", "REPR_MAX_NODES", "NodeStyle", "op_lines", "task_lines"):
        assert name in taskgraph.render.__all__
    assert taskgraph.render.NodeStyle is einpage_core.dot.NodeStyle


def test_drawing_helpers_are_a_leaf_and_memgraph_draws_without_taskgraphs_renderer():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import einpage_core.dot\n"
        "project = ('einpage', 'taskgraph', 'memgraph', 'runtime')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in project)\n"
        "assert loaded == [], loaded\n"
        "import memgraph.render\n"
        "assert 'taskgraph.render' not in sys.modules and 'taskgraph.dot' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_docstring_examples_run():
    import doctest

    import einpage_core.dot

    assert doctest.testmod(einpage_core.dot, optionflags=doctest.ELLIPSIS).failed == 0
