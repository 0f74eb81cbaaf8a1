"""Scheduled transfers on and off, and hidden reloads, side by side: simulated time and bytes moved.

Run: `python benchmarks/transfer_schedule.py [--json out.json] [--quick]` (~5 min on a
shared 2-core VM; `--quick` a few seconds). Each cell is planned three times, with
`schedule_transfers=True` (steps ahead of the execution horizon prepared by evicting at
their deadline, see `memgraph.transfer_schedule`), with the defaults (prefetch into
free memory only, Belady's victims), and with `hide_reloads=True` (victims read at
least one copy's time before, same module), and simulated on `h100-pcie5`
(`memgraph.simulate`):

* `generation`: `benchmarks/generation.py`'s LLaMA-7B / 16 GiB / batch 16 cell, the
  unrolled plan (prompt 512, 32 new tokens, float16, pages of 128): tokens/s and the
  share of the bound (`generation.bound_seconds`);
* `training`: `benchmarks/training.py`'s GPT-2 1.5B 16×1024 AdamW step (`outputs=
  "host"`) at its host-state streaming minimum and at 50% of its resident peak:
  slowdown against its compute time;
* `quality`: `benchmarks/plan_bench.py`'s compute-bound transformer-like graph at 50% of
  its streaming minimum: bytes moved against its sharpest bound
  (`plan_bench.lower_bounds`), and stall against compute.

Every plan is verified (`memgraph.verify`). `--quick` runs tiny versions of each cell
(a smoke test of the script, not figures to quote).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import generation  # noqa: E402
import plan_bench  # noqa: E402
import training  # noqa: E402

import memgraph  # noqa: E402
from einpage.generation_plans import GenerationSpec, Planning, plan_generation  # noqa: E402
from einpage.models import gpt2, llama  # noqa: E402
from einpage.models.training import training_graph  # noqa: E402
from einpage.optim import AdamW  # noqa: E402
from einpage_core.units import format_bytes, parse_bytes  # noqa: E402

COST_MODEL = "h100-pcie5"
WAYS = {
    "scheduled": {"schedule_transfers": True},
    "unscheduled": {},
    "hidden reloads": {"hide_reloads": True},
}
"""The ways each cell is planned: the planner options beside the cell's own."""
FULL = {
    "generation": ("7b", "16GiB", 16, 512, 32),
    "training": ("1.5b", 16, 1024),
    "quality": (8, 4),
}
QUICK = {
    "generation": ("tiny", "1MiB", 2, 16, 4),
    "training": ("tiny", 2, 16),
    "quality": (2, 2),
}


def simulated(mg: memgraph.MemGraph) -> dict[str, Any]:
    """Verify `mg` and simulate it: seconds, stall and bytes each way."""
    memgraph.verify(mg)
    sim = memgraph.simulate(mg, COST_MODEL)
    return {
        "makespan_s": sim.makespan,
        "compute_s": sim.compute_seconds,
        "stall_s": sim.stall_seconds,
        "h2d_bytes": sim.h2d_bytes,
        "d2h_bytes": sim.d2h_bytes,
        "prepared_ahead_evicting": mg.info.get("prepared_ahead_evicting", 0),
    }


def generation_cell(model: str, budget: str, batch: int, prompt: int, new: int) -> dict:
    cfg = llama.PRESETS[model]
    spec = GenerationSpec(llama.FAMILY, cfg, batch, prompt, new, "float16", page_size=128)
    rows: dict[str, Any] = {"cell": f"LLaMA-{model} / {budget} / batch {batch}"}
    cost = memgraph.get_cost_model(COST_MODEL)
    for way, on in WAYS.items():
        options = {"eviction": "belady", **on}
        start = time.perf_counter()
        plan = plan_generation(
            spec, parse_bytes(budget), Planning("unrolled", cost_model=COST_MODEL, options=options)
        )
        row = {"planning_s": time.perf_counter() - start, **simulated(plan.plan)}
        tg = plan.compiled.program
        new_kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * 2
        compute, kv, weights = generation.per_step(tg, cost, prompt, new_kv)
        bound = generation.bound_seconds(compute, kv, weights, parse_bytes(budget), cost)
        row["tokens_per_s"] = spec.tokens / row["makespan_s"]
        row["of_bound"] = bound / row["makespan_s"]
        rows[way] = row
    return rows


def training_cell(preset: str, batch: int, seq: int) -> dict:
    tg = training_graph(gpt2.PRESETS[preset], batch, seq, AdamW(), "float16")
    resident = memgraph.streaming_minimum(training.resident_graph(tg), outputs="device")
    host_peak = memgraph.streaming_minimum(tg, outputs="host")
    rows: dict[str, Any] = {"cell": f"GPT-2 {preset} {batch}×{seq}"}
    for label, budget in (("host-state minimum", host_peak), ("50% of resident", resident // 2)):
        for way, on in WAYS.items():
            mg = memgraph.plan(tg, budget, outputs="host", cost_model=COST_MODEL, **on)
            row = simulated(mg)
            row["budget"] = budget
            row["peak_cut"] = mg.stats.peak_bytes / resident - 1.0
            row["slowdown"] = row["stall_s"] / row["compute_s"]
            rows[f"{label}, {way}"] = row
    return rows


def quality_cell(layers: int, steps: int) -> dict:
    tg = plan_bench.transformer_like(layers, steps, 2048, 8192, 8192)
    budget = memgraph.streaming_minimum(tg) // 2
    rows: dict[str, Any] = {"cell": f"{tg.name} at 50% streaming"}
    for way, on in WAYS.items():
        mg = memgraph.plan(tg, budget, **on)
        row = simulated(mg)
        row["moved_bytes"] = mg.stats.offload_bytes + mg.stats.reload_bytes
        bound = plan_bench.lower_bounds(tg, mg)["best_bound_bytes"]
        row["vs_bound"] = row["moved_bytes"] / bound
        rows[way] = row
    return rows


def show(rows: dict) -> None:
    print(rows["cell"])
    for way, row in rows.items():
        if way == "cell":
            continue
        extra = ""
        if "tokens_per_s" in row:
            extra = f"  {row['tokens_per_s']:.1f} tok/s, {row['of_bound']:.0%} of bound"
        if "slowdown" in row:
            extra = f"  peak {row['peak_cut']:+.1%}, slowdown {row['slowdown']:+.1%}"
        if "vs_bound" in row:
            extra = f"  moved {format_bytes(row['moved_bytes'])} ({row['vs_bound']:.2f}x bound)"
        print(
            f"  {way:<34} {row['makespan_s'] * 1e3:9.1f} ms  compute "
            f"{row['compute_s'] * 1e3:8.1f} ms  h2d {format_bytes(row['h2d_bytes']):>10}  "
            f"d2h {format_bytes(row['d2h_bytes']):>10}{extra}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny cells (a smoke test)")
    args = parser.parse_args(argv)
    cells = QUICK if args.quick else FULL
    results = {
        "generation": generation_cell(*cells["generation"]),
        "training": training_cell(*cells["training"]),
        "quality": quality_cell(*cells["quality"]),
    }
    for rows in results.values():
        show(rows)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
