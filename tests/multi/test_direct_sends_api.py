"""Direct sends through the API and the files: `einpage.compile_devices(sends=...)` for
the pipeline, tensor and auto strategies, `Planning(sends=...)` for generations on
several devices (unrolled and step plans), and multi-device plan files that keep each
link's path (host-staged files unchanged byte for byte, a direct plan loaded verifies)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_direct_sends import check_direct_plan
from test_placement_driver import llama_case

import einpage as ep
from einpage.models import llama
from einpage.models.errors import GenerationError
from einpage.pipeline import devices as pipeline_devices
from einpage.workloads.generate import Planning
from einpage.workloads.generation import GenerationSpec, plan_generation
from einpage_core.errors import PlanError, SerializationError, VerificationError
from memgraph import NodeKind
from memgraph.multi import MultiPlan, plan_devices, verify_multi
from memgraph.multi_serialize import multi_from_json, multi_to_json, read_multi_json
from memgraph.peer import direct_sends

TINY = replace(llama.PRESETS["tiny"], num_layers=2)


def chain(devices: int = 3) -> ep.Program:
    prog = ep.Program("chain")
    x = prog.input("x", (8, 64))
    for i in range(2 * devices):
        x = ep.tanh(x @ prog.input(f"w{i}", (64, 64), role="weight"))
    prog.output(x, "y")
    return prog


# -- plan files ----------------------------------------------------------------------------


def test_a_direct_plan_round_trips_byte_for_byte_and_verifies():
    prog = chain()
    tg = prog.build()
    mp = plan_devices(tg, 3, "80%", sends="direct")
    assert [k.path for k in mp.links] == ["peer", "peer"]
    text = multi_to_json(mp, tg)
    data = json.loads(text)
    assert [k["path"] for k in data["links"]] == ["peer", "peer"]
    sends = [n for part in data["parts"] for n in part["plan"]["nodes"] if n["kind"] == "send"]
    recvs = [n for part in data["parts"] for n in part["plan"]["nodes"] if n["kind"] == "recv"]
    assert sorted(n["link"] for n in sends) == sorted(n["link"] for n in recvs) == [0, 1]
    loaded = read_multi_json(text)
    assert loaded.plan.links == mp.links
    assert multi_to_json(loaded.plan, loaded.program) == text
    for old, new in zip(mp.plans, loaded.plan.plans, strict=True):
        assert new.mg.nodes == old.mg.nodes  # send and recv nodes with their links
    assert verify_multi(loaded.plan).links == 2


def test_the_validated_reader_takes_what_the_quick_one_does():
    """A send or recv whose id is written 3.0 (which only the validated reader takes)
    is read by it: the same nodes as the quick reader gives."""
    mp = plan_devices(chain().build(), 3, "80%", sends="direct")
    data = json.loads(multi_to_json(mp))
    for part in data["parts"]:
        for node in part["plan"]["nodes"]:
            if node["kind"] in ("send", "recv"):
                node["id"] = float(node["id"])
    back = multi_from_json(json.dumps(data))
    assert [p.mg.nodes for p in back.plans] == [p.mg.nodes for p in mp.plans]


def test_a_host_staged_file_has_no_path_key():
    mp = plan_devices(chain().build(), 3, "80%")
    data = json.loads(multi_to_json(mp))
    assert all("path" not in k for k in data["links"]) and len(data["links"]) == 2
    assert multi_from_json(multi_to_json(mp)).links == mp.links


@pytest.mark.parametrize(
    "value, kind, message",
    [
        ("nvlink", "path", "$.links[0].path: expected one of 'host', 'peer', got 'nvlink'"),
        (1, "path", "$.links[0].path: expected one of"),
        (-1, "link", "link"),
        ("0", "link", "link"),
    ],
)
def test_a_bad_path_or_link_index_is_an_error_naming_its_json_path(value, kind, message):
    mp = plan_devices(chain().build(), 3, "80%", sends="direct")
    data = json.loads(multi_to_json(mp))
    if kind == "path":
        data["links"][0]["path"] = value
    else:
        (send,) = [n for n in data["parts"][0]["plan"]["nodes"] if n["kind"] == "send"]
        send["link"] = value
    with pytest.raises(SerializationError) as caught:
        multi_from_json(json.dumps(data))
    assert message in str(caught.value)
    if kind == "link":
        assert str(caught.value).startswith("$.parts[0].plan.nodes[")


def test_a_file_whose_link_says_host_but_whose_nodes_send_is_rejected_by_the_verifier():
    mp = plan_devices(chain().build(), 3, "80%", sends="direct")
    data = json.loads(multi_to_json(mp))
    del data["links"][1]["path"]
    loaded = multi_from_json(json.dumps(data))
    assert [k.path for k in loaded.links] == ["peer", "host"]
    with pytest.raises(VerificationError, match="link#1"):
        verify_multi(loaded)


# -- compile_devices -----------------------------------------------------------------------


def test_compile_devices_pipeline_sends_direct_and_says_so():
    host = ep.compile_devices(chain(), "80%", 3)
    direct = ep.compile_devices(chain(), "80%", 3, sends="direct")
    check_direct_plan(host.plan, direct.plan)
    assert (host.sends, direct.sends) == ("host", "direct")
    rows = dict(direct.rows())
    assert rows["sends"].startswith("direct: 2 of 2 links device to device")
    assert dict(host.rows())["sends"] == "host: all 2 links staged through host memory"
    assert "sends direct" in repr(direct)
    table = pipeline_devices.device_rows(direct.plan)
    assert table[1][-1].endswith(", 1 direct") and table[2][-2].endswith(", 1 direct")
    assert direct.report is not None and direct.report.links == 2


def test_compile_devices_tensor_sends_its_partial_sums_direct():
    tg, _ = llama_case(TINY, batch=1, seq=4)
    host = ep.compile_devices(tg, "100%", 2, strategy="tensor")
    direct = ep.compile_devices(tg, "100%", 2, strategy="tensor", sends="direct")
    check_direct_plan(host.plan, direct.plan)
    assert direct.plan.info["direct"]["links"] >= 1
    assert direct.plan.placed.strategy == "tensor"


def test_compile_devices_auto_compiles_every_candidate_with_the_sends(monkeypatch):
    """Each candidate is compiled with `sends`: the simulator is handed direct plans (a
    stand-in that records them, so this does not depend on its timing of sends)."""
    seen: dict[str, MultiPlan] = {}

    class Result:
        def __init__(self, makespan):
            self.makespan = makespan

    def fake(mp, cost_model, **_):
        seen[mp.placed.strategy] = mp
        return Result(1.0 if mp.placed.strategy == "tensor" else 2.0)

    import memgraph.simulate_multi

    monkeypatch.setattr(memgraph.simulate_multi, "simulate_multi", fake)
    tg, _ = llama_case(TINY, batch=1, seq=4)
    compiled = ep.compile_devices(tg, "100%", 2, strategy="auto", sends="direct")
    assert set(seen) == {"pipeline", "tensor"}
    for mp in seen.values():
        assert mp.info["sends"] == "direct" and any(k.path == "peer" for k in mp.links)
    assert compiled.strategy == "tensor" and compiled.plan is seen["tensor"]
    assert compiled.report is not None  # the kept one is verified


def test_compile_devices_refuses_an_unknown_sends_naming_the_choices():
    with pytest.raises(PlanError, match="sends must be one of 'host', 'direct'.*'nvlink'"):
        ep.compile_devices(chain(), "80%", 3, sends="nvlink")
    with pytest.raises(PlanError, match="sends must be one of"):
        ep.compile_devices(chain(), "80%", 3, strategy="auto", sends="p2p")


# -- generations on several devices --------------------------------------------------------


def generation(planning: Planning):
    """The generation's plans only (`plan_generation`: their simulated stats are the
    simulator's business, which times direct sends on its own branch)."""
    spec = GenerationSpec(llama.FAMILY, TINY, 1, 4, 2, "float32", page_size=4)
    return plan_generation(spec, "100%", planning)


