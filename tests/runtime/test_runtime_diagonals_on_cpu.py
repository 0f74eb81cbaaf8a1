"""Einsums that read diagonals through the CuPy backend's kernels, on the CPU stand-in.

An index repeated inside an operand reaches the GPU kernels as a strided diagonal view
(`runtime.contraction.broadcast_operands`): the generated elementwise and reduction
kernels broadcast over it, `matmul_plan` refuses it (a diagonal is not a reshape), and
a plain pair that is not matmul-shaped goes to `einsum`. Each path must equal the
reference evaluator.
"""

from __future__ import annotations

import numpy as np
import pytest
from cpu_cuda import CXX, fake_cupy

import taskgraph
from runtime.contraction import broadcast_operands, gemm_plan
from runtime.cupy_backend import CupyKernels, evaluate_on_gpu
from taskgraph.builder import GraphBuilder
from taskgraph.einsum import EinsumSpec
from taskgraph.expr import parse
from taskgraph.nodes import Einsum, Input

needs_cxx = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++)")

CASES = [
    # spec, operand shapes, join, agg, the kernel that runs it
    ("ii->i", [(4, 4)], "exp(tanh(a))", "sum", "elementwise_kernel"),
    ("iij->j", [(3, 3, 5)], "a", "max", "reduction_kernel"),
    ("iij,jk->ik", [(3, 3, 4), (4, 2)], "a * b + 1.0", "sum", "reduction_kernel"),
    ("ii->", [(5, 5)], None, "sum", "reduction_kernel"),
    ("ii,ij->j", [(3, 3), (3, 4)], None, "sum", "reduction_kernel"),  # no cp.einsum
    ("aab,bc->ac", [(3, 3, 4), (4, 2)], None, "sum", "reduction_kernel"),
]


def one_task_graph(spec, shapes, join, agg):
    """A TaskGraph of exactly one einsum (built without the frontend, which would take a
    plain einsum's diagonals as tasks of their own)."""
    builder = GraphBuilder("diagonal")
    ids = [builder.add(Input(f"x{i}"), (), shape=s, dtype="float64") for i, s in enumerate(shapes)]
    parsed = EinsumSpec.parse(spec)
    op = Einsum(parsed, None if join is None else parse(join, len(shapes)), agg)
    builder.output(builder.add(op, ids), "y")
    return builder.build()


def test_a_diagonal_is_never_a_matmul():
    diagonal = gemm_plan(EinsumSpec.parse("aab,bc->ac"), [(3, 3, 4), (4, 2)], "float64", "float64")
    assert diagonal is None
    assert gemm_plan(EinsumSpec.parse("ab,bc->ac"), [(3, 4), (4, 2)], "float64", "float64")


def test_broadcast_views_read_the_diagonal():
    a = np.arange(2 * 3 * 2).reshape(2, 3, 2)
    (view,) = broadcast_operands(EinsumSpec.parse("iji->j"), [a])
    assert view.shape == (3, 2)  # iteration space j, i: the diagonal of axes 0 and 2
    np.testing.assert_array_equal(view, np.einsum("iji->ji", a))


@needs_cxx
@pytest.mark.parametrize("spec, shapes, join, agg, kernel", CASES)
def test_diagonal_einsums_on_the_cupy_kernels(spec, shapes, join, agg, kernel):
    tg = one_task_graph(spec, shapes, join, agg)
    rng = np.random.default_rng(0)
    inputs = {f"x{i}": rng.standard_normal(s) for i, s in enumerate(shapes)}
    kernels = CupyKernels(fake_cupy())
    got = evaluate_on_gpu(tg, inputs, kernels)["y"]
    want = taskgraph.evaluate(tg, inputs)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert kernels.counters[kernel] == 1
