"""Sliced reloads in the planner: a Slice of a host input is copied as just its box."""

from __future__ import annotations

import numpy as np
import pytest
from replay import check_outputs, check_plan
from strategies import program_inputs

import einpage as ep
import runtime
import taskgraph
from memgraph import MemGraph, NodeKind
from memgraph.planner import min_budget, plan, sliced_reloads

KiB = 1024


def nodes(mg: MemGraph, kind: NodeKind, tensor: int | None = None) -> list:
    return [n for n in mg.nodes if n.kind is kind and (tensor is None or n.tensor == tensor)]


def column_blocks(blocks: int = 8, location: str | None = None, role: str = "weight"):
    """x [8, 256] times a weight w [256, 128 * blocks] (128 KiB per block), read only
    through column slices: y = concat_j (x @ w[:, 128j : 128(j+1)])."""
    prog = ep.Program("columns")
    x = prog.input("x", (8, 256))
    w = prog.input("w", (256, 128 * blocks), role=role, location=location)
    parts = [x @ prog.slice(w, (0, 128 * j), (256, 128)) for j in range(blocks)]
    prog.output(ep.concat(parts, axis=1), "y")
    return prog.build()


def run_everywhere(mg: MemGraph, inputs: dict) -> None:
    """The plan verifies, replays, and runs on the NumPy runtime (random order too) to the
    reference evaluator's outputs."""
    check_plan(mg)
    check_outputs(mg, inputs)
    expected = taskgraph.evaluate(mg.taskgraph, inputs)
    for mode, seed in [("sequential", 0), ("random", 1), ("random", 2)]:
        got = runtime.run(mg, inputs, backend="numpy", mode=mode, seed=seed)
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=mode)


def test_a_weight_larger_than_the_budget_read_through_slices_is_streamed():
    tg = column_blocks()
    w = tg.inputs["w"]
    assert tg[w].nbytes == 1024 * KiB
    needed, task = min_budget(tg)
    # The largest step is one block's product: x (8 KiB), its 128 KiB slice and the
    # 4 KiB result; no step needs the 1 MiB weight.
    assert needed == 140 * KiB and tg[task].kind == "einsum"
    mg = plan(tg, "256KiB")
    assert sorted(sliced_reloads(tg)) == [t.id for t in tg if t.kind == "slice"]
    reloads = nodes(mg, NodeKind.RELOAD)
    assert {n.tensor for n in reloads} == set(sliced_reloads(tg))  # never the whole weight
    assert not nodes(mg, NodeKind.APPLY, tg.consumers[w][0])  # slices are not computed
    assert mg.info["sliced_reloads"] == len(reloads) == 8
    assert mg.stats.reload_bytes == tg[w].nbytes  # each box once
    run_everywhere(mg, program_inputs(tg, 0))


def test_an_evicted_slice_is_dropped_and_sliced_again():
    prog = ep.Program("again")
    x = prog.input("x", (16, 16))
    w = prog.input("w", (64, 16), role="weight")
    head = prog.slice(w, (0, 0), (16, 16))  # 1 KiB, read first and last
    h = x @ head
    for i in range(4):
        h = ep.tanh(h @ prog.input(f"v{i}", (16, 16), role="weight"))
    prog.output(h @ head, "y")
    tg = prog.build()
    mg = plan(tg, "3KiB")
    s = mg.stats
    assert s.offload_count == 0  # the slice has a host copy: its box of w
    assert s.drop_count >= 1 and len(nodes(mg, NodeKind.RELOAD, head.id)) == 2
    run_everywhere(mg, program_inputs(tg, 3))


def test_a_device_input_read_only_through_slices_starts_on_the_host():
    tg = column_blocks(4, location="device", role="activation")
    mg = plan(tg, "1MiB")
    (inp,) = [n for n in nodes(mg, NodeKind.INPUT) if n.name == "w"]
    assert inp.storage is not None and mg.info["sliced_reloads"] == 4
    run_everywhere(mg, program_inputs(tg, 1))


def test_slices_of_an_input_on_the_device_are_computed():
    prog = ep.Program("both")
    w = prog.input("w", (64, 16))  # a device activation, also read whole
    prog.output(ep.exp(prog.slice(w, (8, 0), (8, 16))) @ ep.transpose(w), "y")
    tg = prog.build()
    assert sliced_reloads(tg) == {}
    mg = plan(tg, "64KiB")
    assert mg.info["sliced_reloads"] == 0
    assert sliced_reloads(tg, inputs="host") == {1: 0}
    host = plan(tg, "64KiB", inputs="host")
    assert host.info["sliced_reloads"] >= 1
    for made in (mg, host):
        run_everywhere(made, program_inputs(tg, 2))


def test_a_slice_that_is_an_output_is_computed_from_its_input():
    prog = ep.Program("out")
    w = prog.input("w", (64, 16), role="weight")
    piece = prog.slice(w, (8, 0), (8, 16))
    prog.output(piece, "piece")
    prog.output(ep.exp(prog.slice(w, (0, 0), (8, 16))), "y")
    tg = prog.build()
    assert list(sliced_reloads(tg)) == [t.id for t in tg if t.kind == "slice"][1:]
    assert min_budget(tg)[0] == 4 * KiB + 512  # the output slice needs w (4 KiB) and itself
    mg = plan(tg, "8KiB", outputs="host")
    assert len(nodes(mg, NodeKind.APPLY, piece.id)) == 1
    run_everywhere(mg, program_inputs(tg, 4))


def test_a_slice_nothing_reads_is_made_once_by_a_sliced_reload():
    prog = ep.Program("dead")
    w = prog.input("w", (64, 16), role="weight")
    unused = prog.slice(w, (32, 0), (8, 16))
    prog.output(ep.exp(prog.slice(w, (0, 0), (8, 16))), "y")
    tg = prog.build()
    mg = plan(tg, "2KiB")
    (made,) = nodes(mg, NodeKind.RELOAD, unused.id)
    (freed,) = nodes(mg, NodeKind.FREE, unused.id)
    assert made.id < freed.id and min_budget(tg)[0] == 1 * KiB
    run_everywhere(mg, program_inputs(tg, 5))


@pytest.mark.parametrize("budget", ["160KiB", "200KiB", "400KiB", "2MiB"])
@pytest.mark.parametrize("order", ["program", "memory"])
def test_sliced_plans_round_trip_through_json_and_run(budget, order):
    tg = column_blocks(6)
    mg = MemGraph.from_json(plan(tg, budget, order=order).to_json())
    run_everywhere(mg, program_inputs(tg, 6))
