"""Three tiers (device, host, disk): a real run whose weights exceed the host budget, and
simulated LLaMA-65B/70B generation and a 405B-shaped prefill over an NVMe.

Run: `python benchmarks/tiers.py run [--json out.json]` (the real run: 6 GB of disk, 77 s
measured on two shared cores), `python benchmarks/tiers.py simulate [--json out.json]`
(the simulated tables: 400 s, planning the 70B-class generations most of it), or
`--quick` with any (tiny shapes: a smoke test, seconds); `python benchmarks/tiers.py
direct` (10 s) compares buffered and O_DIRECT transfers (below).

**run** – a LLaMA-shaped model (hidden 2048, 14 layers, 16 heads, 4 K/V heads, MLP 5632,
vocabulary 32,000: 762 M parameters, 3.05 GB of float32 weights) with random weights
(`einpage.cli.generate.random_weights`) saved as one safetensors file by input name
(`einpage.weight_files.save_weights`), greedy generation of 3 new tokens after an
8-token prompt as one unrolled program, compiled with a device arena of 256 MiB, a host
budget of 1 GiB, the checkpoint and a spill folder (`einpage.compile`). The plan is
written to a file; each runtime mode (sequential, streams, random) then runs it in a
process of its own (`runtime.run(..., spill=)`, the NumPy backend: its "device" arena
is host memory too), which reports its resident set once the plan is loaded, before the
run, and its peak resident set during the run (VmHWM, reset before the run). The
weights are drawn and written by a process of their own too. For comparison, the row "two
tiers" runs the same program planned without a host tier (the same device arena) in
sequential mode, the caller holding every weight in host memory, as before host tiers.
The row "HF folder" writes the same weights as a Hugging Face `save_pretrained` folder
would hold them (their keys, `o_proj`/`down_proj` transposed, a `config.json`) and
generates from it with `einpage.workloads.generate.generate(folder, ...,
plan=Planning(host_budget="1GiB", spill=...))` in a process of its own: the weights read
in place (the transposed ones transposed back as they are read); its time and peak
include planning. A last process computes the reference, `taskgraph.evaluate` on the
weights read whole (safetensors), and the chosen token ids of every run must equal it.
The weights are read with `os.preadv` into the host arena, so the file's pages in the
kernel's cache are not part of the resident set.

**direct** – a chain of 8 matmuls of 2560×2560 float32 weights (200 MiB in one
safetensors file) streamed under a 64 MiB host budget, run four times with buffered
transfers and four times with `direct_io=True` (O_DIRECT), alternating, each from a cold
page cache (the file's pages dropped with `posix_fadvise` first: nothing system-wide): the
growth of the kernel's page cache (`Cached:` in /proc/meminfo) during each run beside its
growth while idle for as long, and the time; outputs against `taskgraph.evaluate`.

**simulate** – `memgraph.simulate` of plans made by `einpage.compile` and
`memgraph.tiers.place_host` (weights at made-up offsets of one checkpoint file: planning
needs only their sizes), on the "h100-pcie5" cost model (400 TFLOP/s, 50 GB/s each way
over PCIe) over an NVMe (`memgraph.cost.DISKS["nvme-pcie4"]`: 7 GB/s read, 5 GB/s
write), float16, greedy, KV pages of 128 positions, prompt 512 and 32 new tokens
(FlexGen's setting) as one unrolled program:

* LLaMA-65B and Llama-2-70B at batches 1 and 8, a device budget of 32 GiB and 64 GiB of
  host memory, beside the same plan with host memory unbounded (two tiers, as before);
* Llama-3-70B at batch 96 on one H100 of 96 GB (budget 92 GiB) over two NVMe drives in
  RAID-0 (13 GB/s read), the setting of DeepNVMe's ZeRO-Inference figure, with 64 GiB
  and 16 GiB of host memory (DeepNVMe does not state its host memory);
* a 405B-shaped prefill (Llama-3.1-405B's shape: hidden 16384, 126 layers, 128 heads,
  8 K/V heads, MLP 53248, vocabulary 128,256; 810 GB of float16 weights) of one
  2048-token prompt, device budget 76 GiB, 64 GiB of host memory.

Columns: simulated seconds, generated (or prompt) tokens per second, bytes read from
disk, the **bound** and einpage's share of it. The bound is the larger of two lower
bounds on any plan's time: `memgraph.bounds.generation_time_bound` (compute and PCIe,
host memory unbounded; for the prefill, the weights over PCIe and the compute), and the
disk's: every weight starts on disk and is read at least once; and between two decode
steps (the next needs the token the last chose, so every weight's use in one step ends
before any in the next starts) at most device budget + host budget bytes of weights are
in memory, so each step after the first reads at least weights - both budgets from
disk: W + (steps - 1) * max(0, W - B_device - B_host) bytes at the disk's read rate.

Published figures cited beside (`CITED`), with where their settings differ.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import einpage as ep  # noqa: E402
import memgraph  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage_core.units import format_bytes, parse_bytes  # noqa: E402
from memgraph.bounds import generation_time_bound  # noqa: E402
from memgraph.cost import Disk, get_cost_model  # noqa: E402
from memgraph.tiers import CheckpointPlace, place_host  # noqa: E402
from taskgraph.nodes import Input  # noqa: E402

RUN_CONFIG = llama.LlamaConfig(2048, 14, 16, 4, 5632, vocab_size=32000, name="llama-3gb")
QUICK_CONFIG = llama.LlamaConfig(256, 2, 4, 2, 512, vocab_size=1024, name="llama-quick")
MODES = ("sequential", "streams", "random")
PROMPT, NEW = 8, 3

LLAMA3_70B = llama.LlamaConfig(
    8192, 80, 64, 8, 28672, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
    name="llama3-70b",
)  # fmt: skip
LLAMA_405B = llama.LlamaConfig(
    16384, 126, 128, 8, 53248, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
    name="llama3.1-405b",
)  # fmt: skip
RAID0 = Disk("2x-nvme-raid0", 13e9, 10e9)  # DeepNVMe's two drives, ~6.5 GB/s read each

CITED = [
    "FlexGen (README, 'Performance Results'; T4 16 GB, 208 GB DRAM, 1.5 TB SSD, prompt "
    "512, 32 new): OPT-175B with half its weights and all its KV cache on disk, 0.69 tok/s "
    "at batch 256; HF Accelerate and DeepSpeed ZeRO-Inference on the same disk 0.01 tok/s. "
    "Not matched: OPT-175B is not a model here, and no T4 cost model is.",
    "ZeRO-Inference 2023 (DeepSpeedExamples inference/huggingface/zero_inference README; one "
    "A6000 48 GB, 252 GB DRAM, one NVMe of 5.6 GB/s, prompt 512, 32 new): OPT-175B and "
    "BLOOM-176B with weights on NVMe, 0.47 tok/s at batch 32. Not matched (model, GPU).",
    "DeepNVMe (DeepSpeedExamples deepnvme/zero_inference README; one H100 96 GB, two NVMe "
    "in RAID-0 ~13 GB/s, prompt 512, 32 new, weights on NVMe): Llama-3-70B 8.6 tok/s at "
    "batch 96 (8.9 with GPUDirect Storage). Matched below except host memory (not stated) "
    "and the GPU's rates (einpage's h100-pcie5 model: 400 TFLOP/s, PCIe 5).",
]


# -- the real run ------------------------------------------------------------------------


def _rss_now() -> int:
    """This process's resident set now, in bytes (Linux: /proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    """This process's peak resident set so far, in bytes: VmHWM of /proc/self/status, the
    high-water mark of this program's own memory (`ru_maxrss` is not: Linux keeps it
    across `execve`, so a child started by a parent holding 3 GB reports the parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> None:
    """Start this process's VmHWM afresh (Linux >= 4.0: 5 written to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def _child(args: argparse.Namespace) -> None:
    """One measured process: `einpage` runs the plan in a mode, `reference` evaluates."""
    folder = Path(args.folder)
    meta = json.loads((folder / "meta.json").read_text())
    if args.child == "weights":  # in a process of its own: the parent never holds them
        from einpage.cli.generate import random_weights
        from einpage.weight_files import save_weights

        weights = random_weights(QUICK_CONFIG if meta["quick"] else RUN_CONFIG, "float32", 0)
        save_weights(weights, folder / "model.safetensors")
        print(json.dumps({"weight_bytes": sum(a.nbytes for a in weights.values())}))
        return
    if args.child == "hf-weights":  # the same weights as Hugging Face lays them out
        from einpage.cli.generate import random_weights
        from einpage.weight_files import save_weights

        cfg = QUICK_CONFIG if meta["quick"] else RUN_CONFIG
        weights = random_weights(cfg, "float32", 0)
        hf = folder / "hf"
        hf.mkdir(exist_ok=True)
        save_weights(_hf_tensors(cfg, weights), hf / "model.safetensors")
        (hf / "config.json").write_text(json.dumps(_hf_config(cfg)))
        print(json.dumps({"folder": str(hf)}))
        return
    if args.child == "generate":
        from einpage.workloads.generate import Planning, Running, generate

        tokens = np.load(folder / "inputs.npz")["tokens"]
        _reset_peak_rss()  # the peak of planning and running, not of importing
        before = _rss_now()
        started = time.perf_counter()
        out = generate(
            folder / "hf", tokens, NEW, meta["device"], eos=(),
            plan=Planning(host_budget=meta["host"], spill=folder / "spill"),
            run=Running(backend="numpy", mode="sequential"),
        )  # fmt: skip
        seconds = time.perf_counter() - started
        stats = out.plan.plan.stats
        left = sorted(p.name for p in (folder / "spill").iterdir())
        print(
            json.dumps(
                {
                    "ids": out.new_ids.tolist(),
                    "seconds": seconds,
                    "rss_before_run": before,
                    "peak_rss": _peak_rss(),
                    "spill_left": left,
                    "host_budget": stats.host_budget,
                    "host_peak": stats.host_peak_bytes,
                    "disk_read_bytes": stats.disk_read_bytes,
                }
            )
        )
        return
    if args.child == "reference":
        import safetensors.numpy

        import taskgraph

        tg = taskgraph.TaskGraph.from_json((folder / "program.json").read_text())
        inputs = {k: np.asarray(v) for k, v in np.load(folder / "inputs.npz").items()}
        inputs.update(safetensors.numpy.load_file(folder / "model.safetensors"))
        ids = taskgraph.evaluate(tg, inputs)["ids"]
        print(json.dumps({"ids": ids.tolist()}))
        return
    import runtime
    from memgraph.serialize import memgraph_from_json

    two_tiers = args.child == "two-tiers"  # the same program planned without a host tier
    mg = memgraph_from_json((folder / ("plan2.json" if two_tiers else "plan.json")).read_text())
    inputs = {k: np.asarray(v) for k, v in np.load(folder / "inputs.npz").items()}
    if two_tiers:  # the caller holds every weight, as before host tiers
        import safetensors.numpy

        inputs.update(safetensors.numpy.load_file(folder / "model.safetensors"))
    _reset_peak_rss()  # the peak of the run, not of loading the plan or the weights
    before = _rss_now()
    started = time.perf_counter()
    out = runtime.run(mg, inputs, backend="numpy", mode=args.mode, spill=folder / "spill")
    seconds = time.perf_counter() - started
    left = sorted(p.name for p in (folder / "spill").iterdir())
    print(
        json.dumps(
            {
                "ids": out["ids"].tolist(),
                "seconds": seconds,
                "rss_before_run": before,
                "peak_rss": _peak_rss(),
                "spill_left": left,
                "host_budget": meta["host_budget"],
            }
        )
    )


def _hf_tensors(cfg: llama.LlamaConfig, weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """The program's `weights` as a Hugging Face checkpoint holds them: each under its
    key, in its shape, `o_proj` and `down_proj` transposed (`WeightSpec`)."""
    tensors = {}
    for spec in cfg.weight_specs():
        array = weights[spec.name]
        if spec.transpose:
            array = np.ascontiguousarray(array.reshape(spec.source_shape[::-1]).T)
        tensors[spec.key] = array.reshape(spec.source_shape)
    return tensors


def _hf_config(cfg: llama.LlamaConfig) -> dict[str, Any]:
    """A `config.json` that `LlamaConfig.from_hf` reads back as `cfg`."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def _spawn(folder: Path, child: str, mode: str | None = None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", child, "--folder", str(folder)]
    command += ["--mode", mode] if mode else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{child} {mode or ''} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def real_run(quick: bool, folder: Path | None) -> dict[str, Any]:
    """Write the checkpoint, compile, run each mode in a process of its own; see the
    module docstring."""
    from einpage.models.generation import generation_inputs

    cfg = QUICK_CONFIG if quick else RUN_CONFIG
    device, host = ("4MiB", "8MiB") if quick else ("256MiB", "1GiB")
    work = Path(folder or tempfile.mkdtemp(prefix="einpage-tiers-"))
    (work / "spill").mkdir(parents=True, exist_ok=True)
    prog = llama.generation_program(cfg, 1, PROMPT, NEW, "float32")
    tg = prog.build()
    started = time.perf_counter()
    (work / "meta.json").write_text(json.dumps({"quick": quick}))
    weight_bytes = _spawn(work, "weights")["weight_bytes"]
    path = work / "model.safetensors"
    written = time.perf_counter() - started
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, PROMPT))
    inputs = generation_inputs(llama.FAMILY, cfg, tokens, NEW, "float32")
    np.savez(work / "inputs.npz", **inputs)
    (work / "program.json").write_text(tg.to_json())
    started = time.perf_counter()
    compiled = ep.compile(prog, device, host_budget=host, checkpoint=path, spill=work / "spill")
    planning = time.perf_counter() - started
    mg = compiled.plan
    (work / "plan.json").write_text(mg.to_json())
    (work / "plan2.json").write_text(ep.compile(prog, device).plan.to_json())
    meta = {"quick": quick, "host_budget": mg.tier.budget}
    (work / "meta.json").write_text(json.dumps(meta))
    reference = _spawn(work, "reference")
    runs = {}
    for mode in MODES:
        runs[mode] = _spawn(work, "einpage", mode)
        runs[mode]["equal"] = runs[mode]["ids"] == reference["ids"]
    two_tiers = _spawn(work, "two-tiers", "sequential")
    two_tiers["equal"] = two_tiers["ids"] == reference["ids"]
    meta.update(device=device, host=host)
    (work / "meta.json").write_text(json.dumps(meta))
    _spawn(work, "hf-weights")
    hf = _spawn(work, "generate")
    hf["equal"] = hf["ids"] == reference["ids"]
    s = mg.stats
    return {
        "model": cfg.name,
        "parameters": sum(int(np.prod(shape)) for shape in cfg.weight_shapes().values()),
        "weight_bytes": weight_bytes,
        "checkpoint_bytes": path.stat().st_size,
        "device_budget": mg.budget,
        "host_budget": mg.tier.budget,
        "host_peak": s.host_peak_bytes,
        "disk_read_bytes": s.disk_read_bytes,
        "disk_read_count": s.disk_read_count,
        "nodes": len(mg),
        "tasks": len(compiled.graph),
        "writing_s": written,
        "planning_s": planning,
        "reference_ids": reference["ids"],
        "runs": runs,
        "two_tiers": two_tiers,
        "hugging_face": hf,
        "folder": str(work),
    }


