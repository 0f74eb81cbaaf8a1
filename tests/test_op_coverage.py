"""Every op kind appears in every dispatch: the reference evaluator, the partition rules,
the NumPy backend, the CuPy backend's kernels, FLOPs and JSON.

Adding an op kind means a class in `taskgraph.nodes` plus its entries in the per-kind
tables (`taskgraph.dispatch.OpTable`); a missing entry fails at import and here, and
a sample of the kind (`SAMPLES`) runs through each dispatch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import einpage as ep
import taskgraph
from einpage_core.errors import UnsupportedError
from runtime.cupy_backend import CupyKernels
from runtime.numpy_backend import ImmediateStream, NumpyBackend
from runtime.workspace import kernel_workspace
from taskgraph import OP_KINDS, Fill, Input, TaskGraph
from taskgraph.dispatch import OpTable
from taskgraph.evaluate import REFERENCE_KERNELS, evaluate_task
from taskgraph.nodes import Operand, op_from_attributes
from taskgraph.partition import blocks_of, partition, smallest_feasible_block_limit
from taskgraph.partition.rules import RULES

TABLES = {
    "reference kernels": REFERENCE_KERNELS,
    "partition rules": RULES,
    "CuPy kernels": CupyKernels.HANDLERS,
}


def _cpu_cuda():
    """`tests/runtime/cpu_cuda.py` (the CPU stand-in for CuPy), loaded by path."""
    if "cpu_cuda" not in sys.modules:
        folder = Path(__file__).parent / "runtime"
        if str(folder) not in sys.path:  # its own imports (fake_cublas) sit beside it
            sys.path.insert(0, str(folder))
        path = folder / "cpu_cuda.py"
        spec = importlib.util.spec_from_file_location("cpu_cuda", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["cpu_cuda"] = module
        spec.loader.exec_module(module)
    return sys.modules["cpu_cuda"]


def zoo() -> TaskGraph:
    """A program with at least one task of every op kind, each an output."""
    prog = ep.Program("zoo")
    x = prog.input("x", (4, 6))
    ids = prog.input("ids", (3,), "int64")
    parts = {
        "einsum": prog.einsum("ij->ij", x, join="exp(a)"),
        "fill": prog.fill((4, 6), 0.5),
        "gather": prog.gather(x, ids),
        "slice": prog.slice(x, (1, 0), (2, 6)),
        "argreduce": ep.argmax(x),
        "kth_largest": ep.kth_largest(x, 2),
    }
    parts["view"] = prog.view(parts["einsum"], (4, 2, 3))
    parts["concat"] = prog.concat([x, parts["fill"]], 0)
    parts["scatter_add"] = prog.scatter_add(parts["gather"], ids, 5)
    for name, tensor in parts.items():
        prog.output(tensor, name)
    return prog.build()


ZOO = zoo()
SAMPLES = {task.kind: task for task in reversed(ZOO.tasks)}  # the first task of each kind
INPUTS = {
    "x": np.random.default_rng(0).standard_normal((4, 6)).astype("float32"),
    "ids": np.array([3, 0, 2]),
}
KINDS = sorted(OP_KINDS)


def operands_of(task: taskgraph.Task) -> list[np.ndarray]:
    """The operand arrays of a zoo task, as the reference computes them."""
    values = {}
    for t in ZOO.tasks:
        if t.kind == "input":
            values[t.id] = INPUTS[t.op.name]
        else:
            values[t.id] = evaluate_task(t, [values[i] for i in t.inputs])
    return [values[i] for i in task.inputs]


def test_the_zoo_has_every_op_kind():
    assert set(SAMPLES) == set(OP_KINDS)


@pytest.mark.parametrize("name", TABLES)
def test_every_table_names_every_op_kind_or_says_why_not(name):
    table = TABLES[name]
    covered = set(table) | set(table.without)
    assert covered == set(OP_KINDS.values()), name
    for cls, reason in table.without.items():
        assert not cls.is_compute and not cls.aliases_input, f"{name} leaves out {cls.kind}"
        assert reason


def test_a_table_missing_a_kind_fails_when_built():
    entries = {cls: cls.kind for cls in OP_KINDS.values() if cls is not Fill}
    with pytest.raises(UnsupportedError, match="no entry for op kind.*'fill'"):
        OpTable("test table", entries)
    with pytest.raises(UnsupportedError, match="not an op kind"):
        OpTable("test table", {**entries, Fill: "f", int: "x"})
    table = OpTable("test table", entries, without={Fill: "fills are not wanted here"})
    assert table.of(SAMPLES["einsum"].op) == "einsum"
    with pytest.raises(UnsupportedError, match="fills are not wanted here"):
        table.of(SAMPLES["fill"].op)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_kernel(kind):
    task = SAMPLES[kind]
    if type(task.op) in REFERENCE_KERNELS.without:
        with pytest.raises(UnsupportedError, match=f"op kind {kind!r}"):
            evaluate_task(task, operands_of(task))
        return
    value = evaluate_task(task, operands_of(task))
    assert value.shape == task.shape and value.dtype == np.dtype(task.dtype)
    name = next(n for n, i in ZOO.outputs.items() if i == task.id)
    np.testing.assert_array_equal(value, taskgraph.evaluate(ZOO, INPUTS)[name])


@pytest.mark.parametrize("kind", KINDS)
def test_numpy_backend(kind):
    task = SAMPLES[kind]
    if type(task.op) in REFERENCE_KERNELS.without:
        return  # the NumPy backend runs the reference kernels: inputs are copied, not run
    out = np.full(task.shape, np.nan if task.dtype.startswith("float") else -1, task.dtype)
    operands = operands_of(task)
    NumpyBackend().compute(task, operands, out, ImmediateStream("compute"))
    np.testing.assert_array_equal(out, evaluate_task(task, operands))


@pytest.mark.parametrize("kind", KINDS)
def test_cupy_kernels_on_the_cpu_stand_in(kind):
    task = SAMPLES[kind]
    if type(task.op) in CupyKernels.HANDLERS.without:
        with pytest.raises(UnsupportedError, match=f"op kind {kind!r}"):
            CupyKernels(np).run(task, [], None)
        return
    cpu_cuda = _cpu_cuda()
    if cpu_cuda.CXX is None:
        pytest.skip("no host C++ compiler (g++) for the CuPy stand-in's kernels")
    cp = cpu_cuda.fake_cupy()
    kernels = CupyKernels(cp)
    operands = operands_of(task)
    out = cp.empty(task.shape, task.dtype)
    on_device = [cp.asarray(a) for a in operands]
    size = kernel_workspace(task, [(a.shape, a.dtype.name) for a in operands])
    kernels.run(task, on_device, out, cp.empty(size, np.uint8) if size else None)
    kernels.check_flags()
    np.testing.assert_allclose(cp.asnumpy(out), evaluate_task(task, operands), rtol=1e-6)


def test_partition_rules_split_every_kind():
    """At the finest limit every task but the inputs (host storage) is split."""
    parted = partition(ZOO, smallest_feasible_block_limit(ZOO))
    blocks = blocks_of(parted)
    for kind, task in SAMPLES.items():
        assert blocks.get(task.id), f"no blocks of the {kind} task %{task.id}"
    split = {ZOO[of].kind for of, ids in blocks.items() if len(ids) > 1}
    assert split == {kind for kind, cls in OP_KINDS.items() if cls is not Input}
    want = taskgraph.evaluate(ZOO, INPUTS)
    got = taskgraph.evaluate(parted, INPUTS)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_flops(kind):
    task = SAMPLES[kind]
    operands = [Operand(ZOO[i].shape, ZOO[i].dtype) for i in task.inputs]
    flops = task.op.flops(operands, task.shape)
    assert isinstance(flops, int) and flops == task.flops
    assert (flops > 0) == task.is_compute


@pytest.mark.parametrize("kind", KINDS)
def test_json_round_trip(kind):
    task = SAMPLES[kind]
    assert op_from_attributes(kind, task.op.attributes()) == task.op
    again = TaskGraph.from_json(ZOO.to_json())
    assert again[task.id] == task
