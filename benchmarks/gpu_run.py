"""LLaMA prefill on a real GPU under 25%, 50% and 100% budgets, against the simulator.

Run on a machine with a CUDA GPU: `make test-gpu` installs the matching CuPy, then
`python benchmarks/gpu_run.py [--json out.json] [--preset tiny] [--batch 4 --seq 256]`.
`--dry-run` runs the same measurement on the NumPy backend (no GPU needed; the timings
then mean nothing for a GPU): it is what the test suite runs, so the script stays
working where no GPU is.

Per budget (a fraction of the streaming minimum, `memgraph.streaming_minimum`), one
warm-up run and `--repeats` timed runs of a `runtime.Session` with staged weights:

* tokens/s (batch × seq over the median run), the simulator's prediction for the same
  plan on `--cost-model` (default "h100-pcie5"), and their ratio;
* the device peak (the arena: kernels allocate nothing else, their workspaces are in the
  plan) and, on a GPU, the used memory from `cudaMemGetInfo` after the runs;
* bytes moved (offloads + reloads of the plan) and the achieved H2D and D2H rates over
  the time the copy streams were busy in the run's trace, and the overlap of compute
  with copies.

Not measured by this script: PyTorch with Accelerate-style CPU offload (a comparison
for a GPU machine with `torch` and `accelerate` installed; not written yet). No figure
from this script appears in the README: no GPU was available where einpage is built.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import memgraph  # noqa: E402
import runtime  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage_core.units import format_bytes  # noqa: E402

FRACTIONS = (0.25, 0.5, 1.0)


def random_weights(cfg: llama.LlamaConfig, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: (rng.standard_normal(shape) * 0.02).astype(dtype)
        for name, shape in cfg.weight_shapes().items()
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per budget fraction (see the module docstring)."""
    cfg = llama.PRESETS[args.preset]
    program = llama.prefill_program(cfg, args.batch, args.seq, args.dtype, "last").build()
    tg = runtime.declare_workspaces(program)  # what the CuPy kernels need, planned
    weights = random_weights(cfg, args.dtype)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (args.batch, args.seq))
    activations = llama.prefill_inputs(cfg, tokens, None, args.dtype)
    low, _ = memgraph.min_budget(tg)
    peak = memgraph.streaming_minimum(tg)
    rows = []
    for fraction in FRACTIONS:
        budget = max(low, int(fraction * peak))
        mg = memgraph.plan(tg, budget, cost_model=args.cost_model)
        predicted = memgraph.simulate(mg, args.cost_model).makespan
        backend = "numpy" if args.dry_run else "cupy"
        with runtime.Session(mg, backend, mode="streams") as session:
            session.stage(weights)
            session.run(activations)  # warm-up: kernels compiled, caches filled
            seconds, traces = [], []
            for _ in range(args.repeats):
                session.run(activations, trace=True)
                seconds.append(session.last.seconds)
                traces.append(session.last.trace)
            memory = dict(session.last.memory)
            used = _device_used() if not args.dry_run else None
        median = statistics.median(seconds)
        trace = traces[seconds.index(median)] if median in seconds else traces[-1]
        stats = mg.stats
        rows.append({
            "fraction": fraction,
            "budget_bytes": budget,
            "tokens_per_s": args.batch * args.seq / median,
            "seconds": median,
            "predicted_seconds": predicted,
            "device_peak_bytes": memory.get("device_peak_bytes"),
            "device_used_bytes": used,
            "pinned_bytes": memory.get("host_bytes"),
            "moved_bytes": stats.offload_bytes + stats.reload_bytes,
            "h2d_bytes_per_s": _rate(stats.reload_bytes, trace, "h2d"),
            "d2h_bytes_per_s": _rate(stats.offload_bytes, trace, "d2h"),
            "overlap_s": trace.overlap("compute", "h2d") if "h2d" in trace.streams else 0.0,
        })  # fmt: skip
    return rows


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
    print("| budget | tokens/s | measured / predicted | device peak | pinned | moved | "
          "H2D rate | D2H rate |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = [("-" if v is None else f"{format_bytes(int(v))}/s")
                for v in (r["h2d_bytes_per_s"], r["d2h_bytes_per_s"])]  # fmt: skip
        print(
            f"| {r['fraction']:.0%} ({format_bytes(r['budget_bytes'])}) | "
            f"{r['tokens_per_s']:.1f} | {r['seconds'] / r['predicted_seconds']:.2f}x | "
            f"{format_bytes(r['device_peak_bytes'] or 0)} | "
            f"{format_bytes(r['pinned_bytes'] or 0)} | "
            f"{format_bytes(r['moved_bytes'])} | {rate[0]} | {rate[1]} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(llama.PRESETS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cost-model", default="h100-pcie5")
    parser.add_argument("--dry-run", action="store_true", help="NumPy backend, no GPU")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not args.dry_run and not runtime.cupy_usable():
        print("no usable CUDA GPU (CuPy missing or no device): use --dry-run", file=sys.stderr)
        return 2
    rows = measure(args)
    print_table(rows, args.dry_run)
    if args.json:
        args.json.write_text(json.dumps({"dry_run": args.dry_run, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
