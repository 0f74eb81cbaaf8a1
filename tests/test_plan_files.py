"""Plan files: written streamed, byte for byte the JSON of the plan's dicts; read through
quick checks that accept only what the full checks accept; progress while writing and
reading; files written by earlier versions still load and write back unchanged."""

from __future__ import annotations

import gc
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from plans import reference_plan, sliced_weight_plan, two_output_mlp

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK, main
from einpage.cli.console import Console
from einpage.cli.demo import random_inputs
from einpage.cli.files import load_json_graph, load_plan, save_plan
from einpage.cli.presets import load_program
from einpage_core.errors import SerializationError
from einpage_core.progress import Progress
from memgraph import MemGraph, NodeKind
from memgraph import serialize as mgs
from taskgraph import serialize as tgs

DATA = Path(__file__).resolve().parent / "memgraph" / "data"
OLD_PLAN = DATA / "llama_micro_partitioned.json"
"""A plan written by einpage before plans were streamed (commit 7d8bad1): a one-layer
LLaMA (hidden 32, 2 heads, vocabulary 64; batch 1, seq 8, every logit) compiled at
35%streaming, so partitioned (2304-byte blocks), with sliced reloads of weights, sliced
offloads assembling the logits on the host, whole offloads and reloads, and -inf fills."""


def strange_program() -> taskgraph.TaskGraph:
    """Names, scopes and labels that JSON must escape; fills of -0.0, 0.0, -inf and NaN."""
    prog = ep.Program('odd "names"\n é ∑')
    x = prog.input('x "quoted" é', (4, 8), role="weight")
    with prog.scope("a\\b/ü"):
        zero = prog.fill((4, 8), 0.0, label="zero")
        minus_zero = prog.fill((4, 8), -0.0, label="tab\there")
        y = prog.einsum("ij,ij->ij", x, zero, join="a + b")
        y = prog.einsum("ij,ij->ij", y, minus_zero, join="a - b")
        low = prog.fill((4,), -math.inf)
        nan = prog.fill((4,), math.nan)
    prog.output(prog.einsum("ij,i->i", y, low, join="max(a, b)", agg="max"), "y ∂")
    prog.output(prog.einsum("i,i->i", nan, nan, join="a * 0"), "nan")
    return prog.build()


def variety() -> dict[str, MemGraph]:
    """Plans of every node kind and field: offloads and host outputs, sliced reloads,
    a partitioned plan (blocks), strange strings and floats, and a file from before."""
    offloads = frozenset({3, 5})
    return {
        "reference": reference_plan(two_output_mlp(), offload=offloads, outputs_to_host=True),
        "sliced": sliced_weight_plan(),
        "partitioned": ep.compile(load_program("mlp"), "40%").plan,
        "strange": ep.compile(strange_program(), "100%").plan,
        "old file": load_plan(OLD_PLAN),
    }


@pytest.fixture(scope="module")
def plans() -> dict[str, MemGraph]:
    return variety()


def test_the_streamed_text_is_the_json_of_the_dicts_byte_for_byte(plans):
    for name, mg in plans.items():
        expected = json.dumps(mgs.memgraph_to_dict(mg), allow_nan=False)
        assert mgs.memgraph_to_json(mg) == expected, name
        stream = io.StringIO()
        mgs.write_memgraph_json(mg, stream)
        assert stream.getvalue() == expected, name
        tg = mg.taskgraph
        assert tgs.taskgraph_to_json(tg) == json.dumps(tgs.taskgraph_to_dict(tg), allow_nan=False)
    mg = plans["reference"]
    assert mg.to_json(indent=2) == json.dumps(mgs.memgraph_to_dict(mg), indent=2)


def test_a_file_from_before_loads_verifies_runs_and_writes_back_unchanged(tmp_path):
    mg = load_plan(OLD_PLAN)
    assert len(mg) == 671 and mg.stats.sliced_offload_count == 8
    kinds = {n.kind for n in mg.nodes}
    # not: send and recv (several devices), read, write and release (a host tier)
    tiers = {NodeKind.READ, NodeKind.WRITE, NodeKind.RELEASE}
    assert kinds == set(NodeKind) - {NodeKind.SEND, NodeKind.RECV} - tiers
    assert any(n.box is not None for n in mg.of_kind(NodeKind.RELOAD))
    memgraph.verify(mg)
    inputs = random_inputs(mg.taskgraph, 0)
    out = runtime.run(mg, inputs, backend="numpy")
    ref = taskgraph.evaluate(mg.taskgraph, inputs)
    np.testing.assert_allclose(out["logits"], ref["logits"], rtol=1e-5, atol=1e-6)
    again = tmp_path / "again.json"
    save_plan(mg, again)
    assert again.read_bytes() == OLD_PLAN.read_bytes()


def test_the_same_plan_gives_the_same_bytes(tmp_path):
    tg = load_program("mlp")
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    save_plan(ep.compile(tg, "40%").plan, first)
    save_plan(ep.compile(tg, "40%").plan, second)
    assert first.read_bytes() == second.read_bytes()
    assert first.read_text(encoding="utf-8") == ep.compile(tg, "40%").plan.to_json()
    save_plan(load_plan(first), second)  # and a loaded plan writes what it read
    assert first.read_bytes() == second.read_bytes()


