"""LLaMA on a real GPU: prefill under 25%, 50% and 100% budgets in float16 and bfloat16,
and a generation both ways (unrolled, step plans), against the simulator and the plans'
promises.

Run on a machine with a CUDA GPU and CuPy (`make test-gpu` uses the CuPy installed, or
installs the one matching the driver), from the repository root:
`python benchmarks/gpu_run.py [--json out.json] [--preset tiny] [--batch 4 --seq 256]`.
`--dry-run` runs the same measurement on the NumPy backend (no GPU needed; the timings
then mean nothing for a GPU): it is what the test suite runs, so the script stays
working where no GPU is.

Prefill, per dtype of `--dtypes` (default float16 and bfloat16) and per budget (a
fraction of the streaming minimum, `memgraph.streaming_minimum`), one warm-up run and
`--repeats` timed runs of a `runtime.Session` with staged weights:

* tokens/s (batch × seq over the median run), the simulator's prediction for the same
  plan on `--cost-model` (default "h100-pcie5"), and their ratio;
* the device peak the backend reports (the arena: kernels allocate nothing else, their
  workspaces are in the plan) against the budget and, on a GPU, the used memory from
  `cudaMemGetInfo` after the runs;
* the host memory pinned – allocated, plus the weights registered where they are –
  against `runtime.pinned_bytes(plan)`, the plan's promise;
* bytes moved (offloads + reloads of the plan) and the achieved H2D and D2H rates over
  the time the copy streams were busy in the run's trace, and the overlap of compute
  with copies.

Generation (`--new-tokens`, at `--gen-budget` of the plans' resident peak), unrolled
and in step plans: one `runtime.Session` for the whole generation either way; tokens/s
measured and simulated, the device peak against the budget, the arena the session
allocated, the pinned host memory against `runtime.pinned_bytes(plans)`, and whether
the ids equal the NumPy backend's (greedy; 16-bit rounding may flip a near tie).

A cell the backend refuses (a dtype it cannot run) is printed as refused, and the exit
code is then 1. Not measured by this script: PyTorch with Accelerate-style CPU offload
(not written yet). No figure from this script appears in the README unless it was
measured on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import memgraph  # noqa: E402
import runtime  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.workloads.generation import WAYS, GenerationSpec, Planning, plan_generation  # noqa: E402
from einpage_core.errors import UnsupportedError  # noqa: E402
from einpage_core.units import format_bytes  # noqa: E402

FRACTIONS = (0.25, 0.5, 1.0)
DTYPES = ("float16", "bfloat16")


def random_weights(cfg: llama.LlamaConfig, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: (rng.standard_normal(shape) * 0.02).astype(dtype)
        for name, shape in cfg.weight_shapes().items()
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per dtype and budget fraction (see the module docstring)."""
    rows = []
    for dtype in args.dtypes:
        rows += measure_prefill(args, dtype)
    return rows


def measure_prefill(args: argparse.Namespace, dtype: str) -> list[dict[str, Any]]:
    cfg = llama.PRESETS[args.preset]
    program = llama.prefill_program(cfg, args.batch, args.seq, dtype, "last").build()
    tg = runtime.declare_workspaces(program)  # what the CuPy kernels need, planned
    weights = random_weights(cfg, dtype)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (args.batch, args.seq))
    activations = llama.prefill_inputs(cfg, tokens, None, dtype)
    low, _ = memgraph.min_budget(tg)
    peak = memgraph.streaming_minimum(tg)
    rows = []
    for fraction in FRACTIONS:
        budget = max(low, int(fraction * peak))
        mg = memgraph.plan(tg, budget, cost_model=args.cost_model)
        predicted = memgraph.simulate(mg, args.cost_model).makespan
        row: dict[str, Any] = {"dtype": dtype, "fraction": fraction, "budget_bytes": budget}
        try:
            with runtime.Session(mg, _backend(args), mode="streams") as session:
                session.stage(weights)
                session.run(activations)  # warm-up: kernels compiled, caches filled
                seconds, traces = [], []
                for _ in range(args.repeats):
                    session.run(activations, trace=True)
                    seconds.append(session.last.seconds)
                    traces.append(session.last.trace)
                memory = dict(session.last.memory)
                used = _device_used() if not args.dry_run else None
        except UnsupportedError as err:
            rows.append({**row, "refused": str(err)})
            continue
        median = statistics.median(seconds)
        trace = traces[seconds.index(median)] if median in seconds else traces[-1]
        stats = mg.stats
        rows.append({
            **row,
            "tokens_per_s": args.batch * args.seq / median,
            "seconds": median,
            "predicted_seconds": predicted,
            "device_peak_bytes": memory.get("device_peak_bytes"),
            "device_used_bytes": used,
            **_pinned(memory, runtime.pinned_bytes(mg)),
            "moved_bytes": stats.offload_bytes + stats.reload_bytes,
            "h2d_bytes_per_s": _rate(stats.reload_bytes, trace, "h2d"),
            "d2h_bytes_per_s": _rate(stats.offload_bytes, trace, "d2h"),
            "overlap_s": trace.overlap("compute", "h2d") if "h2d" in trace.streams else 0.0,
        })  # fmt: skip
    return rows


