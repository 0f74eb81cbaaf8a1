"""`einpage.compile_devices(strategy="auto")`: every placement strategy compiled, each
plan simulated on the cost model, the fastest kept. The choice is checked against plans
compiled and simulated one strategy at a time (the same public calls, made here), and
the kept plan's outputs against `taskgraph.evaluate`."""

from __future__ import annotations

import pytest
from test_compile_devices import assert_close
from test_placement_driver import chain, llama_case

import einpage as ep
import taskgraph
from einpage.models import llama
from einpage.pipeline import NoStrategyError, StrategyChoice
from memgraph.multi import DeviceBudgetError
from memgraph.placement import STRATEGIES
from memgraph.simulate_multi import simulate_multi


def one_by_one(tg, budget, devices: int, cost_model: str) -> dict[str, float]:
    """Each strategy's simulated makespan, compiled on its own (refused ones left out)."""
    seconds = {}
    for name in STRATEGIES:
        try:
            compiled = ep.compile_devices(tg, budget, devices, strategy=name, cost_model=cost_model)
        except ep.PlanError:
            continue
        seconds[name] = simulate_multi(compiled.plan, cost_model).makespan
    return seconds


@pytest.mark.parametrize("cost_model", ["h100-pcie5", "8xh100-sxm"])
def test_auto_keeps_the_strategy_that_simulates_fastest_and_runs_to_the_reference(cost_model):
    tg, arrays = llama_case(llama.PRESETS["tiny"], seq=16)
    compiled = ep.compile_devices(tg, "70%", 2, strategy="auto", cost_model=cost_model)
    choice = compiled.choice
    assert isinstance(choice, StrategyChoice) and choice.cost_model == cost_model
    want = one_by_one(tg, "70%", 2, cost_model)
    assert choice.seconds == pytest.approx(want)
    assert choice.chosen == min(want, key=want.get) == compiled.strategy
    assert set(choice.seconds) | set(choice.refused) == set(STRATEGIES)
    assert compiled.report is not None  # the kept plan is verified, and only it
    assert all(candidate.report is None for candidate in choice.candidates.values())
    assert compiled.plan is choice.candidates[choice.chosen].plan
    rows = dict(compiled.rows())
    assert rows["strategy"].startswith(f"auto on {cost_model}: ")
    assert f"{choice.chosen} " in rows["strategy"] and "(chosen)" in rows["strategy"]
    assert_close(compiled.run(arrays), taskgraph.evaluate(tg, arrays))


def test_a_strategy_given_by_name_records_no_choice():
    tg, _ = chain((16, 16, 16))
    assert ep.compile_devices(tg, "1MiB", 2).choice is None
    assert "strategy" not in dict(ep.compile_devices(tg, "1MiB", 2).rows())


def test_auto_with_no_strategy_that_fits_names_each_one_s_reason():
    tg, _ = chain((16, 16))  # two weights: no pipeline of three devices
    with pytest.raises(NoStrategyError) as caught:
        ep.compile_devices(tg, "1MiB", 3, strategy="auto")
    err = caught.value
    assert set(err.errors) == set(STRATEGIES)
    assert "strategy='auto': no placement strategy fits" in str(err)
    assert "pipeline: pipeline placement of 3 devices needs at least 3 weights" in str(err)


@pytest.mark.parametrize("sharded", [False, True])
def test_auto_when_the_device_budgets_are_too_small_raises_the_device_s_error(sharded):
    """Whether tensor parallelism is refused (no Shard facts) or fails on its budgets too,
    a budget too small for the strategies that could place the program is the error."""
    if sharded:
        tg, _ = llama_case(llama.PRESETS["tiny"], seq=16)
    else:
        tg, _ = chain((64, 64, 64))
    with pytest.raises(DeviceBudgetError) as caught:
        ep.compile_devices(tg, 64, 2, strategy="auto", partition="off")
    err = caught.value
    assert err.device in (0, 1) and err.needed > err.budget == 64
    assert "no placement strategy fits" in str(err)
    assert "pipeline: device" in str(err)
    assert ("tensor: device" if sharded else "states none; use pipeline") in str(err)


def test_unknown_strategy_lists_auto_among_the_valid_ones():
    tg, _ = chain((16, 16))
    with pytest.raises(ep.PlanError, match="unknown placement strategy 'best'; valid: .*'auto'"):
        ep.compile_devices(tg, "1MiB", 2, strategy="best")


# -- strategy="tensor" through the front door ----------------------------------------------


def test_tensor_strategy_splits_first_then_partitions_for_a_small_budget_and_runs(tmp_path):
    """compile_devices(strategy="tensor") splits the program for tensor parallelism, then
    (partition="auto", a budget below what a whole task needs) partitions the split
    program; the plan file holds that graph, and the plan equals the reference."""
    from memgraph.multi_serialize import read_multi_json
    from taskgraph.facts import TensorPart, fact_of

    tg, arrays = llama_case(llama.PRESETS["tiny"], seq=16)
    roomy = ep.compile_devices(tg, "100%", 2, strategy="tensor")
    assert roomy.strategy == "tensor" and "splitting" in roomy.timings
    assert roomy.partitioning.block_limit is None
    parts = {fact_of(t, TensorPart) for t in roomy.graph} - {None}
    assert {(p.index, p.count) for p in parts} == {(0, 2), (1, 2)}
    smallest = min(reading.nbytes for reading in roomy.budgets)
    tight = ep.compile_devices(tg, smallest // 8, 2, strategy="tensor")
    assert tight.partitioning.block_limit is not None and len(tight.graph) > len(roomy.graph)
    for compiled in (roomy, tight):
        assert compiled.plan.placed.graph is compiled.graph
        assert_close(compiled.run(arrays), taskgraph.evaluate(tg, arrays))
    path = tmp_path / "tensor.json"
    tight.save(path)
    loaded = read_multi_json(path.read_text(encoding="utf-8"))
    assert loaded.program.to_json() == tight.graph.to_json()
    assert_close(
        taskgraph.evaluate(loaded.program, arrays), taskgraph.evaluate(tg, arrays)
    )  # the file's program is the split one, with the same outputs


def test_tensor_strategy_on_a_program_without_shard_facts_says_use_pipeline():
    tg, _ = chain((16, 16))
    with pytest.raises(ep.PlanError, match="states none; use pipeline"):
        ep.compile_devices(tg, "1MiB", 2, strategy="tensor")
    choice = ep.compile_devices(tg, "1MiB", 2, strategy="auto").choice
    assert choice.chosen == "pipeline" and "use pipeline" in choice.refused["tensor"]
