"""Generation under a device budget: einpage's plans against offloading baselines and a bound.

Run: `python benchmarks/generation.py [--json out.json] [--quick]`. FlexGen's setting
(prompt 512, 32 new tokens, float16) for LLaMA-7B at 8 and 16 GiB and LLaMA-65B at
32 GiB, batches 1 to 64, simulated on the "h100-pcie5" cost model (400 TFLOP/s, 2 TB/s
HBM, 50 GB/s each way over PCIe; `memgraph.simulate`). Greedy decoding, KV pages of
128 positions. Each cell prints the simulated generation throughput – generated tokens
(batch x 32) over the simulated seconds of the prefill and every decode step – of:

* `unrolled`: `einpage.generation_plans.plan_generation(spec, budget, Planning("unrolled"))`: the
  prefill and 31 decode steps as one program planned once (`einpage.compile`);
* `hidden`: the same unrolled plan with `hide_reloads=True` (reload victims read at least
  one copy's time before, `memgraph.transfer_schedule`), beside the default in one run;
* `steps`: the same with "steps": a prefill plan and one decode plan per length bucket
  (a page), run back to back – nothing stays on the device between steps;
* `steps×8`: step plans of chunks of 8 decode steps (`chunk_steps=8`): weights and the
  chunk's pages stay on the device within a chunk;
* `stream`: `memgraph.layer_streaming_plan` of the unrolled program, ZeRO-Inference-like:
  every weight copied in per layer and dropped after use, every step; activations and
  KV pages stay on the device (infeasible when they do not fit);
* `flexgen`: FlexGen's searched policy (`memgraph.flexgen.search_policy`): its cost
  model's LP over the GPU shares of weights (wg), KV cache (cg) and activations (hg)
  and the number of GPU batches in its zig-zag block, on the same cost model and the
  same per-step compute as the program (`flexgen_workload`), printed with its choice;
* `kv-host`: the "KV always on host" variant of a fixed placement (the baseline before
  the searched policy): the largest fraction of the weights that fits beside its
  working set (two layers of streamed weights, two layers of KV pages, the largest
  task) stays resident, the rest is streamed every step, and the KV cache lives on the
  host – read in whole every step, each step's new keys and values written back – with
  transfers overlapping compute perfectly;
* `bound`: `memgraph.bounds.generation_time_bound` of the program: per step, the
  largest of its compute, the bytes that must cross PCIe during it / bandwidth, and
  the loads that must precede one of its bottlenecks plus the compute after it; summed.
  A step reads every weight and every page so far, at most `budget` bytes of which
  (less the previous choice's working set) are on the device when it starts; and the
  step's own working memory – what is resident while a bottleneck runs, and what is
  still to be read after it – takes room from that cache. (The bound reported before,
  `bound_seconds`, counted only `weights + pages - budget` bytes per step.)

and, for the einpage plans, the weight bytes streamed and KV bytes paged (reloaded plus
offloaded) per generated token, and the planning seconds (building the programs and
`einpage.compile`; every plan is also verified, which is not counted in these seconds
and takes a fraction of them). JSON (`--json`) has every number in bytes and seconds.

What the numbers say: see the README's "Measured" section (the command there).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import memgraph  # noqa: E402
from einpage.generation_plans import (  # noqa: E402
    GenerationSpec,
    Planning,
    plan_generation,
    steps_of,
)
from einpage.models import llama  # noqa: E402
from einpage.models.errors import GenerationBudgetError  # noqa: E402
from einpage_core.errors import InfeasibleBudgetError  # noqa: E402
from einpage_core.units import format_bytes, parse_bytes  # noqa: E402
from memgraph.bounds import generation_time_bound  # noqa: E402
from memgraph.cost import get_cost_model  # noqa: E402
from memgraph.flexgen import FlexGenWorkload, search_policy  # noqa: E402
from taskgraph import TaskGraph  # noqa: E402
from taskgraph.nodes import Input  # noqa: E402

COST_MODEL = "h100-pcie5"
PROMPT, NEW_TOKENS, PAGE_SIZE, CHUNK = 512, 32, 128, 8
BATCHES = (1, 2, 4, 8, 16, 32, 64)
SETTINGS = (("7b", "8GiB"), ("7b", "16GiB"), ("65b", "32GiB"))
QUICK = {"settings": (("7b", "8GiB"),), "batches": (1, 4), "prompt": 128, "new_tokens": 4}


@dataclass(frozen=True)
class Way:
    """One einpage plan of a cell."""

    tokens_per_s: float
    seconds: float
    planning_seconds: float
    weight_bytes_per_token: float
    kv_bytes_per_token: float
    tasks: int
    nodes: int


@dataclass(frozen=True)
class Cell:
    model: str
    budget: int
    batch: int
    prompt: int
    new_tokens: int
    weight_bytes: int
    kv_bytes: int
    bound_tokens_per_s: float
    unrolled: Way | None
    hidden: Way | None
    steps: Way | None
    chunked: Way | None
    stream_tokens_per_s: float | None
    flexgen_tokens_per_s: float | None
    flexgen_policy: dict[str, float] | None
    kv_host_tokens_per_s: float | None
    kv_host_resident_fraction: float | None
    notes: dict[str, str]


def per_step(
    tg: TaskGraph, cost: Any, prompt: int, kv_per_position: int
) -> tuple[list[float], list[int], int]:
    """Compute seconds of each step (0 = prefill), the KV bytes cached when each step
    starts (read by it: the prompt and the tokens before it), and the weight bytes."""
    # 0 for the prefill, t for decode step t: the first step whose choice needs the task
    # (what only the outputs read counts with the prefill)
    step_of = [step or 0 for step in steps_of(tg)]
    steps = 1 + max(step_of)
    compute = [0.0] * steps
    weights = 0
    for task in tg:
        if isinstance(task.op, Input):
            weights += task.nbytes if task.op.role == "weight" else 0
        else:
            compute[step_of[task.id]] += cost.task_seconds(tg, task.id)
    kv = [0] + [(prompt + t - 1) * kv_per_position for t in range(1, steps)]
    return compute, kv, weights


def bound_seconds(
    compute: list[float], kv: list[int], weights: int, budget: int, cost: Any
) -> float:
    """The per-step bound this benchmark reported before `generation_time_bound`: per
    step max(compute, (weights + KV so far - budget) / h2d), summed (all weights for the
    prefill). Kept for comparison (`tests/memgraph/test_generation_bound.py`)."""
    total = max(compute[0], weights / cost.h2d_bytes_per_s)
    for t in range(1, len(compute)):
        must = max(0, weights + kv[t] - budget)
        total += max(compute[t], must / cost.h2d_bytes_per_s)
    return total


def flexgen_workload(
    cfg: llama.LlamaConfig,
    batch: int,
    prompt: int,
    new_tokens: int,
    compute: list[float],
    weights: int,
) -> FlexGenWorkload:
    """FlexGen's view of a float16 LLaMA generation: einpage's per-step compute and weight
    bytes, and per-position sizes from the config (2 bytes an element): K and V of a
    layer, the hidden state, the largest non-attention intermediate (the MLP's gate, up
    and their product, or Q, K, V and their input), and scores and probabilities per key."""
    kv_width = cfg.num_kv_heads * cfg.head_dim
    return FlexGenWorkload(
        layers=cfg.num_layers,
        batch=batch,
        prompt=prompt,
        new_tokens=new_tokens,
        weight_bytes=weights,
        kv_bytes_per_token=2 * kv_width * 2,
        hidden_bytes_per_token=cfg.hidden_size * 2,
        act_bytes_per_token=2 * max(3 * cfg.intermediate_size, 2 * cfg.hidden_size + 2 * kv_width),
        score_bytes_per_key=2 * cfg.num_heads * 2,
        compute_seconds=tuple(compute),
    )


def flexgen_policy(workload: FlexGenWorkload, budget: int) -> tuple[float | None, dict | None]:
    """(seconds, the policy as a dict) of FlexGen's searched policy, or (None, None)."""
    try:
        policy = search_policy(workload, budget, COST_MODEL)
    except InfeasibleBudgetError:
        return None, None
    chosen = {
        "weights_gpu": policy.weights_gpu,
        "cache_gpu": policy.cache_gpu,
        "activations_gpu": policy.activations_gpu,
        "gpu_batches": policy.gpu_batches,
        "gpu_batch_size": policy.gpu_batch_size,
        "gpu_peak": policy.cost.gpu_peak,
    }
    return policy.cost.seconds, chosen


