"""Benchmark of `taskgraph.partition` on a LLaMA-like prefill program.

The program is built here with `einpage.Program` and `einpage.ops` (the models are
written elsewhere): embedding gather, and per layer RMSNorm, q/k/v projections with
explicit head indices, scores `"bhqd,bhkd->bhqk"`, a causal mask, softmax,
`"bhqk,bhkd->bhqd"`, the output projection and the residual, RMSNorm and a SwiGLU MLP
and the residual; then a final RMSNorm and the LM head. No arrays are made: only the
TaskGraph is built and partitioned.

    python benchmarks/partition_bench.py                 # the 7B configurations
    python benchmarks/partition_bench.py --quick         # small shapes, for a smoke test
    python benchmarks/partition_bench.py --json out.json

Columns: tasks before/after, the largest working set (operands + output) of any task
before and after (the Concat that rebuilds the 2 GiB logits output is excluded, see
`taskgraph.partition`), the seconds `partition` took, the live peak of the task order
(see `live_peak`) before and after, and how many tasks of each block kind the result
has.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import einpage as ep
from einpage_core.units import format_bytes, parse_bytes
from taskgraph import TaskGraph
from taskgraph.partition import partition, smallest_feasible_block_limit, working_set


@dataclass(frozen=True)
class Shape:
    """Transformer dimensions."""

    hidden: int = 4096
    heads: int = 32
    intermediate: int = 11008
    layers: int = 32
    vocab: int = 32000
    batch: int = 8
    seq: int = 4096
    dtype: str = "float16"


LLAMA_7B = Shape()
SMALL = Shape(hidden=256, heads=4, intermediate=688, layers=2, vocab=1000, batch=2, seq=256)


def transformer_program(shape: Shape) -> ep.Program:
    """A LLaMA-like prefill program (no rotary embedding: it does not change the shapes)."""
    s = shape
    head = s.hidden // s.heads
    prog = ep.Program("llama_prefill")
    tokens = prog.input("tokens", (s.batch, s.seq), "int64")
    table = prog.input("embed", (s.vocab, s.hidden), s.dtype, role="weight")
    x = ep.gather(table, tokens)
    for layer in range(s.layers):
        with prog.scope(f"layers.{layer}"):

            def weight(name, dims, layer=layer):
                return prog.input(f"layers.{layer}.{name}", dims, s.dtype, role="weight")

            with prog.scope("attn"):
                h = ep.rmsnorm(x, weight("attn_norm", (s.hidden,)))
                q = prog.einsum(
                    "bsd,dhe->bhse", h, weight("wq", (s.hidden, s.heads, head)), label="q"
                )
                k = prog.einsum(
                    "bsd,dhe->bhse", h, weight("wk", (s.hidden, s.heads, head)), label="k"
                )
                v = prog.einsum(
                    "bsd,dhe->bhse", h, weight("wv", (s.hidden, s.heads, head)), label="v"
                )
                scores = prog.einsum(
                    "bhqd,bhkd->bhqk", q, k, join=f"a * b * {1 / math.sqrt(head)!r}", label="scores"
                )
                probs = ep.softmax(ep.causal_mask(scores), axis=-1)
                o = prog.einsum("bhqk,bhkd->bhqd", probs, v, label="attn")
                out = prog.einsum(
                    "bhqe,hed->bqd", o, weight("wo", (s.heads, head, s.hidden)), label="o"
                )
                x = ep.add(x, out)
            with prog.scope("mlp"):
                h = ep.rmsnorm(x, weight("mlp_norm", (s.hidden,)))
                gate = prog.einsum(
                    "bsd,df->bsf", h, weight("w1", (s.hidden, s.intermediate)), label="gate"
                )
                up = prog.einsum(
                    "bsd,df->bsf", h, weight("w3", (s.hidden, s.intermediate)), label="up"
                )
                act = prog.einsum("bsf,bsf->bsf", gate, up, join="silu(a) * b", label="act")
                down = prog.einsum(
                    "bsf,fd->bsd", act, weight("w2", (s.intermediate, s.hidden)), label="down"
                )
                x = ep.add(x, down)
    with prog.scope("head"):
        h = ep.rmsnorm(x, prog.input("norm", (s.hidden,), s.dtype, role="weight"))
        logits = prog.einsum(
            "bsd,vd->bsv", h, prog.input("lm_head", (s.vocab, s.hidden), s.dtype, role="weight")
        )
    prog.output(logits, "logits")
    return prog


def largest_working_set(tg: TaskGraph) -> int:
    """The largest working set of a non-input task, output assembly excluded."""
    return max(
        working_set(tg, t.id)
        for t in tg.tasks
        if t.kind != "input" and (t.block is None or t.block.kind != "output")
    )


def live_peak(tg: TaskGraph) -> int:
    """The most bytes live at once when tasks run in insertion order and each tensor lives
    from its task to its last reader (outputs to the end): no offloading, inputs, views
    and the Concats that rebuild outputs excluded. A rough measure of the order."""
    last = {i: len(tg) for i in tg.outputs.values()}
    for task in tg.tasks:
        for i in task.inputs:
            last[i] = max(last.get(i, 0), task.id)
    live = peak = 0
    ending: dict[int, int] = {}
    for task in tg.tasks:
        if task.kind not in ("input", "view") and (
            task.block is None or task.block.kind != "output"
        ):
            live += task.nbytes
            end = last.get(task.id, task.id)
            ending[end] = ending.get(end, 0) + task.nbytes
        peak = max(peak, live)
        live -= ending.pop(task.id, 0)
    return peak


def run_config(name: str, shape: Shape, limit: int) -> dict:
    tg = transformer_program(shape).build()
    start = time.perf_counter()
    parted = partition(tg, limit)
    seconds = time.perf_counter() - start
    kinds: dict[str, int] = {}
    for task in parted.tasks:
        if task.block is not None:
            kinds[task.block.kind] = kinds.get(task.block.kind, 0) + 1
    return {
        "config": name,
        "shape": asdict(shape),
        "limit": limit,
        "smallest_feasible_limit": smallest_feasible_block_limit(tg),
        "tasks_before": len(tg),
        "tasks_after": len(parted),
        "largest_ws_before": largest_working_set(tg),
        "largest_ws_after": largest_working_set(parted),
        "live_peak_before": live_peak(tg),
        "live_peak_after": live_peak(parted),
        "kinds": kinds,
        "seconds": round(seconds, 3),
    }


CONFIGS = {
    "full": [
        ("7b b8 s4096 / 4GiB", LLAMA_7B, "4GiB"),
        ("7b b8 s4096 / 1GiB", LLAMA_7B, "1GiB"),
        ("7b b8 s4096 / 256MiB", LLAMA_7B, "256MiB"),
        ("7b b8 s4096 / 64MiB", LLAMA_7B, "64MiB"),
    ],
    "quick": [
        ("small / 1MiB", SMALL, "1MiB"),
        ("small / 256KiB", SMALL, "256KiB"),
    ],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    rows = []
    header = (
        f"{'config':<22} {'tasks before':>12} {'tasks after':>11} {'largest ws before':>17} "
        f"{'largest ws after':>16} {'seconds':>7} {'live peak before':>16} "
        f"{'live peak after':>15}  blocks/partials/assembly"
    )
    print(header)
    print("-" * len(header))
    for name, shape, limit in CONFIGS["quick" if args.quick else "full"]:
        row = run_config(name, shape, parse_bytes(limit))
        rows.append(row)
        kinds = row["kinds"]
        print(
            f"{name:<22} {row['tasks_before']:>12} {row['tasks_after']:>11} "
            f"{format_bytes(row['largest_ws_before']):>17} "
            f"{format_bytes(row['largest_ws_after']):>16} {row['seconds']:>7.2f} "
            f"{format_bytes(row['live_peak_before']):>16} "
            f"{format_bytes(row['live_peak_after']):>15}  "
            f"{kinds.get('block', 0)}/{kinds.get('partial', 0)}/{kinds.get('assembly', 0)}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"benchmark": "partition", "python": sys.version.split()[0], "rows": rows},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
