"""Micro-batches (`taskgraph.microbatch.stack`): a stacked graph computes what each graph
computes alone (against `taskgraph.evaluate` of each), reads each shared weight once,
keeps every task's facts, scope, label and workspace, refuses a weight that differs
between graphs; and, placed on a pipeline of two devices and simulated, m micro-batches
take less than m times one (the pipe fills)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import einsum_programs, program_inputs
from test_placement_driver import assert_same_outputs, chain, llama_case, run_split

import einpage as ep
import taskgraph
from einpage.models import llama
from einpage_core.errors import GraphError
from memgraph.cost import CostModel
from memgraph.multi import plan_devices, verify_multi
from memgraph.placement import place
from memgraph.simulate_multi import simulate_multi
from taskgraph.facts import Gradient, Update, fact_of
from taskgraph.microbatch import shared_weights, stack
from taskgraph.nodes import Input
from taskgraph.partition import partition


def weight_names(tg):
    """The names of `tg`'s inputs with role "weight" (a typed field)."""
    return [n for n, i in tg.inputs.items() if tg[i].op.role == "weight"]


def stacked_equals_each_alone(graphs, arrays):
    """Evaluate the stack of `graphs` on each graph's `arrays` and compare every output,
    bit for bit, with `taskgraph.evaluate` of that graph alone."""
    stacked = stack(graphs)
    got = taskgraph.evaluate(stacked.tg, stacked.stacked_inputs(arrays))
    per_graph = stacked.split_outputs(got)
    for k, (graph, values) in enumerate(zip(graphs, arrays, strict=True)):
        want = taskgraph.evaluate(graph, values)
        assert sorted(per_graph[k]) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(per_graph[k][name], want[name], err_msg=f"{k}:{name}")
    return stacked


# -- LLaMA-tiny prefill ----------------------------------------------------------------


def test_two_llama_prefills_of_batch_one_equal_each_alone_and_share_every_weight():
    cfg = llama.PRESETS["tiny"]
    tg, first = llama_case(cfg, batch=1, seq=5, seed=0)
    _, second = llama_case(cfg, batch=1, seq=5, seed=1)
    for name in weight_names(tg):  # the same weights, other tokens
        second[name] = first[name]
    assert not np.array_equal(first["tokens"], second["tokens"])
    stacked = stacked_equals_each_alone([tg, tg], [first, second])

    weights = weight_names(tg)
    assert weights and weight_names(stacked.tg) == weights  # each once, by its own name
    others = [n for n in tg.inputs if n not in weights]
    assert len(stacked.tg.inputs) == len(weights) + 2 * len(others)
    for k in (0, 1):
        for name in others:
            assert stacked.inputs[k, name] == f"{name}@{k}"
        assert stacked.outputs[k, "logits"] == f"logits@{k}"
    assert len(stacked.tg) == 2 * len(tg) - len(weights)
    assert stacked.tg.total_flops == 2 * tg.total_flops


def test_order_is_graph_0_then_graph_1_each_in_its_own_order():
    cfg = llama.PRESETS["tiny"]
    tg, _ = llama_case(cfg, batch=1, seq=3)
    stacked = stack([tg, tg, tg])
    ids = stacked.task_ids
    assert list(ids[0]) == list(range(len(tg)))  # graph 0 first, as it was
    for k in (1, 2):
        computed = [ids[k][t.id] for t in tg if not isinstance(t.op, Input)]
        assert computed == sorted(computed)
        assert min(computed) > max(ids[k - 1][t.id] for t in tg if t.is_compute)


