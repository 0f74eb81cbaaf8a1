"""`einpage.compile_devices`: place, plan each device under its own budget, verify; run,
simulate and save the result. Outputs are compared with `taskgraph.evaluate` of the
program given (the reference evaluator, which shares no code with placement, planning or
the runtime)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_placement import training_case
from test_placement_driver import chain, llama_case

import einpage as ep
import taskgraph
from einpage.cli.presets import load_program, random_inputs
from einpage.models import llama
from einpage.models.generation import generation_inputs
from einpage.pipeline import CompiledDevices
from einpage_core.errors import BackendError, InfeasibleBudgetError, PlanError
from memgraph import min_budget, read_budget
from memgraph.multi import DeviceBudgetError, verify_multi
from memgraph.multi_serialize import read_multi_json
from memgraph.options import PlanOptions
from memgraph.placement import place
from runtime.workspace import declare_workspaces

HOST = PlanOptions(outputs="host")


def assert_close(got: dict, want: dict, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


def smallest(tg, devices: int) -> list[int]:
    """Each device's smallest feasible budget under the pipeline placement (its kernels'
    workspaces declared, as `compile_devices` declares them)."""
    return [min_budget(part.tg)[0] for part in place(declare_workspaces(tg), devices).parts]


@pytest.mark.parametrize("devices", [2, 3])
def test_llama_prefill_at_each_device_s_smallest_budget_runs_to_the_reference(devices):
    cfg = replace(llama.PRESETS["tiny"], num_layers=devices)  # a layer per device at least
    tg, arrays = llama_case(cfg, seq=16)
    compiled = ep.compile_devices(tg, smallest(tg, devices), devices)
    assert isinstance(compiled, CompiledDevices) and compiled.devices == devices
    assert compiled.report is not None and compiled.report.links == len(compiled.plan.links) > 0
    for part, plan in zip(compiled.plan.placed.parts, compiled.plan.plans, strict=True):
        resident = read_budget(part.tg, "100%", HOST).nbytes
        assert plan.mg.stats.peak_bytes <= plan.budget < resident  # offloads forced
    assert any(p.mg.stats.offload_bytes > 0 for p in compiled.plan.plans)
    want = taskgraph.evaluate(tg, arrays)
    assert_close(compiled.run(arrays), want)
    assert_close(compiled.run(arrays, order="random", seed=5), want)


def test_a_training_step_on_two_devices_equals_the_reference():
    tg, arrays = training_case()
    compiled = ep.compile_devices(tg, smallest(tg, 2), 2)
    assert_close(compiled.run(arrays), taskgraph.evaluate(tg, arrays))


def test_an_unrolled_generation_on_two_devices_chooses_the_reference_s_ids():
    cfg = llama.PRESETS["tiny"]
    tg = llama.generation_program(cfg, 2, 5, 3).build()
    _, prefill = llama_case(cfg)
    weights = {n: a for n, a in prefill.items() if n in llama.weight_shapes(cfg)}
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 5))
    arrays = generation_inputs(llama.FAMILY, cfg, tokens, 3, weights=weights)
    compiled = ep.compile_devices(tg, smallest(tg, 2), 2)
    assert {(k.source, k.target) for k in compiled.plan.links} == {(0, 1), (1, 0)}
    got, want = compiled.run(arrays), taskgraph.evaluate(tg, arrays)
    assert sorted(got) == ["ids"] and want["ids"].dtype == np.int64
    np.testing.assert_array_equal(got["ids"], want["ids"])  # each step's chosen ids


def test_budgets_per_device_and_percentages_read_against_each_device_s_graph():
    tg, _ = chain((32, 32, 32, 32))
    compiled = ep.compile_devices(tg, ["100%", "75%"], 2)
    parts = compiled.plan.placed.parts
    want = [read_budget(parts[0].tg, "100%", HOST), read_budget(parts[1].tg, "75%", HOST)]
    assert [b.nbytes for b in compiled.budgets] == [w.nbytes for w in want]
    assert [p.budget for p in compiled.plan.plans] == [w.nbytes for w in want]
    one = ep.compile_devices(tg, "75%", 2)
    assert [b.nbytes for b in one.budgets] == [
        read_budget(part.tg, "75%", HOST).nbytes for part in one.plan.placed.parts
    ]
    with pytest.raises(PlanError, match="3 budgets given for 2 devices"):
        ep.compile_devices(tg, ["1MiB"] * 3, 2)


def test_a_device_budget_too_small_names_the_device_and_its_smallest_budget():
    tg, _ = llama_case(llama.PRESETS["tiny"], seq=16)
    fits = smallest(tg, 2)
    with pytest.raises(DeviceBudgetError) as caught:
        ep.compile_devices(tg, [fits[0], fits[1] - 1024], 2, partition="off")
    err = caught.value
    assert isinstance(err, InfeasibleBudgetError)
    assert err.device == 1 and err.needed == fits[1]
    assert "device 1" in str(err) and f"{fits[1]} B" in str(err)


def test_auto_partitions_the_whole_program_when_a_device_needs_it_then_places_it():
    """At 2 MiB a device of the MLP cannot run its largest task: "off" refuses, "auto"
    splits the program at a quarter of the budget and places the blocks; the outputs are
    the reference's. Far below, the error says what "auto" tried."""
    tg = load_program("mlp", batch=256)
    with pytest.raises(DeviceBudgetError):
        ep.compile_devices(tg, "2MiB", 2, partition="off")
    compiled = ep.compile_devices(tg, "2MiB", 2)
    assert compiled.partitioning.block_limit == 512 * 1024
    assert compiled.partitioning.how == "auto: 25% of the smallest device budget"
    assert len(compiled.graph) > len(compiled.program)
    assert all(p.mg.stats.peak_bytes <= p.budget == 2 * 2**20 for p in compiled.plan.plans)
    arrays = random_inputs(tg, 0)
    assert_close(compiled.run(arrays), taskgraph.evaluate(tg, arrays), rtol=1e-4, atol=1e-6)
    with pytest.raises(DeviceBudgetError) as caught:
        ep.compile_devices(tg, "384KiB", 2)
    message = str(caught.value)
    assert f"device {caught.value.device}" in message
    assert "split the program at a block limit of 96.0 KiB" in message


