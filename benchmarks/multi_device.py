"""LLaMA-70B on several simulated H100s: each placement strategy against one H100 with offload.

Run: `python benchmarks/multi_device.py [--json out.json] [--quick] [--weights W]
[--sends S]`.
A full run with `--sends host` took 45–50 minutes (2,724 s and 2,969 s measured on two
shared CPU cores: planning each work on 1 device and with each strategy on 2, 4 and 8,
twice each with `--weights best`, verifying and simulating them; the tensor-parallel
unrolled generations, ~40,000 tasks per device, take most of it); the default `--sends
both` also rewrites, verifies and simulates each candidate with direct sends: 3,599 s;
`--quick` (tiny presets, a smoke test) a few seconds.

Everything is simulated on the "8xh100-sxm" cost model (`memgraph.cost.PRESETS`: per
device 520 TFLOP/s sustained fp16, 3.35 TB/s HBM, 50 GB/s each way to the host over its
own PCIe link, 80 GB). Each device's budget is its 80 GB less a reserve of 4 GiB (CUDA
context, library workspaces, fragmentation): 75.7 GB. LLaMA-2-70B
(`einpage.models.llama.PRESETS["70b"]`), float16 (140 GB of weights). Workloads:

* `prefill 1x2048`: one prompt of 2048 tokens (`llama.prefill_program`, the last
  position's logits);
* `prefill 8x2048`, as one batch of 8 (`one batch`) and as 8 micro-batches of 1
  stacked side by side sharing their weights (`8 micro-batches`,
  `taskgraph.microbatch.stack`: on a pipeline, device 0 works on micro-batch k+1 while
  device 1 works on micro-batch k);
* `generate b1` and `generate b8`: an unrolled generation (`GenerationSpec`, as
  `benchmarks/generation.py` builds it: the prefill and every decode step as one
  program, greedy, KV pages of 128 positions) of batch 1 and 8, prompt 512, 16 new
  tokens. (Step plans are not used: each step plan would stage every weight again.)

Each on 1 device (`memgraph.plan` + `memgraph.simulate`: one H100 with offload) and on
2, 4 and 8 by `einpage.compile_devices(strategy="auto")`: every placement strategy of
`memgraph.placement.STRATEGIES` planned (`partition="off"`), each candidate verified
(`memgraph.verify_multi`) and simulated (`memgraph.simulate_multi`); a row per strategy
and one for auto's choice (the fastest: `auto: NAME`). A strategy that cannot place a
workload (too few heads or layers for the devices) has no row; the log says why. Each
plan is one run from a cold start: the weights are in host memory and every device
copies its own over its PCIe link. `--sends` says how tensors travel between devices:
"host" (every link staged through host memory: an offload on the sender, a reload on
the receiver, both over PCIe), "direct" (each link that `memgraph.peer.direct_sends`
can make so sent as one copy between the devices, over NVLink: 450 GB/s each way; the
rest staged), or "both" (default: each strategy's plans measured both ways, a row each;
auto's choice is made among the plans of one way). The direct plans are the host-staged
ones rewritten (`direct_sends` of each compiled candidate: the same regions and budgets).
`--weights` says where the weights
start: "host" (`Input.location`, copied in as the plan needs them), "device" (staged by
the driver at the start, while they fit; the rest from the host as needed), or "best"
(default: both planned, the faster kept; the table says which).

Columns: devices; the strategy; the weights' start; how links travel ("host", or
"direct N/M": N of the plan's M links direct; "-" on one device); makespan (s);
tokens/s (prefill: prompt tokens, generation: generated tokens, over the makespan);
speedup over the fastest one-device plan of the same work; scaling efficiency =
speedup / devices, and against 2 devices of the same variant, strategy and sends =
(T2 / TN) / (N / 2); bytes over the host links (both directions, all devices); the
largest per-device peak; planning seconds (for a direct row, with its rewrite). The
anchor, a published multi-GPU throughput of Llama-2-70B on H100s, is printed beside
(`ANCHORS`).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import memgraph  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.pipeline import compile_devices  # noqa: E402
from einpage.workloads.generation import GenerationSpec  # noqa: E402
from einpage_core.units import format_bytes  # noqa: E402
from memgraph.cost import get_cost_model  # noqa: E402
from memgraph.multi import MultiPlan, verify_multi  # noqa: E402
from memgraph.peer import direct_sends  # noqa: E402
from memgraph.placement import STRATEGIES  # noqa: E402
from memgraph.simulate_multi import simulate_multi  # noqa: E402
from taskgraph import TaskGraph  # noqa: E402
from taskgraph.microbatch import stack  # noqa: E402
from taskgraph.nodes import Input  # noqa: E402

COST_MODEL = "8xh100-sxm"
RESERVE = 4 * 2**30
"""Bytes of each device's memory kept out of its budget."""
WEIGHTS = ("host", "device")
SENDS = ("host", "direct")
"""How links travel in a row's plans (`--sends`): staged through the host, or direct where
`memgraph.peer.direct_sends` can make them so."""
NO_LINKS = "none"
"""The sends of a one-device plan (it has no links)."""
ONE = "one device"
"""The strategy column of a one-device plan."""


