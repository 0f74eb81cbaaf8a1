"""Tensor facts (`taskgraph.facts`): typed records on tasks, checked where stated, shown in
listings, kept by JSON (older files without them still load), and carried by the passes
that renumber tasks: pruning, partitioning and the backward pass."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import einpage as ep
import taskgraph
from einpage.errors import GraphError, SerializationError
from taskgraph import GraphBuilder, Input, TaskGraph
from taskgraph.facts import (
    FACT_KINDS,
    ChosenIds,
    Gradient,
    KVEntries,
    KVPage,
    Layer,
    LogSumExp,
    MasterWeight,
    OptimizerState,
    Shard,
    Softmax,
    TensorPart,
    Update,
    fact_of,
    is_kv_page,
)

DATA = Path(__file__).parent / "memgraph" / "data"


def stated_graph() -> TaskGraph:
    """A small training-like program with a fact of every kind."""
    prog = ep.Program("facts")
    with prog.layer(2):
        w = prog.input("w", (4, 3), role="weight")
    master = prog.fact(prog.input("master.w", (4, 3), role="state"), MasterWeight(w.id))
    m = prog.fact(prog.input("m.w", (4, 3), role="state"), OptimizerState(w.id, "momentum"))
    prog.fact(m, Shard(1))
    page = prog.fact(prog.input("page", (2, 3), location="host"), KVPage(1, "v", 7))
    x = prog.input("x", (2, 4))
    h = prog.fact(prog.einsum("bd,df->bf", x, w), TensorPart(0, 2))
    p = ep.softmax(h + page, axis=-1)
    loss = ep.reduce_sum(p * p)
    (g,) = prog.backward(loss, [w])
    prog.output(loss, "loss")
    prog.output(prog.fact(g + m, Update(w.id)), "new.w")
    prog.output(prog.fact(master * 1.0, Update(master.id)), "new.master")
    prog.output(prog.fact(ep.exp(h), KVEntries(0, "k")), "entries")
    prog.output(prog.fact(ep.argmax(h), ChosenIds(2)), "ids")
    lse = ep.cross_entropy(h, prog.input("y", (2,), "int64"))
    prog.output(lse, "ce")
    return prog.build()


def every_fact(tg: TaskGraph) -> list[tuple[int, object]]:
    return [(task.id, fact) for task in tg for fact in task.facts]


def test_a_fact_of_every_kind_is_stated_and_read_back():
    tg = stated_graph()
    kinds = {type(fact) for _, fact in every_fact(tg)}
    assert kinds == set(FACT_KINDS.values())
    w = tg.inputs["w"]
    assert fact_of(tg[tg.inputs["m.w"]], OptimizerState) == OptimizerState(w, "momentum")
    assert fact_of(tg[tg.outputs["new.w"]], Update) == Update(w)
    assert is_kv_page(tg[tg.inputs["page"]]) and not is_kv_page(tg[tg.outputs["entries"]])
    assert fact_of(tg[tg.outputs["entries"]], KVEntries) == KVEntries(0, "k")
    assert tg[w].facts == (Layer(2),)
    gradients = [t for t in tg if fact_of(t, Gradient)]
    assert [fact_of(t, Gradient).of for t in gradients] == [w]


def test_facts_are_shown_in_the_listing():
    tg = stated_graph()
    line = tg[tg.inputs["page"]].line()
    assert line.endswith("  [kv_page(layer=1, part=v, page=7)]"), line
    listing = str(tg)
    assert f"[optimizer_state(of=%{tg.inputs['w']}, state=momentum), shard(axis=1)]" in listing
    assert "[tensor_part(index=0, count=2)]" in listing
    assert f"[update(of=%{tg.inputs['w']})]" in listing
    assert tg[tg.inputs["w"]].line().endswith("  [layer(index=2)]")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: KVPage(0, "q", 1), "part must be one of"),
        (lambda: KVPage(-1, "k", 1), "layer must be an int >= 0"),
        (lambda: KVPage(0, "k", 1.5), "page must be an int >= 0 or None"),
        (lambda: KVEntries(True, "k"), "layer must be an int >= 0"),
        (lambda: ChosenIds("1"), "step must be an int >= 0"),
        (lambda: Gradient(None), "of must be an int >= 0"),
        (lambda: OptimizerState(0, ""), "state must be a non-empty string"),
        (lambda: Layer(-1), "index must be an int >= 0"),
        (lambda: Layer(None), "index must be an int >= 0"),
    ],
)
def test_invalid_facts_are_refused_naming_the_field(make, message):
    with pytest.raises(GraphError, match=message):
        make()


def test_a_fact_must_name_an_earlier_task_and_an_input_where_its_kind_says():
    b = GraphBuilder()
    w = b.add(Input("w", "weight", "host"), (), (3,), "float32")
    y = b.add(taskgraph.Einsum(taskgraph.EinsumSpec.parse("i->i")), (w,))
    with pytest.raises(GraphError, match=r"names %5, which is not an earlier task"):
        b.add_facts(y, [Gradient(5)])
    with pytest.raises(GraphError, match=r"names %1, which is not an input"):
        b.add(taskgraph.Einsum(taskgraph.EinsumSpec.parse("i->i")), (y,), facts=[Update(y)])
    with pytest.raises(GraphError, match="a fact must be one of KVPage"):
        b.add_facts(y, ["kv_page"])
    with pytest.raises(GraphError, match="does not exist"):
        b.add_facts(9, [Softmax()])
    b.add_facts(y, [Update(w), Update(w), Gradient(w)])  # repeats are stated once
    assert b.tasks[y].facts == (Update(w), Gradient(w))


def test_facts_survive_json_byte_for_byte():
    tg = stated_graph()
    text = tg.to_json()
    back = TaskGraph.from_json(text)
    assert every_fact(back) == every_fact(tg)
    assert back.to_json() == text
    assert json.loads(text) == taskgraph.serialize.taskgraph_to_dict(tg)
    page = json.loads(text)["tasks"][tg.inputs["page"]]
    assert page["facts"] == [{"kind": "kv_page", "layer": 1, "part": "v", "page": 7}]
    assert "facts" not in json.loads(text)["tasks"][tg.inputs["x"]]  # none: no key


def test_files_written_before_facts_existed_load_and_write_back_unchanged():
    text = (DATA / "llama_micro_partitioned.json").read_text()
    graph = json.loads(text)["taskgraph"]
    tg = taskgraph.serialize.taskgraph_from_dict(graph)
    assert not every_fact(tg)
    assert tg.to_json() == json.dumps(graph)


def _with_facts(position: int, facts: object) -> str:
    document = json.loads(stated_graph().to_json())
    document["tasks"][position]["facts"] = facts
    return json.dumps(document)


INVALID_FACTS = [
    # (task position, its "facts" document, what the error says)
    (5, [{"kind": "kv_cache", "layer": 0}], r"\[5\]\.facts\[0\]: unknown fact kind 'kv_cache';"),
    (5, [{"kind": "kv_page", "layer": 0, "part": "k"}], r"facts\[0\]: kv_page fact: fields must"),
    (5, [{"kind": "kv_page", "layer": 0, "part": "x", "page": 0}], r"kv_page: part must be"),
    (5, [{"kind": "gradient", "of": 0}, "softmax"], r"facts\[1\]: a fact must be an object"),
    (5, [{"kind": "layer", "layer": 0}], r"facts\[0\]: layer fact: fields must be exactly"),
    (5, [{"kind": "layer", "index": -2}], r"facts\[0\]: layer: index must be an int >= 0"),
    (5, [{"kind": "shard", "axis": 2}], r"\[5\]: task %5: fact shard\(axis=2\) names axis 2 of"),
    (5, [{"kind": "shard", "axis": -1}], r"facts\[0\]: shard: axis must be an int >= 0"),
    (5, [{"kind": "tensor_part", "index": 2, "count": 2}], r"index must be below count \(2\)"),
    (5, [{"kind": "update", "of": 9}], r"\[5\]: task %5: .*%9, which is not an earlier task"),
    (6, [{"kind": "update", "of": 5}], r"\[6\]: task %6: .*%5, which is not an input"),
    (5, [], r"tasks\[5\]\.facts: expected a non-empty list"),
    (5, {"kind": "softmax"}, r"tasks\[5\]\.facts: expected a non-empty list"),
]  # fmt: skip


@pytest.mark.parametrize("position, facts, message", INVALID_FACTS)
def test_invalid_facts_in_json_are_refused_naming_where(position, facts, message):
    with pytest.raises(SerializationError, match=message):
        TaskGraph.from_json(_with_facts(position, facts))
    # the same facts naming the input %4 ("x") instead are accepted
    assert fact_of(TaskGraph.from_json(_with_facts(5, [{"kind": "update", "of": 4}]))[5], Update)


def test_pruning_renumbers_facts_and_drops_those_about_pruned_tensors():
    prog = ep.Program()
    unused = prog.input("unused", (3,))
    dead = ep.exp(unused)  # no output needs it: pruned
    w = prog.input("w", (3,), role="weight")
    loss = ep.reduce_sum(w * w)
    g1, g2 = prog.backward(loss, [w, dead])
    prog.output(loss, "loss")
    prog.output(prog.fact(g1 * 1.0, Update(w.id)), "new.w")
    prog.output(g2, "g.dead")
    tg = prog.build()
    w_id = tg.inputs["w"]
    assert w_id != w.id  # renumbered
    assert fact_of(tg[tg.outputs["new.w"]], Update) == Update(w_id)
    assert fact_of(tg[tg.outputs["g.dead"]], Gradient) is None  # its subject is gone


def test_grad_keeps_the_forward_facts_and_states_the_gradients():
    prog = ep.Program()
    x = prog.input("x", (2, 5), "float64")
    w = prog.input("w", (5,), "float64", role="weight")
    prog.output(ep.reduce_sum(ep.softmax(x * w, axis=-1) * x), "loss")
    tg = prog.build()
    g = taskgraph.grad(tg, "loss", ["x", "w"])
    assert every_fact(g)[: len(every_fact(tg))] == every_fact(tg)
    assert fact_of(g[g.outputs["grad.x"]], Gradient) == Gradient(tg.inputs["x"])
    assert fact_of(g[g.outputs["grad.w"]], Gradient) == Gradient(tg.inputs["w"])


def test_partitioning_carries_facts_to_the_blocks_with_the_ids_renumbered():
    prog = ep.Program("split")
    w = prog.input("w", (64, 64), role="weight")
    state = prog.fact(prog.input("m", (64, 64), role="state"), OptimizerState(w.id, "m"))
    x = prog.input("x", (64, 64))
    page = prog.fact(x @ w, KVPage(0, "k", 2))
    prog.output(prog.fact(page + state, Update(w.id)), "new")
    tg = prog.build()
    split = taskgraph.partition.partition(tg, 16 * 1024)
    assert len(split) > len(tg)
    w_new, m_new = split.inputs["w"], split.inputs["m"]
    assert fact_of(split[m_new], OptimizerState) == OptimizerState(w_new, "m")
    pages = [t for t in split if is_kv_page(t)]
    assert pages and all(t.block is not None and t.block.of == page.id for t in pages)
    assert {fact_of(t, KVPage) for t in pages} == {KVPage(0, "k", 2)}
    updates = {fact_of(t, Update) for t in split if fact_of(t, Update)}
    assert updates == {Update(w_new)}
    assert fact_of(split[split.outputs["new"]], Update) == Update(w_new)
    # and the partitioned graph computes what the original does (to float32 rounding of
    # sums of 64 products in another order)
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal(tg[i].shape).astype("float32") for n, i in tg.inputs.items()}
    got, want = taskgraph.evaluate(split, arrays)["new"], taskgraph.evaluate(tg, arrays)["new"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_softmax_and_log_sum_exp_are_marked_by_the_op_library():
    tg = stated_graph()
    marked = {type(f) for _, f in every_fact(tg) if isinstance(f, Softmax | LogSumExp)}
    assert marked == {Softmax, LogSumExp}
    assert [t.label for t in tg if fact_of(t, Softmax)] == ["softmax"]
    assert [t.label for t in tg if fact_of(t, LogSumExp)] == ["ce.lse"]


def test_weights_declared_inside_a_layer_state_it_and_nothing_else_does():
    """`Program.layer(i)`: every weight input declared inside states `Layer(i)` – the
    quantized inputs of a weight too – and nothing else (activations, states, computed
    tensors, weights outside) states any; the fact survives JSON."""
    from einpage.program.quantize import Quantization, dequantized_weight

    prog = ep.Program("layers")
    x = prog.input("x", (2, 8))
    outside = prog.input("outside", (8, 8), role="weight")
    with prog.layer(0):
        w = prog.input("w", (8, 8), role="weight")
        state = prog.input("m", (8, 8), role="state")
        act = prog.input("a", (2, 8))
        q = dequantized_weight(prog, "q", (8, 8), "float32", Quantization(4, 4, minimum=True))
        h = x @ w + act @ q
    with prog.layer(7):
        h = h @ prog.input("w7", (8, 8), role="weight")
    assert prog.current_layer is None
    prog.output(h @ outside + state[:2], "y")
    tg = prog.build()
    stated = {tg[i].op.name: tg[i].facts for i in tg.inputs.values()}
    assert stated == {
        "x": (), "outside": (), "w": (Layer(0),), "m": (), "a": (),
        "q.q": (Layer(0),), "q.scale": (Layer(0),), "q.min": (Layer(0),), "w7": (Layer(7),),
    }  # fmt: skip
    assert not any(t.facts for t in tg if not isinstance(t.op, Input))
    back = TaskGraph.from_json(tg.to_json())
    assert every_fact(back) == every_fact(tg) and back.to_json() == tg.to_json()
    assert json.loads(tg.to_json())["tasks"][tg.inputs["w7"]]["facts"] == [
        {"kind": "layer", "index": 7}
    ]


def test_layers_do_not_nest_and_take_an_index():
    prog = ep.Program()
    nested = pytest.raises(ep.ProgramError, match="layer 2 inside layer 1")
    with prog.layer(1), nested, prog.layer(2):
        pass
    for bad in (-1, 1.0, True, "0"):
        refused = pytest.raises(ep.ProgramError, match="layer index must be an int >= 0")
        with refused, prog.layer(bad):
            pass
    assert prog.current_layer is None  # left on every way out
