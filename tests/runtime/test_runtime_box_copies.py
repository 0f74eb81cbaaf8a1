"""Box copies: the one strided-copy primitive, on NumPy and on the CuPy backend's CPU stand-in.

The CuPy backend copies a box of a pinned host array as memcpy / memcpy2D planes
(`runtime.boxcopy`); `cpu_cuda.fake_cupy_backend` runs exactly that code with copies done
by `ctypes.memmove`, so every box, in both directions, is checked against NumPy slicing,
and whole plans run through it (outputs assembled on the host: in
test_runtime_host_assembly).
"""

from __future__ import annotations

import numpy as np
import pytest
from cpu_cuda import CudaCopiesBackend, FakeDeviceArray, fake_cupy_backend
from hypothesis import given
from hypothesis import strategies as st
from plans import sliced_weight_plan

import runtime
import taskgraph
from einpage.errors import BackendError
from runtime.boxcopy import BoxRuns
from runtime.numpy_backend import ImmediateStream, NumpyBackend


@st.composite
def boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    starts = tuple(draw(st.integers(0, d - 1)) for d in shape)
    sizes = tuple(draw(st.integers(1, d - s)) for d, s in zip(shape, starts, strict=True))
    dtype = draw(st.sampled_from(["float32", "float64", "int32", "float16"]))
    return shape, starts, sizes, dtype


def index(starts, sizes):
    return tuple(slice(s, s + n) for s, n in zip(starts, sizes, strict=True))


@pytest.mark.parametrize(
    "shape, starts, sizes, planes, rows, run",
    [
        ((64, 8), (16, 0), (8, 8), 1, 1, 256),  # whole rows: one memcpy
        ((64, 8), (0, 2), (64, 4), 1, 64, 16),  # columns: one 2D copy
        ((4, 6, 8), (1, 2, 0), (2, 3, 8), 1, 2, 96),  # runs of whole last axes
        ((4, 6, 8), (1, 2, 1), (2, 3, 4), 2, 3, 16),  # a plane per outer index
        ((4, 6, 8), (0, 0, 2), (4, 6, 3), 1, 24, 12),  # whole outer axes merge
        ((4, 6, 8), (0, 0, 0), (4, 6, 8), 1, 1, 768),  # the whole array
        ((), (), (), 1, 1, 4),  # a scalar
    ],
)
def test_box_runs(shape, starts, sizes, planes, rows, run):
    runs = BoxRuns.of(shape, 4, starts, sizes)
    assert (len(runs.planes), runs.planes[0].rows, runs.run) == (planes, rows, run)
    assert runs.nbytes == 4 * int(np.prod(sizes))


def test_a_box_outside_its_array_is_refused():
    with pytest.raises(BackendError, match="is not a box of an array of shape"):
        BoxRuns.of((4, 4), 4, (3, 0), (2, 4))


@given(case=boxes(), seed=st.integers(0, 2**16))
def test_cupy_box_copies_match_numpy_slicing(case, seed):
    shape, starts, sizes, dtype = case
    backend, cuda_runtime, stream = fake_cupy_backend()
    rng = np.random.default_rng(seed)
    host = np.asarray((rng.standard_normal(shape) * 100).astype(dtype))
    device = np.zeros(sizes, dtype)
    backend.copy_box(host, starts, FakeDeviceArray(device), "h2d", stream)
    np.testing.assert_array_equal(device, host[index(starts, sizes)])
    runs = BoxRuns.of(shape, host.itemsize, starts, sizes)
    assert len(cuda_runtime.calls) == len(runs.planes)
    assert sum(n for _, n in cuda_runtime.calls) == device.nbytes
    back = np.zeros_like(host)
    fresh = np.asarray((rng.standard_normal(sizes) * 100).astype(dtype))
    backend.copy_box(back, starts, FakeDeviceArray(fresh), "d2h", stream)
    expected = np.zeros_like(host)
    expected[index(starts, sizes)] = fresh
    np.testing.assert_array_equal(back, expected)  # only the box was written


@given(case=boxes())
def test_numpy_box_copies_match_numpy_slicing(case):
    shape, starts, sizes, dtype = case
    host = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    device = np.zeros(sizes, dtype)
    NumpyBackend().copy_box(host, starts, device, "h2d", ImmediateStream("h2d"))
    np.testing.assert_array_equal(device, host[index(starts, sizes)])


def test_box_copies_refuse_bad_arguments():
    backend, _, stream = fake_cupy_backend()
    host = np.zeros((4, 4), "float32")
    with pytest.raises(BackendError, match="between float32 \\(host\\) and float64"):
        backend.copy_box(host, (0, 0), FakeDeviceArray(np.zeros((2, 2))), "h2d", stream)
    with pytest.raises(BackendError, match="C-contiguous"):
        backend.copy_box(host[:, :2], (0, 0), FakeDeviceArray(host[:1, :2]), "h2d", stream)
    with pytest.raises(BackendError, match="direction must be 'h2d' or 'd2h'"):
        backend.copy_box(host, (0, 0), FakeDeviceArray(host[:1]), "up", stream)
    with pytest.raises(BackendError, match="does not lie inside"):
        NumpyBackend().copy_box(host, (3, 0), np.zeros((2, 4), "float32"), "h2d", None)


@pytest.mark.parametrize("mode", ["sequential", "streams", "random"])
def test_plans_run_to_the_reference_through_the_cupy_copies(mode):
    weights = {"w": np.arange(64 * 8, dtype="float32").reshape(64, 8) / 100}
    mg = sliced_weight_plan()
    backend = CudaCopiesBackend()
    got = runtime.run(mg, weights, backend, mode=mode)
    np.testing.assert_array_equal(got["y"], taskgraph.evaluate(mg.taskgraph, weights)["y"])
    assert ("memcpyAsync", 256) in backend.cuda_runtime.calls  # just the box's 8 rows


def test_runs_of_one_plan_alternate_between_staging_and_plain_backends():
    """A staging backend lays out more host memory (input and output slots) than a plain
    one of the same name; runs of one plan alternating between them each get the
    layout of their own backend."""
    weights = {"w": np.arange(64 * 8, dtype="float32").reshape(64, 8) / 100}
    mg = sliced_weight_plan()
    want = taskgraph.evaluate(mg.taskgraph, weights)["y"]
    for backend in ("numpy", CudaCopiesBackend(), "numpy", CudaCopiesBackend()):
        np.testing.assert_array_equal(runtime.run(mg, weights, backend)["y"], want)