@dataclass(frozen=True)
class Setting:
    """What a run covers: the model preset (with `layers` layers instead of its own, when
    given: a pipeline needs a layer per device), the device counts, the shapes."""

    model: str
    devices: tuple[int, ...]
    prompt: int
    batch: int
    gen_prompt: int
    new_tokens: int
    page_size: int
    gen_batches: tuple[int, ...]
    layers: int | None = None


FULL = Setting("70b", (1, 2, 4, 8), 2048, 8, 512, 16, 128, (1, 8))
QUICK = Setting("tiny", (1, 2, 4), 16, 4, 8, 3, 4, (1,), layers=4)

ANCHORS = [
    {
        "what": "prefill 1x2048",
        "stack": "NVIDIA TensorRT-LLM v0.5",
        "source": "https://github.com/NVIDIA/TensorRT-LLM/blob/release/0.5.0/docs/source/"
        "performance.md (Low Latency, H100 GPUs (FP8))",
        "settings": "LLaMA 70B, batch 1, input 2048, TP 4 (4 H100 80GB HBM3), FP8",
        "value": "1st token latency 109 ms (18,800 prompt tokens/s)",
        "tokens_per_s": 2048 / 0.109,
        "devices": 4,
        "differs": "FP8 weights and KV cache (half the bytes, twice the tensor FLOP/s of "
        "fp16); tensor parallel (all 4 GPUs work on one prompt; all-reduces over NVLink); "
        "weights resident before the request (no load from the host); fused kernels",
    },
    {
        "what": "generate",
        "stack": "NVIDIA TensorRT-LLM v0.5",
        "source": "https://github.com/NVIDIA/TensorRT-LLM/blob/release/0.5.0/docs/source/"
        "performance.md (High Throughput, H100 GPUs (FP8))",
        "settings": "LLaMA 70B, batch 64, TP 4, input 128, output 128, FP8",
        "value": "3,317 output tokens/s",
        "tokens_per_s": 3317.0,
        "devices": 4,
        "differs": "FP8; batch 64 (here 1 and 8); tensor parallel over NVLink; weights "
        "resident before the run and steady-state serving (here: a cold run that stages "
        "140 GB of weights over PCIe); prompt 128 and 128 new tokens (here 512 and 16)",
    },
]
"""Published multi-GPU numbers for Llama-2-70B on H100s, with their settings."""


@dataclass(frozen=True)
class Row:
    """One plan of one workload on `devices` devices (seconds, bytes)."""

    work: str
    variant: str
    devices: int
    strategy: str
    weights: str
    sends: str
    links: int
    direct_links: int
    direct_bytes: int
    tokens: int
    makespan: float
    tokens_per_s: float
    speedup: float | None
    efficiency: float | None
    efficiency_vs_2: float | None
    host_link_bytes: int
    sent_bytes: int
    peak_bytes: tuple[int, ...]
    budget: int
    offload_bytes: int
    reload_bytes: int
    compute_seconds: tuple[float, ...]
    planning_seconds: float
    verified: bool
    reordered: int
    tasks: int
    refused: dict[str, str]


@dataclass(frozen=True)
class Workload:
    """A program to plan: `work` (what is computed, shared by variants), `variant`,
    `tokens` counted for tokens/s, and how to build its TaskGraph."""

    work: str
    variant: str
    tokens: int
    build: Callable[[], TaskGraph]