def print_run(result: dict[str, Any]) -> None:
    print(
        f"{result['model']}: {result['parameters'] / 1e6:.0f} M parameters, "
        f"{format_bytes(result['weight_bytes'])} of float32 weights in "
        f"{result['folder']}/model.safetensors; device arena "
        f"{format_bytes(result['device_budget'])}, "
        f"host budget {format_bytes(result['host_budget'])} (planned host peak "
        f"{format_bytes(result['host_peak'])}); {format_bytes(result['disk_read_bytes'])} "
        f"read from disk in {result['disk_read_count']} reads; {result['tasks']} tasks, "
        f"{result['nodes']} nodes, planned in {result['planning_s']:.1f} s"
    )
    print(f"reference ids (taskgraph.evaluate): {result['reference_ids']}")
    print(f"{'mode':<11} {'equal':>5} {'run s':>7} {'RSS before run':>15} {'peak RSS':>10} "
          f"{'peak - before':>14}")  # fmt: skip
    rows = [*result["runs"].items(), ("two tiers", result["two_tiers"])]
    rows.append(("HF folder", result["hugging_face"]))
    for mode, run in rows:
        print(
            f"{mode:<11} {str(run['equal']):>5} {run['seconds']:>7.1f} "
            f"{format_bytes(run['rss_before_run']):>15} {format_bytes(run['peak_rss']):>10} "
            f"{format_bytes(run['peak_rss'] - run['rss_before_run']):>14}"
        )


