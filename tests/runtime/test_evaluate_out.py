"""`taskgraph.evaluate_task(..., out=)`, the NumPy backend's kernels: the same values as
without `out`, written into the given array."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from runtime_cases import block_program, einsum_programs, make_inputs

from einpage.errors import InputError
from taskgraph import TaskGraph
from taskgraph.evaluate import evaluate_task
from taskgraph.nodes import Input


def check_every_task_writes_out(tg: TaskGraph, seed: int) -> None:
    inputs = make_inputs(tg, seed)
    values: dict[int, np.ndarray] = {}
    for task in tg:
        if isinstance(task.op, Input):
            values[task.id] = inputs[task.op.name]
            continue
        operands = [values[i] for i in task.inputs]
        with np.errstate(all="ignore"):
            want = evaluate_task(task, operands)
            out = np.full(task.shape, 7, dtype=task.dtype)
            got = evaluate_task(task, operands, out=out)
        assert got is out
        # Summation order may differ with out= (NumPy picks the loop order with the output).
        rtol = {"float16": 1e-3, "float32": 1e-5}.get(task.dtype, 1e-12)
        scale = max(1.0, float(np.abs(want[np.isfinite(want)]).max(initial=0.0)))
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=task.line())
        values[task.id] = want


@given(tg=einsum_programs(), seed=st.integers(0, 2**16))
def test_out_holds_the_same_values_on_random_programs(tg, seed):
    check_every_task_writes_out(tg, seed)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_out_holds_the_same_values_on_a_transformer_block(dtype):
    # gather, views, slices, concat, a mask fill, reductions, joins, matmuls
    check_every_task_writes_out(block_program(dtype=dtype, layers=2), seed=3)


def test_out_of_the_wrong_shape_or_dtype_is_refused():
    tg = block_program()
    task = next(t for t in tg if t.kind == "einsum")
    operands = [np.zeros(tg[i].shape, tg[i].dtype) for i in task.inputs]
    with pytest.raises(InputError, match="out is float64"):
        evaluate_task(task, operands, out=np.empty(task.shape, "float64"))
    with pytest.raises(InputError, match="expected float32"):
        evaluate_task(task, operands, out=np.empty((1, *task.shape), task.dtype))
