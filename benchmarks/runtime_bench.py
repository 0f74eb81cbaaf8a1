"""Benchmark of the runtime: interpreter overhead against plain evaluation, and offloading.

Run: `python benchmarks/runtime_bench.py [--json out.json] [--quick] [--planner NAME]`.
It builds a transformer-like program (einpage.Program: embedding, `--layers` blocks of
RMSNorm, causal multi-head attention and a SiLU-gated MLP, a final norm) and times,
as the median of `--repeat` runs after a warm-up, side by side in one process:

* `evaluate`: plain `taskgraph.evaluate` (the reference evaluator), the baseline;
* the NumPy backend on a plan with no offloads at an unlimited budget, in the
  sequential and threaded modes, both through `runtime.run` (everything per call:
  a session, a fresh arena whose pages are touched for the first time, threads)
  and through `Session.run` on a kept session (all inputs placed per run: the
  interpreter's own overhead);
* the NumPy backend on plans forcing offloads (a fraction of the activations are
  offloaded after they are computed and reloaded before each later use);
* on a GPU (CuPy usable): plain CuPy execution (`runtime.cupy_backend.
  evaluate_on_gpu`: no plan, every tensor its own allocation, inputs uploaded
  first) against the CuPy backend with and without offloads.

Rows are timed interleaved (one run of each per round) so a noisy machine slows all
alike. Ratios are medians divided by the baseline's median (CPU rows by `evaluate`, GPU
rows by plain CuPy). On small VMs, a multi-threaded BLAS makes timings erratic (its
threads spin against everything else): `--blas-threads 1` gives stable numbers.
The target for the interpreter's overhead on the CPU is <= 1.15x at an unlimited
budget. Plans come from a planner in `PLANNERS` (`--planner`):
`reference` (tests/plans.reference_plan; pressure = the fraction of activations
offloaded), `memgraph` (memgraph.plan, once it exists; pressure = the budget as a
fraction of the unlimited plan's peak), or `module:function` taking (tg, pressure).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

if "--blas-threads" in sys.argv:  # must be set before NumPy loads its BLAS
    _threads = sys.argv[sys.argv.index("--blas-threads") + 1]
    for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_name] = _threads

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))  # tests/plans.py, the stand-in planner

import numpy as np  # noqa: E402

import einpage as ep  # noqa: E402
import runtime  # noqa: E402
import taskgraph  # noqa: E402
from einpage.units import format_bytes, format_count  # noqa: E402
from memgraph import MemGraph  # noqa: E402
from taskgraph import TaskGraph  # noqa: E402

# -- the program ------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    layers: int = 4
    seq: int = 256
    width: int = 512
    heads: int = 8
    ffn: int = 1024
    vocab: int = 2048


def transformer(cfg: Config) -> TaskGraph:
    prog = ep.Program("transformer")
    ids = prog.input("ids", (cfg.seq,), "int64")
    emb = prog.input("emb", (cfg.vocab, cfg.width), role="weight")
    x = ep.gather(emb, ids)
    head = cfg.width // cfg.heads
    for layer in range(cfg.layers):
        with prog.scope(f"layers.{layer}"):

            def weight(name, shape, layer=layer):
                return prog.input(f"{name}.{layer}", shape, role="weight")

            h = ep.rmsnorm(x, weight("norm1", (cfg.width,)))
            q, k, v = (
                (h @ weight(n, (cfg.width, cfg.width))).reshape(cfg.seq, cfg.heads, head)
                for n in ("wq", "wk", "wv")
            )
            scores = ep.scale(prog.einsum("qhe,khe->hqk", q, k), 1.0 / math.sqrt(head))
            p = ep.softmax(ep.causal_mask(scores))
            att = prog.einsum("hqk,khe->qhe", p, v).reshape(cfg.seq, cfg.width)
            x = x + att @ weight("wo", (cfg.width, cfg.width))
            h = ep.rmsnorm(x, weight("norm2", (cfg.width,)))
            gate = ep.silu(h @ weight("w1", (cfg.width, cfg.ffn)))
            x = x + (gate * (h @ weight("w3", (cfg.width, cfg.ffn)))) @ weight(
                "w2", (cfg.ffn, cfg.width)
            )
    prog.output(ep.rmsnorm(x, prog.input("norm", (cfg.width,), role="weight")), "y")
    return prog.build()


def make_inputs(tg: TaskGraph, cfg: Config, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, task_id in tg.inputs.items():
        task = tg[task_id]
        if name == "ids":
            arrays[name] = rng.integers(0, cfg.vocab, task.shape).astype("int64")
        else:
            scale = 1.0 if name.startswith("norm") else 1.0 / math.sqrt(task.shape[0])
            arrays[name] = (rng.standard_normal(task.shape) * scale).astype(task.dtype)
    return arrays


# -- planners ---------------------------------------------------------------------

Planner = Callable[[TaskGraph, float | None], MemGraph]


def reference_planner(tg: TaskGraph, pressure: float | None) -> MemGraph:
    """tests/plans.reference_plan: pressure None offloads nothing; else that fraction of
    the computed tensors (evenly spread) is offloaded and reloaded before each use."""
    from plans import reference_plan

    if pressure is None:
        return reference_plan(tg)
    computed = [t.id for t in tg if t.kind not in ("input", "view")]
    step = max(1, round(1 / pressure))
    return reference_plan(tg, offload=frozenset(computed[::step]))


def memgraph_planner(tg: TaskGraph, pressure: float | None) -> MemGraph:
    """memgraph.plan: pressure None plans at an unlimited budget; else at that fraction of
    the unlimited plan's peak."""
    import memgraph

    plan = getattr(memgraph, "plan", None)
    if plan is None:
        raise SystemExit("memgraph.plan is not available yet: use --planner reference")
    unlimited = plan(tg, sum(t.nbytes for t in tg) + 256 * len(tg))
    if pressure is None:
        return unlimited
    return plan(tg, int(unlimited.stats.peak_bytes * pressure))


