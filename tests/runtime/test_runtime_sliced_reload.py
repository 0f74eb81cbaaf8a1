"""Sliced reloads: a Slice of a host input is loaded as just its box, on every backend path."""

from __future__ import annotations

import numpy as np
import pytest
from plans import sliced_weight_plan

import runtime
import taskgraph
from memgraph import HostBox
from runtime.numpy_backend import NumpyBackend


class StagingNumpyBackend(NumpyBackend):
    """The NumPy backend with host staging on, as the CuPy backend has it (weights live in
    slots of the one host buffer); it records every box copy it is asked for."""

    host_staging = True

    def __init__(self):
        super().__init__()
        self.copies = []

    def copy_box(self, host, starts, device, direction, stream):
        self.copies.append((host.shape, tuple(starts), device.shape, direction))
        super().copy_box(host, starts, device, direction, stream)


def weights():
    return {"w": np.arange(64 * 8, dtype="float32").reshape(64, 8) / 100}


@pytest.mark.parametrize("mode", ["sequential", "threaded", "random"])
def test_sliced_reload_runs_to_the_reference(mode):
    mg = sliced_weight_plan()
    expected = taskgraph.evaluate(mg.taskgraph, weights())["y"]
    got = runtime.run(mg, weights(), backend="numpy", mode=mode)["y"]
    np.testing.assert_array_equal(got, expected)


def test_the_reload_carries_its_box_and_the_runtime_copies_just_that():
    mg = sliced_weight_plan()
    (reload,) = [n for n in mg.nodes if n.kind.value == "reload"]
    assert reload.box == HostBox((64, 8), "float32", (16, 0), (8, 8))
    assert mg.storages[reload.storage].shape == (64, 8)
    assert str(reload.box) == "[16:24, 0:8]" and "host#0[16:24, 0:8]" in reload.describe()


def test_staging_backends_copy_the_box_straight_from_the_storage():
    mg = sliced_weight_plan()
    backend = StagingNumpyBackend()
    with runtime.Session(mg, backend, mode="sequential") as session:
        # One slot for the weight and one staging slot for the device output: no box copy.
        assert set(session.layout.storages) == {0} and not session.layout.inputs
        assert session.layout.storages[0].shape == (64, 8)
        assert session.layout.nbytes == 64 * 8 * 4 + 256
        session.stage(weights())
        got = session.run({})["y"]
    assert ((64, 8), (16, 0), (8, 8), "h2d") in backend.copies
    np.testing.assert_array_equal(got, taskgraph.evaluate(mg.taskgraph, weights())["y"])
