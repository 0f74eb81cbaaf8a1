"""Pinned host memory of a step-plan generation, before and after one session per generation.

Computed from the plans, not run: `runtime.pinned_bytes` is what a CuPy session pins.

* **before** (a session per step plan, as the step loop had it): each session pinned
  `pinned_bytes(plan)` – every weight copied into its pinned buffer – one after another;
  the table gives the sum over the generation (pinned and copied) and the largest;
* **after** (one session for the whole generation): `pinned_bytes(plans)` once, of which
  the weights of at least `CupyBackend.in_place_min` are registered where the caller
  holds them (pinned in place, not copied) and the rest – the KV pages' homes, the
  plans' scratch, the small weights – is the one allocated buffer.

`python benchmarks/pinned_bytes.py [--preset 7b --dtype float16 --batch 1 --prompt 512
--new-tokens 32 --budget 8GiB]` (the README's figures; about 10 s).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import runtime  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.workloads.generation import GenerationSpec, Planning, plan_generation  # noqa: E402
from einpage_core.units import format_bytes  # noqa: E402
from runtime.cupy_backend import CupyBackend  # noqa: E402
from runtime.hostmem import SharedHost  # noqa: E402


def measure(args: argparse.Namespace) -> dict[str, Any]:
    cfg = llama.PRESETS[args.preset]
    spec = GenerationSpec(llama.FAMILY, cfg, args.batch, args.prompt, args.new_tokens, args.dtype)
    plan = plan_generation(spec, args.budget, Planning(way="steps"))
    plans = plan.session_plans
    each = {str(key): runtime.pinned_bytes(mg) for key, mg in plans.items()}
    shared = SharedHost.of(list(plans.values()), True, CupyBackend.in_place_min)
    weights = sum(
        tg[i].nbytes
        for tg in [plans["prefill"].taskgraph]
        for i in tg.inputs.values()
        if tg[i].op.role == "weight"
    )
    return {
        "model": f"{cfg.name} {args.dtype}, batch {args.batch}, prompt {args.prompt}, "
        f"{args.new_tokens} new tokens, step plans at {args.budget}",
        "plans": list(each),
        "weight_bytes": weights,
        "before_per_session": each,
        "before_total": sum(each.values()),
        "before_largest": max(each.values()),
        "after_promise": shared.promise,
        "after_allocated": shared.nbytes,
        "after_in_place": sum(shared.in_place.values()),
    }


def print_table(result: dict[str, Any]) -> None:
    sessions = len(result["before_per_session"])
    print(result["model"])
    print("| | pinned | of which copied weights | allocations |")
    print("|---|---|---|---|")
    print(
        f"| before: a session per plan ({sessions}) | {format_bytes(result['before_total'])} "
        f"({format_bytes(result['before_largest'])} at a time) | "
        f"{format_bytes(sessions * result['weight_bytes'])} | {sessions} |"
    )
    copied = result["weight_bytes"] - result["after_in_place"]
    print(
        f"| after: one session | {format_bytes(result['after_promise'])}: "
        f"{format_bytes(result['after_allocated'])} allocated, "
        f"{format_bytes(result['after_in_place'])} of weights registered in place | "
        f"{format_bytes(copied)} | 1 |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="7b", choices=sorted(llama.PRESETS))
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budget", default="8GiB")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = measure(args)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