# -- O_DIRECT against the page cache ----------------------------------------------------


def _page_cache_bytes() -> int:
    """The kernel's page cache now, in bytes (`Cached:` of /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no Cached: in /proc/meminfo")


def _evict(path: Path) -> None:
    """Drop this file's pages from the page cache (written back first): a cold read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def direct_run(quick: bool, folder: Path | None) -> dict[str, Any]:
    """A chain of matmuls whose weights stream from a checkpoint under a small host budget,
    run with buffered and with O_DIRECT transfers in turn, each from a cold page cache:
    how much the page cache grew during each run, beside how much it grows idle for as
    long (the machine's own noise), and the time; outputs against `taskgraph.evaluate`."""
    import runtime
    import taskgraph
    from einpage.weight_files import save_weights

    layers, width, rounds = (2, 256, 2) if quick else (8, 2560, 4)
    prog = ep.Program("chain")
    x = prog.input("x", (4, width))
    h = x
    for i in range(layers):
        h = ep.gelu(h @ prog.input(f"w{i}", (width, width), role="weight"))
    prog.output(h, "y")
    rng = np.random.default_rng(0)
    weights = {
        f"w{i}": (rng.standard_normal((width, width)) / np.sqrt(width)).astype("float32")
        for i in range(layers)
    }
    xs = {"x": rng.standard_normal((4, width)).astype("float32")}
    work = Path(folder or tempfile.mkdtemp(prefix="einpage-direct-"))
    (work / "spill").mkdir(parents=True, exist_ok=True)
    path = save_weights(weights, work / "chain.safetensors")
    host = "512KiB" if quick else "64MiB"
    mg = ep.compile(prog, "100%streaming", host_budget=host, checkpoint=path).plan
    expected = taskgraph.evaluate(mg.taskgraph, {**weights, **xs})["y"]
    runs = []
    for turn in range(rounds):
        for direct in (False, True) if turn % 2 == 0 else (True, False):
            _evict(path)
            before = _page_cache_bytes()
            started = time.perf_counter()
            with runtime.Session(mg, "numpy", mode="streams", direct_io=direct) as session:
                y = session.run(xs)["y"]
                flags = session.last.disk_direct
            seconds = time.perf_counter() - started
            grew = _page_cache_bytes() - before
            idle = _page_cache_bytes()
            time.sleep(seconds)
            runs.append(
                {
                    "direct_io": direct,
                    "files_direct": list(flags),
                    "seconds": seconds,
                    "page_cache_growth": grew,
                    "idle_growth": _page_cache_bytes() - idle,
                    "equal": bool(np.allclose(y, expected, rtol=1e-5, atol=1e-6)),
                }
            )
    return {
        "checkpoint_bytes": path.stat().st_size,
        "host_budget": mg.tier.budget,
        "disk_read_bytes": mg.stats.disk_read_bytes,
        "runs": runs,
        "folder": str(work),
    }


