"""Benchmark: how far einpage's plans are from the optimum, and from the sharpest bound.

Run: `python benchmarks/plan_quality.py [--json out.json] [--quick] [--skip-large]
[--placement room|best_fit|lifetime]` (~6 min on a
shared 2-core VM; `--quick` ~30 s). It prints the tables below and a verdict per
target, and with --json writes the same numbers as JSON (every cell, the summaries,
the targets).

1. **The MILP-sized set.** Random programs drawn from the test suite's generators
   (`tests/strategies.py`'s `einsum_programs` and `tests/partition_cases.py`'s
   `random_programs`, derandomized: the same programs every run) and small
   transformer-like graphs (`plan_bench.transformer_like`: 2-4 layers and passes,
   transfer- and compute-bound shapes), at 75/50/35% of each graph's streaming minimum
   (cells below `min_budget` are skipped and counted), in both orders
   (`memgraph.ORDERS`). In each cell the optimum bytes moved (offloads + reloads) of
   a plan of the same steps (`memgraph.optimal.optimal_transfers`, HiGHS: exact for an
   arena without fragmentation, a lower bound for every plan), with the recompute
   option as the planner's default (a recompute priced at its compute time at the
   link's bandwidth, `memgraph.cost.rebuild_bytes`, added to the bytes on both sides:
   `plan_rebuild_bytes`; in the optimum, as in a plan, a recompute reads its operands
   resident, reloaded where they are not), and einpage's bytes with
   each eviction policy (`memgraph.POLICIES`), less the reloads that bring evicted
   outputs back to the device after the last step (`delivery_bytes`: the model reads
   them from their host copies; counted apart). Reported: the distribution (median,
   p90, worst) of einpage bytes / optimal bytes per policy, family, order and budget;
   the targets (median <= 1.05x, worst <= 1.25x) for each policy.
2. **The large graphs of `plan_bench.py`** (transformer-like, transfer- and
   compute-bound; LLaMA-7B prefill, partitioned where needed) at 100/75/50/25%:
   einpage (the default options) against the sharpest sound bound: the LP relaxation
   of the MILP (`memgraph.optimal.lp_transfer_bound`), `memgraph.transfer_lower_bounds`
   and `plan_bench.paging_excess_bytes`; and the MILP's optimum where HiGHS proves it
   within a time limit. The diagnostic column "policy" is einpage's policy (Belady)
   simulated in an arena without fragmentation (`relaxed_policy_bytes`): it splits
   einpage's gap to the optimum into the policy's part (policy / optimum) and the
   contiguous arena's part (einpage / policy: placement, fragmentation, prefetching).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import plan_bench  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from partition_cases import random_programs  # noqa: E402
from strategies import einsum_programs  # noqa: E402

from einpage_core.errors import EinpageError  # noqa: E402
from einpage_core.units import format_bytes  # noqa: E402
from memgraph import POLICIES, NodeKind, min_budget, plan, streaming_minimum, verify  # noqa: E402
from memgraph.bounds import host_inputs_of, transfer_lower_bounds  # noqa: E402
from memgraph.optimal import (  # noqa: E402
    Origin,
    TransferProblem,
    plan_rebuild_bytes,
    transfer_problem,
)
from memgraph.optimal.solve import lp_bound_of, solve_problem  # noqa: E402
from memgraph.options import PLACEMENTS  # noqa: E402
from memgraph.orders import ORDERS  # noqa: E402
from taskgraph import TaskGraph  # noqa: E402
from taskgraph.partition import partition_for_budget  # noqa: E402

PERCENTS = (75, 50, 35)
TRANSFORMERS = [
    (2, 2, 64, 128, 16),
    (2, 2, 64, 128, 256),
    (3, 3, 64, 128, 16),
    (3, 3, 64, 256, 128),
    (4, 3, 64, 128, 32),
    (4, 4, 128, 256, 256),
    (4, 4, 64, 128, 16),
]
"""Small transformer-like shapes (layers, passes, d, ff, chunk): chunk >= d is
compute-bound (activations larger than weights), chunk < d transfer-bound."""

TARGET_MEDIAN, TARGET_WORST = 1.05, 1.25


@dataclass(frozen=True)
class Case:
    """A graph of the MILP-sized set: its family and a name."""

    family: str
    name: str
    tg: TaskGraph


def drawn(strategy, count: int) -> list[TaskGraph]:
    """`count` examples of a hypothesis strategy, the same ones every run."""
    found: list = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example):
        found.append(example)

    collect()
    return found


def milp_cases(quick: bool) -> list[Case]:
    """The random programs and small transformer-like graphs of part 1."""
    cases = [
        Case("einsum_programs", f"einsum{i}", tg)
        for i, tg in enumerate(drawn(einsum_programs(), 25 if quick else 150))
    ]
    cases += [
        Case("random_programs", f"random{i}", case.tg)
        for i, case in enumerate(drawn(random_programs(), 15 if quick else 100))
    ]
    for shape in TRANSFORMERS[:2] if quick else TRANSFORMERS:
        tg = plan_bench.transformer_like(*shape)
        cases.append(Case("transformer-like", tg.name, tg))
    return cases


def moved(mg) -> int:
    stats = mg.stats
    return stats.offload_bytes + stats.reload_bytes


def delivery_bytes(mg) -> int:
    """The bytes of the reloads after the last apply that bring outputs back to the device
    for their `output` nodes (`outputs="device"`: an output evicted on the way is reloaded
    at the end when it fits). The model reads such an output from its host copy instead,
    so these bytes are a delivery choice, not paging: `paging_bytes` leaves them out."""
    nodes = mg.nodes
    applies = [i for i, n in enumerate(nodes) if n.kind is NodeKind.APPLY]
    outputs = {n.tensor for n in nodes if n.kind is NodeKind.OUTPUT}
    after = nodes[applies[-1] + 1 :] if applies else nodes
    tg = mg.taskgraph
    return sum(
        tg[n.tensor].nbytes for n in after if n.kind is NodeKind.RELOAD and n.tensor in outputs
    )


def paging_bytes(mg) -> int:
    """Bytes moved, without the delivery reloads of outputs (`delivery_bytes`): what the
    optimum is compared with. Still at least the optimum: leaving those reloads out leaves
    a plan of the model (the outputs read from their host copies)."""
    return moved(mg) - delivery_bytes(mg)


def ratio(bytes_moved: int, optimum: int) -> float:
    if optimum:
        return bytes_moved / optimum
    return 1.0 if bytes_moved == 0 else math.inf


def milp_cell(
    case: Case, order: str, percent: int, time_limit: float, placement: str = "room"
) -> dict | None:
    """One cell of part 1: the optimum and every policy's bytes (None: below min_budget),
    with the planner's `placement` rule."""
    tg = case.tg
    budget = streaming_minimum(tg, order=order) * percent // 100
    row = {"family": case.family, "graph": case.name, "tasks": len(tg), "order": order}
    row.update(percent=percent, budget=budget)
    if budget < min_budget(tg)[0]:
        return None
    problem = transfer_problem(tg, budget, order, recompute=True)
    best = solve_problem(problem, time_limit)
    row.update(steps=len(problem.steps), gaps=len(problem.gaps), status=best.status)
    row.update(optimum=best.cost_bytes, proven=best.lower_bound, milp_s=best.seconds)
    row.update(optimum_recomputes=len(best.rebuilt))
    for policy in POLICIES:
        mg = plan(tg, budget, order=order, eviction=policy, placement=placement)
        verify(mg)
        row[policy] = paging_bytes(mg) + plan_rebuild_bytes(mg)
        row[f"{policy}_delivery"] = delivery_bytes(mg)
        row[f"{policy}_ratio"] = ratio(row[policy], best.cost_bytes)
    return row


def quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}
    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p90": ordered[math.ceil(0.9 * len(ordered)) - 1],
        "worst": ordered[-1],
        "at_optimum": sum(v <= 1.0 for v in ordered) / len(ordered),
    }


def _shown(q: dict) -> str:
    if not q["n"]:
        return "-"
    return (
        f"{q['median']:.3f} / {q['p90']:.3f} / {q['worst']:.3f}  "
        f"({100 * q['at_optimum']:.0f}% optimal, n={q['n']})"
    )


def milp_summary(rows: list[dict], skipped: int) -> dict:
    """Distributions of einpage / optimum per policy (solved cells only), and by
    family, order and budget."""
    solved = [r for r in rows if r["status"] == "optimal"]
    print(
        f"\n{len(rows)} cells ({len(rows) - len(solved)} not solved to optimality within "
        f"the time limit, left out), {skipped} below min_budget skipped"
    )
    print("einpage bytes / optimal bytes: median / p90 / worst")
    summary: dict = {"cells": len(rows), "solved": len(solved), "skipped": skipped}
    groups = {"all": lambda r: True}
    groups |= {f"family={f}": (lambda r, f=f: r["family"] == f) for f in _keys(rows, "family")}
    groups |= {f"order={o}": (lambda r, o=o: r["order"] == o) for o in ORDERS}
    groups |= {f"budget={p}%": (lambda r, p=p: r["percent"] == p) for p in PERCENTS}
    for policy in POLICIES:
        summary[policy] = {}
        print(f"  {policy}:")
        for label, keep in groups.items():
            q = quantiles([r[f"{policy}_ratio"] for r in solved if keep(r)])
            summary[policy][label] = q
            print(f"    {label:<28} {_shown(q)}")
    return summary