def test_strange_strings_and_floats_come_back(plans):
    mg = plans["strange"]
    again = MemGraph.from_json(mg.to_json())
    assert again.taskgraph.name == mg.taskgraph.name == 'odd "names"\n é ∑'
    assert [t.line() for t in again.taskgraph] == [t.line() for t in mg.taskgraph]  # NaN != NaN
    assert again.nodes == mg.nodes
    fills = [t.op.value for t in again.taskgraph if t.kind == "fill"]
    assert [math.copysign(1.0, v) for v in fills[:2]] == [1.0, -1.0]  # 0.0 and -0.0 apart
    assert fills[2] == -math.inf and math.isnan(fills[3])
    assert again.to_json() == mg.to_json()


def test_equal_ops_are_made_once_and_shared_on_load(plans):
    tg = MemGraph.from_json(plans["partitioned"].to_json()).taskgraph
    ops: dict[str, object] = {}
    for task in tg:
        text = json.dumps([task.kind, task.op.attributes()])
        assert ops.setdefault(text, task.op) is task.op  # one object per distinct document
    assert len(ops) < len(tg) / 2


# -- the quick checks accept only what the full checks accept ---------------------------


def test_the_key_sets_are_exactly_what_the_key_check_passes():
    from itertools import combinations

    optional = sorted(mgs.FIELDS) + ["bogus"]
    for kind in NodeKind:
        for n in range(len(optional) + 1):
            for extra in combinations(optional, n):
                keys = set(mgs._COMMON) | set(extra)
                try:
                    mgs._check_keys(dict.fromkeys(keys), kind, "$")
                    passes = True
                except SerializationError:
                    passes = False
                assert (frozenset(keys) in mgs._KEY_SETS[kind]) == passes, (kind, keys)


def test_every_node_of_real_plans_takes_the_quick_path_to_the_same_node(plans):
    for name, mg in plans.items():
        data = json.loads(mg.to_json())
        tg = mg.taskgraph
        storages = mgs._storages(data["storages"], tg)
        for position, entry in enumerate(data["nodes"]):
            quick = mgs._quick_node(entry, position, len(tg), storages, {})
            assert quick is not None, (name, entry)
            assert quick == mgs._node(entry, position, tg, storages) == mg.nodes[position]
        for position, entry in enumerate(data["taskgraph"]["tasks"]):
            assert tgs._quick_task_check(entry, position), (name, entry)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 40)
    | st.sampled_from([2**70, 1.0, 0.5, -0.0, 3.0])
    | st.sampled_from(["", "x", "alloc", "apply", "reload", "input", "starts", "sizes"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["starts", "sizes", "other"]), inner, max_size=3)
    ),
    max_leaves=6,
)
NODE_KEYS = ["id", "kind", "deps", "tensor", *mgs.FIELDS, "bogus"]
TASK_KEYS = ["id", "op", "inputs", "shape", "dtype", "scope", "label", "attrs", "block", "x"]
SAMPLES = json.loads(sliced_weight_plan().to_json())


def edits(keys: list[str]) -> st.SearchStrategy:
    """One to three (key, value) edits of a document; a value None removes the key."""
    return st.lists(
        st.tuples(st.sampled_from(keys), st.none() | JSON_VALUES), min_size=1, max_size=3
    )


@given(st.integers(0, len(SAMPLES["nodes"]) - 1), edits(NODE_KEYS))
def test_a_mutated_node_passes_the_quick_check_only_if_it_passes_the_full_one(position, edits):
    """Each edit sets a key to a value (None: removes it); whatever the quick path
    accepts, the full checks accept as the same node."""
    entry = json.loads(json.dumps(SAMPLES["nodes"][position]))
    for key, value in edits:
        if value is None:
            entry.pop(key, None)
        else:
            entry[key] = value
    tg = sliced_weight_plan().taskgraph
    storages = mgs._storages(SAMPLES["storages"], tg)
    quick = mgs._quick_node(entry, position, len(tg), storages, {})
    try:
        full = mgs._node(entry, position, tg, storages)
    except SerializationError:
        assert quick is None, entry
    else:
        assert quick is None or quick == full, entry


@given(st.integers(0, len(SAMPLES["taskgraph"]["tasks"]) - 1), edits(TASK_KEYS))
def test_a_mutated_task_passes_the_quick_check_only_if_it_passes_the_full_one(position, edits):
    entry = json.loads(json.dumps(SAMPLES["taskgraph"]["tasks"][position]))
    for key, value in edits:
        if value is None:
            entry.pop(key, None)
        else:
            entry[key] = value
    if tgs._quick_task_check(entry, position):
        tgs._check_task(entry, position, "$")  # raises if the quick check was wrong


