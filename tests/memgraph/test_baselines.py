"""Layer streaming (the ZeRO-Inference baseline): valid plans, the right transfers, the
budget respected, prefetch that overlaps, and infeasible budgets with the right `needed`."""

from __future__ import annotations

import collections
import doctest

import numpy as np
import pytest
from replay import random_inputs, replay
from streaming_cases import PROGRAMS, mlp, working_budget

import einpage as ep
import memgraph.baselines as baselines_module
import taskgraph
from einpage.errors import InfeasibleBudgetError, PlanError
from einpage.models import llama
from memgraph import NodeKind, verify
from memgraph.baselines import layer_key, layer_segments, layer_streaming_plan, streaming_peak
from memgraph.simulate import simulate

MIB = 2**20


def test_module_doctests():
    assert doctest.testmod(baselines_module).failed == 0


def weight_uses(tg) -> collections.Counter:
    """How many layers read each host input: how often layer streaming must copy it."""
    return collections.Counter(w for seg in layer_segments(tg) for w in seg.weights)


# -- layers ---------------------------------------------------------------------------------


def test_layer_key():
    assert layer_key("layers.3.attn") == layer_key("layers.3.mlp") == "layers.3"
    assert layer_key("layers.12") == "layers.12"
    assert layer_key("model.h.0.attn.c_attn") == "model.h.0"
    assert layer_key("head") == "head"
    assert layer_key("rope.tables") == "rope.tables"
    assert layer_key("") is None


def test_llama_layers_are_its_scopes_up_to_the_layer_number():
    tg = PROGRAMS["llama-tiny"]()
    segments = layer_segments(tg)
    assert [s.key for s in segments] == ["rope", "embed", "layers.0", "layers.1", "head"]
    names = [[tg[w].op.name for w in s.weights] for s in segments]
    assert names[1] == ["embed"]
    assert names[2] == [
        "layers.0.attn.norm",
        "layers.0.attn.wq",
        "layers.0.attn.wk",
        "layers.0.attn.wv",
        "layers.0.attn.wo",
        "layers.0.mlp.norm",
        "layers.0.mlp.w_gate",
        "layers.0.mlp.w_up",
        "layers.0.mlp.w_down",
    ]
    for seg in segments:  # the last use of each weight is a task of its layer that reads it
        for w, t in seg.last_use.items():
            assert t in seg.tasks and w in {tg.storage_root(i) for i in tg[t].inputs}


def test_unscoped_tasks_are_layers_of_their_own():
    tg = PROGRAMS["mlp-unscoped"]()
    segments = layer_segments(tg)
    assert all(s.key is None and len(s.tasks) == 1 for s in segments)
    assert len(segments) == sum(1 for t in tg if t.kind not in ("input", "view"))


def test_gpt2_ties_its_head_to_the_embedding_so_it_is_copied_twice():
    tg = PROGRAMS["gpt2-tiny"]()
    uses = weight_uses(tg)
    assert uses[tg.inputs["embed"]] == 2  # read by the embedding and by the LM head
    mg = layer_streaming_plan(tg, 4 * working_budget(tg))
    reloads = collections.Counter(n.tensor for n in mg.of_kind(NodeKind.RELOAD))
    assert reloads[tg.inputs["embed"]] == 2


# -- the plans --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("scale", [1.0, 1.5, 4.0])
def test_plans_verify_copy_each_weight_once_per_layer_and_fit(name, prefetch, scale):
    tg = PROGRAMS[name]()
    budget = int(working_budget(tg) * scale)
    mg = layer_streaming_plan(tg, budget, prefetch=prefetch)
    report = verify(mg)
    assert mg.budget == budget and report.peak_bytes <= budget
    reloads = collections.Counter(n.tensor for n in mg.of_kind(NodeKind.RELOAD))
    assert reloads == weight_uses(tg)
    assert not mg.of_kind(NodeKind.OFFLOAD)  # activations never leave the device
    assert mg.info["planner"] == "layer_streaming" and mg.info["prefetch"] == prefetch
    if prefetch == 0:
        assert mg.info["prefetched_layers"] == 0


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("prefetch", [0, 1])
def test_plans_compute_the_reference_outputs(name, prefetch):
    tg = PROGRAMS[name]()
    inputs = random_inputs(tg)
    expected = taskgraph.evaluate(tg, inputs)
    mg = layer_streaming_plan(tg, working_budget(tg), prefetch=prefetch)
    got = replay(mg, inputs)
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6)


def test_prefetch_hides_copies_behind_compute():
    tg = PROGRAMS["llama-tiny"]()
    budget = 4 * working_budget(tg)
    plain = simulate(layer_streaming_plan(tg, budget, prefetch=0), "cpu")
    ahead = layer_streaming_plan(tg, budget, prefetch=1)
    assert ahead.info["prefetched_layers"] == len(layer_segments(tg)) - 1
    streamed = simulate(ahead, "cpu")
    assert streamed.compute_seconds == plain.compute_seconds
    assert streamed.h2d_bytes == plain.h2d_bytes
    assert streamed.stall_seconds < plain.stall_seconds
    assert streamed.makespan < plain.makespan