def _keys(rows: list[dict], field: str) -> list[str]:
    return list(dict.fromkeys(r[field] for r in rows))


def milp_targets(summary: dict) -> list[dict]:
    found = []
    for policy in POLICIES:
        q = summary[policy]["all"]
        if not q["n"]:
            continue
        found += [
            {
                "target": f"{policy}: median <= {TARGET_MEDIAN}x of the optimum",
                "measured": f"{q['median']:.3f}x",
                "met": q["median"] <= TARGET_MEDIAN,
            },
            {
                "target": f"{policy}: worst <= {TARGET_WORST}x of the optimum",
                "measured": f"{q['worst']:.3f}x",
                "met": q["worst"] <= TARGET_WORST,
            },
        ]
    return found


# -- part 2: the large graphs -------------------------------------------------------


def relaxed_policy_bytes(problem: TransferProblem) -> int:
    """Bytes moved by Belady in an arena without fragmentation, prefetching or alignment
    waste beyond the model's: before each step its missing tensors are loaded and, while
    the arena is over the budget, the resident tensor needed furthest in the future is
    evicted (offloaded first, once, if it needs a host copy); dead tensors are freed."""
    steps = len(problem.steps)
    tensors = problem.tensors
    at_end = {g.tensor for g in problem.gaps if g.before == steps and g.keepable}
    pending = {t: list(reversed(u)) for t, u in problem.uses.items()}  # next use last
    copied = {t for t, v in tensors.items() if v.origin is Origin.HOST or v.forced_copy}
    resident: set[int] = set()
    used, cost = 0, problem.fixed_bytes
    for t, v in sorted(tensors.items()):  # device inputs start on the device while they fit
        if v.origin is Origin.DEVICE_INPUT and pending[t]:
            if used + v.size <= problem.budget:
                resident.add(t)
                used += v.size
            else:
                copied.add(t)

    def next_use(t: int) -> int | None:
        return pending[t][-1] if pending[t] else (steps if t in at_end else None)

    at_step: list[list[int]] = [[] for _ in range(steps)]
    for t, positions in problem.uses.items():
        for position in positions:
            at_step[position].append(t)
    for s in range(steps):
        working = at_step[s]
        for t in working:
            if t in resident:
                continue
            fresh = problem.uses[t][0] == s and tensors[t].origin is not Origin.DEVICE_INPUT
            cost += 0 if fresh else tensors[t].nbytes
            resident.add(t)
            used += tensors[t].size
        for t in working:
            pending[t].pop()
        while used > problem.budget:
            victim = max(
                (t for t in resident if t not in working),
                key=lambda t: (next_use(t) if next_use(t) is not None else math.inf, -t),
            )
            if victim not in copied and next_use(victim) is not None:
                cost += tensors[victim].nbytes
                copied.add(victim)
            resident.remove(victim)
            used -= tensors[victim].size
        for t in [t for t in resident if next_use(t) is None]:
            resident.remove(t)
            used -= tensors[t].size
    return cost


