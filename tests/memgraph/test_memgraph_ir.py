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


# -- host storages and boxes in JSON ------------------------------------------------


def test_json_carries_storages_and_boxes():
    from plans import sliced_weight_plan

    mg = sliced_weight_plan()
    data = json.loads(mg.to_json())
    assert data["version"] == 2
    assert data["storages"] == [
        {"id": 0, "shape": [64, 8], "dtype": "float32", "nbytes": 2048, "tensor": 0,
         "kind": "input"}
    ]  # fmt: skip
    (reload,) = [n for n in data["nodes"] if n["kind"] == "reload"]
    assert reload["box"] == {"starts": [16, 0], "sizes": [8, 8]}
    again = MemGraph.from_json(mg.to_json())
    assert again.nodes == mg.nodes and again.storages == mg.storages
    assert again.to_json() == mg.to_json()
    verify(again)


def test_version_1_documents_are_read_with_storages_and_boxes_worked_out():
    from plans import sliced_weight_plan

    for mg in (sliced_weight_plan(), reference_plan(two_output_mlp(), offload=frozenset({3}))):
        data = json.loads(mg.to_json())
        data["version"] = 1
        del data["storages"]
        for node in data["nodes"]:
            node.pop("box", None)
        old = MemGraph.from_json(json.dumps(data))
        assert old.nodes == mg.nodes and old.storages == mg.storages
        verify(old)


def corrupted_sliced(edit):
    from plans import sliced_weight_plan

    data = json.loads(sliced_weight_plan().to_json())
    edit(data)
    return json.dumps(data)


def reload_entry(data):
    return next(n for n in data["nodes"] if n["kind"] == "reload")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(version=3), r"\$.version: expected 2 \(or 1"),
        (lambda d: d.pop("storages"), r"\$.storages: missing"),
        (lambda d: d.update(storages={}), r"\$.storages: expected a list"),
        (lambda d: d["storages"][0].pop("nbytes"), r"storages\[0\]: missing key\(s\) \['nbytes'\]"),
        (lambda d: d["storages"][0].update(dtype="bf16"), r"storages\[0\].dtype: expected one of"),
        (lambda d: d["storages"][0].update(kind="x"), r"storages\[0\].kind: expected one of input"),
        (lambda d: d["storages"][0].update(tensor=99), r"storages\[0\].tensor: %99 is not a task"),
        (lambda d: d["storages"][0].update(shape=[64, -8]), r"storages\[0\].shape\[1\]"),
        (lambda d: d["storages"].append(dict(d["storages"][0])), r"host#0 is listed twice"),
        (lambda d: reload_entry(d)["box"].pop("sizes"), r"box: missing key\(s\) \['sizes'\]"),
        (lambda d: reload_entry(d)["box"].update(sizes=[0, 8]), r"box.sizes\[0\]: expected an"),
        (lambda d: d.update(storages=[]), r"box: a box of a storage that is not in \$.storages"),
        (lambda d: reload_entry(d).update(into=2), r"reload node has unknown key\(s\) \['into'\]"),
        (
            lambda d: [n.update(box={"starts": [0], "sizes": [1]}) for n in d["nodes"]
                       if n["kind"] == "free"],
            r"free node has unknown key\(s\) \['box'\]",
        ),
    ],
)  # fmt: skip
def test_json_validation_of_storages_and_boxes(edit, message):
    with pytest.raises(SerializationError, match=message):
        MemGraph.from_json(corrupted_sliced(edit))


# -- the node declaration -------------------------------------------------------------


def test_every_kind_declares_its_fields_and_json_keys_follow_it():
    from memgraph.nodes import FIELDS, NODE_FIELDS

    assert set(NODE_FIELDS) == set(NodeKind)
    for spec in NODE_FIELDS.values():
        assert spec.allowed <= set(FIELDS)
    mg = reference_plan(two_output_mlp(), offload=frozenset({3, 5}), outputs_to_host=True)
    for node, entry in zip(mg.nodes, json.loads(mg.to_json())["nodes"], strict=True):
        spec = NODE_FIELDS[node.kind]
        keys = set(entry) - {"id", "kind", "deps", "tensor"}
        assert set(spec.required) <= keys <= spec.allowed, node.line()
        assert node.field_problem() is None


@pytest.mark.parametrize(
    "kind, changes, message",
    [
        (NodeKind.ALLOC, {"region": None}, "has no device region"),
        (NodeKind.RELOAD, {"storage": None}, "has no host storage"),
        (NodeKind.FREE, {"into": 3}, r"only an offload can fill an output assembly \('into'\)"),
        (NodeKind.ALLOC, {"name": "x"}, r"only an input, an output, a send or a recv can name"),
        (NodeKind.ALLOC, {"reads": (Region(0, 256),)}, r"only an apply can read operand regions"),
        (NodeKind.INPUT, {"storage": 0, "region": Region(0, 256)}, "an input is in exactly one"),
        (NodeKind.OUTPUT, {"storage": None, "region": None}, "an output is in exactly one"),
    ],
)
def test_field_problems_come_from_the_declaration(kind, changes, message):
    import dataclasses
    import re

    from memgraph import MemNode

    base = MemNode(0, kind, tensor=1, region=Region(0, 256), storage=0, name="x")
    defaults = {"region": base.region, "storage": None, "name": ""}
    if kind in (NodeKind.INPUT, NodeKind.OUTPUT):
        defaults = {"region": None, "storage": 0, "name": "x"}
    elif kind is NodeKind.RELOAD:
        defaults["storage"] = 0
    node = dataclasses.replace(base, **{**defaults, **changes})
    assert re.search(message, node.field_problem())
    assert dataclasses.replace(base, **defaults).field_problem() is None


def test_describe_follows_the_templates():
    from plans import sliced_weight_plan

    mg = sliced_weight_plan()
    lines = [n.describe() for n in mg.nodes]
    assert lines[0] == 'input "w" %0 -> host#0'
    assert lines[2] == "reload %1 host#0[16:24, 0:8] -> [0x00000000, +256 B)"
    assert lines[4].startswith("apply %2 ([0x00000000, +256 B)) -> ")
    assert lines[-1] == 'output "y" %2 [0x00000100, +256 B)'