def kv_host_seconds(
    compute: list[float], kv: list[int], weights: int, budget: int, layers: int,
    largest_task: int, new_kv_per_step: int, cost: Any,
) -> tuple[float | None, float | None]:  # fmt: skip
    """(seconds, resident fraction) of the "KV always on host" placement, or (None, None)
    when its working set alone exceeds the budget."""
    kv_max = kv[-1] + new_kv_per_step
    working = largest_task + 2 * kv_max / layers
    room = budget - working
    two_layers = 2 * weights / layers  # the streamed part's double buffer, at most
    if room < two_layers:
        return None, None
    # resident f*W plus two layers of the streamed (1-f)*W fill `room`
    f = min(1.0, (room - two_layers) / (weights * (1 - 2 / layers)))
    h2d, d2h = cost.h2d_bytes_per_s, cost.d2h_bytes_per_s
    total = max(compute[0], weights / h2d, kv[1] / d2h if len(kv) > 1 else 0.0)
    for t in range(1, len(compute)):
        streamed = (1 - f) * weights + kv[t]
        total += max(compute[t], streamed / h2d, new_kv_per_step / d2h)
    return total, f


def einpage_way(
    spec: GenerationSpec, budget: int, way: str, eviction: str, chunk: int = 1, **options: Any
) -> tuple[Way | None, str, Any]:
    chunks = {} if way == "unrolled" else {"chunk_steps": chunk}
    options = {"eviction": eviction, **options}
    planning = Planning(way=way, cost_model=COST_MODEL, options=options, **chunks)
    try:
        plan = plan_generation(spec, budget, planning)
    except (GenerationBudgetError, InfeasibleBudgetError) as err:
        return None, f"infeasible: {err}"[:300], None
    stats = plan.stats(COST_MODEL)
    result = Way(
        tokens_per_s=stats.tokens_per_s,
        seconds=stats.simulated_seconds,
        planning_seconds=stats.planning_seconds,
        weight_bytes_per_token=stats.weight_bytes_per_token,
        kv_bytes_per_token=stats.kv_bytes_per_token,
        tasks=stats.tasks,
        nodes=stats.nodes,
    )
    return result, "", plan


