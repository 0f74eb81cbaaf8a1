"""The MemGraph IR: nodes, printing, statistics, builder and JSON."""

from __future__ import annotations

import json

import pytest
from plans import reference_plan, two_output_mlp

from einpage.errors import GraphError, SerializationError
from memgraph import MemGraph, MemGraphBuilder, NodeKind, Region, verify


def test_region():
    r = Region(0x3A000000, 256 * 2**20)
    assert str(r) == "[0x3a000000, +256.0 MiB)"
    assert r.end == 0x3A000000 + 256 * 2**20
    assert r.overlaps(Region(r.end - 1, 1)) and not r.overlaps(Region(r.end, 1))


def test_node_lines_and_graph_listing():
    mg = reference_plan(two_output_mlp(), offload=frozenset({3}))
    text = str(mg)
    assert text.splitlines()[0].startswith("MemGraph 'mlp': ")
    lines = {n.kind: n.line() for n in mg.nodes}
    assert lines[NodeKind.INPUT].startswith("n") and 'input "' in lines[NodeKind.INPUT]
    assert " -> host#" in lines[NodeKind.OFFLOAD]
    reload = mg.of_kind(NodeKind.RELOAD)[0]
    assert reload.line() == (
        f"n{reload.id}: reload %{reload.tensor} host#{reload.storage} -> "
        f"{reload.region}  after {', '.join(f'n{d}' for d in reload.deps)}"
    )
    assert repr(mg).startswith("<MemGraph 'mlp' nodes=")
    assert reload.stream == "h2d" and mg.of_kind(NodeKind.APPLY)[0].stream == "compute"


def test_stats_count_transfers_and_drops():
    tg = two_output_mlp()
    mg = reference_plan(tg, offload=frozenset({3}))
    s = mg.stats
    assert s.offload_count == 1 and s.offload_bytes == tg[3].nbytes
    # Weights are dropped after each use and reloaded: their reloads are not offloads.
    weights = [tg.inputs["w1"], tg.inputs["w2"]]
    assert s.reload_count == 1 + len(weights)
    assert s.drop_count == 0  # every weight is used once, so no drop is reloaded later
    assert s.peak_bytes <= s.high_water <= mg.budget
    assert s.node_count == len(mg) and s.apply_count == len(mg.of_kind(NodeKind.APPLY))
    rows = dict(s.rows())
    assert rows["offloaded"].endswith("in 1")
    assert "budget" in str(s)


def test_stats_count_drops_of_reused_weights():
    import einpage as ep

    prog = ep.Program()
    x = prog.input("x", (2, 4))
    w = prog.input("w", (4, 4), role="weight")
    prog.output((x @ w) @ w, "y")
    mg = reference_plan(prog.build())
    assert mg.stats.drop_count == 1 and mg.stats.drop_bytes == 64
    assert mg.stats.reload_count == 2


def test_builder_rejects_forward_dependencies():
    b = MemGraphBuilder(two_output_mlp(), budget=1024)
    b.alloc(0, Region(0, 256))
    with pytest.raises(GraphError, match="must be earlier nodes"):
        b.free(0, Region(0, 256), deps=[1])


def test_json_round_trip():
    mg = reference_plan(two_output_mlp(), offload=frozenset({3, 5}), outputs_to_host=True)
    text = mg.to_json()
    again = MemGraph.from_json(text)
    assert again.nodes == mg.nodes
    assert again.taskgraph.tasks == mg.taskgraph.tasks
    assert (again.budget, again.alignment, dict(again.info)) == (
        mg.budget,
        mg.alignment,
        dict(mg.info),
    )
    assert again.to_json() == text
    verify(again)


def first_input(data):
    return next(n for n in data["nodes"] if n["kind"] == "input")


def corrupted(edit):
    data = json.loads(reference_plan(two_output_mlp()).to_json())
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format="x"), r"\$.format: expected 'einpage.memgraph'"),
        (lambda d: d.update(budget=0), r"\$.budget: expected an integer >= 1"),
        (lambda d: d.pop("taskgraph"), r"\$.taskgraph: missing"),
        (lambda d: d["taskgraph"].update(version=9), r"\$.taskgraph.version"),
        (lambda d: d.update(nodes={}), r"\$.nodes: expected a list"),
        (lambda d: d["nodes"][1].update(kind="copy"), r"\$.nodes\[1\].kind: unknown kind 'copy'"),
        (lambda d: d["nodes"][1].update(id=5), r"\$.nodes\[1\].id: expected 1"),
        (
            lambda d: d["nodes"][1].update(deps=[1]),
            r"\$.nodes\[1\].deps\[0\]: n1 is not an earlier",
        ),
        (lambda d: d["nodes"][1].update(tensor=500), r"\$.nodes\[1\].tensor: %500 is not a task"),
        (lambda d: d["nodes"][1].update(bogus=1), r"unknown key\(s\) \['bogus'\]"),
        (lambda d: first_input(d).pop("name"), r"missing key\(s\) \['name'\]"),
        (
            lambda d: first_input(d).update(region=[0, 256], storage=0),
            r"exactly one of 'region' and 'storage'",
        ),
        (
            lambda d: [n.update(region=[0, -4]) for n in d["nodes"] if "region" in n],
            r"region\[1\]: expected an integer >= 1",
        ),
        (
            lambda d: [n.update(reads="x") for n in d["nodes"] if n["kind"] == "apply"],
            r"reads: expected a list",
        ),
    ],
)
def test_json_validation_names_the_path(edit, message):
    with pytest.raises(SerializationError, match=message):
        MemGraph.from_json(corrupted(edit))
