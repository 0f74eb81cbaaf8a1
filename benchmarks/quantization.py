"""What weight-only quantization saves: bytes over PCIe and simulated time of LLaMA
prefill with float16, int8 and int4 weights (group 128) under an offloading budget, and
the error round-to-nearest quantization costs.

Run: `python benchmarks/quantization.py [--json out.json] [--quick]`.

* Plans: `einpage.compile(prefill_program(cfg, batch, seq, "float16", "last",
  quant=...), budget)`, verified, simulated on the "h100-pcie5" cost model. "weights"
  is the bytes of the weight inputs (what the host holds), "H2D" the bytes reloaded
  (weights and anything else brought back), "time" the simulated makespan, "compute"
  its compute time. Ratios are against float16 in the same cell.
* Error: the float32 logits of `llama:tiny`-shaped random models (weights ~ N(0, 0.02²))
  quantized with group 128 (or the largest divisor below it), against the same model
  unquantized: the largest difference over the largest logit; and the RMS error of a
  random 4096×4096 matrix relative to its RMS.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import einpage as ep  # noqa: E402
import memgraph  # noqa: E402
import taskgraph  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.quantize import Quantization, dequantize, quantize, quantize_weights  # noqa: E402
from einpage_core.units import format_bytes, parse_bytes  # noqa: E402

COST_MODEL = "h100-pcie5"
VARIANTS = {"float16": None, "int8": Quantization(8, 128), "int4": Quantization(4, 128)}
CELLS = [("7b", 1, 512, "4GiB"), ("7b", 8, 1024, "8GiB")]
QUICK_CELLS = [("tiny", 1, 32, "128KiB")]


def measure_plan(preset: str, batch: int, seq: int, budget: str, quant: Any) -> dict[str, Any]:
    """Plan one prefill and return its bytes and simulated times."""
    cfg = llama.PRESETS[preset]
    tg = llama.prefill_program(cfg, batch, seq, "float16", "last", quant=quant).build()
    weights = sum(t.nbytes for t in tg.tasks if t.op.kind == "input" and t.op.role == "weight")
    start = time.perf_counter()
    compiled = ep.compile(tg, parse_bytes(budget), cost_model=COST_MODEL)
    seconds = time.perf_counter() - start
    mg = compiled.plan
    sim = memgraph.simulate(mg, COST_MODEL)
    return {
        "weights_bytes": weights,
        "reload_bytes": mg.stats.reload_bytes,
        "offload_bytes": mg.stats.offload_bytes,
        "makespan_s": sim.makespan,
        "compute_s": sim.compute_seconds,
        "plan_s": seconds,
    }


def model_error(bits: int, seed: int = 0) -> float:
    """Largest logit difference over the largest logit, quantized vs float32."""
    cfg = llama.PRESETS["tiny"]
    rng = np.random.default_rng(seed)
    weights = {
        k: (rng.standard_normal(s) * 0.02).astype(np.float32)
        for k, s in cfg.weight_shapes().items()
    }
    tokens = rng.integers(0, cfg.vocab_size, (2, 16))
    full = taskgraph.evaluate(
        llama.prefill_program(cfg, 2, 16).build(), llama.prefill_inputs(cfg, tokens, weights)
    )["logits"]
    quant = Quantization(bits, 128)
    tg = llama.prefill_program(cfg, 2, 16, quant=quant).build()
    inputs = llama.prefill_inputs(cfg, tokens, quantize_weights(cfg, weights, bits, 128))
    got = taskgraph.evaluate(tg, inputs)["logits"]
    return float(np.abs(got - full).max() / np.abs(full).max())


def matrix_error(bits: int, size: int, seed: int = 0) -> float:
    """RMS quantization error of a random size×size matrix over its RMS."""
    w = np.random.default_rng(seed).standard_normal((size, size)).astype(np.float32)
    quant = Quantization(bits, 128)
    back = dequantize(*quantize(w, quant), quant)
    return float(np.sqrt(np.mean((back - w) ** 2)) / np.sqrt(np.mean(w**2)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="a small model only (seconds)")
    args = parser.parse_args(argv)
    cells = QUICK_CELLS if args.quick else CELLS
    rows = []
    print("| model, batch×seq, budget | weights | weights bytes (×fp16) | H2D (×fp16) | "
          "time ms (×fp16) | compute ms | plan s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for preset, batch, seq, budget in cells:
        base = None
        for name, quant in VARIANTS.items():
            cell = measure_plan(preset, batch, seq, budget, quant)
            base = base or cell
            rows.append({"model": preset, "batch": batch, "seq": seq, "budget": budget,
                         "weights": name, **cell})  # fmt: skip
            print(
                f"| {preset} {batch}×{seq}, {budget} | {name} | "
                f"{format_bytes(cell['weights_bytes'])} "
                f"({cell['weights_bytes'] / base['weights_bytes']:.2f}x) | "
                f"{format_bytes(cell['reload_bytes'])} "
                f"({cell['reload_bytes'] / max(base['reload_bytes'], 1):.2f}x) | "
                f"{1e3 * cell['makespan_s']:.1f} "
                f"({cell['makespan_s'] / base['makespan_s']:.2f}x) | "
                f"{1e3 * cell['compute_s']:.1f} | {cell['plan_s']:.1f} |"
            )
    size = 512 if args.quick else 4096
    errors = {
        f"int{bits}": {"logits": model_error(bits), "matrix_rms": matrix_error(bits, size)}
        for bits in (8, 4)
    }
    print()
    print(f"| weights | logit error (tiny LLaMA) | RMS error ({size}×{size} N(0,1)) |")
    print("|---|---|---|")
    for name, e in errors.items():
        print(f"| {name} | {100 * e['logits']:.2f}% | {100 * e['matrix_rms']:.2f}% |")
    if args.json:
        args.json.write_text(json.dumps({"cells": rows, "errors": errors}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
