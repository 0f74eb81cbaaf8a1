"""Feasibility of LLaMA prefill under a memory budget: einpage against layer streaming.

For LLaMA-7B under a 16 GiB budget and LLaMA-65B under 32 GiB (float16 weights and
activations), every cell of batch {1, 2, 4, 8, 16, 32} x sequence {512, ..., 8192}:

* **einpage**: `einpage.compile(tg, budget)`, which partitions the graph when a task
  cannot fit (fine-grained paging; the block limit is then a quarter of the budget)
  and plans it, verified with `memgraph.verify`, and timed with `memgraph.simulate` on the
  "h100-pcie5" cost model (400 TFLOP/s sustained, 50 GB/s each way over PCIe 5). Reported:
  peak device bytes, bytes moved (host to device plus device to host), simulated time
  against the pure compute time, the stall (simulated - compute, in % of compute),
  the block limit (- when not partitioned), the tasks planned and the seconds
  `compile` took to partition and plan (verification apart).
* **layer streaming** (ZeRO-Inference-like, `memgraph.baselines.layer_streaming_plan`
  with one layer of prefetch): feasible only if a whole layer's weights plus the
  layer's activations fit; else its `needed` bytes are reported.

Whether transfers can hide at all depends on the ratio of a layer's compute time to
the time its weights take to load (`comp/xfer`, from the same cost model; >= 1 means
compute dominates). The target: every cell feasible for einpage, and a stall under 10%
wherever compute dominates. Cells where transfers dominate cannot get there: they are
bound by the weight stream (12.6 GiB for 7B, 121.6 GiB for 65B, each loaded once).

`logits="last"` (the default): prefill for generation needs the next token's logits
only. With `logits="all"` the output alone is batch x seq x 32000 x 2 bytes (16 GiB at
32 x 8192): split, it is assembled on the host (each logits block is copied into its
box of the host array as soon as it is computed, see `taskgraph.assembly`), so it is
never on the device whole; a plan that kept it on the device could not fit the large
cells.

    python benchmarks/feasibility.py --quick               # a few cells
    python benchmarks/feasibility.py --json feasibility.json
    python benchmarks/feasibility.py --models 7b --batches 8 --seqs 4096
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import einpage  # noqa: E402
import memgraph  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage_core.errors import InfeasibleBudgetError  # noqa: E402
from einpage_core.units import format_bytes, parse_bytes  # noqa: E402
from memgraph.baselines import layer_streaming_plan  # noqa: E402
from memgraph.cost import CostModel, get_cost_model  # noqa: E402
from taskgraph import TaskGraph  # noqa: E402

BUDGETS = {"7b": "16GiB", "65b": "32GiB"}
BATCHES = (1, 2, 4, 8, 16, 32)
SEQS = (512, 1024, 2048, 4096, 8192)
QUICK = {"7b": [(1, 512), (8, 4096), (32, 8192)], "65b": [(4, 2048)]}
STALL_TARGET = 0.10


@dataclass
class Cell:
    """One (model, batch, seq) measurement; seconds are simulated unless said otherwise."""

    model: str
    budget: int
    batch: int
    seq: int
    layer_compute_s: float
    layer_transfer_s: float
    feasible: bool
    error: str = ""
    peak_bytes: int = 0
    moved_bytes: int = 0
    makespan_s: float = 0.0
    compute_s: float = 0.0
    block_limit: int | None = None
    original_tasks: int = 0
    tasks: int = 0
    plan_seconds: float = 0.0
    verify_seconds: float = 0.0
    baseline_feasible: bool = False
    baseline_needed: int = 0
    baseline_peak_bytes: int = 0
    baseline_makespan_s: float = 0.0
    baseline_compute_s: float = 0.0

    @property
    def ratio(self) -> float:
        """A layer's compute time over its weights' transfer time."""
        return self.layer_compute_s / self.layer_transfer_s

    @property
    def stall(self) -> float:
        return (self.makespan_s - self.compute_s) / self.compute_s if self.feasible else math.nan

    @property
    def baseline_stall(self) -> float:
        if not self.baseline_feasible:
            return math.nan
        return (self.baseline_makespan_s - self.baseline_compute_s) / self.baseline_compute_s

    @property
    def target_met(self) -> bool | None:
        """None where compute does not dominate (no target there)."""
        if self.ratio < 1:
            return None
        return self.feasible and self.stall < STALL_TARGET

    def as_dict(self) -> dict:
        data = asdict(self)
        data.update(
            compute_over_transfer=self.ratio,
            stall=self.stall,
            baseline_stall=self.baseline_stall,
            target_met=self.target_met,
        )
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in data.items()}


def layer_times(tg: TaskGraph, cost: CostModel, layer: int = 0) -> tuple[float, float]:
    """Compute seconds of one layer's tasks and transfer seconds of its weights."""
    prefix = f"layers.{layer}."
    compute = sum(cost.task_seconds(tg, t.id) for t in tg if (t.scope + ".").startswith(prefix))
    weights = [tg[i].nbytes for name, i in tg.inputs.items() if name.startswith(prefix)]
    return compute, sum(cost.transfer_seconds(n, "h2d") for n in weights)