def test_a_bad_node_is_still_named_by_its_path(plans):
    data = json.loads(plans["partitioned"].to_json())
    data["nodes"][-3]["deps"] = [len(data["nodes"])]
    with pytest.raises(SerializationError, match=rf"\$.nodes\[{len(data['nodes']) - 3}\].deps"):
        MemGraph.from_json(json.dumps(data))
    data = json.loads(plans["partitioned"].to_json())
    data["taskgraph"]["tasks"][40]["shape"] = [2, "3"]
    message = r"\$.taskgraph.tasks\[40\].shape: expected a list"
    with pytest.raises(SerializationError, match=message):
        MemGraph.from_json(json.dumps(data))


# -- progress ---------------------------------------------------------------------------


def check_events(events: list[Progress], stages: list[str], items: dict[str, int]) -> None:
    """Stages in order, a fraction that never decreases from 0.0 to 1.0, each stage's
    count growing to its total, about a hundred events a stage at most."""
    assert list(dict.fromkeys(e.stage for e in events)) == [*stages, "done"]
    fractions = [e.fraction for e in events]
    assert fractions == sorted(fractions) and fractions[0] == 0.0
    assert events[-1] == Progress("done", 1, 1, 1.0)
    for stage, total in items.items():
        done = [e.done for e in events if e.stage == stage]
        assert done == sorted(done) and done[-1] == total, stage
        assert 10 < len(done) <= 103, stage  # intermediate reports, not just start and end


def test_saving_and_loading_report_progress(plans, tmp_path):
    mg = plans["partitioned"]
    path = tmp_path / "plan.json"
    events: list[Progress] = []
    save_plan(mg, path, progress=events.append)
    sizes = {"writing tasks": len(mg.taskgraph), "writing nodes": len(mg)}
    check_events(events, ["writing tasks", "writing nodes"], sizes)
    events.clear()
    again = load_plan(path, progress=events.append)
    sizes = {"checking tasks": len(mg.taskgraph), "checking nodes": len(mg)}
    check_events(events, ["reading", "checking tasks", "checking nodes"], sizes)
    assert again.nodes == mg.nodes
    events.clear()
    load_json_graph(path, progress=events.append)  # `einpage render`'s loader: no "reading"
    check_events(events, ["checking tasks", "checking nodes"], sizes)
    graph = tmp_path / "graph.json"
    graph.write_text(mg.taskgraph.to_json(), encoding="utf-8")
    events.clear()
    load_json_graph(graph, progress=events.append)
    check_events(events, ["checking tasks"], {"checking tasks": len(mg.taskgraph)})


def test_a_small_plan_reports_progress_too():
    events: list[Progress] = []
    mg = reference_plan(two_output_mlp())
    mgs.write_memgraph_json(mg, io.StringIO(), events.append)
    assert events[-1] == Progress("done", 1, 1, 1.0)
    events.clear()
    mgs.memgraph_from_json(mg.to_json(), events.append)
    fractions = [e.fraction for e in events]
    assert fractions == sorted(fractions) and events[-1].fraction == 1.0


def test_the_cli_shows_writing_and_reading_on_its_bar(tmp_path, capsys, monkeypatch):
    events: list[Progress] = []
    monkeypatch.setattr(Console, "report", lambda self, event: events.append(event))
    path = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--budget", "40%", "-o", str(path)]) == EXIT_OK
    stages = [e.stage for e in events]
    assert "planning" in stages and "writing nodes" in stages and stages[-1] == "done"
    events.clear()
    assert main(["stats", str(path)]) == EXIT_OK
    assert [e.stage for e in events][-2:] == ["checking nodes", "done"]
    events.clear()
    assert main(["run", str(path), "--backend", "numpy"]) == EXIT_OK
    assert "checking nodes" in [e.stage for e in events]
    capsys.readouterr()


def test_a_console_bar_names_the_writing():
    class TTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = TTY()
    console = Console(out=TTY(), err=err)
    with console.stages(1), console.stage("writing the plan"):
        mgs.write_memgraph_json(reference_plan(two_output_mlp()), io.StringIO(), console.report)
    assert "writing the plan" in err.getvalue() and "done 100%" in err.getvalue()


# -- what is not JSON -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[" * 100_000, "nested too deeply"),
        ('{"format": "einpage.memgraph", "budget": ' + "9" * 5000 + "}", "4300"),
        ('{"format": "einpage.memgraph", "budget": 1', "not valid JSON"),
    ],
)
def test_json_python_cannot_read_is_a_serialization_error(tmp_path, capsys, text, needle):
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SerializationError, match=needle):
        MemGraph.from_json(text)
    with pytest.raises(SerializationError, match=needle):
        taskgraph.TaskGraph.from_json(text)
    with pytest.raises(SerializationError, match=needle):
        load_json_graph(path)
    assert main(["stats", str(path)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("einpage: error: ") and needle in err


@pytest.mark.parametrize("enabled", [True, False])
def test_loading_leaves_the_collector_as_it_found_it(plans, enabled):
    text = plans["reference"].to_json()
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        MemGraph.from_json(text)
        assert gc.isenabled() == enabled
        with pytest.raises(SerializationError):
            MemGraph.from_json(text.replace('"kind": "alloc"', '"kind": "copy"'))
        assert gc.isenabled() == enabled
        with pytest.raises(SerializationError):
            MemGraph.from_json(text[:-5])
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()
