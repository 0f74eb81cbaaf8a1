"""LLaMA prefill plans: the planner against layer streaming and the lower bounds, by budget.

Run: `python benchmarks/llama_plans.py [--json out.json] [--quick]`. For the LLaMA-7B
and LLaMA-65B prefill programs (float16 weights and activations, logits for every
position, `einpage.models.llama.prefill_program`) at several (batch, sequence) shapes
and device budgets, it prints one row per cell:

* `streaming`: `memgraph.streaming_minimum` – the arena the planner needs when nothing
  leaves the device (weights still stream in from the host just in time);
  `min`: `memgraph.min_budget` – the largest single step, below which no plan exists
  without partitioning;
* `plan`: `memgraph.plan(tg, budget)` (default options: program order, Belady, auto
  lookahead; whole tasks, like the baseline: `plan` never partitions), verified:
  its peak, bytes offloaded and reloaded, and its simulated makespan on the
  "h100-pcie5" cost model (`memgraph.simulate`: 400 TFLOP/s fp16, 2 TB/s HBM, 50 GB/s
  each way over PCIe), with `stall` = the share of the makespan the compute stream
  waits for transfers;
* `stream`: `memgraph.layer_streaming_plan(tg, budget)`, the ZeRO-Inference-like
  baseline (each layer's weights copied in before it runs, one layer prefetched),
  verified and simulated the same way;
* `bound`: `memgraph.transfer_lower_bounds` – the reload bytes every plan needs – and
  the makespan no plan can beat on this machine: max(compute time, those bytes over
  the host-to-device bandwidth, the offload bound over device-to-host).

The compute time of a program does not depend on its plan (one stream runs every
apply), so it is printed once per shape, with the step that sets `min`. A budget below
`min` is infeasible for every plan; one below the streaming policy's own need is
infeasible for the baseline only. JSON (`--json`) holds the same numbers in bytes and
seconds, and the reasons in full.

What the numbers say (`python benchmarks/llama_plans.py`: 70 cells in 33-39 s on a
shared 2-core VM; `--quick`: 4 cells in ~1.5 s). Weights start in host memory and a
prefill reads each once, so every plan moves all of them (12.6 GiB for 7B, 121.6 GiB
for 65B) and no plan beats max(compute, that transfer at 50 GB/s: ~270 ms, ~2.6 s):

    model b x s    budget  plan: offload  ms    stall   stream: ms   stall  bound ms
    7b    1x2048   1 GiB         112M     280   59%           274    58%    270
    7b    1x2048   8 GiB         0        274   58%           274    58%    270
    7b    4x2048   8 GiB         0        459    4%           448     1%    443
    7b    8x1024   1 GiB   no plan: min budget 1.00 GiB (the masked scores) + 2 MiB
    65b   1x512    1 GiB         0       2649   93%   needs 1.53 GiB        2611
    65b   1x2048   2 GiB         192M    2688   67%   needs 2.21 GiB        2611
    65b   8x1024   4 GiB         1.38G   3392    7%          3190     1%   3168
    65b   8x1024   8 GiB         0       3180    0%          3180     0%   3168

* Batch 1 is transfer-bound (stall 58-93% for every policy): the weights cannot
  arrive faster. At 8k+ tokens per batch compute hides them (stall 0-4%).
* The planner plans budgets layer streaming cannot (65B at 1-2 GiB: it holds the
  weights of the next few steps, not of a whole layer, and spills activations when
  it must), within 1.5-3% of the bound there.
* Where both fit, layer streaming is as fast or faster: 7B 4x2048 stalls 4% with the
  planner's "auto" lookahead against 1% (`lookahead_seconds=None` gets 1% too), and
  65B 8x1024 at 4 GiB offloads 1.4 GiB of activations to make room for prefetched
  weights, 6% slower than streaming, which needs no offload there (3.4 GiB).
* Below `min` nothing works: attention holds the scores and their masked copy
  ([b, heads, s, s] each) at once, so 2 x b x heads x s² x 2 bytes is the floor
  (2 GiB for 7B at 4x2048, 16 GiB for 65B at 1x8192) for whole tasks. Partitioned
  plans (`einpage.compile`, which partitions when needed) go below it:
  `benchmarks/feasibility.py`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import memgraph  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage_core.errors import InfeasibleBudgetError  # noqa: E402
from einpage_core.units import format_bytes, parse_bytes  # noqa: E402
from taskgraph import TaskGraph  # noqa: E402
from taskgraph.nodes import Input  # noqa: E402

COST_MODEL = "h100-pcie5"
MODELS = ("7b", "65b")
SHAPES = ((1, 512), (1, 2048), (4, 2048), (8, 1024), (1, 8192))
BUDGETS = ("1GiB", "2GiB", "4GiB", "8GiB", "16GiB", "32GiB", "80GiB")
QUICK = {"models": ("7b",), "shapes": ((1, 2048), (8, 1024)), "budgets": ("1GiB", "8GiB")}


@dataclass
class Shape:
    """What a (model, batch, seq) program needs whatever the budget."""

    model: str
    batch: int
    seq: int
    tasks: int
    weight_bytes: int
    streaming_minimum: int
    min_budget: int
    min_task: str
    compute_seconds: float
    build_seconds: float


@dataclass
class Cell:
    """One (shape, budget): the planner, the baseline and the bound (None: infeasible)."""

    model: str
    batch: int
    seq: int
    budget: int
    plan: dict[str, Any] | None = None
    plan_infeasible: str | None = None
    stream: dict[str, Any] | None = None
    stream_infeasible: str | None = None
    stream_needed: int | None = None
    bound: dict[str, Any] | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def describe_task(tg: TaskGraph, task_id: int | None) -> str:
    if task_id is None:
        return "-"
    task = tg[task_id]
    where = f" in {task.scope}" if task.scope else ""
    return f"%{task_id} {task.label or task.op.describe()}{where}"


def measure_shape(model: str, batch: int, seq: int) -> tuple[TaskGraph, Shape]:
    start = time.perf_counter()
    tg = llama.prefill_program(llama.PRESETS[model], batch, seq, "float16").build()
    built = time.perf_counter() - start
    smallest, task = memgraph.min_budget(tg)
    cost = memgraph.get_cost_model(COST_MODEL)
    return tg, Shape(
        model=model,
        batch=batch,
        seq=seq,
        tasks=len(tg),
        weight_bytes=sum(t.nbytes for t in tg if isinstance(t.op, Input) and t.op.role == "weight"),
        streaming_minimum=memgraph.streaming_minimum(tg),
        min_budget=smallest,
        min_task=describe_task(tg, task),
        compute_seconds=sum(cost.task_seconds(tg, t.id) for t in tg),
        build_seconds=built,
    )


def simulated(mg: memgraph.MemGraph) -> dict[str, Any]:
    """Plan statistics and simulated times of a verified plan."""
    memgraph.verify(mg)
    stats, sim = mg.stats, memgraph.simulate(mg, COST_MODEL)
    return {
        "peak_bytes": stats.peak_bytes,
        "offload_bytes": stats.offload_bytes,
        "reload_bytes": stats.reload_bytes,
        "drop_bytes": stats.drop_bytes,
        "makespan_s": sim.makespan,
        "compute_s": sim.compute_seconds,
        "stall_fraction": 1.0 - sim.compute_utilization,
    }


def measure_cell(tg: TaskGraph, shape: Shape, budget: int) -> Cell:
    cell = Cell(shape.model, shape.batch, shape.seq, budget)
    if budget < shape.min_budget:
        why = (
            f"min budget {mib(shape.min_budget)} > {mib(budget)}: "
            f"task {shape.min_task} alone does not fit – needs partitioning"
        )
        cell.plan_infeasible = cell.stream_infeasible = why
        return cell
    clock = time.perf_counter()
    cell.plan = simulated(memgraph.plan(tg, budget, cost_model=COST_MODEL))
    cell.seconds["plan"] = time.perf_counter() - clock
    clock = time.perf_counter()
    try:
        cell.stream = simulated(memgraph.layer_streaming_plan(tg, budget, cost_model=COST_MODEL))
    except InfeasibleBudgetError as err:
        cell.stream_needed = err.needed
        cell.stream_infeasible = (
            f"layer streaming needs {mib(err.needed)} > {mib(budget)} "
            f"(a layer's weights and the live activations at {describe_task(tg, err.task)})"
        )
    cell.seconds["stream"] = time.perf_counter() - clock
    clock = time.perf_counter()
    bounds = memgraph.transfer_lower_bounds(tg, budget)
    cost = memgraph.get_cost_model(COST_MODEL)
    cell.bound = {
        **bounds.as_dict(),
        "makespan_s": max(
            shape.compute_seconds,
            bounds.reload_bytes / cost.h2d_bytes_per_s,
            bounds.offload_bytes / cost.d2h_bytes_per_s,
        ),
    }
    cell.seconds["bound"] = time.perf_counter() - clock
    return cell


# ----------------------------------------------------------------------------- printing

HEADER = (
    f"{'model':<5} {'b x s':>8} {'budget':>7} {'no-offld':>9} {'min':>9} | "
    f"{'peak':>9} {'offload':>9} {'reload':>9} {'ms':>7} {'stall':>6} | "
    f"{'peak':>9} {'ms':>7} {'stall':>6} | {'reload>=':>9} {'ms>=':>7}"
)
GROUPS = (
    f"{'':<5} {'':>8} {'':>7} {'':>9} {'':>9} | {'planner (memgraph.plan)':<53}| "
    f"{'layer streaming':<25}| {'lower bound':<17}"
)


def gib(nbytes: int) -> str:
    """Bytes in a table cell: `1.02G`, `781M`, `0` (binary units)."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f}G"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.0f}M"
    return f"{nbytes / 2**10:.0f}K" if nbytes else "0"


