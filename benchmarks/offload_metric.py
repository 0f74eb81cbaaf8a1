"""Benchmark: HyperOffload's headline measured on einpage: the least memory at no slowdown.

Run: `python benchmarks/offload_metric.py [--json out.json] [--quick]` (~10 min on a
shared 2-core VM; `--quick`: tiny models, ~15 s).

HyperOffload reports up to 26% lower peak memory for inference "while maintaining
end-to-end performance"; PyTorch's activation offloading -17.8% peak at +2.2% step time.
Measured the same way here: for each workload (LLaMA-7B prefill at batch x seq 1x2048,
4x2048, 8x4096, 16x8192; GPT-2 124M and 1.5B prefill at 1x1024 and 8x1024; float16,
`logits="last"`), the smallest budget whose simulated time on `h100-pcie5`
(`memgraph.simulate`) is within 1% (and 3%) of the unlimited-budget time, found by
bisection over budgets (geometric, to 2%) with `einpage.compile` (partitioning as
needed; a budget it cannot plan counts as too slow), and the plans found verified.

The budget is reported as a fraction of two reference points:

* the **streaming minimum** (`memgraph.streaming_minimum`: what `"100%streaming"`
  budgets mean): the arena when no activation leaves the device. Weights start on the
  host and are read once in prefill, so there they are loaded just in time and dropped
  after use: it is
  already close to the streaming footprint, and a plan needs *more* to prefetch weights
  early enough to hide their transfers;
* the **resident peak**: every weight resident plus the activation peak, the memory of
  inference without any offloading – HyperOffload's baseline. "cut" is one minus the
  budget over it. (Computed here from the weights' bytes and the streaming run's
  activation peak, the figures the README reports; `memgraph.resident_peak`, what
  `"100%"` budgets mean, measures the same idea with a plan, fragmentation included.)

The unlimited-budget time is that of a plan whose arena holds every tensor at once
(every weight still crosses PCIe once: it starts on the host). "compute / weights" is
the compute time over the weights' transfer time: where it is at least 1, compute
covers the weights' transfer and the 26% goal applies; below 1 every plan is bound by
the weight stream.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import einpage as ep  # noqa: E402
from einpage.models import gpt2, llama  # noqa: E402
from einpage.pipeline import MAX_AUTO_BLOCKS  # noqa: E402
from einpage_core.errors import EinpageError  # noqa: E402
from einpage_core.units import format_bytes  # noqa: E402
from memgraph import get_cost_model, plan, simulate, streaming_minimum  # noqa: E402
from memgraph.residency import analyze  # noqa: E402
from taskgraph import TaskGraph  # noqa: E402
from taskgraph.nodes import Input  # noqa: E402

COST_MODEL = "h100-pcie5"
THRESHOLDS = (1.0, 3.0)
"""Slowdowns (percent of the unlimited-budget time) a budget may cost."""
PRECISION = 1.02
"""Bisection stops when the budget that fails and the one that passes differ by this
factor at most."""


@dataclass(frozen=True)
class Workload:
    """A model prefill: its name and how to build its TaskGraph."""

    name: str
    build: Callable[[], TaskGraph]


def workloads(quick: bool) -> list[Workload]:
    if quick:
        tiny_llama, tiny_gpt2 = llama.PRESETS["tiny"], gpt2.PRESETS["tiny"]
        return [
            Workload("llama-tiny 2x32", lambda: _llama(tiny_llama, 2, 32)),
            Workload("gpt2-tiny 2x32", lambda: _gpt2(tiny_gpt2, 2, 32)),
        ]
    found = [
        Workload(f"llama-7b {b}x{s}", lambda b=b, s=s: _llama(llama.PRESETS["7b"], b, s))
        for b, s in ((1, 2048), (4, 2048), (8, 4096), (16, 8192))
    ]
    for size in ("124m", "1.5b"):
        for b in (1, 8):
            cfg = gpt2.PRESETS[size]
            found.append(Workload(f"gpt2-{size} {b}x1024", lambda c=cfg, b=b: _gpt2(c, b, 1024)))
    return found


def _llama(cfg, batch: int, seq: int) -> TaskGraph:
    return llama.prefill_program(cfg, batch, seq, "float16", logits="last").build()


def _gpt2(cfg, batch: int, seq: int) -> TaskGraph:
    return gpt2.prefill_program(cfg, batch, seq, "float16", logits="last").build()


def _round_up(nbytes: int, alignment: int = 256) -> int:
    return -(-nbytes // alignment) * alignment


def resident_peak(tg: TaskGraph) -> int:
    """Every weight (host input) resident, plus the activation peak of a plan that moves
    nothing: the device memory of inference without offloading."""
    everything = sum(_round_up(t.nbytes) for t in tg) + 256
    mg = plan(tg, everything, lookahead=0, placement="best_fit")
    weights = {
        t.id
        for t in tg
        if isinstance(t.op, Input) and t.op.location == "host" and tg.consumers[t.id]
    }
    events: list[tuple[int, int]] = []
    for stay in analyze(mg).stays:
        if stay.tensor in weights:
            continue
        events.append((stay.alloc, stay.region.size))
        if stay.free is not None:
            events.append((stay.free, -stay.region.size))
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return sum(_round_up(tg[w].nbytes) for w in weights) + peak


class Measure:
    """Simulated times of one workload's plans by budget, cached."""

    def __init__(self, tg: TaskGraph):
        self.tg = tg
        self.model = get_cost_model(COST_MODEL)
        self.times: dict[int, float] = {}
        self.seconds = 0.0

    def time(self, budget: int) -> float:
        """The simulated makespan at `budget` (inf when einpage.compile cannot plan it)."""
        if budget not in self.times:
            started = time.perf_counter()
            try:
                compiled = ep.compile(self.tg, budget, verify=False, max_blocks=MAX_AUTO_BLOCKS)
                self.times[budget] = simulate(compiled.plan, self.model).makespan
            except EinpageError:
                self.times[budget] = math.inf
            self.seconds += time.perf_counter() - started
        return self.times[budget]


