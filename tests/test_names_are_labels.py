"""Names are labels for people: a generation program and a training step with every input
and output name, label and scope replaced by strings that say nothing – the facts kept –
are classified, planned and run as the originals, and hand their state on the same way.

The step loop of a generation feeds some inputs by name – the prompt, the positions, the
mask, the weights, the position tables: what a caller passes – and reads the ids by
name; everything it learns about the KV cache (which input is page P of layer L, which
output holds a layer's new keys) comes from facts, so there those names are replaced too.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import numpy as np
import pytest

import einpage as ep
import runtime
import taskgraph
from einpage.models import llama
from einpage.models.generation import generation_inputs
from einpage.program.optim import AdamW
from einpage.workloads.generation import (
    GenerationSpec,
    Planning,
    StepPlans,
    Transfers,
    plan_generation,
)
from einpage.workloads.training import next_inputs, training_graph, training_inputs
from memgraph import MemGraph
from taskgraph import GraphBuilder, Input, TaskGraph
from taskgraph.facts import KVEntries, fact_of, is_kv_page

CFG = llama.PRESETS["tiny"]
RNG = np.random.default_rng(5)


def opaque(
    tg: TaskGraph, keep: Collection[str] = (), prefix: str = ""
) -> tuple[TaskGraph, dict, dict]:
    """`tg` with its input and output names (but those in `keep`), labels and scopes
    replaced by opaque strings (starting with `prefix`); ops, edges and facts kept.
    Returns the graph and the input and output names, old to new."""
    inputs = {n: n if n in keep else f"{prefix}i{k:03x}" for k, n in enumerate(tg.inputs)}
    outputs = {n: n if n in keep else f"{prefix}o{k:03x}" for k, n in enumerate(tg.outputs)}
    builder = GraphBuilder("q")
    for task in tg:
        op = replace(task.op, name=inputs[task.op.name]) if isinstance(task.op, Input) else task.op
        label = f"t{task.id:x}"
        builder.add(op, task.inputs, task.shape, task.dtype, f"s{task.id % 5}", label, task.facts)
    for name, task_id in tg.outputs.items():
        builder.output(task_id, outputs[name])
    return builder.build(), inputs, outputs


def classification(mg: MemGraph) -> list[tuple[int, str, str, str]]:
    """What the memory map shows of each residency: tensor, kind, arrival, departure."""
    return [(s.tensor, s.kind, s.arrival, s.departure) for s in mg.residencies.stays]


def same_plan_reading(original, renamed_tg: TaskGraph, **options):
    """`renamed_tg` compiled under the bytes `original` (a `Compiled`) was planned in."""
    return ep.compile(renamed_tg, original.plan.budget, **options)


@pytest.fixture(scope="module")
def spec() -> GenerationSpec:
    return GenerationSpec(llama.FAMILY, CFG, batch=2, prompt_len=5, new_tokens=5, page_size=2)


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return {
        k: (RNG.standard_normal(s) * 0.1).astype("float32") for k, s in CFG.weight_shapes().items()
    }


def test_an_unrolled_generation_renamed_is_classified_planned_and_run_the_same(spec, weights):
    plan = plan_generation(spec, "40%")
    tg = plan.compiled.program
    renamed, inputs, outputs = opaque(tg)
    assert not set(inputs.values()) & set(tg.inputs)  # every name replaced
    compiled = same_plan_reading(plan.compiled, renamed)
    mg, theirs = compiled.plan, plan.plan
    assert sum(is_kv_page(t) for t in renamed) == sum(is_kv_page(t) for t in tg) > 0
    assert classification(mg) == classification(theirs)
    assert Transfers.of(mg) == Transfers.of(theirs) and Transfers.of(mg).kv_paged > 0
    prompt = RNG.integers(0, CFG.vocab_size, (spec.batch, spec.prompt_len))
    want = plan.run(weights, prompt).ids
    arrays = generation_inputs(llama.FAMILY, CFG, prompt, spec.new_tokens, weights=weights)
    got = runtime.run(mg, {inputs[k]: v for k, v in arrays.items()}, backend="numpy")
    np.testing.assert_array_equal(got[outputs["ids"]], want)


def test_step_plans_hand_the_kv_cache_over_by_facts_not_names(spec, weights):
    plans = plan_generation(spec, "60%", Planning(way="steps"))
    interface = {"tokens", "positions", "kv.mask", "gumbel", "ids", "logits"}
    interface |= set(weights) | set(llama.position_inputs(CFG, spec.positions, spec.dtype))

    def renamed(compiled, prefix):
        """The plan renamed; names unique to it (one session runs every plan, and shares
        inputs by name: `test_plans_sharing_a_name_for_two_tensors_are_refused`)."""
        program = compiled.program
        tg, inputs, outputs = opaque(program, keep=interface, prefix=prefix)
        pages = [inputs[n] for n, i in program.inputs.items() if is_kv_page(program[i])]
        entries = [outputs[n] for n, i in program.outputs.items() if fact_of(program[i], KVEntries)]
        assert pages or entries
        assert not set(pages + entries) & (set(program.inputs) | set(program.outputs))
        return same_plan_reading(compiled, tg, outputs="host")

    prefill = renamed(plans.prefill, "p")
    assert any(isinstance(f, KVEntries) for t in prefill.program for f in t.facts)
    decoders = {key: renamed(c, f"d{k}") for k, (key, c) in enumerate(plans.decoders.items())}
    steps = StepPlans(spec, prefill, decoders, plans.chunks, plans.planning_seconds)
    for theirs, ours in zip(plans.plans.values(), steps.plans.values(), strict=True):
        assert classification(ours.plan) == classification(theirs.plan)
    assert steps.stats().transfers == plans.stats().transfers
    prompt = RNG.integers(0, CFG.vocab_size, (spec.batch, spec.prompt_len))
    want = plans.run(weights, prompt).ids
    np.testing.assert_array_equal(steps.run(weights, prompt).ids, want)
    unrolled = plan_generation(spec, "100%").run(weights, prompt).ids
    np.testing.assert_array_equal(want, unrolled)  # the hand-over is right, not just equal


def test_plans_sharing_a_name_for_two_tensors_are_refused(spec):
    """One session runs every plan of a generation and shares inputs by name: two decode
    plans whose page inputs were renamed each from "i000" on name different pages alike,
    which a session refuses, naming the input and both plans' facts."""
    plans = plan_generation(spec, "60%", Planning(way="steps"))
    keep = {"tokens", "positions", "kv.mask"}
    renamed = {
        key: memgraph_of(opaque(c.program, keep=keep)[0], c.plan.budget)
        for key, c in plans.decoders.items()
    }
    with pytest.raises(ep.InputError, match="a name must mean one tensor in every plan"):
        runtime.Session(renamed, "numpy")


