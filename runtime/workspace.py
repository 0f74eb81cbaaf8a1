"""Kernel workspaces: the device memory each task's GPU kernel needs, declared before planning.

Every device byte a run uses is inside the plan. A kernel either needs none (GEMMs that
read their operands and write their output where they are, generated elementwise and
reduction kernels reading strided views in place) or a *workspace*: bytes it uses while
it runs – operands a GEMM cannot read in place, copied transposed; a gather's error flag
– whose size is a pure function of the task (op, shapes, dtypes), computed here, once,
by the functions the CuPy kernels use to lay them out (`einsum_gemm`, `GATHER_FLAG`,
`cuda_codegen.scatter_add_workspace`: the scatter-add's sort keys).

`declare_workspaces(tg)` writes them on the TaskGraph (`Task.workspace`); the planner
then gives each such task's apply a transient region (`MemNode.workspace`), the verifier
proves the budget holds it with everything else, and the runtime hands it to the
kernel (`Backend.compute(..., workspace)`). `einpage.compile` declares them after
partitioning and before planning. Plans stay backend-agnostic: the NumPy backend runs the
same plans and is handed the same regions (poisoned in random mode).

>>> import einpage as ep
>>> prog = ep.Program()
>>> p = prog.input("p", (8, 64, 64))
>>> v = prog.input("v", (64, 8, 32))
>>> prog.output(prog.einsum("hqk,khe->qhe", p, v), "o")
>>> [t.workspace for t in declare_workspaces(prog.build())]
[0, 0, 0]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from runtime import cuda_codegen
from runtime.contraction import GemmPlan, gemm_plan
from taskgraph.dispatch import OpTable
from taskgraph.einsum import EinsumSpec
from taskgraph.graph import TaskGraph
from taskgraph.nodes import (
    ArgReduce,
    Concat,
    Einsum,
    Fill,
    Gather,
    Input,
    KthLargest,
    ScatterAdd,
    Slice,
    Task,
    View,
)

__all__ = [
    "GATHER_FLAG",
    "Operands",
    "einsum_gemm",
    "kernel_workspace",
    "declare_workspaces",
    "WORKSPACES",
]

Operands = Sequence[tuple[tuple[int, ...], str]]
"""The (shape, dtype) of each of a task's operands, in order."""

GATHER_FLAG = 16
"""Bytes of a gather's workspace: its error flag (two int64: seen, the bad id)."""


@functools.lru_cache(maxsize=4096)
def _gemm(spec: str, shapes: tuple, in_dtype: str, out_dtype: str) -> GemmPlan | None:
    return gemm_plan(EinsumSpec.parse(spec), shapes, in_dtype, out_dtype)


def einsum_gemm(task: Task, operands: Operands) -> GemmPlan | None:
    """The GEMMs of an einsum task (`runtime.contraction.gemm_plan`), or None when it runs
    as a generated kernel: not a plain two-operand einsum of one dtype that cuBLAS takes,
    or not matmul-shaped. Remembered per (spec, shapes, dtypes)."""
    op: Einsum = task.op  # type: ignore[assignment]
    if not op.is_plain or len(operands) != 2:
        return None
    (shape_a, dtype_a), (shape_b, dtype_b) = operands
    if dtype_a != dtype_b:
        return None
    return _gemm(str(op.spec), (tuple(shape_a), tuple(shape_b)), dtype_a, task.dtype)


def _einsum(task: Task, operands: Operands) -> int:
    plan = einsum_gemm(task, operands)
    return 0 if plan is None else plan.workspace


def _none(task: Task, operands: Operands) -> int:
    return 0


def _scatter_add(task: Task, operands: Operands) -> int:
    return cuda_codegen.scatter_add_workspace(task, [shape for shape, _ in operands])


WORKSPACES: OpTable[Callable[[Task, Operands], int]] = OpTable(
    "kernel workspaces",
    {
        Einsum: _einsum,
        Gather: lambda task, operands: GATHER_FLAG,
        Fill: _none,
        Slice: _none,
        Concat: _none,
        View: _none,
        ScatterAdd: _scatter_add,
        ArgReduce: _none,
        KthLargest: _none,
    },
    without={Input: "inputs are copied to the device, not computed"},
)
"""The workspace bytes of each op kind's CuPy kernel, from the task and its operands."""


def kernel_workspace(task: Task, operands: Operands) -> int:
    """The bytes of device memory the CuPy kernel of `task` needs besides its operands and
    output, given its operands' (shape, dtype)."""
    return WORKSPACES.of(task.op)(task, operands)


def declare_workspaces(tg: TaskGraph) -> TaskGraph:
    """`tg` with every compute task's `workspace` set to what its kernel needs (tasks the
    device does not compute have none); `tg` itself when every one already says so."""
    sizes = {}
    for task in tg:
        if task.is_compute:
            operands = [(tg[i].shape, tg[i].dtype) for i in task.inputs]
            sizes[task.id] = kernel_workspace(task, operands)
    return tg.with_workspaces(sizes)