def mib(nbytes: int) -> str:
    """Bytes in a note, precise enough to compare two sizes: `1,025.0 MiB`."""
    return f"{nbytes / 2**20:,.1f} MiB"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


LEGEND = (
    "no plan: the budget is below min, so one step (its operands and output) does not fit;\n"
    "         no plan of the whole tasks exists; partitioned plans: benchmarks/feasibility.py\n"
    "needs X: layer streaming holds a layer's weights and the live activations at once,\n"
    "         X in all, more than the budget (the planner needs one step's operands at a time)"
)


def row_text(cell: Cell, shape: Shape) -> str:
    left = (
        f"{shape.model:<5} {f'{cell.batch}x{cell.seq}':>8} {gib(cell.budget):>7} "
        f"{gib(shape.streaming_minimum):>9} {gib(shape.min_budget):>9} | "
    )
    if cell.plan is None:
        return left + f"{'no plan (min > budget)':<53}|"
    p = cell.plan
    plan = (
        f"{gib(p['peak_bytes']):>9} {gib(p['offload_bytes']):>9} {gib(p['reload_bytes']):>9} "
        f"{ms(p['makespan_s']):>7} {p['stall_fraction']:>6.0%} | "
    )
    if cell.stream is None:
        stream = f"{'needs ' + gib(cell.stream_needed):<25}| "
    else:
        s = cell.stream
        stream = (
            f"{gib(s['peak_bytes']):>9} {ms(s['makespan_s']):>7} {s['stall_fraction']:>6.0%} | "
        )
    b = cell.bound
    return left + plan + stream + f"{gib(b['reload_bytes']):>9} {ms(b['makespan_s']):>7}"


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="7B, two shapes, two budgets")
    parser.add_argument("--models", help=f"comma-separated presets (default {','.join(MODELS)})")
    parser.add_argument(
        "--shapes",
        help="comma-separated BATCHxSEQ (default " + ",".join(f"{b}x{s}" for b, s in SHAPES) + ")",
    )
    parser.add_argument("--budgets", help=f"comma-separated sizes (default {','.join(BUDGETS)})")
    args = parser.parse_args(argv)
    models = QUICK["models"] if args.quick else MODELS
    shapes = QUICK["shapes"] if args.quick else SHAPES
    budgets = QUICK["budgets"] if args.quick else BUDGETS
    if args.models:
        models = tuple(args.models.split(","))
    if args.shapes:
        shapes = tuple(tuple(int(n) for n in s.split("x")) for s in args.shapes.split(","))
    if args.budgets:
        budgets = tuple(args.budgets.split(","))
    budget_bytes = [parse_bytes(b) for b in budgets]

    started = time.perf_counter()
    cost = memgraph.get_cost_model(COST_MODEL)
    print(
        f"LLaMA prefill plans, float16, cost model {cost.name} "
        f"({cost.flops_per_s / 1e12:.0f} TFLOP/s, h2d {cost.h2d_bytes_per_s / 1e9:.0f} GB/s)"
    )
    shape_rows: list[Shape] = []
    cells: list[Cell] = []
    print(GROUPS)
    print(HEADER)
    for model in models:
        for batch, seq in shapes:
            tg, shape = measure_shape(model, batch, seq)
            shape_rows.append(shape)
            print(
                f"-- llama-{model} batch {batch} seq {seq}: {shape.tasks} tasks, weights "
                f"{format_bytes(shape.weight_bytes)}, compute {ms(shape.compute_seconds)} ms, "
                f"min budget at {shape.min_task}"
            )
            for budget in budget_bytes:
                cell = measure_cell(tg, shape, budget)
                cells.append(cell)
                print(row_text(cell, shape), flush=True)
    print(LEGEND)
    elapsed = time.perf_counter() - started
    print(f"\n{len(cells)} cells in {elapsed:.1f} s")

    result = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cost_model": asdict(cost),
        "quick": args.quick,
        "seconds": elapsed,
        "shapes": [asdict(s) for s in shape_rows],
        "cells": [asdict(c) for c in cells],
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