PLANNERS: dict[str, Planner] = {"reference": reference_planner, "memgraph": memgraph_planner}


def get_planner(name: str) -> Planner:
    if name in PLANNERS:
        return PLANNERS[name]
    if ":" in name:
        module, function = name.split(":", 1)
        return getattr(importlib.import_module(module), function)
    raise SystemExit(f"unknown planner {name!r}; valid: {', '.join(PLANNERS)} or module:function")


# -- timing -----------------------------------------------------------------------


@dataclass
class Row:
    name: str
    group: str  # "cpu" or "gpu"
    seconds: list[float]
    notes: dict = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def measure(rows: list[tuple[Row, Callable[[], object]]], repeat: int, sync=None) -> None:
    """Time every row `repeat` times, interleaved (one run of each row per round), so that
    slow phases of a noisy machine hit all rows alike; a warm-up run of each row first."""
    for _, fn in rows:
        fn()
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            for row, fn in rows:
                if sync:
                    sync()
                start = time.perf_counter()
                fn()
                if sync:
                    sync()
                row.seconds.append(time.perf_counter() - start)
    finally:
        if gc_was:
            gc.enable()


def check(got: dict, want: dict, what: str) -> None:
    for name, value in want.items():
        scale = max(1.0, float(np.abs(value).max()))
        if not np.allclose(got[name], value, rtol=1e-3, atol=1e-3 * scale):
            raise SystemExit(f"{what}: output {name!r} differs from the reference")


def cpu_rows(tg, inputs, plans, repeat) -> list[Row]:
    expected = taskgraph.evaluate(tg, inputs)
    rows = [(Row("evaluate (reference)", "cpu", []), lambda: taskgraph.evaluate(tg, inputs))]
    sessions = []
    for label, mg in plans.items():
        stats = mg.stats
        notes = {
            "budget": mg.budget,
            "peak": stats.peak_bytes,
            "offload_bytes": stats.offload_bytes,
            "reload_bytes": stats.reload_bytes,
            "nodes": len(mg),
        }
        for mode in ("sequential", "threaded"):
            check(runtime.run(mg, inputs, "numpy", mode=mode), expected, f"{label}/{mode}")
            rows.append(
                (
                    Row(f"numpy {mode:<10} run()   {label}", "cpu", [], notes),
                    lambda mg=mg, mode=mode: runtime.run(mg, inputs, "numpy", mode=mode),
                )
            )
            session = runtime.Session(mg, "numpy", mode=mode)
            sessions.append(session)
            rows.append(
                (
                    Row(f"numpy {mode:<10} session {label}", "cpu", [], notes),
                    lambda session=session: session.run(inputs),
                )
            )
    measure(rows, repeat)
    for session in sessions:
        session.close()
    return [row for row, _ in rows]