def run_cell(
    model: str, budget_text: str, batch: int, prompt: int, new_tokens: int,
    eviction: str = "belady", step_plans: bool = True,
) -> Cell:  # fmt: skip
    cfg = llama.PRESETS[model]
    budget = parse_bytes(budget_text)
    cost = get_cost_model(COST_MODEL)
    spec = GenerationSpec(
        llama.FAMILY, cfg, batch, prompt, new_tokens, "float16", page_size=PAGE_SIZE
    )
    notes: dict[str, str] = {}
    unrolled, note, plan = einpage_way(spec, budget, "unrolled", eviction)
    if note:
        notes["unrolled"] = note
    tg = plan.compiled.program if plan is not None else spec.generation_program().build()
    hidden, note, _ = einpage_way(spec, budget, "unrolled", eviction, hide_reloads=True)
    if note:
        notes["hidden"] = note
    steps = chunked = None
    if step_plans:
        steps, note, _ = einpage_way(spec, budget, "steps", eviction)
        if note:
            notes["steps"] = note
        chunked, note, _ = einpage_way(spec, budget, "steps", eviction, CHUNK)
        if note:
            notes["chunked"] = note
    else:
        notes["steps"] = notes["chunked"] = "not run (--unrolled-only)"
    new_kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * 2  # one position
    compute, kv, weights = per_step(tg, cost, prompt, new_kv)
    stream = None
    try:
        mg = memgraph.layer_streaming_plan(tg, budget, prefetch=1, cost_model=COST_MODEL)
        stream = spec.tokens / memgraph.simulate(mg, COST_MODEL).makespan
    except InfeasibleBudgetError as err:
        notes["stream"] = f"infeasible: needs {format_bytes(err.needed)}"
    largest = memgraph.min_budget(tg)[0]
    kv_host, fraction = kv_host_seconds(
        compute, kv, weights, budget, cfg.num_layers, largest, new_kv, cost
    )
    if kv_host is None:
        notes["kv_host"] = "infeasible: its working set exceeds the budget"
    flex, chosen = flexgen_policy(
        flexgen_workload(cfg, batch, prompt, new_tokens, compute, weights), budget
    )
    if flex is None:
        notes["flexgen"] = "infeasible: no policy fits the budget"
    return Cell(
        model=model,
        budget=budget,
        batch=batch,
        prompt=prompt,
        new_tokens=new_tokens,
        weight_bytes=weights,
        kv_bytes=kv[-1] + new_kv,
        bound_tokens_per_s=spec.tokens / generation_time_bound(tg, budget, cost).seconds,
        unrolled=unrolled,
        hidden=hidden,
        steps=steps,
        chunked=chunked,
        stream_tokens_per_s=stream,
        flexgen_tokens_per_s=None if flex is None else spec.tokens / flex,
        flexgen_policy=chosen,
        kv_host_tokens_per_s=None if kv_host is None else spec.tokens / kv_host,
        kv_host_resident_fraction=fraction,
        notes=notes,
    )


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f}" if value < 10 else f"{value:,.1f}"