def print_direct(result: dict[str, Any]) -> None:
    print(
        f"checkpoint {format_bytes(result['checkpoint_bytes'])}, host budget "
        f"{format_bytes(result['host_budget'])}, {format_bytes(result['disk_read_bytes'])} "
        "read per run, each run from a cold page cache"
    )
    print(f"{'transfers':<10} {'direct files':>12} {'equal':>5} {'run s':>6} "
          f"{'page cache +':>13} {'idle +':>10}")  # fmt: skip
    for run in result["runs"]:
        kind = "O_DIRECT" if run["direct_io"] else "buffered"
        files = f"{sum(run['files_direct'])} of {len(run['files_direct'])}"
        print(
            f"{kind:<10} {files:>12} {str(run['equal']):>5} {run['seconds']:>6.2f} "
            f"{format_bytes(run['page_cache_growth']):>13} {format_bytes(run['idle_growth']):>10}"
        )


# -- the simulated tables ----------------------------------------------------------------


def _places(graph: Any) -> dict[str, CheckpointPlace]:
    """Made-up places of every weight in one checkpoint file, back to back."""
    offsets, offset = {}, 0
    for task in graph:
        if isinstance(task.op, Input) and task.op.role == "weight":
            offsets[task.op.name] = offset
            offset += task.nbytes
    path = "/models/checkpoint.safetensors"
    return {n: CheckpointPlace(path, offset, at) for n, at in offsets.items()}