def test_tasks_keep_facts_scopes_labels_and_workspaces():
    prog = ep.Program("facts")
    x = prog.input("x", (2, 4))
    w = prog.input("w", (4, 4), role="weight")
    h = ep.tanh(x @ w)
    g = prog.fact(ep.exp(h), Gradient(h.id))  # a fact naming another task
    prog.output(g, "g")
    tg = prog.build().with_workspaces({g.id: 64})
    stacked = stack([tg, tg])
    assert sum(1 for t in stacked.tg if fact_of(t, Gradient)) == 2
    for k in (0, 1):
        new = stacked.task_ids[k]
        for task in tg:
            mine = stacked.tg[new[task.id]]
            kept = ("scope", "label", "workspace", "kind", "shape", "dtype")
            assert [getattr(mine, a) for a in kept] == [getattr(task, a) for a in kept]
        fact = fact_of(stacked.tg[new[g.id]], Gradient)
        assert fact == Gradient(new[h.id])  # graph k's own h, renumbered
    llama_tg, _ = llama_case(llama.PRESETS["tiny"], batch=1, seq=3)
    softmaxes = [t.id for t in llama_tg if t.facts]
    stacked = stack([llama_tg, llama_tg])
    for k in (0, 1):
        for t in softmaxes:
            assert stacked.tg[stacked.task_ids[k][t]].facts == llama_tg[t].facts


@pytest.mark.parametrize(
    "shape, dtype, role, said",
    [
        ((4, 8), "float32", "weight", "float32[4, 4]"),
        ((4, 4), "float16", "weight", "float16[4, 4]"),
        ((4, 4), "float32", "activation", "activation"),
    ],
)
def test_a_weight_that_differs_between_graphs_is_an_error_naming_it_and_both(
    shape, dtype, role, said
):
    def program(shape, dtype, role):
        prog = ep.Program("p")
        x = prog.input("x", (2, 4), dtype)
        w = prog.input("w", shape, dtype, role=role)
        prog.output(x @ w, "y")
        return prog.build()

    base = program((4, 4), "float32", "weight")
    other = program(shape, dtype, role)
    with pytest.raises(GraphError, match=r"weight 'w' differs between stacked graphs 0 and 2") as e:
        stack([base, base, other])
    assert "float32[4, 4]" in str(e.value) and said in str(e.value)


def test_an_activation_or_a_weight_missing_somewhere_is_not_shared():
    prog = ep.Program("p")
    x = prog.input("x", (2, 4))
    prog.output(x @ prog.input("w", (4, 4), role="weight"), "y")
    with_w = prog.build()
    prog = ep.Program("q")
    x = prog.input("x", (2, 4))
    prog.output(x @ prog.input("v", (4, 4), role="weight"), "y")
    with_v = prog.build()
    assert shared_weights([with_w, with_v]) == []
    stacked = stack([with_w, with_v])
    assert list(stacked.tg.inputs) == ["x@0", "w@0", "x@1", "v@1"]
    rng = np.random.default_rng(0)
    arrays = [{n: rng.standard_normal(g[i].shape).astype(np.float32) for n, i in g.inputs.items()}
              for g in (with_w, with_v)]  # fmt: skip
    stacked_equals_each_alone([with_w, with_v], arrays)


def test_a_taken_name_gets_a_fresh_one():
    prog = ep.Program("p")
    x = prog.input("x", (2, 4))
    prog.output(x @ prog.input("x@1", (4, 4), role="weight"), "y")
    tg = prog.build()
    stacked = stack([tg, tg])
    assert stacked.inputs[1, "x"] == "x@1#1" and stacked.inputs[1, "x@1"] == "x@1"


def test_an_update_of_a_shared_weight_is_refused():
    prog = ep.Program("step")
    x = prog.input("x", (2, 4))
    w = prog.input("w", (4, 4), role="weight")
    grad = (x.T @ x) * 0.1  # (not a real gradient: a tensor of w's shape)
    prog.output(prog.fact(w - grad, Update(w.id)), "w.next")
    tg = prog.build()
    stack([tg])  # one graph: its own update
    with pytest.raises(GraphError, match=r"graph 1's %\d+ is the update of weight 'w'"):
        stack([tg, tg])


def test_bad_arguments():
    with pytest.raises(GraphError, match="at least one"):
        stack([])
    with pytest.raises(GraphError, match="graph 1 is a str"):
        stack([chain()[0], "graph"])
    tg, arrays = chain()
    stacked = stack([tg, tg])
    with pytest.raises(GraphError, match="1 input sets given for 2"):
        stacked.stacked_inputs([arrays])
    with pytest.raises(GraphError, match="input 'x' of stacked graph 1 is not given"):
        stacked.stacked_inputs([arrays, {}])
    assert repr(stacked).startswith("<Stacked graphs=2 shared=4 ")