def _policy(chosen: dict | None) -> str:
    """wg/cg/hg in percent and the block (GPU batches x their size)."""
    if chosen is None:
        return "-"
    shares = "/".join(f"{chosen[k]:.0%}" for k in ("weights_gpu", "cache_gpu", "activations_gpu"))
    return f"{shares} {chosen['gpu_batches']}x{chosen['gpu_batch_size']}"


def _shares(way: Way | None, cell: Cell) -> tuple[str, str]:
    """`way`'s share of the bound and its ratio to FlexGen's searched policy, as text."""
    if way is None:
        return "-", "-"
    flex = cell.flexgen_tokens_per_s
    over = "-" if flex is None else f"{way.tokens_per_s / flex:.2f}"
    return f"{way.tokens_per_s / cell.bound_tokens_per_s:.0%}", over


def print_cell(cell: Cell) -> None:
    u, h, s, c = cell.unrolled, cell.hidden, cell.steps, cell.chunked
    share, over = _shares(u, cell)
    hidden_share, hidden_over = _shares(h, cell)
    flex = cell.flexgen_tokens_per_s
    print(
        f"{cell.model:>4} {format_bytes(cell.budget):>9} {cell.batch:>3}  "
        f"{_rate(u and u.tokens_per_s):>8} {_rate(h and h.tokens_per_s):>8} "
        f"{_rate(s and s.tokens_per_s):>8} "
        f"{_rate(c and c.tokens_per_s):>8} "
        f"{_rate(cell.stream_tokens_per_s):>8} {_rate(cell.kv_host_tokens_per_s):>8} "
        f"{_rate(flex):>8} {_policy(cell.flexgen_policy):>20} "
        f"{cell.bound_tokens_per_s:>8,.1f} {share:>5} {over:>5} {hidden_share:>5} "
        f"{hidden_over:>5}  "
        f"{'-' if u is None else format_bytes(u.weight_bytes_per_token):>10} "
        f"{'-' if u is None else format_bytes(u.kv_bytes_per_token):>10} "
        f"{'-' if u is None else f'{u.planning_seconds:.1f}':>6} "
        f"{'-' if s is None else f'{s.planning_seconds:.1f}':>6}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="two small cells (a smoke test)")
    parser.add_argument("--only", metavar="MODEL:BUDGET:BATCH", help="one cell, e.g. 7b:16GiB:16")
    parser.add_argument(
        "--eviction", default="belady", help="the planner's eviction policy (belady, lru)"
    )
    parser.add_argument(
        "--unrolled-only", action="store_true", help="skip the step plans (steps, steps×8)"
    )
    args = parser.parse_args(argv)
    settings, batches = (QUICK["settings"], QUICK["batches"]) if args.quick else (SETTINGS, BATCHES)
    if args.only:
        model, budget, batch = args.only.split(":")
        settings, batches = ((model, budget),), (int(batch),)
    prompt, new_tokens = (
        (QUICK["prompt"], QUICK["new_tokens"]) if args.quick else (PROMPT, NEW_TOKENS)
    )
    print(
        f"prompt {prompt}, {new_tokens} new tokens, float16, pages of {PAGE_SIZE}, "
        f"simulated on {COST_MODEL}; tokens/s of the whole generation"
    )
    print(
        "model    budget   b  unrolled   hidden    steps  steps×8   stream  kv-host  flexgen "
        "  wg/cg/hg block        bound  u/bd  u/fx  h/bd  h/fx  weights/tok     KV/tok  "
        "plan-u plan-s"
    )
    cells = []
    started = time.perf_counter()
    for model, budget in settings:
        for batch in batches:
            cell = run_cell(
                model, budget, batch, prompt, new_tokens, args.eviction, not args.unrolled_only
            )
            print_cell(cell)
            cells.append(cell)
    summary = summarize(cells)
    for line in summary["lines"]:
        print(line)
    result = {
        "machine": platform.platform(),
        "cost_model": COST_MODEL,
        "page_size": PAGE_SIZE,
        "eviction": args.eviction,
        "seconds": time.perf_counter() - started,
        "cells": [asdict(c) for c in cells],
        "summary": {k: v for k, v in summary.items() if k != "lines"},
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


def summarize(cells: list[Cell]) -> dict[str, Any]:
    """The targets of the issue, met or not, cell by cell: for the default unrolled plan
    and for the one with `hide_reloads` (`hidden`)."""
    result: dict[str, Any] = {"cells": len(cells), "lines": []}
    for label in ("unrolled", "hidden"):
        near, beats, close, fails = 0, 0, 0, defaultdict(list)
        for c in cells:
            u = getattr(c, label)
            if u is None:
                fails[f"{label} infeasible"].append((c.model, c.batch))
                continue
            where = (c.model, format_bytes(c.budget), c.batch)
            if u.tokens_per_s >= 0.9 * c.bound_tokens_per_s:
                near += 1
            else:
                fails["more than 10% under the bound"].append(where)
            flex = c.flexgen_tokens_per_s
            if flex is None or u.tokens_per_s >= flex:
                beats += 1
            else:
                fails["below FlexGen's searched policy"].append(where)
            close += flex is None or u.tokens_per_s >= 0.98 * flex
        n = len(cells)
        result["lines"].append(
            f"{label}: within 10% of the bound: {near} of {n} cells; at least FlexGen's "
            f"searched policy: {beats} of {n} (within 2% of it: {close})"
        )
        result["lines"] += [f"  {why}: {where}" for why, where in fails.items()]
        prefix = "" if label == "unrolled" else "hidden_"
        result[f"{prefix}near_bound"] = near
        result[f"{prefix}beats_flexgen"] = beats
        result[f"{prefix}within_2pct_of_flexgen"] = close
        slowest = max(
            (getattr(c, label).planning_seconds for c in cells if getattr(c, label)),
            default=math.nan,
        )
        result["lines"].append(f"slowest {label} plan: {slowest:.1f} s")
    return result


if __name__ == "__main__":
    main()