def _weights(graph: Any) -> int:
    return sum(t.nbytes for t in graph if isinstance(t.op, Input) and t.op.role == "weight")


def simulated_cell(
    name: str, prog: Any, device: str, hosts: list[str | None], disk: Any, steps: int | None
) -> list[dict[str, Any]]:
    """One program planned on the device once, then its host at each of `hosts` (None:
    unbounded, no tier); a row each."""
    started = time.perf_counter()
    tg = prog.build()
    compiled = ep.compile(tg, device, cost_model="h100-pcie5", verify=False)
    planning = time.perf_counter() - started
    mg, graph = compiled.plan, compiled.graph
    cost = get_cost_model("h100-pcie5", disk=disk)
    weights = _weights(graph)
    if steps is None:  # a prefill: its weights over PCIe, and its compute
        sim0 = memgraph.simulate(mg, cost)
        base_bound = max(sim0.compute_seconds, weights / cost.h2d_bytes_per_s)
    else:
        base_bound = generation_time_bound(tg, mg.budget, cost).seconds
    tokens = (
        compiled.program[compiled.program.inputs["tokens"]].shape[0] * steps
        if steps is not None
        else int(np.prod(compiled.program[compiled.program.inputs["tokens"]].shape))
    )
    rows = []
    for host in hosts:
        started = time.perf_counter()
        if host is None:
            plan, bound, disk_bytes = mg, base_bound, 0
        else:
            plan = place_host(mg, host, _places(graph))
            memgraph.verify(plan)
            budget = parse_bytes(host)
            must = weights + (steps - 1 if steps else 0) * max(0, weights - mg.budget - budget)
            bound = max(base_bound, must / cost.disk_read_bytes_per_s)
            disk_bytes = plan.stats.disk_read_bytes
        seconds = memgraph.simulate(plan, cost).makespan
        rows.append(
            {
                "work": name,
                "device": mg.budget,
                "host": None if host is None else parse_bytes(host),
                "disk": cost.name,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "disk_read_bytes": disk_bytes,
                "bound_s": bound,
                "of_bound": bound / seconds,
                "planning_s": planning + time.perf_counter() - started,
                "tier": dict(plan.info.get("tier", {})),
            }
        )
        print(_row(rows[-1]), flush=True)
    return rows


