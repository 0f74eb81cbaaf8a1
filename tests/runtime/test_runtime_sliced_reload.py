"""Sliced reloads: a Slice of a host input is loaded as just its box, on every backend path."""

from __future__ import annotations

import numpy as np
import pytest
from plans import sliced_weight_plan

import runtime
import taskgraph
from runtime.numpy_backend import NumpyBackend


class StagingNumpyBackend(NumpyBackend):
    """The NumPy backend with host staging on, as the CuPy backend has it: the layout then
    keeps contiguous copies of sliced-reload boxes, filled when inputs are placed."""

    host_staging = True


def weights():
    return {"w": np.arange(64 * 8, dtype="float32").reshape(64, 8) / 100}


@pytest.mark.parametrize("mode", ["sequential", "threaded", "random"])
def test_sliced_reload_runs_to_the_reference(mode):
    mg = sliced_weight_plan()
    expected = taskgraph.evaluate(mg.taskgraph, weights())["y"]
    got = runtime.run(mg, weights(), backend="numpy", mode=mode)["y"]
    np.testing.assert_array_equal(got, expected)


def test_staging_backends_copy_the_box_contiguously():
    mg = sliced_weight_plan()
    with runtime.Session(mg, StagingNumpyBackend(), mode="sequential") as session:
        assert set(session.layout.boxes) == {1}
        session.stage(weights())
        got = session.run({})["y"]
        box = session.layout.boxes[1].of(session.host)
        np.testing.assert_array_equal(box, weights()["w"][16:24])
    np.testing.assert_array_equal(got, taskgraph.evaluate(mg.taskgraph, weights())["y"])