@settings(max_examples=25, deadline=None)
@given(einsum_programs(max_tasks=12), st.integers(1, 3), st.integers(0, 2**16))
def test_random_programs_stacked_equal_each_alone(tg, graphs, seed):
    arrays = [program_inputs(tg, seed + k) for k in range(graphs)]
    shared = shared_weights([tg] * graphs)
    for k in range(1, graphs):
        for name in shared:
            arrays[k][name] = arrays[0][name]
    stacked = stacked_equals_each_alone([tg] * graphs, arrays)
    assert shared == weight_names(tg)
    assert len(stacked.tg) == graphs * len(tg) - (graphs - 1) * len(shared)


# -- on a pipeline: the pipe fills -----------------------------------------------------

# Compute only: transfers (and their latencies) free, no device-memory roofline, so each
# pipeline stage takes its FLOPs' time and nothing else.
COMPUTE_ONLY = CostModel(
    "compute-only", flops_per_s=1e6, device_bytes_per_s=math.inf, h2d_bytes_per_s=1e18,
    d2h_bytes_per_s=1e18,
)  # fmt: skip


def test_stacked_micro_batches_on_two_devices_equal_the_reference_and_fill_the_pipe():
    cfg = llama.PRESETS["tiny"]
    tg, first = llama_case(cfg, batch=1, seq=4, seed=0)
    cases = [first]
    for seed in (1, 2, 3):
        arrays = llama_case(cfg, batch=1, seq=4, seed=seed)[1]
        cases.append({**arrays, **{n: first[n] for n in weight_names(tg)}})

    one = plan_devices(tg, 2, "100%", cost_model=COMPUTE_ONLY)
    verify_multi(one)
    single = simulate_multi(one, COMPUTE_ONLY).makespan
    stage = [sum(t.flops for t in part.tg) / COMPUTE_ONLY.flops_per_s for part in one.placed.parts]
    assert single <= sum(stage) * (1 + 1e-9)  # one micro-batch: stage after stage
    for m in (2, 4):
        stacked = stack([tg] * m)
        placed = place(stacked.tg, 2)
        got = run_split(placed, stacked.stacked_inputs(cases[:m]))
        for k, outputs in enumerate(stacked.split_outputs(got)):
            assert_same_outputs(outputs, taskgraph.evaluate(tg, cases[k]))
        mp = plan_devices(placed, 2, "100%", cost_model=COMPUTE_ONLY)
        verify_multi(mp)
        piped = simulate_multi(mp, COMPUTE_ONLY).makespan
        assert piped < m * single
        # both stages busy at once: about (m + 1) stages' time, far under m * single
        assert piped <= sum(stage) + (m - 1) * max(stage) * (1 + 1e-9)


def test_partitioned_graphs_keep_their_blocks_each_graph_naming_its_own_originals():
    tg, first = llama_case(llama.PRESETS["tiny"], batch=1, seq=8, seed=0)
    _, second = llama_case(llama.PRESETS["tiny"], batch=1, seq=8, seed=1)
    second.update({n: first[n] for n in weight_names(tg)})
    blocks = partition(tg, "24KiB")
    assert any(t.block is not None for t in blocks)
    stacked = stacked_equals_each_alone([blocks, blocks], [first, second])
    originals = []
    for k in (0, 1):
        mine = set()
        for task in blocks:
            new = stacked.tg[stacked.task_ids[k][task.id]]
            if task.block is None:
                assert new.block is None
                continue
            assert (new.block.kind, new.block.starts, new.block.shape, new.block.reduced) == (
                task.block.kind, task.block.starts, task.block.shape, task.block.reduced,
            )  # fmt: skip
            if k == 0 or stacked.task_ids[1][task.id] != stacked.task_ids[0][task.id]:
                mine.add(new.block.of)  # (a shared weight is graph 0's)
        originals.append(mine)
    assert originals[0] and not originals[0] & originals[1]  # no original named twice
