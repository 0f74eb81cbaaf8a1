"""Recomputes in the MemGraph IR: an apply marked `recompute` computes a dropped tensor again.

Plans are built by hand here (the planner's choice of recomputes is tested in
`test_recompute_planner.py`): printing, JSON (old files load unchanged), the verifier
and the independent oracle (each by its own rules), the residency analysis and the
statistics, the simulator, the drawing and the NumPy runtime.
"""

from __future__ import annotations

import json

import numpy as np
import oracle
import pytest

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.errors import SerializationError, VerificationError
from memgraph import MemGraph, MemGraphBuilder, NodeKind, Region
from memgraph.render import style_kind
from memgraph.serialize import memgraph_from_dict

N = 64  # float32 elements: 256 B, one aligned slot


def _program() -> taskgraph.TaskGraph:
    """%0 w (a weight on the host), %1 h = exp(w), %2 x (an input), %3 y = x * h."""
    prog = ep.Program("again")
    w = prog.input("w", (N,), role="weight")
    h = ep.exp(w)
    x = prog.input("x", (N,))
    prog.output(ep.mul(x, h), "y")
    return prog.build()


def _slot(k: int) -> Region:
    return Region(256 * k, 256)


def _plan(mark: bool = True, read_between: bool = False, first_apply: bool = True) -> MemGraph:
    """w is reloaded, h computed, then h is freed with no copy out (discarded) and
    computed again – marked `recompute` when `mark` – before y reads it. With
    `read_between`, y is computed from h's region while h is gone; without
    `first_apply`, the recompute is the only computation of h."""
    tg = _program()
    b = MemGraphBuilder(tg, budget=4 * 256)
    host = b.input("w", 0, storage=0)
    xa = b.alloc(2, _slot(3))
    x = b.input("x", 2, region=_slot(3), deps=[xa])
    wa = b.alloc(0, _slot(0))
    w = b.reload(0, 0, _slot(0), deps=[wa, host])
    users = [w]
    if first_apply:
        ha = b.alloc(1, _slot(1))
        h = b.apply(1, [_slot(0)], _slot(1), deps=[ha, w])
        users = [b.free(1, _slot(1), deps=[h])]  # discarded: no offload
        users.append(h)
    if read_between:
        ya = b.alloc(3, _slot(2), deps=users)
        b.apply(3, [_slot(3), _slot(1)], _slot(2), deps=[ya, x])
        return b.build()
    ha = b.alloc(1, _slot(1), deps=users)
    h = b.apply(1, [_slot(0)], _slot(1), deps=[ha, w], recompute=mark)
    wf = b.free(0, _slot(0), deps=[h])
    ya = b.alloc(3, _slot(2))
    y = b.apply(3, [_slot(3), _slot(1)], _slot(2), deps=[ya, x, h])
    b.free(1, _slot(1), deps=[y])
    b.free(2, _slot(3), deps=[y])
    b.output("y", 3, region=_slot(2), deps=[y])
    del wf
    return b.build()


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(N).astype(np.float32) for k in ("w", "x")}


def test_a_recompute_prints_as_one_and_round_trips_through_json():
    mg = _plan()
    again = [n for n in mg if n.recompute]
    assert len(again) == 1 and again[0].kind is NodeKind.APPLY
    assert again[0].describe().startswith("recompute %1 ([0x00000000, +256 B)) -> ")
    assert "recompute %1" in str(mg) and sum("apply %1" in line for line in mg.lines()) == 1
    doc = json.loads(mg.to_json())
    marked = [n for n in doc["nodes"] if "recompute" in n]
    assert [(n["id"], n["recompute"]) for n in marked] == [(again[0].id, True)]
    loaded = MemGraph.from_json(mg.to_json())
    assert loaded.nodes == mg.nodes and loaded.to_json() == mg.to_json()
    assert memgraph_from_dict(doc).nodes == mg.nodes


def test_plans_without_recomputes_write_no_recompute_key():
    mg = memgraph.plan(_program(), "100%")
    nodes = json.loads(mg.to_json())["nodes"]
    assert nodes and not any("recompute" in n for n in nodes)
    assert not any(n.recompute for n in MemGraph.from_json(mg.to_json()))


