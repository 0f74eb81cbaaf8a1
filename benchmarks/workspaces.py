"""Kernel workspaces: the device memory GPU kernels need besides their operands and outputs,
before (temporaries outside the plan) and now (workspaces declared inside it).

Run: `python benchmarks/workspaces.py [--json out.json] [--quick]` (seconds: no plan is
made, no kernel runs; every figure is computed from the programs' shapes).

For each program (float16; `--quick`: tiny presets):

* GEMM tasks: the einsums that run as cuBLAS strided-batched GEMMs
  (`runtime.contraction.gemm_plan`); the GEMM calls they issue in all; "in place": the
  tasks whose GEMMs read the operands and write the output where they are; the
  matmul-shaped einsums that run as a generated reduction kernel instead (cheaper by the
  model: a short reduced index, whose GEMMs would need copies).
* workspace now: the tasks that declare a workspace (`runtime.declare_workspaces`), and
  the largest; each is planned inside the budget.
* before: what the GEMM path of commit 6b188d8 (`matmul_into`) took from its private
  pool, outside the plan: the product of a task whose output order needs a transpose, in
  a temporary the size of the output, and a copy of each operand that a transpose and
  reshape could not view – the largest such task, and the q projection's.
* modelled: the launches and copies of the chosen GEMM plans on the `h100-pcie5` cost
  model (5 µs a launch, 2 TB/s), against the time of their products (tensor cores at
  400 TFLOP/s, or HBM).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from einpage.models import gpt2, llama  # noqa: E402
from einpage.program.optim import AdamW  # noqa: E402
from einpage.workloads.training import training_graph  # noqa: E402
from einpage_core.units import format_bytes  # noqa: E402
from memgraph.cost import PRESETS  # noqa: E402
from runtime.contraction import product_seconds  # noqa: E402
from runtime.workspace import declare_workspaces, einsum_gemm  # noqa: E402
from taskgraph import dtypes  # noqa: E402

COST = PRESETS["h100-pcie5"]


def programs(quick: bool) -> dict[str, Any]:
    if quick:
        tiny = llama.PRESETS["tiny"]
        return {
            "LLaMA tiny 2x16 prefill": llama.prefill_program(tiny, 2, 16, "float16").build(),
            "LLaMA tiny 2x16 training": training_graph(tiny, 2, 16, AdamW(), "float16"),
        }
    seven = llama.PRESETS["7b"]
    return {
        "LLaMA-7B 1x2048 prefill": llama.prefill_program(seven, 1, 2048, "float16").build(),
        "LLaMA-7B 32x8192 prefill": llama.prefill_program(seven, 32, 8192, "float16").build(),
        "GPT-2 1.5B 8x1024 prefill": gpt2.prefill_program(
            gpt2.PRESETS["1.5b"], 8, 1024, "float16"
        ).build(),
        "GPT-2 124M 8x1024 training": training_graph(
            gpt2.PRESETS["124m"], 8, 1024, AdamW(), "float16"
        ),
    }


def _views(shape: tuple[int, ...], perm: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a C-contiguous array of `shape`, transposed by `perm`, reshapes to `target`
    without a copy (NumPy's rule, which CuPy's follows), on strides alone."""
    strides = np.cumprod((1, *shape[::-1]))[:-1][::-1] if shape else ()
    base = np.lib.stride_tricks.as_strided(np.zeros(1), shape, [s * 8 for s in strides])
    try:
        base.transpose(perm).reshape(target, copy=False)
    except ValueError:
        return False
    return True