def workloads(setting: Setting) -> list[Workload]:
    """The setting's workloads (see the module docstring)."""
    cfg = llama.PRESETS[setting.model]
    if setting.layers is not None:
        cfg = replace(cfg, num_layers=setting.layers)
    prompt, batch = setting.prompt, setting.batch

    def prefill(b: int) -> TaskGraph:
        return llama.prefill_program(cfg, b, prompt, "float16", logits="last").build()

    result = [
        Workload(f"prefill 1x{prompt}", "one batch", prompt, lambda: prefill(1)),
        Workload(f"prefill {batch}x{prompt}", "one batch", batch * prompt, lambda: prefill(batch)),
        Workload(
            f"prefill {batch}x{prompt}",
            f"{batch} micro-batches",
            batch * prompt,
            lambda: stack([prefill(1)] * batch).tg,
        ),
    ]
    for b in setting.gen_batches:
        spec = GenerationSpec(
            llama.FAMILY, cfg, b, setting.gen_prompt, setting.new_tokens, "float16",
            page_size=setting.page_size,
        )  # fmt: skip
        result.append(
            Workload(
                f"generate b{b}",
                f"p{setting.gen_prompt} n{setting.new_tokens}",
                spec.tokens,
                lambda spec=spec: spec.generation_program().build(),
            )
        )
    return result


def weights_on_device(tg: TaskGraph) -> TaskGraph:
    """`tg` with every weight (`Input.role` "weight") located on the device: staged by the
    driver at the start, while it fits (`memgraph.plan`'s inputs="auto")."""
    tasks = tuple(
        replace(t, op=replace(t.op, location="device"))
        if isinstance(t.op, Input) and t.op.role == "weight"
        else t
        for t in tg.tasks
    )
    return TaskGraph(tasks, tg.outputs, tg.name)


def plan_one(
    tg: TaskGraph, devices: int, budget: int, sends: tuple[str, ...] = SENDS
) -> dict[str, dict[str, Any]]:
    """Plan `tg` on `devices` devices at `budget` each, verify and simulate it, for each
    way of sending in `sends`: `{way: {"strategies": {name: result}, "chosen": name,
    "refused": {name: why}}}`. On one device (no links) one entry, `NO_LINKS`, whose
    strategy is "one device". On several, `einpage.compile_devices(strategy="auto")`'s
    every candidate strategy (compiled once, its links staged through the host), verified
    and simulated as compiled ("host") and with `memgraph.peer.direct_sends` of it
    ("direct"); `chosen` is the fastest candidate of that way (for "host", auto's own
    choice) and `refused` says why the other strategies could not place `tg`."""
    started = time.perf_counter()
    if devices == 1:
        mg = memgraph.plan(tg, budget, outputs="host", cost_model=COST_MODEL)
        planning = time.perf_counter() - started
        memgraph.verify(mg)
        sim = memgraph.simulate(mg, COST_MODEL)
        moved = sim.bytes_moved["h2d"] + sim.bytes_moved["d2h"]
        result = {
            "makespan": sim.makespan,
            "host_link_bytes": moved,
            "sent_bytes": 0,
            "links": 0,
            "direct_links": 0,
            "direct_bytes": 0,
            "peak_bytes": (mg.stats.peak_bytes,),
            "offload_bytes": mg.stats.offload_bytes,
            "reload_bytes": mg.stats.reload_bytes,
            "compute_seconds": (sim.compute_seconds,),
            "planning_seconds": planning,
            "verified": True,
            "reordered": 0,
            "tasks": len(tg),
        }
        return {NO_LINKS: {"strategies": {ONE: result}, "chosen": ONE, "refused": {}}}
    compiled = compile_devices(
        tg, budget, devices, strategy="auto", partition="off", cost_model=COST_MODEL,
        verify=False,
    )  # fmt: skip
    choice = compiled.choice
    planning = time.perf_counter() - started
    out: dict[str, dict[str, Any]] = {}
    for way in sends:
        results: dict[str, Any] = {}
        for name, candidate in choice.candidates.items():
            started = time.perf_counter()
            mp = candidate.plan if way == "host" else direct_sends(candidate.plan)[0]
            rewriting = time.perf_counter() - started
            results[name] = {
                **_measure(mp, devices),
                "planning_seconds": planning + rewriting,
                "tasks": len(candidate.graph),
            }
        if way == "host":
            chosen = choice.chosen
        else:  # auto's rule (the fastest simulated) on the direct plans
            chosen = min(results, key=lambda name: results[name]["makespan"])
        out[way] = {"strategies": results, "chosen": chosen, "refused": dict(choice.refused)}
    return out


