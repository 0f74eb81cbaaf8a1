"""Properties of `taskgraph.grad` on random programs: gradients equal `torch.autograd` in
float64 (random joins of the allow-list, every agg, broadcasts, reuse, views, slices,
concats, gathers), agree with central finite differences on tiny cases, and survive
partitioning of the whole gradient program."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from grad_cases import finite_differences, grad_cases, loss_scale, torch_gradients  # noqa: E402

import taskgraph  # noqa: E402
from taskgraph.partition import partition, smallest_feasible_block_limit  # noqa: E402

torch.set_num_threads(1)


def _close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    scale = 1.0 + np.abs(want).max(initial=0.0)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


@given(grad_cases())
def test_random_program_gradients_equal_torch_autograd(case):
    assume(np.isfinite(loss_scale(case)))
    want = torch_gradients(case.tg, case.arrays, "loss", case.wrt)
    assume(all(np.all(np.isfinite(w)) for w in want.values()))
    got = taskgraph.evaluate(taskgraph.grad(case.tg, "loss", case.wrt), case.arrays)
    for name in case.wrt:
        _close(got["grad." + name], want[name], 1e-8)


@settings(max_examples=15)
@given(grad_cases())
def test_random_program_gradients_agree_with_finite_differences(case):
    assume(np.isfinite(loss_scale(case)) and loss_scale(case) < 1e3)
    assume(sum(case.arrays[n].size for n in case.wrt) <= 24)
    got = taskgraph.evaluate(taskgraph.grad(case.tg, "loss", case.wrt), case.arrays)
    want = torch_gradients(case.tg, case.arrays, "loss", case.wrt)
    for name in case.wrt:
        numeric = finite_differences(case.tg, case.arrays, "loss", name)
        # Where the program is smooth at the point (torch and the differences agree),
        # ours agrees too; at kinks (relu, max, ties) the one-sided slopes differ.
        smooth = np.isclose(numeric, want[name], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(
            got["grad." + name][smooth], numeric[smooth], rtol=1e-4, atol=1e-5
        )


@settings(max_examples=20)
@given(grad_cases(), st.integers(0, 2))
def test_partitioned_gradient_programs_compute_the_same(case, coarseness):
    g = taskgraph.grad(case.tg, "loss", case.wrt)
    limit = smallest_feasible_block_limit(g) * (1 + 3 * coarseness)
    want = taskgraph.evaluate(g, case.arrays)
    got = taskgraph.evaluate(partition(g, limit), case.arrays)
    for name, value in want.items():
        if np.all(np.isfinite(value)):
            _close(got[name], value, 1e-9)
