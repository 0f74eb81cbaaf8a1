"""A session over several plans (issue 23: one session for a whole generation).

The plans run one at a time in one arena (the largest plan's) and one host buffer
(`runtime.hostmem`): an input's home is shared by the plans that read it with the same
shape and dtype (a weight is placed once for all of them), and each plan's scratch –
offloaded tensors, outputs assembled on the host, output staging slots – overlaps the
others'. `runtime.pinned_bytes(plans)` states the whole; closing the session releases
every buffer at once, without the garbage collector.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from counting_backend import Counting
from runtime_cases import assert_outputs_match, block_program, make_inputs, reference

import memgraph
import runtime
from einpage.errors import InputError
from memgraph import NodeKind
from runtime.hostmem import HOST_ALIGNMENT
from runtime.interpreter import arena_bytes


def aligned(n: int) -> int:
    return -(-max(n, 1) // HOST_ALIGNMENT) * HOST_ALIGNMENT


@pytest.fixture(scope="module")
def plans():
    """Two programs with the same weights and ids of different lengths, planned at their
    smallest budgets (offloads, reloads of weights: host storages of their own)."""
    made = {}
    for key, seq in (("long", 6), ("short", 4)):
        tg = block_program(seq=seq, layers=2)
        made[key] = memgraph.plan(tg, memgraph.min_budget(tg)[0])
        assert made[key].stats.offload_count > 0
    return made


def weights_of(tg):
    return {n: a for n, a in make_inputs(tg, 0).items() if n != "ids"}


def stated(plans) -> int:
    """What the host buffer of a staging session over `plans` holds, counted here: each
    input's bytes once per name, shape and dtype, and the largest plan's scratch."""
    homes = {}
    scratch = []
    for mg in plans.values():
        tg = mg.taskgraph
        inputs = {n.storage for n in mg.nodes if n.kind is NodeKind.INPUT}
        for name, i in tg.inputs.items():
            homes[name, tg[i].shape, tg[i].dtype] = aligned(tg[i].nbytes)
        outputs = [
            aligned(tg[tg.outputs[n.name]].nbytes)
            for n in mg.nodes
            if n.kind is NodeKind.OUTPUT and n.region is not None
        ]
        storages = [aligned(s.nbytes) for sid, s in mg.storages.items() if sid not in inputs]
        scratch.append(sum(storages) + sum(outputs))
    return sum(homes.values()) + max(scratch)


@pytest.mark.parametrize("staging", [False, True])
@pytest.mark.parametrize("mode", ["sequential", "streams", "random"])
def test_plans_of_one_session_share_one_arena_one_host_buffer_and_the_weights(plans, staging, mode):
    backend = Counting(staging, timeout=30)
    weights = weights_of(plans["long"].taskgraph)
    with runtime.Session(plans, backend, mode=mode) as session:
        session.stage(weights)  # once, for both plans
        for seed in range(2):
            for key in ("long", "short", "long"):
                tg = plans[key].taskgraph
                ids = make_inputs(tg, seed)["ids"]
                got = session.run({"ids": ids}, plan=key, seed=seed)
                assert_outputs_match(got, reference(tg, {**weights, "ids": ids}), f"{key}")
                assert session.mg is plans[key]
        assert set(session.staged) == set(weights)
        layout = session.host_layout
    assert backend.arenas == [max(arena_bytes(mg) for mg in plans.values())]
    assert backend.hosts == [layout.nbytes]
    if staging:
        assert layout.nbytes == stated(plans) == runtime.pinned_bytes(plans)
        separately = sum(runtime.pinned_bytes(mg) for mg in plans.values())
        assert runtime.pinned_bytes(plans) < separately  # the weights once, not twice


def test_pinned_bytes_of_one_plan_is_as_before(plans):
    """`pinned_bytes(mg)` of a single plan: its storages and staging slots, each rounded."""
    mg = plans["long"]
    tg = mg.taskgraph
    device_inputs = [n for n in mg.nodes if n.kind is NodeKind.INPUT and n.region is not None]
    device_outputs = [n for n in mg.nodes if n.kind is NodeKind.OUTPUT and n.region is not None]
    want = (
        sum(aligned(s.nbytes) for s in mg.storages.values())
        + sum(aligned(tg[n.tensor].nbytes) for n in device_inputs)
        + sum(aligned(tg[tg.outputs[n.name]].nbytes) for n in device_outputs)
    )
    assert runtime.pinned_bytes(mg) == runtime.pinned_bytes([mg]) == want


def test_an_input_goes_to_the_plans_of_its_shape(plans):
    weights = weights_of(plans["long"].taskgraph)
    long_ids = make_inputs(plans["long"].taskgraph, 1)["ids"]
    with runtime.Session(plans, "numpy") as session:
        session.stage({**weights, "ids": long_ids})  # the long plan's ids only
        got = session.run(plan="long")
        want = reference(plans["long"].taskgraph, {**weights, "ids": long_ids})
        assert_outputs_match(got, want)
        with pytest.raises(InputError, match="missing"):
            session.run(plan="short")  # its ids were never given
        with pytest.raises(
            InputError, match=r"'ids' has shape \[5\]; the plans take \[6\] \(plan 'long'\)"
        ):
            session.stage({"ids": np.zeros(5, np.int64)})
        with pytest.raises(InputError, match=r"no plan 'medium'; its plans: 'long', 'short'"):
            session.run({}, plan="medium")
        with pytest.raises(InputError, match="unknown input"):
            session.stage({"nope": long_ids})


@pytest.mark.parametrize("mode", ["sequential", "streams"])
def test_closing_releases_every_buffer_without_the_garbage_collector(plans, mode):
    """The arena and the host buffer die when the session closes, with the collector off:
    nothing of them is held in a reference cycle (the interpreter's dispatch table of
    bound methods was one, so a closed session held its arena until a collection)."""
    backend = Counting(staging=True, timeout=30)
    weights = weights_of(plans["long"].taskgraph)
    gc.collect()
    gc.disable()
    try:
        session = runtime.Session(plans, backend, mode=mode)
        session.stage(weights)
        session.run({"ids": make_inputs(plans["short"].taskgraph, 0)["ids"]}, plan="short")
        assert all(ref() is not None for ref in backend.buffers)
        session.close()
        assert [ref() for ref in backend.buffers] == [None, None]
    finally:
        gc.enable()