def _measure(mp: MultiPlan, devices: int) -> dict[str, Any]:
    """A plan for several devices verified and simulated: a row's numbers."""
    report = verify_multi(mp)
    sim = simulate_multi(mp, COST_MODEL)
    direct = [link for link in mp.links if link.path == "peer"]
    return {
        "makespan": sim.makespan,
        "host_link_bytes": sum(sum(v.values()) for v in sim.host_link_bytes.values()),
        "sent_bytes": sum(sim.sent_bytes.values()),
        "links": len(mp.links),
        "direct_links": mp.info.get("direct", {}).get("links", 0),
        "direct_bytes": sum(sim.direct_bytes.values()),
        "peak_bytes": tuple(p.mg.stats.peak_bytes for p in mp.plans),
        "offload_bytes": sum(p.mg.stats.offload_bytes for p in mp.plans),
        "reload_bytes": sum(p.mg.stats.reload_bytes for p in mp.plans),
        "compute_seconds": sim.compute_seconds,
        "verified": report.devices == devices
        and len(report.plans) == devices
        and len(direct) == mp.info.get("direct", {}).get("links", 0),
        "reordered": sim.reordered,
    }


def _family(strategy: str) -> str:
    """What a row's eff/2 compares with on 2 devices: the same strategy, or auto's row
    whatever auto chose there."""
    return "auto" if strategy.startswith("auto") else strategy


def run(
    setting: Setting, weights: str, log: Callable[[str], None] = print, sends: str = "both"
) -> list[Row]:
    """Every workload of `setting` on each device count, with each placement strategy
    and auto's choice, each with its links sent each way of `sends` ("host", "direct" or
    "both"); rows with speedups filled in. Strategies that cannot place a workload are
    left out of the rows (`Row.refused` of the auto row says why)."""
    cost = get_cost_model(COST_MODEL)
    budget = cost.topology.device_memory_bytes - RESERVE
    starts = WEIGHTS if weights == "best" else (weights,)
    ways = SENDS if sends == "both" else (sends,)
    raw: list[dict[str, Any]] = []
    for load in workloads(setting):
        tg = load.build()
        graphs = {"host": tg, "device": weights_on_device(tg)}
        for devices in setting.devices:
            best: dict[tuple[str, str], dict[str, Any]] = {}  # (strategy, way) -> fastest
            auto: dict[str, dict[str, Any]] = {}  # way -> auto's fastest choice
            for start in starts:
                for way, planned in plan_one(graphs[start], devices, budget, ways).items():
                    for name, result in planned["strategies"].items():
                        result.update(weights=start, sends=way)
                        key = (name, way)
                        if key not in best or result["makespan"] < best[key]["makespan"]:
                            best[key] = result
                    chosen = planned["strategies"][planned["chosen"]]
                    if way not in auto or chosen["makespan"] < auto[way]["makespan"]:
                        auto[way] = {**chosen, "strategy": f"auto: {planned['chosen']}",
                                     "refused": planned["refused"]}  # fmt: skip
            results = [{**r, "strategy": name, "refused": {}} for (name, _), r in best.items()]
            if devices > 1:
                results.extend(auto.values())
            for r in results:
                r.update(work=load.work, variant=load.variant, devices=devices,
                         tokens=load.tokens, budget=budget)  # fmt: skip
                raw.append(r)
                log(
                    f"  planned {load.work} ({load.variant}) on {devices}, {r['strategy']}, "
                    f"sends {sends_label(r['sends'], r['direct_links'], r['links'])}: "
                    f"{r['makespan']:.4g} s, weights {r['weights']}"
                )
            for name, why in next(iter(auto.values()), {"refused": {}})["refused"].items():
                log(f"  {name} refused for {load.work} ({load.variant}) on {devices}: {why}")
    rows = []
    for r in raw:
        one = min(x["makespan"] for x in raw if x["work"] == r["work"] and x["devices"] == 1)
        two = [
            x["makespan"]
            for x in raw
            if (x["work"], x["variant"], _family(x["strategy"]), x["sends"], x["devices"])
            == (r["work"], r["variant"], _family(r["strategy"]), r["sends"], 2)
        ]
        speedup = one / r["makespan"]
        vs_2 = two[0] / r["makespan"] / (r["devices"] / 2) if two and r["devices"] >= 2 else None
        rows.append(
            Row(
                work=r["work"],
                variant=r["variant"],
                devices=r["devices"],
                strategy=r["strategy"],
                weights=r["weights"],
                sends=r["sends"],
                links=r["links"],
                direct_links=r["direct_links"],
                direct_bytes=r["direct_bytes"],
                tokens=r["tokens"],
                makespan=r["makespan"],
                tokens_per_s=r["tokens"] / r["makespan"],
                speedup=speedup,
                efficiency=speedup / r["devices"],
                efficiency_vs_2=vs_2,
                host_link_bytes=r["host_link_bytes"],
                sent_bytes=r["sent_bytes"],
                peak_bytes=r["peak_bytes"],
                budget=r["budget"],
                offload_bytes=r["offload_bytes"],
                reload_bytes=r["reload_bytes"],
                compute_seconds=r["compute_seconds"],
                planning_seconds=r["planning_seconds"],
                verified=r["verified"],
                reordered=r["reordered"],
                tasks=r["tasks"],
                refused=r["refused"],
            )
        )
    return rows