def memgraph_of(tg: TaskGraph, budget: int) -> MemGraph:
    return ep.compile(tg, budget, outputs="host").plan


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_training_step_renamed_hands_its_state_on_the_same(dtype, weights):
    opt = AdamW(lr=1e-2)
    tg = training_graph(CFG, 2, 6, opt, dtype)
    renamed, inputs, outputs = opaque(tg)
    tokens = RNG.integers(0, CFG.vocab_size, (2, 6))
    arrays = training_inputs(CFG, opt, tokens, np.roll(tokens, -1, 1), weights, dtype=dtype)
    want = next_inputs(tg, taskgraph.evaluate(tg, arrays))
    got = next_inputs(
        renamed, taskgraph.evaluate(renamed, {inputs[k]: v for k, v in arrays.items()})
    )
    assert set(got) == {inputs[k] for k in want}
    states = {n for n, i in tg.inputs.items() if tg[i].op.role in ("weight", "state")}
    assert set(want) == states  # every weight and state gets its next value
    for name, value in want.items():
        np.testing.assert_array_equal(got[inputs[name]], value)
    if dtype == "float32":  # planned, offloading: the same memory map and the same hand-over
        compiled = ep.compile(tg, "40%", outputs="host")
        ours = same_plan_reading(compiled, renamed, outputs="host")
        assert classification(ours.plan) == classification(compiled.plan)
        out = runtime.run(ours.plan, {inputs[k]: v for k, v in arrays.items()}, backend="numpy")
        planned = next_inputs(ours.plan.taskgraph, out)
        theirs = next_inputs(tg, runtime.run(compiled.plan, arrays, backend="numpy"))
        assert set(planned) == {inputs[k] for k in theirs}
        for name, value in theirs.items():
            np.testing.assert_array_equal(planned[inputs[name]], value)