def run_cell(
    model: str, budget: int, batch: int, seq: int, logits: str, cost: CostModel, verify: bool
) -> Cell:
    tg = llama.prefill_program(llama.PRESETS[model], batch, seq, "float16", logits).build()
    compute, transfer = layer_times(tg, cost)
    cell = Cell(model, budget, batch, seq, compute, transfer, feasible=False)
    started = time.perf_counter()
    try:
        # max_blocks=None: the grid plans large partitions on purpose (153,005 tasks at most)
        mg = einpage.compile(tg, budget, cost_model=cost, verify=False, max_blocks=None).plan
    except InfeasibleBudgetError as error:
        cell.plan_seconds = time.perf_counter() - started
        cell.error = str(error).split(". ")[0]
    else:
        cell.plan_seconds = time.perf_counter() - started
        if verify:
            started = time.perf_counter()
            memgraph.verify(mg)
            cell.verify_seconds = time.perf_counter() - started
        result = memgraph.simulate(mg, cost)
        cell.feasible = mg.stats.peak_bytes <= budget
        cell.peak_bytes = mg.stats.peak_bytes
        cell.moved_bytes = result.h2d_bytes + result.d2h_bytes
        cell.makespan_s, cell.compute_s = result.makespan, result.compute_seconds
        cell.block_limit = mg.info["block_limit"]
        cell.original_tasks, cell.tasks = len(tg), len(mg.taskgraph)
    try:
        base = layer_streaming_plan(tg, budget, cost_model=cost)
    except InfeasibleBudgetError as error:
        cell.baseline_needed = error.needed
    else:
        result = memgraph.simulate(base, cost)
        cell.baseline_feasible = True
        cell.baseline_peak_bytes = base.stats.peak_bytes
        cell.baseline_makespan_s, cell.baseline_compute_s = result.makespan, result.compute_seconds
    return cell


# ----------------------------------------------------------------------------- printing


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f}%"


HEADER = (
    f"{'model':<5} {'batch':>5} {'seq':>5} {'comp/xfer':>9} | {'einpage':<7} {'peak':>9} "
    f"{'moved':>9} {'sim s':>7} {'comp s':>7} {'stall':>7} {'target':>6} {'limit':>9} "
    f"{'tasks':>7} {'plan s':>6} | {'streaming':<9} {'stall':>7} {'needed':>9}"
)


def row(cell: Cell) -> str:
    target = {None: "-", True: "yes", False: "NO"}[cell.target_met]
    einpage = "ok" if cell.feasible else "NO"
    base = "ok" if cell.baseline_feasible else "NO"
    needed = "" if cell.baseline_feasible else format_bytes(cell.baseline_needed)
    limit = format_bytes(cell.block_limit) if cell.block_limit else "-"
    return (
        f"{cell.model:<5} {cell.batch:>5} {cell.seq:>5} {cell.ratio:>9.2f} | {einpage:<7} "
        f"{format_bytes(cell.peak_bytes):>9} {format_bytes(cell.moved_bytes):>9} "
        f"{cell.makespan_s:>7.3f} {cell.compute_s:>7.3f} {_pct(cell.stall):>7} {target:>6} "
        f"{limit:>9} {cell.tasks:>7} {cell.plan_seconds:>6.1f} | {base:<9} "
        f"{_pct(cell.baseline_stall):>7} {needed:>9}"
    )


