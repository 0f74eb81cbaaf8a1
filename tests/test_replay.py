"""The test replay itself: it computes right plans right and catches plans that read bad bytes."""

from __future__ import annotations

import numpy as np
import pytest
from plans import reference_plan, sliced_weight_plan
from replay import check_outputs, random_inputs, replay

import einpage as ep
import taskgraph
from memgraph import MemGraphBuilder, Region


def small_graph() -> taskgraph.TaskGraph:
    prog = ep.Program("small")
    x = prog.input("x", (4, 8))
    w = prog.input("w", (8, 8), role="weight")
    h = ep.gelu(x @ w)
    prog.output(h, "h")
    prog.output(h.reshape(32), "flat")  # a view output
    return prog.build()


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("outputs_to_host", [False, True])
def test_replay_of_reference_plans_equals_the_evaluator(offload, outputs_to_host):
    tg = small_graph()
    chosen = frozenset(t.id for t in tg if t.kind == "einsum") if offload else frozenset()
    mg = reference_plan(tg, offload=chosen, outputs_to_host=outputs_to_host)
    check_outputs(mg, random_inputs(tg, seed=3))


def test_a_sliced_reload_copies_the_slice_box():
    mg = sliced_weight_plan()
    inputs = {"w": np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 100}
    np.testing.assert_allclose(replay(mg, inputs)["y"], np.exp(inputs["w"][16:24]))


def small_plan(free_input_early: bool = False, free_output_late: bool = False):
    """x @ w with both inputs on the device. `free_input_early` frees x's region before
    the apply reads it; `free_output_late` frees y's region after its output node. The
    verifier would reject either plan; the replay must compute garbage."""
    prog = ep.Program("small")
    prog.output(prog.input("x", (4, 4)) @ prog.input("w", (4, 4)), "y")
    tg = prog.build()
    b = MemGraphBuilder(tg, budget=768)
    x_at, w_at, y_at = Region(0, 256), Region(256, 256), Region(512, 256)
    x_alloc, w_alloc = b.alloc(0, x_at), b.alloc(1, w_at)
    x_in = b.input("x", 0, region=x_at, deps=[x_alloc])
    w_in = b.input("w", 1, region=w_at, deps=[w_alloc])
    if free_input_early:
        b.free(0, x_at, deps=[x_in])
    y_alloc = b.alloc(2, y_at)
    y = b.apply(2, [x_at, w_at], y_at, deps=[x_in, w_in, y_alloc])
    out = b.output("y", 2, region=y_at, deps=[y])
    if free_output_late:
        b.free(2, y_at, deps=[y, out])
    return tg, b.build()


def test_reading_a_freed_region_gives_a_wrong_answer():
    tg, good = small_plan()
    inputs = random_inputs(tg)
    check_outputs(good, inputs)
    _, bad = small_plan(free_input_early=True)
    got = replay(bad, inputs)["y"]  # x read as released bytes: huge floats or NaN
    assert (np.isnan(got) | (np.abs(got) > 1e30)).all()
    with pytest.raises(AssertionError):
        check_outputs(bad, inputs)


def test_an_output_freed_after_its_output_node_is_wrong():
    tg, mg = small_plan(free_output_late=True)
    with pytest.raises(AssertionError):
        check_outputs(mg, random_inputs(tg))


def test_random_inputs_are_normal_floats_and_small_ints():
    prog = ep.Program("ids")
    table = prog.input("table", (8, 4), role="weight")
    ids = prog.input("ids", (5,), dtype="int32")
    prog.output(prog.gather(table, ids), "rows")
    arrays = random_inputs(prog.build(), seed=1, int_high=8)
    assert arrays["ids"].dtype == np.int32 and 0 <= arrays["ids"].min() <= arrays["ids"].max() < 8
    assert arrays["table"].dtype == np.float32 and arrays["table"].std() > 0.1
    assert not np.array_equal(random_inputs(prog.build(), seed=2)["table"], arrays["table"])