def large_cell(graph: plan_bench.QualityGraph, percent: int, peak: int, milp_limit: float):
    """One cell of part 2: einpage's bytes, every bound, the MILP where it solves."""
    tg = graph.tg
    budget = peak * percent // 100
    row = {"graph": tg.name, "kind": graph.kind, "percent": percent, "budget": budget}
    planned = tg
    try:
        if budget < min_budget(tg)[0] and graph.partition:
            planned = partition_for_budget(tg, budget).graph
        mg = plan(planned, budget)
    except EinpageError as err:
        row["infeasible"] = str(err)[:80]
        return row
    row.update(tasks=len(planned), einpage=moved(mg))
    problem = transfer_problem(planned, budget)
    started = time.perf_counter()
    row["lp"] = lp_bound_of(problem)
    row["lp_s"] = time.perf_counter() - started
    order = plan_bench.applied_order(mg)
    capacity = transfer_lower_bounds(planned, budget, order, host_inputs_of(mg))
    row["capacity"] = capacity.total_bytes
    row["paging"] = (
        capacity.compulsory_reload_bytes
        + plan_bench.paging_excess_bytes(planned, budget, order)
        + capacity.offload_bytes
    )
    row["policy"] = relaxed_policy_bytes(problem)
    if len(problem.steps) <= 5000 and milp_limit > 0:
        best = solve_problem(problem, milp_limit)
        row.update(milp_status=best.status, milp=best.moved_bytes, milp_proven=best.lower_bound)
        row["milp_s"] = best.seconds
    row["bound"] = max(row["lp"], row["capacity"], row["paging"], row.get("milp_proven", 0))
    if row.get("milp_status") == "optimal":
        row["bound"] = max(row["bound"], row["milp"])
    assert row["bound"] <= row["einpage"], f"unsound bound: {row}"
    return row


LARGE_HEADER = (
    f"{'graph':<34} {'pct':>4} {'einpage':>10} {'optimum':>10} {'bound':>10} {'/bound':>7}"
    f" {'policy':>10} {'LP':>10} {'capacity':>10} {'paging':>10}"
)


def _large_line(row: dict) -> str:
    head = f"{row['graph'][:34]:<34} {row['percent']:>3}%"
    if "infeasible" in row:
        return f"{head} infeasible: {row['infeasible']}"
    optimum = format_bytes(row["milp"]) if row.get("milp_status") == "optimal" else "-"
    return (
        f"{head} {format_bytes(row['einpage']):>10} {optimum:>10}"
        f" {format_bytes(row['bound']):>10} {row['einpage'] / max(1, row['bound']):>6.2f}x"
        f" {format_bytes(row['policy']):>10} {format_bytes(row['lp']):>10}"
        f" {format_bytes(row['capacity']):>10} {format_bytes(row['paging']):>10}"
    )


def large(quick: bool, milp_limit: float) -> list[dict]:
    rows = []
    print(LARGE_HEADER)
    for graph in plan_bench.quality_graphs(quick):
        peak = streaming_minimum(graph.tg)
        for percent in (100, 75, 50, 25):
            row = large_cell(graph, percent, peak, milp_limit)
            print(_large_line(row), flush=True)
            rows.append(row)
    print(
        "  einpage: default options; optimum: the MILP's, where HiGHS proved it; bound: the"
        " sharpest sound lower bound (optimum, LP relaxation, memgraph.transfer_lower_bounds,"
        " plan_bench's paging bound); policy: Belady in an arena without fragmentation"
    )
    return rows


# -- main ---------------------------------------------------------------------------


def milp_set(quick: bool, time_limit: float, placement: str = "room") -> tuple[list[dict], int]:
    rows, skipped = [], 0
    for case in milp_cases(quick):
        for order in ORDERS:
            for percent in PERCENTS:
                row = milp_cell(case, order, percent, time_limit, placement)
                if row is None:
                    skipped += 1
                else:
                    rows.append(row)
    return rows, skipped


def print_targets(found: Iterable[dict]) -> None:
    print("\ntargets:")
    for t in found:
        verdict = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        print(f"  [{verdict:>7}] {t['target']}: {t['measured']}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a small set (~30 s)")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds per MILP")
    parser.add_argument("--skip-large", action="store_true", help="part 1 only")
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="room",
        help="the planner's placement rule in part 1 (default: room, the planner's default)",
    )
    args = parser.parse_args(argv)
    limit = args.time_limit or (10.0 if args.quick else 60.0)

    started = time.perf_counter()
    print("1. einpage against the optimum on the MILP-sized set")
    rows, skipped = milp_set(args.quick, limit, args.placement)
    summary = milp_summary(rows, skipped)
    found = milp_targets(summary)
    large_rows = []
    if not args.skip_large:
        print("\n2. the large graphs of plan_bench.py: einpage against the sharpest bound")
        large_rows = large(args.quick, limit)
    print_targets(found)
    result = {
        "python": platform.python_version(),
        "quick": args.quick,
        "milp_time_limit_s": limit,
        "placement": args.placement,
        "milp_cells": rows,
        "milp_summary": summary,
        "large": large_rows,
        "targets": found,
        "seconds": time.perf_counter() - started,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=_json_float))
        print(f"\nwrote {args.json}")
    return result


def _json_float(value):  # pragma: no cover - json handles floats; inf is written as text
    return str(value)


if __name__ == "__main__":
    main()