def test_an_explicit_block_limit_partitions_the_program_then_places_it():
    tg = load_program("mlp", batch=256)
    compiled = ep.compile_devices(tg, "2MiB", 2, partition="256KiB")
    assert compiled.partitioning.block_limit == 256 * 1024
    assert len(compiled.graph) > len(compiled.program)
    verify_multi(compiled.plan)
    arrays = random_inputs(tg, 0)
    assert_close(compiled.run(arrays), taskgraph.evaluate(tg, arrays), rtol=1e-4, atol=1e-6)


def test_more_devices_than_weights_and_unknown_names_are_refused():
    tg, _ = chain((16, 16))
    with pytest.raises(PlanError, match="at least 3 weights; this program has 2"):
        ep.compile_devices(tg, "1MiB", 3)
    with pytest.raises(PlanError, match="unknown placement strategy 'ring'"):
        ep.compile_devices(tg, "1MiB", 2, strategy="ring")
    with pytest.raises(PlanError, match="tensor placement needs tensors stating Shard facts"):
        ep.compile_devices(tg, "1MiB", 2, strategy="tensor")
    with pytest.raises(PlanError, match="devices must be an int >= 1"):
        ep.compile_devices(tg, "1MiB", 0)
    with pytest.raises(PlanError, match="no option 'frobnicate'"):
        ep.compile_devices(tg, "1MiB", 2, frobnicate=1)
    with pytest.raises(PlanError, match="einpage.compile_devices"):
        ep.compile(tg, "1MiB", devices=2)
    compiled = ep.compile_devices(tg, "1MiB", 2)
    with pytest.raises(BackendError, match="unknown runner 'mpi'; valid: 'local', 'ray'"):
        compiled.run({}, runner="mpi")


def test_simulate_and_save(tmp_path):
    tg, _ = llama_case(llama.PRESETS["tiny"], seq=16)
    compiled = ep.compile_devices(tg, "70%", 2, cost_model="h100-pcie5")
    sim = compiled.simulate()
    assert sim.devices == 2 and sim.cost_model.name == "h100-pcie5"
    assert sim.makespan >= max(sim.finish_seconds) > 0
    assert compiled.simulate("cpu").cost_model.name == "cpu"
    path = tmp_path / "two.json"
    compiled.save(path)
    text = path.read_text(encoding="utf-8")
    assert text == compiled.to_json()
    again = ep.compile_devices(tg, "70%", 2, cost_model="h100-pcie5")
    assert again.to_json() == text  # plans are deterministic, byte for byte
    loaded = read_multi_json(text)
    assert loaded.program.to_json() == compiled.graph.to_json()
    verify_multi(loaded.plan)
    rows = dict(compiled.rows())
    assert rows["placement"].startswith("pipeline on 2 devices")
    assert "CompiledDevices" in repr(compiled)


def test_a_budget_no_partition_can_reach_still_names_the_device_and_its_smallest():
    """With partition="auto", a device budget so small that no split reaches a quarter of
    it (an unsplittable task needs more) raises that device's DeviceBudgetError – its
    smallest budget unsplit – not the partition's BlockLimitError, which names no device."""
    tg, _ = llama_case(llama.PRESETS["tiny"], seq=16)
    fits = smallest(tg, 2)
    with pytest.raises(DeviceBudgetError) as caught:
        ep.compile_devices(tg, [1024, fits[1]], 2)
    err = caught.value
    assert err.device == 0 and err.needed == fits[0]
    assert "device 0" in str(err) and "partition='auto' could not help" in str(err)