def old_temporaries(task: Any, shapes: list[tuple[int, ...]], itemsize: int) -> int:
    """The bytes the old GEMM path (`matmul_plan`/`matmul_into` of 6b188d8) allocated
    outside the plan for `task`: the rule of that code, restated."""
    spec = task.op.spec
    a, b = spec.inputs
    out = spec.output
    sizes = spec.index_sizes(shapes)
    batch = [c for c in out if c in a and c in b]
    m = [c for c in out if c in a and c not in b]
    n = [c for c in out if c in b and c not in a]
    k = [c for c in a if c not in out]
    order = list(out)
    swap = order == batch + n + m
    permuted = order not in (batch + m + n, batch + n + m)
    (left, left_shape), (right, right_shape) = ((b, shapes[1]), (a, shapes[0])) if swap else (
        (a, shapes[0]), (b, shapes[1]))  # fmt: skip
    rows, cols = (n, m) if swap else (m, n)

    def size(group: list[str]) -> int:
        return math.prod(sizes[c] for c in group)

    lead = (size(batch),) if batch else ()
    total = task.nbytes if permuted else 0
    for term, shape, group in ((left, left_shape, batch + rows + k),
                               (right, right_shape, batch + k + cols)):  # fmt: skip
        perm = tuple(term.index(c) for c in group)
        target = (*lead, size(group[len(batch) : len(batch) + len(rows if term == left else k)]),
                  size(group[len(batch) + len(rows if term == left else k) :]))  # fmt: skip
        if not _views(shape, perm, target):
            total += math.prod(shape) * itemsize
    return total


def measure(name: str, tg: Any) -> dict[str, Any]:
    declared = declare_workspaces(tg)
    gemm_tasks = calls = in_place = seconds = compute = kernels = 0
    largest_old = q_old = 0
    for task in declared:
        if task.kind != "einsum" or not task.op.is_plain or len(task.inputs) != 2:
            continue
        operands = [(declared[i].shape, declared[i].dtype) for i in task.inputs]
        shapes = [s for s, _ in operands]
        if old_matmul_shaped(task):
            itemsize = dtypes.itemsize(operands[0][1])
            old = old_temporaries(task, shapes, itemsize)
            largest_old = max(largest_old, old)
            if task.label == "q" and not q_old:
                q_old = old
        plan = einsum_gemm(task, operands)
        if plan is None:
            kernels += old_matmul_shaped(task)  # matmul-shaped, but a reduction kernel now
            continue
        gemm_tasks += 1
        calls += plan.calls
        in_place += not plan.copies
        products = product_seconds(task.op.spec, shapes, operands[0][1], task.dtype)
        seconds += plan.seconds - products
        compute += products
    with_workspace = [t for t in declared if t.workspace]
    return {
        "program": name,
        "gemm_tasks": gemm_tasks,
        "gemm_calls": calls,
        "in_place": in_place,
        "reduction_kernels": kernels,
        "tasks_with_workspace": len(with_workspace),
        "kinds_with_workspace": sorted({t.kind for t in with_workspace}),
        "largest_workspace": max((t.workspace for t in with_workspace), default=0),
        "old_largest_temporary": largest_old,
        "old_q_temporary": q_old,
        "modelled_launch_and_copy_s": seconds,
        "gemm_compute_s": compute,
    }


def old_matmul_shaped(task: Any) -> bool:
    """Whether the old path ran `task` as a matmul (its `matmul_plan` rule)."""
    spec = task.op.spec
    if len(spec.inputs) != 2 or spec.has_diagonal:
        return False
    a, b = spec.inputs
    k = [c for c in a if c not in spec.output]
    return bool(k) and all(c in b for c in k) and all(c in a or c in spec.output for c in b)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    rows = [measure(name, tg) for name, tg in programs(args.quick).items()]
    print(
        "| program | GEMM tasks (calls) | in place | matmuls as reduction kernels | "
        "workspace now: tasks, largest | before: largest temporary, q's | "
        "launches+copies / GEMM compute |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['program']} | {r['gemm_tasks']} ({r['gemm_calls']}) | {r['in_place']} | "
            f"{r['reduction_kernels']} | "
            f"{r['tasks_with_workspace']} ({', '.join(r['kinds_with_workspace']) or '-'}), "
            f"{format_bytes(r['largest_workspace'])} | "
            f"{format_bytes(r['old_largest_temporary'])}, {format_bytes(r['old_q_temporary'])} | "
            f"{1e3 * r['modelled_launch_and_copy_s']:.2f} ms / "
            f"{1e3 * r['gemm_compute_s']:.1f} ms |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
