"""The TaskGraph IR: building, listing, JSON, and the reference evaluator's contract."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import einpage as ep
import taskgraph
from einpage.errors import GraphError, InputError, SerializationError
from taskgraph import Einsum, EinsumSpec, GraphBuilder, Input, TaskGraph, View
from taskgraph.nodes import Block, Concat, Fill, Gather, Slice, with_blocks


def small_graph() -> TaskGraph:
    prog = ep.Program("small")
    x = prog.input("x", (4, 8))
    w = prog.input("w", (8, 16), role="weight")
    with prog.scope("layer0"):
        h = prog.einsum("bd,df->bf", x, w)
        m = prog.einsum("bf->b", h, agg="max")
        e = prog.einsum("bf,b->bf", h, m, join="exp(a - b)")
    prog.output(e, "y")
    return prog.build()


def test_listing_is_readable():
    tg = small_graph()
    assert repr(tg) == (
        "<TaskGraph 'small' tasks=5 inputs=2 outputs=1 flops=1.2 KFLOP inputs_size=640 B>"
    )
    lines = str(tg).splitlines()
    assert lines[0] == "TaskGraph 'small': 5 tasks, 1.2 KFLOP, inputs 640 B"
    assert lines[3].split("#")[0].rstrip() == '  %2 : f32[4,16] = einsum["bd,df->bf"](%0, %1)'
    assert "1.0 KFLOP" in lines[3] and "layer0" in lines[3]
    assert 'einsum["bf->b", agg=max](%2)' in lines[4]
    assert 'einsum["bf,b->bf", join="exp(a - b)"](%2, %3)' in lines[5]
    assert lines[-1] == '  output "y" = %4'


def test_flop_convention():
    tg = small_graph()
    assert tg[2].flops == 2 * 4 * 8 * 16  # matmul: a multiply-add is 2 FLOPs
    assert tg[3].flops == 4 * 16  # a max-reduction: 1 per point
    assert tg[4].flops == 2 * 4 * 16  # exp and minus per element
    assert tg[0].flops == 0
    assert tg.total_flops == sum(t.flops for t in tg)


def test_queries():
    tg = small_graph()
    assert dict(tg.inputs) == {"x": 0, "w": 1}
    assert tg.consumers[2] == (3, 4)
    assert tg.output_ids == {4}
    assert tg[1].op.location == "host" and tg[0].op.location == "device"
    assert tg[2].nbytes == 4 * 16 * 4


def test_is_input_slice_is_a_slice_reading_an_input_directly():
    prog = ep.Program()
    w = prog.input("w", (8, 4), role="weight")
    of_input = prog.slice(w, (2, 0), (3, 4))
    doubled = prog.einsum("ij->ij", w, join="2 * a")
    of_compute = prog.slice(doubled, (0, 0), (3, 4))
    of_view = prog.slice(prog.view(w, (4, 8)), (0, 0), (2, 8))
    for t in (of_input, of_compute, of_view):
        prog.output(t, f"s{t.id}")
    tg = prog.build()
    assert [t.id for t in tg if tg.is_input_slice(t.id)] == [of_input.id]
    assert not tg.is_input_slice(w.id)  # an input is not a slice of one


def test_builder_rejects_bad_graphs():
    b = GraphBuilder()
    x = b.add(Input("x"), (), (2, 3), "float32")
    with pytest.raises(GraphError, match="reads %5, which is not an earlier task"):
        b.add(View(), (5,), (6,))
    with pytest.raises(GraphError, match="reads %1, which is not an earlier task"):
        b.add(View(), (1,), (6,))
    with pytest.raises(GraphError, match="duplicate input name 'x'"):
        b.add(Input("x"), (), (2,), "float32")
    with pytest.raises(GraphError, match=r"shape \(2, 3\) does not match the inferred \(3, 2\)"):
        b.add(Einsum(EinsumSpec.parse("ij->ji")), (x,), (2, 3))
    with pytest.raises(GraphError, match="dtype float64 does not match the inferred float32"):
        b.add(Gather(), (x, b.add(Input("ids"), (), (2,), "int32")), None, "float64")
    with pytest.raises(GraphError, match="view needs an explicit output shape"):
        b.add(View(), (x,))
    with pytest.raises(GraphError, match="input takes 0 operand"):
        b.add(Input("z"), (x,), (1,), "float32")
    with pytest.raises(GraphError, match="output 'y' names %9"):
        b.output(9, "y")
    b.output(x, "y")
    with pytest.raises(GraphError, match="duplicate output name 'y'"):
        b.output(x, "y")


def test_json_round_trip_and_schema():
    tg = small_graph()
    data = json.loads(tg.to_json())
    assert data["format"] == "einpage.taskgraph" and data["version"] == 1
    assert data["tasks"][4]["attrs"] == {"spec": "bf,b->bf", "join": "exp(a - b)", "agg": "sum"}
    again = TaskGraph.from_json(tg.to_json(indent=2))
    assert again.tasks == tg.tasks and again.name == "small"


def test_json_keeps_infinities_and_all_op_kinds():
    b = GraphBuilder("kinds")
    x = b.add(Input("x", "weight", "host"), (), (2, 6), "float16")
    ids = b.add(Input("ids"), (), (3,), "int64")
    b.output(b.add(Fill(-math.inf, "causal", (0, 2)), (), (2, 2), "float16"), "mask")
    b.output(b.add(Gather(), (x, ids)), "rows")
    b.output(b.add(View(), (x,), (3, 4)), "view")
    b.output(b.add(Slice((0, 1)), (x,), (2, 2)), "slice")
    b.output(b.add(Concat(1), (x, x)), "concat")
    tg = b.build()
    assert '"-inf"' in tg.to_json()
    assert TaskGraph.from_json(tg.to_json()).tasks == tg.tasks


def corrupt(path, value):
    data = json.loads(small_graph().to_json())
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(data)


@pytest.mark.parametrize(
    "path, value, message",
    [
        (["format"], "other", r"\$.format: expected 'einpage.taskgraph'"),
        (["version"], 2, r"\$.version: expected 1"),
        (["tasks"], {}, r"\$.tasks: expected a list"),
        (["tasks", 2, "id"], 7, r"\$.tasks\[2\].id: expected 2"),
        (["tasks", 2, "inputs"], [0, 9], r"\$.tasks\[2\]: task %2 .* reads %9"),
        (["tasks", 2, "shape"], [4, 17], r"\$.tasks\[2\]: .*shape \(4, 17\) does not match"),
        (["tasks", 2, "shape"], "big", r"\$.tasks\[2\].shape: expected a list of ints"),
        (["tasks", 2, "op"], "conv", r"\$.tasks\[2\]: unknown op kind 'conv'"),
        (["tasks", 2, "dtype"], "float8", r"\$.tasks\[2\]: unsupported dtype 'float8'"),
        (["tasks", 2, "extra"], 1, r"\$.tasks\[2\]: unknown key\(s\) \['extra'\]"),
        (["tasks", 2, "scope"], KeyError, r"\$.tasks\[2\]: missing key\(s\) \['scope'\]"),
        (["tasks", 2, "attrs", "spec"], "bd,df->bq", r"output index 'q' appears in no operand"),
        (["tasks", 4, "attrs", "join"], "__import__('os')", r"unknown function '__import__'"),
        (["tasks", 4, "attrs", "agg"], "avg", r"unknown agg 'avg'"),
        (["tasks", 4, "attrs", "extra"], 1, r"einsum attributes must be exactly"),
        (["tasks", 0, "attrs", "role"], "bias", r"role must be one of"),
        (["outputs", "y"], 99, r"\$.outputs\['y'\]: output 'y' names %99"),
    ],
)
def test_json_validation_names_the_path(path, value, message):
    with pytest.raises(SerializationError, match=message):
        TaskGraph.from_json(corrupt(path, value))


def test_json_rejects_non_json():
    with pytest.raises(SerializationError, match="not valid JSON"):
        TaskGraph.from_json("{not json")
    with pytest.raises(SerializationError, match=r"\$: expected an object"):
        TaskGraph.from_json("[]")


def test_evaluate_checks_inputs():
    tg = small_graph()
    x, w = np.ones((4, 8), "float32"), np.ones((8, 16), "float32")
    with pytest.raises(InputError, match="missing input\\(s\\): 'w'"):
        taskgraph.evaluate(tg, {"x": x})
    with pytest.raises(InputError, match="unknown input\\(s\\) 'z'"):
        taskgraph.evaluate(tg, {"x": x, "w": w, "z": x})
    with pytest.raises(InputError, match=r"input 'x': expected shape \(4, 8\), got \(8, 4\)"):
        taskgraph.evaluate(tg, {"x": x.T, "w": w})
    with pytest.raises(InputError, match="input 'w': expected dtype float32, got int32"):
        taskgraph.evaluate(tg, {"x": x, "w": w.astype("int32")})
    with pytest.raises(InputError, match="'w': 128 value.*float64 array do not fit.*float32"):
        taskgraph.evaluate(tg, {"x": x, "w": np.full((8, 16), 1e300)})
    with pytest.raises(InputError, match="mapping"):
        taskgraph.evaluate(tg, [x, w])


def test_evaluate_float64_mode_and_float16():
    prog = ep.Program()
    x = prog.input("x", (3, 64), dtype="float16")
    prog.output(prog.einsum("ij->i", x), "s")
    tg = prog.build()
    data = np.random.default_rng(0).standard_normal((3, 64)).astype("float16")
    half = taskgraph.evaluate(tg, {"x": data})["s"]
    wide = taskgraph.evaluate(tg, {"x": data}, dtype="float64")["s"]
    assert half.dtype == np.float16 and wide.dtype == np.float64
    exact = data.astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(wide, exact, rtol=1e-12)
    np.testing.assert_allclose(half, exact, rtol=2e-3, atol=2e-2)
    with pytest.raises(InputError, match="must be a float type"):
        taskgraph.evaluate(tg, {"x": data}, dtype="int32")


def test_gather_out_of_range_is_an_input_error():
    prog = ep.Program()
    table = prog.input("t", (4, 2))
    ids = prog.input("ids", (2,), dtype="int64")
    prog.output(ep.gather(table, ids), "rows")
    with pytest.raises(InputError, match="id 4 is out of range for a table of 4 rows"):
        taskgraph.evaluate(prog.build(), {"t": np.ones((4, 2), "float32"), "ids": np.array([0, 4])})


def test_causal_fill_with_origin_is_a_block_of_the_full_mask():
    full = taskgraph.evaluate_task(_fill_task((6, 6), ()), [])
    block = taskgraph.evaluate_task(_fill_task((2, 3), (2, 3)), [])
    np.testing.assert_array_equal(block, full[2:4, 3:6])
    assert full[0, 1] == -np.inf and full[1, 0] == 0 and full[3, 3] == 0


def _fill_task(shape, origin):
    b = GraphBuilder()
    b.add(Fill(-math.inf, "causal", origin), (), shape, "float32")
    return b.build()[0]


def test_outputs_are_copies():
    prog = ep.Program()
    x = prog.input("x", (2,))
    prog.output(x, "same")
    data = np.ones(2, "float32")
    out = taskgraph.evaluate(prog.build(), {"x": data})["same"]
    out[0] = 5
    assert data[0] == 1


# -- block provenance (set by partitioning) -----------------------------------------


def blocked_graph() -> TaskGraph:
    """`small_graph` with hand-made provenance on its tasks (as partitioning sets it)."""
    tg = small_graph()
    blocks = [Block(t.id, (0,) * len(t.shape), t.shape) for t in tg.tasks]
    blocks[3] = Block(3, (0,), (4,), "partial", ((0, 8),))
    blocks[4] = Block(7, (2, 16), (4, 16), "assembly")
    return TaskGraph(with_blocks(tg.tasks, blocks), tg.outputs, tg.name)


def test_block_is_shown_and_kept_through_json():
    tg = blocked_graph()
    assert tg[4].line().endswith("(%2, %3)  {assembly %7[2:6, 16:32]}")
    assert tg[3].line().endswith("{partial %3[0:4] reduced[0:8]}")
    data = json.loads(tg.to_json())
    assert data["tasks"][3]["block"] == {
        "of": 3,
        "starts": [0],
        "shape": [4],
        "kind": "partial",
        "reduced": [[0, 8]],
    }
    assert "block" not in json.loads(small_graph().to_json())["tasks"][0]
    again = TaskGraph.from_json(tg.to_json())
    assert again.tasks == tg.tasks
    assert again.to_json() == tg.to_json()


@pytest.mark.parametrize(
    "block, message",
    [
        ({"of": -1, "starts": [0], "shape": [4], "kind": "block", "reduced": []}, "task id"),
        ({"of": 3, "starts": [0], "shape": [5], "kind": "block", "reduced": []}, "must equal"),
        ({"of": 3, "starts": [0, 0], "shape": [4], "kind": "block", "reduced": []}, "one per"),
        ({"of": 3, "starts": [0], "shape": [4], "kind": "slab", "reduced": []}, "kind must be"),
        ({"of": 3, "starts": [0], "shape": [4], "kind": "partial", "reduced": []}, "a partial"),
        ({"of": 3, "starts": [0], "shape": [4], "kind": "block", "reduced": [[0, 2]]}, "only a"),
        ({"of": 3, "starts": [0], "shape": [4], "kind": "partial", "reduced": [[0]]}, "pairs"),
        ({"of": 3, "starts": [0], "shape": [4]}, "exactly"),
        ("block", "exactly"),
    ],
)
def test_json_block_validation_names_the_path(block, message):
    data = json.loads(small_graph().to_json())
    data["tasks"][3]["block"] = block
    with pytest.raises(SerializationError, match=r"\$.tasks\[3\].block: .*" + message):
        TaskGraph.from_json(json.dumps(data))


def test_with_blocks_checks_shapes():
    tg = small_graph()
    blocks = [None] * len(tg.tasks)
    blocks[2] = Block(2, (0, 0), (4, 8))
    with pytest.raises(GraphError, match=r"task %2: block .* has shape \(4, 8\)"):
        with_blocks(tg.tasks, blocks)
    with pytest.raises(GraphError, match="3 blocks given for 5 tasks"):
        with_blocks(tg.tasks, blocks[:3])
