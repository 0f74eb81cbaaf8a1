"""A scope no node is in is an error naming the scopes there are (closest first), not
an empty picture and exit 0."""

from __future__ import annotations

import pytest

import memgraph
from einpage.cli.commands import main
from einpage.cli.presets import load_program
from einpage_core.errors import RenderError
from memgraph.render import render_memgraph
from taskgraph.render import render_taskgraph


def test_an_unknown_scope_names_the_closest_scopes(tmp_path):
    tg = load_program("llama:tiny", batch=1, seq=8)
    with pytest.raises(RenderError, match=r"'layers\.9' holds no node; closest scopes: layers\.1"):
        render_taskgraph(tg, tmp_path / "g.dot", scope="layers.9")
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    with pytest.raises(RenderError, match="closest scopes: layers.0.attn"):
        render_memgraph(mg, tmp_path / "p.dot", scope="layers.0.atn")
    assert not (tmp_path / "g.dot").exists() and not (tmp_path / "p.dot").exists()
    render_taskgraph(tg, tmp_path / "ok.dot", scope="layers.1")  # a scope that exists


def test_the_cli_exits_with_an_error_for_an_unknown_scope(tmp_path, capsys):
    graph = tmp_path / "tiny.json"
    graph.write_text(load_program("llama:tiny", batch=1, seq=8).to_json())
    code = main(["render", str(graph), "-o", str(tmp_path / "g.dot"), "--scope", "layers.9"])
    assert code != 0
    err = capsys.readouterr().err
    assert "closest scopes" in err and "layers.1" in err
