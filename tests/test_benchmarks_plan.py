"""benchmarks/plan_bench.py: its lower bound is sound, and its quality table and targets
work end to end on tiny graphs (the --quick run itself takes ~10 s)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import einsum_programs
from streaming_cases import PROGRAMS, working_budget

from einpage.errors import GraphError
from memgraph import layer_streaming_plan, min_budget, no_offload_peak, plan
from memgraph.bounds import transfer_lower_bounds
from memgraph.eviction import POLICIES
from memgraph.orders import ORDERS
from memgraph.planner import INPUTS, OUTPUTS

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("plan_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_bench"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("plan_bench", None)


def test_bounds_hold_for_planner_plans_of_random_programs(bench):
    @given(tg=einsum_programs(), data=st.data())
    def check(tg, data):
        order = data.draw(st.sampled_from(sorted(ORDERS)), label="order")
        outputs = data.draw(st.sampled_from(OUTPUTS), label="outputs")
        inputs = data.draw(st.sampled_from(INPUTS), label="inputs")
        low, _ = min_budget(tg)
        high = max(low, no_offload_peak(tg, order=order, outputs=outputs, inputs=inputs))
        budget = data.draw(st.integers(low, high), label="budget")
        mg = plan(
            tg,
            budget,
            order=order,
            outputs=outputs,
            inputs=inputs,
            eviction=data.draw(st.sampled_from(sorted(POLICIES)), label="eviction"),
        )
        bounds = bench.lower_bounds(tg, mg)
        stats = mg.stats
        assert bounds["best_bound_reload_bytes"] <= stats.reload_bytes
        assert bounds["best_bound_offload_bytes"] <= stats.offload_bytes
        # The paging bound adds up what the single-step capacity bound counts once.
        single = transfer_lower_bounds(tg, budget, bench.applied_order(mg))
        assert bounds["paging_reload_bytes"] >= single.reload_bytes

    check()


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_bounds_hold_for_layer_streaming(bench, name):
    tg = PROGRAMS[name]()
    budget = working_budget(tg)
    mg = layer_streaming_plan(tg, budget)
    bounds = bench.lower_bounds(tg, mg)
    assert bounds["best_bound_reload_bytes"] <= mg.stats.reload_bytes
    assert bounds["best_bound_offload_bytes"] <= mg.stats.offload_bytes


def test_paging_bound_counts_every_pass_of_cyclic_reuse(bench):
    # Two passes over 4 layers whose weights do not all fit: the single-step bound
    # counts the excess once, the paging bound once per pass after the first.
    tg = bench.transformer_like(layers=4, steps=3, d=64, ff=128, chunk=16)
    budget = no_offload_peak(tg) // 2
    order = [t.id for t in tg if t.kind not in ("input", "view")]
    single = transfer_lower_bounds(tg, budget, order)
    paging = single.compulsory_reload_bytes + bench.paging_excess_bytes(tg, budget, order)
    assert paging > single.reload_bytes
    assert paging <= plan(tg, budget).stats.reload_bytes


def test_quality_table_and_targets_on_tiny_graphs(bench, capsys):
    graphs = [
        bench.QualityGraph(bench.transformer_like(2, 2, 64, 128, 16), "transfer-bound"),
        bench.QualityGraph(bench.transformer_like(2, 2, 64, 128, 256), "compute-bound"),
    ]
    rows = bench.quality(graphs, [100, 50, 25])
    assert {row["plan"] for row in rows} == set(bench.QUALITY_PLANS)
    feasible = [row for row in rows if "infeasible" not in row]
    assert feasible and all(r["best_bound_bytes"] <= r["moved_bytes"] for r in feasible)
    assert all(r["stall_pct"] >= 0 and r["makespan_s"] >= r["compute_s"] for r in feasible)
    timing = [{"graph": "chain-60000", "tasks": 75001, "seconds": 3.0}]
    result = bench.summary(rows, timing)
    json.dumps({"quality": rows, "summary": result})  # the JSON output
    names = [t["target"] for t in result["targets"]]
    assert names[0].startswith("plan 50,000-task graphs") and result["targets"][0]["met"]
    assert sum("at 50%" in name for name in names) == 2 * 4
    out = capsys.readouterr().out
    assert "targets:" in out and "transformer-like-L2-T2-c16-d64-f128" in out


def test_a_plan_without_bounds_is_reported_not_fatal(bench, monkeypatch, capsys):
    def no_bounds(tg, mg):
        raise GraphError("order must list every computed task")

    monkeypatch.setattr(bench, "lower_bounds", no_bounds)
    graph = bench.QualityGraph(bench.transformer_like(2, 2, 64, 128, 16), "transfer-bound")
    rows = bench.quality([graph], [50])
    assert all("bound_error" in row for row in rows if "infeasible" not in row)
    result = bench.summary(rows, [])
    bound_target = next(t for t in result["targets"] if "lower bound" in t["target"])
    assert bound_target["met"] is None
    assert "n/a" in capsys.readouterr().out
