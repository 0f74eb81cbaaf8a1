"""`memgraph.multi_serialize`: multi-device plan files. A round trip is byte-for-byte
stable, verifies (`verify_multi`) and runs to the reference's outputs; every corrupted
field is a `SerializationError` naming its JSON path; a wrong size that loads is caught
by the verifier."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import program_inputs
from test_placement import layered_programs

import einpage as ep
import taskgraph
from einpage_core.errors import SerializationError, VerificationError
from memgraph import min_budget, read_budget
from memgraph.multi import MultiPlan, plan_devices, verify_multi
from memgraph.multi_serialize import (
    FORMAT,
    multi_from_json,
    multi_to_json,
    read_multi_json,
    write_multi_json,
)
from memgraph.options import PlanOptions
from memgraph.placement import place
from runtime.multi import run_devices
from taskgraph.builder import GraphBuilder
from taskgraph.einsum import EinsumSpec
from taskgraph.nodes import Einsum, Input

HOST = PlanOptions(outputs="host")


def chain_program(layers: int = 4) -> taskgraph.TaskGraph:
    prog = ep.Program("chain")
    x = prog.input("x", (8, 16))
    for i in range(layers):
        x = ep.tanh(x @ prog.input(f"w{i}", (16, 16), role="weight"))
    prog.output(x, "y")
    return prog.build()


@pytest.fixture(scope="module")
def case() -> tuple[taskgraph.TaskGraph, MultiPlan]:
    tg = chain_program()
    return tg, plan_devices(tg, 2, "2KiB")


def test_a_round_trip_is_stable_byte_for_byte_verifies_and_runs(case):
    tg, mp = case
    for part, plan in zip(mp.placed.parts, mp.plans, strict=True):  # below the resident peak
        assert plan.mg.stats.peak_bytes <= plan.budget < read_budget(part.tg, "100%", HOST).nbytes
    text = multi_to_json(mp, tg)
    loaded = read_multi_json(text)
    assert multi_to_json(loaded.plan, loaded.program) == text
    assert loaded.program.to_json() == tg.to_json()
    assert json.loads(text) == json.loads(json.dumps(json.loads(text)))  # plain JSON
    report = verify_multi(loaded.plan)
    assert report.devices == 2 and report.links == len(mp.links) >= 1
    assert loaded.plan.links == mp.links and dict(loaded.plan.outputs) == dict(mp.outputs)
    assert [p.budget for p in loaded.plan.plans] == [p.budget for p in mp.plans]
    arrays = program_inputs(tg, 1)
    got = run_devices(loaded.plan, arrays)
    want = taskgraph.evaluate(tg, arrays)
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-6)


def test_each_device_graph_is_stored_once_inside_its_plan(case):
    tg, mp = case
    data = json.loads(multi_to_json(mp))
    assert "program" not in data
    for part, entry in zip(mp.placed.parts, data["parts"], strict=True):
        assert set(entry) == {"device", "budget", "origin", "plan"}
        assert entry["plan"]["format"] == "einpage.memgraph"
        assert len(entry["plan"]["taskgraph"]["tasks"]) == len(part.tg)
    loaded = multi_from_json(multi_to_json(mp))
    for part, back in zip(mp.placed.parts, loaded.placed.parts, strict=True):
        assert back.tg.to_json() == part.tg.to_json() and back.origin == part.origin
        assert back.tg is loaded.plans[back.device].mg.taskgraph


def test_written_to_a_stream_is_the_same_text(case, tmp_path):
    tg, mp = case
    path = tmp_path / "multi.json"
    with open(path, "w", encoding="utf-8") as stream:
        write_multi_json(mp, stream, tg)
    assert path.read_text(encoding="utf-8") == multi_to_json(mp, tg)


@settings(max_examples=8, deadline=None)
@given(case=layered_programs(), seed=st.integers(0, 2**16))
def test_random_layered_programs_round_trip_and_run_from_the_file(case, seed):
    tg, devices = case
    placed = place(tg, devices)
    # A device whose tasks all feed nothing has no outputs, and no such TaskGraph loads
    # from JSON: see test_a_device_whose_tasks_feed_nothing_cannot_be_loaded.
    assume(all(part.tg.outputs for part in placed.parts))
    mp = plan_devices(placed, devices, [min_budget(part.tg)[0] for part in placed.parts])
    text = multi_to_json(mp, tg)
    loaded = read_multi_json(text)
    assert multi_to_json(loaded.plan, loaded.program) == text
    verify_multi(loaded.plan)
    arrays = program_inputs(tg, seed)
    got = run_devices(loaded.plan, arrays, order="random", seed=seed)
    want = taskgraph.evaluate(loaded.program, arrays)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


# -- corrupted files -------------------------------------------------------------------


def _corrupt(text: str, edit) -> str:
    data = json.loads(text)
    edit(data)
    return json.dumps(data)


def _pop(key):
    return lambda d: d.pop(key)


def _set(path, value):
    def edit(d):
        *head, last = path
        for key in head:
            d = d[key]
        d[last] = value

    return edit


CORRUPTIONS = [
    ("no links key", _pop("links"), "$: missing key(s) ['links']"),
    ("no parts key", _pop("parts"), "$: missing key(s) ['parts']"),
    ("an unknown key", _set(["extra"], 1), "$: unknown key(s) ['extra']"),
    ("another format", _set(["format"], "einpage.memgraph"), "$.format: expected"),
    ("a future version", _set(["version"], 2), "$.version: expected 1, got 2"),
    ("devices a string", _set(["devices"], "2"), "$.devices: expected an integer >= 1"),
    ("devices zero", _set(["devices"], 0), "$.devices: expected an integer >= 1, got 0"),
    (
        "a link to device 7 of 2",
        _set(["links", 0, "target"], 7),
        "$.links[0].target: device 7 is not one of the plan's devices 0..1",
    ),
    ("a link source negative", _set(["links", 0, "source"], -1), "$.links[0].source"),
    ("a link shape of strings", _set(["links", 0, "shape"], ["8"]), "$.links[0].shape[0]"),
    ("a link of an unknown dtype", _set(["links", 0, "dtype"], "float7"), "$.links[0].dtype"),
    ("a link without nbytes", lambda d: d["links"][0].pop("nbytes"), "$.links[0]: missing"),
    ("a link nbytes as a float", _set(["links", 0, "nbytes"], 512.0), "$.links[0].nbytes"),
    ("an output on device 7", _set(["outputs", "y"], [7, "y"]), "$.outputs['y'][0]: device 7"),
    ("an output not a pair", _set(["outputs", "y"], 1), "$.outputs['y']: expected [device"),
    ("inputs not a list", _set(["inputs"], "x"), "$.inputs: expected a list"),
    ("an input name a number", _set(["inputs", 0], 3), "$.inputs[0]: expected a non-empty"),
    ("one part missing", lambda d: d["parts"].pop(), "$.parts: has 1 parts for 2 devices"),
    ("parts swapped", lambda d: d["parts"].reverse(), "$.parts[0].device: expected 0"),
    ("a budget of zero", _set(["parts", 1, "budget"], 0), "$.parts[1].budget: expected an"),
    ("a budget unlike the plan's", _set(["parts", 1, "budget"], 7), "$.parts[1].budget: 7 B"),
    ("an origin too short", lambda d: d["parts"][0]["origin"].pop(), "$.parts[0].origin: has"),
    (
        "a bad node inside a plan",
        _set(["parts", 1, "plan", "nodes", 2, "kind"], "teleport"),
        "$.parts[1].plan.nodes[2].kind: unknown kind 'teleport'",
    ),
    ("a plan that is no plan", _set(["parts", 0, "plan"], []), "$.parts[0].plan: expected"),
    ("info not an object", _set(["info"], [1]), "$.info: expected an object"),
    (
        "an origin past the program",
        _set(["parts", 1, "origin", 0], 999),
        "$.parts[1].origin[0]: %999 is not a task of the program",
    ),
    ("a program that is no graph", _set(["program"], {"tasks": 1}), "$.program"),
]


@pytest.mark.parametrize("what, edit, message", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_each_corrupted_field_is_an_error_naming_its_path(case, what, edit, message):
    tg, mp = case
    text = multi_to_json(mp, tg)
    with pytest.raises(SerializationError) as caught:
        read_multi_json(_corrupt(text, edit))
    assert message in str(caught.value), (what, str(caught.value))


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.99])
def test_a_truncated_file_is_an_error_not_a_crash(case, cut):
    tg, mp = case
    text = multi_to_json(mp, tg)
    with pytest.raises(SerializationError):
        multi_from_json(text[: int(len(text) * cut)])


def test_a_wrong_size_or_a_dropped_link_loads_and_the_verifier_rejects_it(case):
    """Loading judges structure only; a link whose size differs from what its ends hold,
    or a plan whose link was dropped (its input then fed by nothing), is refused by
    `verify_multi`."""
    tg, mp = case
    text = multi_to_json(mp, tg)
    resized = multi_from_json(_corrupt(text, _set(["links", 0, "nbytes"], 4)))
    with pytest.raises(VerificationError, match="4 B"):
        verify_multi(resized)
    dropped = multi_from_json(_corrupt(text, lambda d: d["links"].pop(0)))
    with pytest.raises(VerificationError, match="fed by nothing"):
        verify_multi(dropped)


def test_writing_refuses_what_is_not_a_multiplan(case):
    tg, mp = case
    with pytest.raises(SerializationError, match="MultiPlan"):
        multi_to_json(mp.plans[0].mg)
    with pytest.raises(SerializationError, match="TaskGraph"):
        multi_to_json(mp, program="chain")
    assert json.loads(multi_to_json(mp))["format"] == FORMAT


def test_a_device_whose_tasks_feed_nothing_is_saved_and_loaded():
    """A hand-built graph may keep a task nothing reads; placed on its weight's device, that
    device's graph has no output. Its plan file loads (a device's share may have none)."""
    builder = GraphBuilder("dead")
    x = builder.add(Input("x"), (), (4, 8), "float32")
    w0 = builder.add(Input("w0", role="weight"), (), (8, 8), "float32")
    w1 = builder.add(Input("w1", role="weight"), (), (8, 8), "float32")
    h = builder.add(Einsum(EinsumSpec.parse("ab,bc->ac")), (x, w0))
    builder.add(Einsum(EinsumSpec.parse("ab,bc->ac")), (h, w1))  # read by nothing
    builder.output(h, "y")
    mp = plan_devices(builder.build(), 2, "100%")
    assert [len(part.tg.outputs) for part in mp.placed.parts] == [2, 0]
    back = multi_from_json(multi_to_json(mp))
    verify_multi(back)
    assert [len(p.tg) for p in back.placed.parts] == [len(p.tg) for p in mp.placed.parts]
    assert multi_to_json(back) == multi_to_json(mp)


def test_a_program_or_a_one_device_plan_without_outputs_is_still_refused():
    """Only a device's share in a plan file for several devices may have no output: a
    program file, and a one-device plan file, need one."""
    import json

    import memgraph
    from memgraph.serialize import memgraph_from_dict
    from taskgraph.serialize import taskgraph_from_dict

    builder = GraphBuilder("one")
    x = builder.add(Input("x"), (), (4, 8), "float32")
    builder.output(builder.add(Einsum(EinsumSpec.parse("ab->ab")), (x,)), "y")
    tg = builder.build()
    program = json.loads(tg.to_json())
    program["outputs"] = {}
    with pytest.raises(SerializationError, match=r"\$.outputs: a program needs at least one"):
        taskgraph_from_dict(program)
    assert len(taskgraph_from_dict(program, device_part=True).outputs) == 0
    plan = json.loads(memgraph.plan(tg, "100%").to_json())
    plan["taskgraph"]["outputs"] = {}
    with pytest.raises(SerializationError, match="a program needs at least one output"):
        memgraph_from_dict(plan)