HEADER = (
    "work", "variant", "devices", "strategy", "weights", "sends", "time s", "tokens/s",
    "speedup", "eff/1", "eff/2", "host links", "max peak", "plan s",
)  # fmt: skip


def sends_label(sends: str, direct_links: int, links: int) -> str:
    """A row's sends as the table shows them: "host", "direct N/M" (N of M links direct),
    or "-" (one device: no links)."""
    if sends == NO_LINKS:
        return "-"
    return f"direct {direct_links}/{links}" if sends == "direct" else sends


def table_rows(rows: list[Row]) -> list[tuple[str, ...]]:
    """The printed table: a header, then one row per plan, as strings."""

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    out = [HEADER]
    for r in rows:
        rate = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s >= 100 else f"{r.tokens_per_s:.2f}"
        out.append(
            (
                r.work,
                r.variant,
                str(r.devices),
                r.strategy,
                r.weights,
                sends_label(r.sends, r.direct_links, r.links),
                f"{r.makespan:.4g}",
                rate,
                ratio(r.speedup),
                ratio(r.efficiency),
                ratio(r.efficiency_vs_2),
                format_bytes(r.host_link_bytes),
                format_bytes(max(r.peak_bytes)),
                f"{r.planning_seconds:.1f}",
            )
        )
    return out


def format_table(rows: list[Row], markdown: bool = False) -> str:
    """The table as aligned text, or as a Markdown table."""
    cells = table_rows(rows)
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
        lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
        return "\n".join(lines)
    widths = [max(len(row[c]) for row in cells) for c in range(len(cells[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) if c in (0, 1, 3, 4, 5) else cell.rjust(w) for c, (cell, w) in
                  enumerate(zip(row, widths, strict=True)))
        for row in cells
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny presets (a smoke test)")
    parser.add_argument(
        "--weights", choices=(*WEIGHTS, "best"), default="best",
        help="where the weights start (default: both planned, the faster kept)",
    )  # fmt: skip
    parser.add_argument(
        "--sends", choices=(*SENDS, "both"), default="both",
        help="how tensors travel between devices: staged through the host, direct (over "
        "NVLink, where memgraph.peer.direct_sends can make a link so), or both (default: "
        "a row each)",
    )  # fmt: skip
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    setting = QUICK if args.quick else FULL
    cost = get_cost_model(COST_MODEL)
    budget = cost.topology.device_memory_bytes - RESERVE
    print(
        f"LLaMA {setting.model} float16 on {COST_MODEL} ({cost.topology.describe()}); "
        f"budget per device {format_bytes(budget)} (80 GB less {format_bytes(RESERVE)}); "
        f"placement strategies: {', '.join(STRATEGIES)} and auto (the fastest simulated)",
        flush=True,
    )
    started = time.perf_counter()
    rows = run(setting, args.weights, log=lambda line: print(line, flush=True), sends=args.sends)
    seconds = time.perf_counter() - started
    print(format_table(rows, markdown=args.markdown))
    for anchor in ANCHORS:
        print(
            f"anchor ({anchor['what']}): {anchor['stack']}, {anchor['settings']}: "
            f"{anchor['value']} [{anchor['source']}]; differs: {anchor['differs']}"
        )
    print(f"{len(rows)} plans, all verified: {all(r.verified for r in rows)}; {seconds:.0f} s")
    result = {
        "machine": platform.platform(),
        "cost_model": COST_MODEL,
        "model": setting.model,
        "setting": asdict(setting),
        "reserve": RESERVE,
        "budget": budget,
        "weights": args.weights,
        "sends": args.sends,
        "strategies": list(STRATEGIES),
        "seconds": seconds,
        "rows": [asdict(r) for r in rows],
        "anchors": ANCHORS,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
