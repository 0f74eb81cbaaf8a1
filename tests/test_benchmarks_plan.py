"""benchmarks/plan_bench.py: its lower bound is sound, and its quality table and targets
work end to end on tiny graphs (the --quick run itself takes ~10 s); plan_quality.py's
cells and bounds and offload_metric.py's bisection work on tiny graphs too."""

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

import einpage as ep
from einpage.errors import GraphError
from memgraph import layer_streaming_plan, min_budget, plan, streaming_minimum
from memgraph.bounds import transfer_lower_bounds
from memgraph.eviction import POLICIES
from memgraph.orders import ORDERS
from memgraph.planner import INPUTS, OUTPUTS
from taskgraph.serialize import taskgraph_from_json

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
        high = max(low, streaming_minimum(tg, order=order, outputs=outputs, inputs=inputs))
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
        # (a plan that recomputes: on what it reloads or recomputes, offloads or discards)
        assert bounds["best_bound_reload_bytes"] <= stats.reload_bytes + stats.recompute_bytes
        assert bounds["best_bound_offload_bytes"] <= stats.offload_bytes + stats.discard_bytes
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
    budget = streaming_minimum(tg) // 2
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


# -- benchmarks/plan_quality.py and benchmarks/offload_metric.py ----------------------

BENCHMARKS = BENCH.parent
FRAGMENTED = Path(__file__).parent / "memgraph" / "data" / "fragmented_by_room.json"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quality():
    try:
        yield load("plan_quality")
    finally:
        sys.modules.pop("plan_quality", None)


@pytest.fixture(scope="module")
def offload():
    try:
        yield load("offload_metric")
    finally:
        sys.modules.pop("offload_metric", None)


def test_quality_cells_compare_every_policy_with_the_optimum(quality):
    graphs = quality.drawn(einsum_programs(), 6)
    cases = [quality.Case("einsum_programs", f"einsum{i}", tg) for i, tg in enumerate(graphs)]
    tg = quality.plan_bench.transformer_like(2, 2, 64, 128, 16)
    cases.append(quality.Case("transformer-like", tg.name, tg))
    prog = ep.Program("rebuild")  # h = u v^T, read twice, cheaper to rebuild than to move
    u = prog.input("u", (256,), role="weight")
    v = prog.input("v", (256,), role="weight")
    x = prog.input("x", (256, 256))
    h = prog.einsum("i,j->ij", u, v)
    prog.output(((x @ h) @ x) @ h, "y")
    cases.append(quality.Case("rebuild", "rebuild", prog.build()))
    rows = []
    for case in cases:
        for order in ORDERS:
            for percent in quality.PERCENTS:
                row = quality.milp_cell(case, order, percent, 20)
                if row is not None:
                    rows.append(row)
    assert any(r["family"] == "transformer-like" for r in rows)
    for row in rows:
        assert row["status"] == "optimal"
        for policy in POLICIES:  # einpage's paging bytes are never below the optimum
            assert row[policy] >= row["optimum"] and row[f"{policy}_ratio"] >= 1
            assert row[f"{policy}_ratio"] == row[policy] / row["optimum"]
    # the optimum (recompute on, as the planner's default) rebuilds h instead of moving it
    assert any(r["optimum_recomputes"] for r in rows if r["family"] == "rebuild")
    summary = quality.milp_summary(rows, skipped=0)
    assert summary["belady"]["all"]["n"] == len(rows)
    targets = quality.milp_targets(summary)
    assert {t["target"].split(":")[0] for t in targets} == set(POLICIES)
    json.dumps({"rows": rows, "summary": summary, "targets": targets})


def test_quality_cells_plan_with_the_placement_asked_for(quality):
    tg = taskgraph_from_json(FRAGMENTED.read_text())  # plan-quality's einsum38
    case = quality.Case("einsum_programs", "einsum38", tg)
    room = quality.milp_cell(case, "program", 75, 20)  # 1344 B
    lifetime = quality.milp_cell(case, "program", 75, 20, placement="lifetime")
    assert room["budget"] == lifetime["budget"] == 1344
    assert room["optimum"] == lifetime["optimum"] == 32
    assert room["belady"] == 184 and lifetime["belady"] == 32


@given(tg=einsum_programs(), data=st.data())
def test_the_relaxed_policy_moves_at_least_the_optimum(quality, tg, data):
    low, _ = min_budget(tg)
    budget = data.draw(st.integers(low, max(low, streaming_minimum(tg))), label="budget")
    problem = quality.transfer_problem(tg, budget)
    optimum = quality.solve_problem(problem, 20).moved_bytes
    assert quality.relaxed_policy_bytes(problem) >= optimum


def test_large_cells_hold_sound_bounds(quality):
    graph = quality.plan_bench.QualityGraph(
        quality.plan_bench.transformer_like(2, 2, 64, 128, 256), "compute-bound"
    )
    peak = streaming_minimum(graph.tg)
    row = quality.large_cell(graph, 50, peak, milp_limit=20)
    assert row["milp_status"] == "optimal"
    assert row["lp"] <= row["milp"] <= row["policy"] and row["milp"] <= row["einpage"]
    assert row["bound"] == row["milp"] >= max(row["capacity"], row["paging"])
    assert "x" in quality._large_line(row)


def test_offload_metric_finds_budgets_within_the_slowdowns(offload, tmp_path, capsys):
    path = tmp_path / "offload.json"
    result = offload.main(["--quick", "--json", str(path)])
    assert json.loads(path.read_text())["rows"] == result["rows"]
    for row in result["rows"]:
        one, three = row["1%"], row["3%"]
        assert one["slowdown_pct"] <= 1.0 + 1e-9 and three["slowdown_pct"] <= 3.0 + 1e-9
        assert three["budget"] <= one["budget"] <= row["resident_peak"] * 2
        assert one["cut"] == 1 - one["budget"] / row["resident_peak"]
        assert one["verified_nodes"] > 0 and row["plans"] >= 3
    assert "llama-tiny" in capsys.readouterr().out