def _row(r: dict[str, Any]) -> str:
    host = "unbounded" if r["host"] is None else format_bytes(r["host"])
    return (
        f"| {r['work']} | {format_bytes(r['device'])} | {host} | {r['seconds']:.1f} | "
        f"{r['tokens_per_s']:.3g} | {format_bytes(r['disk_read_bytes'])} | {r['bound_s']:.1f} | "
        f"{100 * r['of_bound']:.0f}% | {r['planning_s']:.0f} |"
    )


def simulate_tables(quick: bool) -> list[dict[str, Any]]:
    print("| work | device | host | simulated s | tokens/s | read from disk | bound s | "
          "bound/einpage | planning s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    if quick:
        cfg = QUICK_CONFIG
        prog = llama.generation_program(cfg, 2, 16, 4, "float16")
        rows = simulated_cell("quick b2", prog, "2MiB", ["4MiB", None], "nvme-pcie4", 4)
        prefill = llama.prefill_program(cfg, 1, 64, "float16", logits="last")
        return rows + simulated_cell("quick prefill", prefill, "2MiB", ["2MiB"], "nvme-pcie4", None)
    rows = []
    for key, cfg in (("65B", llama.PRESETS["65b"]), ("70B", llama.PRESETS["70b"])):
        for batch in (1, 8):
            prog = llama.generation_program(cfg, batch, 512, 32, "float16")
            rows += simulated_cell(
                f"{key} b{batch}", prog, "32GiB", ["64GiB", None], "nvme-pcie4", 32
            )
    prog = llama.generation_program(LLAMA3_70B, 96, 512, 32, "float16")
    rows += simulated_cell("Llama-3-70B b96", prog, "92GiB", ["64GiB", "16GiB"], RAID0, 32)
    prefill = llama.prefill_program(LLAMA_405B, 1, 2048, "float16", logits="last")
    rows += simulated_cell("405B prefill 1x2048", prefill, "76GiB", ["64GiB"], "nvme-pcie4", None)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "what", nargs="?", choices=["run", "direct", "simulate"], default="simulate"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    parser.add_argument("--json", metavar="OUT.json", help="write every figure")
    parser.add_argument("--folder", help="run: where the checkpoint and spill folder go")
    parser.add_argument(
        "--child",
        choices=["weights", "einpage", "two-tiers", "reference", "hf-weights", "generate"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    started = time.perf_counter()
    if args.what == "run":
        result: Any = real_run(args.quick, Path(args.folder) if args.folder else None)
        print_run(result)
        runs = [*result["runs"].values(), result["two_tiers"], result["hugging_face"]]
        ok = all(run["equal"] and not run["spill_left"] for run in runs)
    elif args.what == "direct":
        result = direct_run(args.quick, Path(args.folder) if args.folder else None)
        print_direct(result)
        ok = all(run["equal"] for run in result["runs"])
    else:
        result = simulate_tables(args.quick)
        print()
        for line in CITED:
            print(f"* {line}")
        ok = True
    seconds = time.perf_counter() - started
    print(f"\n{args.what}: {seconds:.0f} s on {platform.machine()}, {os.cpu_count()} CPUs")
    if args.json:
        document = {"what": args.what, "quick": args.quick, "seconds": seconds, "result": result}
        Path(args.json).write_text(json.dumps(document, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