def smallest_budget(measure: Measure, limit: float, low: int, high: int) -> int:
    """The smallest budget in [low / 64, high] (by bisection in log space) whose time is
    at most `limit`; `high` must pass. `low` is lowered (by 4x, at most 3 times) while it
    passes too."""
    for _ in range(3):
        if measure.time(low) > limit:
            break
        low //= 4
    else:
        return low  # even this passes: reported as found (an upper bound on the answer)
    while high > low * PRECISION:
        middle = int(math.sqrt(low * high))
        if measure.time(middle) <= limit:
            high = middle
        else:
            low = middle
    return high


def measure_workload(workload: Workload) -> dict:
    """One row: the reference points, the unlimited time, and per threshold the budget."""
    tg = workload.build()
    started = time.perf_counter()
    peak = streaming_minimum(tg)
    resident = resident_peak(tg)
    measure = Measure(tg)
    unlimited = sum(_round_up(t.nbytes) for t in tg) + 256
    reference = measure.time(unlimited)
    model = measure.model
    weights = sum(t.nbytes for t in tg if isinstance(t.op, Input) and t.op.location == "host")
    ref_plan = ep.compile(tg, unlimited, verify=False).plan
    compute = simulate(ref_plan, model).compute_seconds
    row = {
        "workload": workload.name,
        "tasks": len(tg),
        "streaming_minimum": peak,
        "resident_peak": resident,
        "unlimited_s": reference,
        "compute_s": compute,
        "weights_transfer_s": model.transfer_seconds(weights, "h2d"),
    }
    row["compute_over_weights"] = compute / row["weights_transfer_s"]
    low = peak // 4  # a budget too small to be within 3% (else lower, see below)
    for threshold in THRESHOLDS:
        limit = reference * (1 + threshold / 100)
        high = min(unlimited, max(resident, peak))
        while measure.time(high) > limit and high < unlimited:
            high = min(unlimited, high * 2)
        budget = smallest_budget(measure, limit, low, high)
        compiled = ep.compile(tg, budget, max_blocks=MAX_AUTO_BLOCKS)  # verified
        sim = simulate(compiled.plan, model)
        key = f"{threshold:g}%"
        row[key] = {
            "budget": budget,
            "of_streaming_minimum": budget / peak,
            "of_resident_peak": budget / resident,
            "cut": 1 - budget / resident,
            "slowdown_pct": 100 * (sim.makespan / reference - 1),
            "partitioned_tasks": len(compiled.graph) if compiled.block_limit else None,
            "verified_nodes": compiled.report.nodes,
        }
    row["plans"] = len(measure.times)
    row["seconds"] = time.perf_counter() - started
    return row


HEADER = (
    f"{'workload':<22} {'streaming':>10} {'resident':>10} {'compute/':>9}"
    f" {'<= 1%: budget':>14} {'/no-off':>7} {'cut':>6} {'<= 3%: budget':>14} {'/no-off':>7}"
    f" {'cut':>6}"
)


def line(row: dict) -> str:
    cells = []
    for threshold in THRESHOLDS:
        found = row[f"{threshold:g}%"]
        cells.append(
            f" {format_bytes(found['budget']):>14} {found['of_streaming_minimum']:>6.2f}x"
            f" {100 * found['cut']:>5.0f}%"
        )
    return (
        f"{row['workload']:<22} {format_bytes(row['streaming_minimum']):>10}"
        f" {format_bytes(row['resident_peak']):>10} {row['compute_over_weights']:>8.2f}x"
        + "".join(cells)
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny models (~15 s)")
    args = parser.parse_args(argv)
    print(f"the smallest budget within 1% / 3% of the unlimited-budget time on {COST_MODEL}")
    print(HEADER)
    rows = []
    for workload in workloads(args.quick):
        row = measure_workload(workload)
        rows.append(row)
        print(line(row), flush=True)
    print(
        "  streaming: memgraph.streaming_minimum; resident: every weight resident + the"
        " activation peak (inference without offloading); compute/weights: compute time over"
        " the weights' transfer time (>= 1: compute covers it); /no-off: the budget over the"
        " streaming minimum; cut: 1 - budget / resident peak"
    )
    goal = [
        {
            "workload": r["workload"],
            "applies": r["compute_over_weights"] >= 1,
            "cut_at_1pct": r["1%"]["cut"],
            "met": r["1%"]["cut"] > 0.26,
        }
        for r in rows
    ]
    result = {
        "python": platform.python_version(),
        "quick": args.quick,
        "cost_model": COST_MODEL,
        "rows": rows,
        "goal": goal,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