def test_without_prefetch_a_layer_copies_only_after_the_previous_layer():
    """Each copy waits for the apply before the point where the policy issues it."""
    tg = PROGRAMS["mlp"]()
    mg = layer_streaming_plan(tg, 16 * MIB, prefetch=0)
    result = simulate(mg, "cpu", timeline=True)
    applies = {n.tensor: n.id for n in mg.of_kind(NodeKind.APPLY)}
    for seg_before, seg in zip(layer_segments(tg), layer_segments(tg)[1:], strict=False):
        boundary = result.node_times[applies[seg_before.tasks[-1]]][1]
        for reload in mg.of_kind(NodeKind.RELOAD):
            if reload.tensor in seg.weights:
                assert result.node_times[reload.id][0] >= boundary


def test_plans_are_deterministic():
    tg = PROGRAMS["llama-tiny"]()
    budget = 2 * working_budget(tg)
    assert layer_streaming_plan(tg, budget).to_json() == layer_streaming_plan(tg, budget).to_json()


def test_llama_7b_at_16_gib():
    tg = llama.prefill_program(llama.PRESETS["7b"], 1, 2048, "float16").build()
    mg = layer_streaming_plan(tg, "16GiB")
    verify(mg)
    assert mg.info["prefetched_layers"] == len(layer_segments(tg)) - 1
    assert mg.stats.reload_bytes == sum(tg[w].nbytes * k for w, k in weight_uses(tg).items())


# -- infeasible budgets -------------------------------------------------------------------------


def test_needed_is_a_layers_weights_plus_the_live_activations():
    tg = mlp(layers=3, width=512, batch=64)
    weight, activation = 512 * 512 * 4, 64 * 512 * 4
    # At h @ w_i: the layer's weight, h (kept for the residual) and the product.
    assert streaming_peak(tg) == (weight + 2 * activation, weight, tg.inputs["w0"] + 1)
    with pytest.raises(InfeasibleBudgetError) as err:
        layer_streaming_plan(tg, weight + 2 * activation - 256)
    assert err.value.needed == weight + 2 * activation
    assert err.value.budget == weight + 2 * activation - 256
    assert err.value.task == tg.inputs["w0"] + 1
    assert "1.0 MiB of weights and 256.0 KiB of activations" in str(err.value)
    verify(layer_streaming_plan(tg, err.value.needed))


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_needed_is_the_streaming_peak_and_enough(name):
    tg = PROGRAMS[name]()
    peak = streaming_peak(tg)[0]
    with pytest.raises(InfeasibleBudgetError) as err:
        layer_streaming_plan(tg, peak - 1)
    assert err.value.needed == peak
    verify(layer_streaming_plan(tg, working_budget(tg)))


def test_a_fragmented_arena_reports_the_budget_that_works():
    tg = PROGRAMS["llama-tiny"]()
    peak = streaming_peak(tg)[0]
    with pytest.raises(InfeasibleBudgetError, match="fragments") as err:
        layer_streaming_plan(tg, peak)  # the live bytes fit, their layout does not
    assert err.value.needed > peak
    verify(layer_streaming_plan(tg, err.value.needed, prefetch=0))
    with pytest.raises(InfeasibleBudgetError):
        layer_streaming_plan(tg, err.value.needed - 256, prefetch=0)


def test_bad_prefetch_is_rejected():
    with pytest.raises(PlanError, match="prefetch must be an int >= 0"):
        layer_streaming_plan(mlp(), "16MiB", prefetch=-1)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_a_weight_shared_by_consecutive_layers_is_copied_once_per_layer(prefetch):
    prog = ep.Program("shared")
    h = prog.input("x", (8, 64))
    w = prog.input("w", (64, 64), role="weight")
    for i in range(3):
        with prog.scope(f"layers.{i}"):
            h = ep.relu(h @ w) + h @ prog.input(f"u{i}", (64, 64), role="weight")
    prog.output(h, "y")
    tg = prog.build()
    mg = layer_streaming_plan(tg, 16 * working_budget(tg), prefetch=prefetch)
    verify(mg)
    reloads = collections.Counter(n.tensor for n in mg.of_kind(NodeKind.RELOAD))
    assert reloads[tg.inputs["w"]] == 3
    inputs = random_inputs(tg)
    np.testing.assert_allclose(replay(mg, inputs)["y"], taskgraph.evaluate(tg, inputs)["y"])


def test_inputs_that_are_outputs_or_unused():
    prog = ep.Program("odd")
    x = prog.input("x", (4, 4))
    w = prog.input("w", (4, 4), role="weight")
    prog.input("unused", (4,))
    prog.input("unused_weight", (4,), role="weight")
    with prog.scope("layers.0"):
        prog.output(x @ w, "y")
    prog.output(w, "w_out")
    prog.output(x, "x_out")
    tg = prog.build()
    for prefetch in (0, 1):
        mg = layer_streaming_plan(tg, "64KiB", prefetch=prefetch)
        verify(mg)
        inputs = random_inputs(tg)
        got, expected = replay(mg, inputs), taskgraph.evaluate(tg, inputs)
        for key in expected:
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-6)