def gpu_rows(tg, inputs, plans, repeat) -> list[Row]:
    import cupy

    from runtime.cupy_backend import CupyKernels, evaluate_on_gpu

    sync = cupy.cuda.runtime.deviceSynchronize
    kernels = CupyKernels(cupy)
    expected = taskgraph.evaluate(tg, inputs)
    check(evaluate_on_gpu(tg, inputs, kernels), expected, "plain cupy")
    rows = [(Row("cupy plain (no plan)", "gpu", []), lambda: evaluate_on_gpu(tg, inputs, kernels))]
    weights = {n: a for n, a in inputs.items() if n != "ids"}
    sessions = []
    for label, mg in plans.items():
        session = runtime.Session(mg, "cupy", mode="streams")
        check(session.run(inputs), expected, f"cupy {label}")
        session.stage(weights)
        sessions.append(session)
        notes = {
            "budget": mg.budget,
            "offload_bytes": mg.stats.offload_bytes,
            "reload_bytes": mg.stats.reload_bytes,
            "device_peak": session.last.memory["device_peak_bytes"],
            **session.last.counters,
        }
        rows.append(
            (
                Row(f"cupy streams     staged {label}", "gpu", [], notes),
                lambda session=session: session.run({"ids": inputs["ids"]}),
            )
        )
    measure(rows, repeat, sync)
    for session in sessions:
        session.close()
    return [row for row, _ in rows]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--quick", action="store_true", help="a small program (a smoke test)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per row (median)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--planner", default="reference", help="reference, memgraph, module:fn")
    parser.add_argument("--no-gpu", action="store_true", help="skip the CuPy rows")
    parser.add_argument(
        "--blas-threads", help="threads of NumPy's BLAS (set before NumPy loads; default: its own)"
    )
    args = parser.parse_args(argv)

    cfg = (
        Config(layers=1, seq=64, width=64, heads=4, ffn=128, vocab=128) if args.quick else Config()
    )
    if args.layers is not None:
        cfg = Config(**{**asdict(cfg), "layers": args.layers})
    tg = transformer(cfg)
    inputs = make_inputs(tg, cfg)
    planner = get_planner(args.planner)
    plans = {
        "unlimited": planner(tg, None),
        "offload 1/4": planner(tg, 0.25),
        "offload all": planner(tg, 1.0),
    }
    print(
        f"{tg.name}: {len(tg)} tasks, {format_count(tg.total_flops, 'FLOP')}, inputs "
        f"{format_bytes(tg.input_bytes)}; planner {args.planner}; median of {args.repeat}"
    )
    rows = cpu_rows(tg, inputs, plans, args.repeat)
    gpu = not args.no_gpu and runtime.cupy_usable()
    if gpu:
        rows += gpu_rows(tg, inputs, plans, args.repeat)

    baseline = {
        group: next(r.median for r in rows if r.group == group)
        for group in ("cpu", "gpu")
        if any(r.group == group for r in rows)
    }
    print(f"\n{'':<34} {'median':>10} {'ratio':>7}  plan")
    for row in rows:
        ratio = row.median / baseline[row.group]
        plan = ""
        if "budget" in row.notes:
            plan = (
                f"budget {format_bytes(row.notes['budget'])}, offload "
                f"{format_bytes(row.notes['offload_bytes'])}, reload "
                f"{format_bytes(row.notes['reload_bytes'])}"
            )
        print(f"{row.name:<34} {row.median * 1e3:>8.1f}ms {ratio:>6.3f}x  {plan}")
    result = {
        "program": {**asdict(cfg), "tasks": len(tg), "flops": tg.total_flops,
                    "input_bytes": tg.input_bytes},
        "planner": args.planner,
        "repeat": args.repeat,
        "environment": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "gpu": gpu,
            "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"),
        },
        "rows": [
            {"name": r.name, "group": r.group, "median_s": r.median,
             "ratio": r.median / baseline[r.group], "samples_s": r.seconds, **r.notes}
            for r in rows
        ],
    }  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