def grids(cells: list[Cell]) -> str:
    """Per model, batch x seq: einpage's stall (* where compute dominates) / streaming's."""
    out = []
    for model in dict.fromkeys(c.model for c in cells):
        mine = {(c.batch, c.seq): c for c in cells if c.model == model}
        seqs = sorted({s for _, s in mine})
        budget = format_bytes(next(iter(mine.values())).budget)
        out.append(
            f"\nLLaMA-{model.upper()} under {budget}: einpage stall / layer-streaming stall "
            f"(x: infeasible; *: compute per layer >= its weights' transfer)"
        )
        out.append(f"{'batch':>5} " + " ".join(f"{s:>8}{'':11}" for s in seqs).rstrip())
        for batch in sorted({b for b, _ in mine}):
            entries = []
            for seq in seqs:
                c = mine.get((batch, seq))
                if c is None:
                    entries.append(f"{'':19}")
                    continue
                ours = _pct(c.stall) if c.feasible else "x"
                theirs = _pct(c.baseline_stall) if c.baseline_feasible else "x"
                mark = "*" if c.ratio >= 1 else " "
                entries.append(f"{ours:>8}{mark} / {theirs:<7}")
            out.append(f"{batch:>5} " + " ".join(entries).rstrip())
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few cells (a smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--models", default="7b,65b", help="comma-separated: 7b, 65b")
    parser.add_argument("--batches", help="comma-separated batch sizes (default: the grid)")
    parser.add_argument("--seqs", help="comma-separated sequence lengths (default: the grid)")
    parser.add_argument("--logits", choices=("last", "all"), default="last")
    parser.add_argument("--cost-model", default="h100-pcie5")
    parser.add_argument("--no-verify", action="store_true", help="skip memgraph.verify")
    args = parser.parse_args(argv)
    cost = get_cost_model(args.cost_model)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in BUDGETS:
            parser.error(f"unknown model {m!r}; known: {', '.join(BUDGETS)}")
    batches = [int(b) for b in args.batches.split(",")] if args.batches else list(BATCHES)
    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else list(SEQS)
    print(
        f"LLaMA prefill, float16, logits={args.logits!r} ("
        + (
            "the next token's logits: what generation needs"
            if args.logits == "last"
            else "every position's logits: the output alone grows with batch x seq"
        )
        + f"), cost model {cost.name}: {cost.flops_per_s / 1e12:.0f} TFLOP/s, "
        f"{cost.h2d_bytes_per_s / 1e9:.0f} GB/s host-to-device"
    )
    print(HEADER)
    print("-" * len(HEADER))
    cells: list[Cell] = []
    started = time.perf_counter()
    for model in models:
        budget = parse_bytes(BUDGETS[model])
        grid = QUICK.get(model, []) if args.quick else [(b, s) for b in batches for s in seqs]
        for batch, seq in grid:
            cell = run_cell(model, budget, batch, seq, args.logits, cost, not args.no_verify)
            cells.append(cell)
            print(row(cell), flush=True)
            if cell.error:
                print(f"      einpage: {cell.error}")
    seconds = time.perf_counter() - started
    print(grids(cells))
    dominated = [c for c in cells if c.ratio >= 1]
    met = [c for c in dominated if c.target_met]
    print(
        f"\neinpage feasible in {sum(c.feasible for c in cells)}/{len(cells)} cells, layer "
        f"streaming in {sum(c.baseline_feasible for c in cells)}/{len(cells)}; stall under "
        f"{STALL_TARGET:.0%} in {len(met)}/{len(dominated)} cells where compute dominates. "
        f"{seconds:.0f} s in all."
    )
    if args.json:
        document = {
            "benchmark": "feasibility",
            "command": " ".join(["python", "benchmarks/feasibility.py", *(argv or sys.argv[1:])]),
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "cost_model": asdict(cost),
            "logits": args.logits,
            "budgets": {m: BUDGETS[m] for m in models},
            "stall_target": STALL_TARGET,
            "seconds": seconds,
            "cells": [c.as_dict() for c in cells],
        }
        Path(args.json).write_text(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