def measure_generation(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per way of planning a generation of `--new-tokens` (module docstring)."""
    cfg = llama.PRESETS[args.preset]
    dtype = args.dtypes[0]
    spec = GenerationSpec(
        llama.FAMILY, cfg, args.batch, args.gen_prompt, args.new_tokens, dtype, page_size=16
    )
    weights = random_weights(cfg, dtype)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, (args.batch, args.gen_prompt))
    rows = []
    for way in WAYS:
        planning = Planning(way=way, chunk_steps=args.chunk_steps, cost_model=args.cost_model)
        plan = plan_generation(spec, args.gen_budget, planning)
        plans = list(plan.session_plans.values()) if way == "steps" else [plan.plan]
        row: dict[str, Any] = {
            "way": way,
            "dtype": dtype,
            "plans": len(plans),
            "budget_bytes": max(mg.budget for mg in plans),
            "simulated_tokens_per_s": plan.stats(args.cost_model).tokens_per_s,
        }
        try:
            plan.run(weights, prompt, backend=_backend(args), mode="streams")  # warm-up
            started = time.perf_counter()
            got = plan.run(weights, prompt, backend=_backend(args), mode="streams")
            seconds = time.perf_counter() - started
        except UnsupportedError as err:
            rows.append({**row, "refused": str(err)})
            continue
        want = plan.run(weights, prompt, backend="numpy") if args.check_ids else None
        memory = [report.memory for report in got.reports]
        rows.append({
            **row,
            "tokens_per_s": spec.tokens / seconds,
            "seconds": seconds,
            "device_peak_bytes": max(m.get("device_peak_bytes", 0) for m in memory),
            "arena_allocated_bytes": memory[-1].get("arena_allocated_bytes"),
            **_pinned(memory[-1], runtime.pinned_bytes(plans)),
            "ids_equal": None if want is None else bool(np.array_equal(got.ids, want.ids)),
        })  # fmt: skip
    return rows


def _pinned(memory: dict[str, Any], promised: int) -> dict[str, Any]:
    """The host memory a session pinned – its buffer and copies, and the weights read in
    place (as `pinned_bytes` counts them) – beside the promise."""
    allocated = memory.get("host_bytes", 0)
    in_place = memory.get("host_in_place_bytes", 0)
    return {
        "pinned_bytes": allocated + in_place,
        "pinned_allocated_bytes": allocated,
        "pinned_in_place_bytes": in_place,
        "pinned_registered_bytes": memory.get("host_registered_bytes", 0),
        "promised_pinned_bytes": promised,
    }


def _backend(args: argparse.Namespace) -> str:
    return "numpy" if args.dry_run else "cupy"


def _rate(nbytes: int, trace: runtime.Trace, stream: str) -> float | None:
    busy = trace.busy(stream) if stream in trace.streams else 0.0
    return nbytes / busy if busy > 0 else None


def _device_used() -> int | None:
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    return int(total - free)


def print_table(rows: list[dict[str, Any]], dry_run: bool) -> None:
    where = "NumPy backend (dry run: not GPU timings)" if dry_run else "CuPy on the GPU"
    print(f"LLaMA prefill, {where}")
    print("| dtype | budget | tokens/s | measured / predicted | device peak | pinned / promised "
          "| moved | H2D rate | D2H rate |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        budget = f"{r['fraction']:.0%} ({format_bytes(r['budget_bytes'])})"
        if "refused" in r:
            print(f"| {r['dtype']} | {budget} | refused: {r['refused']} |")
            continue
        rate = [("-" if v is None else f"{format_bytes(int(v))}/s")
                for v in (r["h2d_bytes_per_s"], r["d2h_bytes_per_s"])]  # fmt: skip
        print(
            f"| {r['dtype']} | {budget} | "
            f"{r['tokens_per_s']:.1f} | {r['seconds'] / r['predicted_seconds']:.2f}x | "
            f"{_against(r['device_peak_bytes'] or 0, r['budget_bytes'])} | "
            f"{_against(r['pinned_bytes'], r['promised_pinned_bytes'])} | "
            f"{format_bytes(r['moved_bytes'])} | {rate[0]} | {rate[1]} |"
        )


def print_generation(rows: list[dict[str, Any]], dry_run: bool) -> None:
    where = "NumPy backend (dry run: not GPU timings)" if dry_run else "CuPy on the GPU"
    print(f"LLaMA generation, one session per generation, {where}")
    print("| way | plans | tokens/s (simulated) | device peak / budget | arena | "
          "pinned / promised (registered in place) | ids = NumPy's |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "refused" in r:
            print(f"| {r['way']} | {r['plans']} | refused: {r['refused']} |")
            continue
        same = {None: "not checked", True: "yes", False: "no"}[r["ids_equal"]]
        print(
            f"| {r['way']} ({r['dtype']}) | {r['plans']} | {r['tokens_per_s']:.1f} "
            f"({r['simulated_tokens_per_s']:.1f}) | "
            f"{_against(r['device_peak_bytes'], r['budget_bytes'])} | "
            f"{format_bytes(r['arena_allocated_bytes'] or 0)} | "
            f"{_against(r['pinned_bytes'], r['promised_pinned_bytes'])} "
            f"({format_bytes(r['pinned_in_place_bytes'])}) | {same} |"
        )


def _against(measured: int, limit: int) -> str:
    """`measured / limit`, marked when over."""
    over = " OVER" if measured > limit else ""
    return f"{format_bytes(measured)} / {format_bytes(limit)}{over}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(llama.PRESETS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--dtypes", type=lambda text: tuple(text.split(",")), default=DTYPES,
        help="comma-separated prefill dtypes (default: float16,bfloat16); the first is the "
        "generation's",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cost-model", default="h100-pcie5")
    parser.add_argument("--gen-prompt", type=int, default=16, help="generation: prompt length")
    parser.add_argument("--new-tokens", type=int, default=8, help="generation: new tokens")
    parser.add_argument("--gen-budget", default="60%", help="generation budget (default 60%%)")
    parser.add_argument("--chunk-steps", type=int, default=2, help="step plans: steps per run")
    parser.add_argument(
        "--no-check-ids", dest="check_ids", action="store_false",
        help="do not rerun the generation on the NumPy backend to compare the ids",
    )  # fmt: skip
    parser.add_argument("--no-generation", dest="generation", action="store_false")
    parser.add_argument("--dry-run", action="store_true", help="NumPy backend, no GPU")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not args.dry_run and not runtime.cupy_usable():
        print("no usable CUDA GPU (CuPy missing or no device): use --dry-run", file=sys.stderr)
        return 2
    rows = measure(args)
    print_table(rows, args.dry_run)
    generation = measure_generation(args) if args.generation else []
    if generation:
        print()
        print_generation(generation, args.dry_run)
    if args.json:
        document = {"dry_run": args.dry_run, "rows": rows, "generation": generation}
        args.json.write_text(json.dumps(document, indent=2))
    refused = [r for r in [*rows, *generation] if "refused" in r]
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