def test_planning_sends_direct_threads_to_the_unrolled_plan():
    host = generation(Planning(devices=2))
    direct = generation(Planning(devices=2, sends="direct"))
    check_direct_plan(host.plan, direct.plan)
    assert direct.plan.info["direct"]["links"] >= 1


def test_planning_sends_direct_threads_to_every_step_plan():
    plans = generation(Planning(way="steps", devices=2, sends="direct"))
    compiled = [plans.prefill, *plans.decoders.values()]
    assert len(compiled) >= 2
    for each in compiled:
        assert each.sends == "direct" and each.plan.info["sends"] == "direct"
        assert any(k.path == "peer" for k in each.plan.links)
        sends = [n for p in each.plan.plans for n in p.mg.nodes if n.kind is NodeKind.SEND]
        assert len(sends) == sum(1 for k in each.plan.links if k.path == "peer")


def test_planning_refuses_a_bad_sends_or_one_on_one_device():
    with pytest.raises(GenerationError, match="sends must be one of"):
        Planning(devices=2, sends="nvlink")
    with pytest.raises(GenerationError, match="give devices=N"):
        Planning(sends="direct")
    assert Planning(devices=2).devices_options()["sends"] == "host"
    with pytest.raises(GenerationError, match="options has no 'sends'|not taken"):
        Planning(devices=2, options={"sends": "direct"})


def test_direct_sends_of_a_compiled_plan_equals_compiling_with_direct():
    host = ep.compile_devices(chain(), "80%", 3)
    direct = ep.compile_devices(chain(), "80%", 3, sends="direct")
    assert multi_to_json(direct_sends(host.plan)[0]) == multi_to_json(direct.plan)