@pytest.mark.parametrize("bad", [False, 1, "yes", None])
def test_a_recompute_mark_other_than_true_is_refused_on_load(bad):
    doc = json.loads(_plan().to_json())
    node = next(n for n in doc["nodes"] if "recompute" in n)
    node["recompute"] = bad
    with pytest.raises(SerializationError, match=r"\.recompute: expected true"):
        memgraph_from_dict(doc)


def test_the_verifier_and_the_oracle_accept_a_recompute():
    mg = _plan()
    memgraph.verify(mg)
    verdict = oracle.judge(mg.to_json())
    assert verdict.accepted, verdict


@pytest.mark.parametrize(
    ("plan", "verify_says", "rule"),
    [
        ({"mark": False}, "computed a second time", "P2"),
        ({"first_apply": False}, "recomputes %1, which no earlier apply computed", "P4"),
        ({"read_between": True}, "is not resident", "D3"),
    ],
    ids=["unmarked", "never-computed", "read-while-dropped"],
)
def test_the_verifier_and_the_oracle_reject_a_bad_recompute(plan, verify_says, rule):
    mg = _plan(**plan)
    with pytest.raises(VerificationError, match=verify_says) as err:
        memgraph.verify(mg)
    verdict = oracle.judge(mg.to_json())
    assert not verdict.accepted and verdict.rule == rule, verdict
    assert verdict.node == err.value.node


def test_a_mark_on_another_kind_is_refused():
    mg = _plan()
    nodes = list(mg.nodes)
    nodes[1] = nodes[1].__class__(**{**_fields(nodes[1]), "recompute": True})  # an alloc
    bad = MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, {}, mg.storages)
    with pytest.raises(VerificationError, match="only an apply can compute a task again"):
        memgraph.verify(bad)


def _fields(node) -> dict:
    return {f: getattr(node, f) for f in node.__slots__}


def test_stats_and_residencies_count_the_discard_and_the_recompute():
    mg = _plan()
    tg = mg.taskgraph
    s = mg.stats
    assert (s.recompute_count, s.recompute_flops) == (1, tg[1].flops)
    assert (s.discard_count, s.discard_bytes) == (1, tg[1].nbytes)
    assert (s.drop_count, s.offload_count, s.apply_count) == (0, 0, 3)
    stays = [st for st in mg.residencies.stays if st.tensor == 1]
    assert [(st.arrival, st.departure) for st in stays] == [
        ("computed", "discarded"),
        ("recomputed", "freed"),
    ]
    assert stays[1].source == "recompute"
    assert any("recompute" in label for label, _ in s.rows())


def test_the_simulator_charges_a_recompute_its_tasks_compute_time():
    mg = _plan()
    model = memgraph.get_cost_model("h100-pcie5")
    sim = memgraph.simulate(mg, model)
    applies = [n.tensor for n in mg if n.kind is NodeKind.APPLY]
    assert applies == [1, 1, 3]
    want = sum(model.task_seconds(mg.taskgraph, t) for t in applies)
    assert sim.compute_seconds == pytest.approx(want)
    assert sim.compute_seconds > sum(model.task_seconds(mg.taskgraph, t) for t in (1, 3))


def test_a_recompute_is_drawn_apart_from_an_apply():
    mg = _plan()
    kinds = [style_kind(n, mg) for n in mg if n.kind is NodeKind.APPLY]
    assert kinds == ["apply", "recompute", "apply"]
    dot = mg.to_dot()
    assert "recompute %1" in dot and "recompute (a dropped tensor computed again)" in dot


@pytest.mark.parametrize("mode", ["sequential", "streams", "random"])
def test_the_numpy_runtime_runs_a_recompute_as_an_apply(mode):
    mg = _plan()
    inputs = _inputs()
    want = taskgraph.evaluate(mg.taskgraph, inputs)["y"]
    for seed in range(3):
        got = runtime.run(mg, inputs, backend="numpy", mode=mode, seed=seed)["y"]
        np.testing.assert_allclose(got, want, rtol=1e-6)
