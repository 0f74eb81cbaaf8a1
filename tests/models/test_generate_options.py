"""`generate()` with a few arguments and three records (issue 22): `Sampling`, `Planning`
and `Running` check themselves when made, the keywords of the old signature say where
they went, weights are taken by their names only (nothing guessed from keys), and the
cost model a `Planning` names is the one the plans are made and simulated for."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from einpage.models import llama
from einpage.models.decode import Sampling
from einpage.models.errors import GenerationError
from einpage.workloads.generate import Running, generate
from einpage.workloads.generation import GenerationSpec, Planning, plan_generation

CFG = llama.PRESETS["tiny"]
PROMPT = np.zeros((1, 4), np.int64)


def weights_of(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return {
        name: (0.02 * rng.standard_normal(shape)).astype(np.float32)
        for name, shape in cfg.weight_shapes().items()
    }


# -- the records check themselves -------------------------------------------------------


@pytest.mark.parametrize(
    "record, fields, words",
    [
        (Planning, {"way": "sideways"}, r"Planning: way must be one of \('unrolled', 'steps'\), "),
        (Planning, {"bucket_pages": 0}, "Planning: bucket_pages must be a positive int, got 0"),
        (Planning, {"chunk_steps": 2.5}, "Planning: chunk_steps must be a positive int, got 2.5"),
        (Planning, {"chunk_steps": True}, "Planning: chunk_steps must be a positive int, got True"),
        (Planning, {"cost_model": "abacus"}, "Planning: unknown cost model 'abacus'; presets: "),
        (Planning, {"options": ["eviction"]}, "Planning: options must be a mapping"),
        (Planning, {"options": {"evict": "lru"}}, "options has no 'evict'; it takes partition, "),
        (Planning, {"options": {"eviction": "mru"}}, "Planning: unknown eviction policy 'mru'"),
        (Planning, {"options": {"lookahead": -1}}, "Planning: lookahead must be a number of st"),
        (Planning, {"options": {"cost_model": "cpu"}}, r"give Planning\(cost_model='cpu'\)"),
        (Planning, {"options": {"budget": "1MiB"}}, "the budget is an argument of generate"),
        (Running, {"backend": "tpu"}, "Running: backend must be one of 'auto', 'numpy', 'cupy'"),
        (Running, {"mode": "backwards"}, "Running: unknown mode 'backwards'; valid: 'sequential'"),
        (Sampling, {"seed": -1}, "Sampling: seed must be an int >= 0, got -1"),
        (Sampling, {"seed": 1.5}, "Sampling: seed must be an int >= 0, got 1.5"),
        (Sampling, {"seed": True}, "Sampling: seed must be an int >= 0, got True"),
    ],
)
def test_each_record_checks_itself_when_made(record, fields, words):
    with pytest.raises(GenerationError, match=words):
        record(**fields)


def test_a_plannings_options_cannot_change_after_it_is_checked():
    given = {"eviction": "lru"}
    planning = Planning(options=given)
    given["eviction"] = "not a policy"
    assert planning.options == {"eviction": "lru"}
    with pytest.raises(TypeError):
        planning.options["eviction"] = "mru"  # type: ignore[index]


def test_the_records_are_where_generate_is_imported_from():
    import einpage.generate as public
    import einpage.workloads.generate as workloads

    for module in (public, workloads):
        assert module.Sampling is Sampling and module.Planning is Planning
        assert module.Running is Running and module.generate is generate
        assert {"Sampling", "Planning", "Running", "generate"} <= set(module.__all__)


# -- the old signature ------------------------------------------------------------------


@pytest.mark.parametrize(
    "keywords, words",
    [
        ({"way": "steps"}, "way= is now plan=Planning(way='steps')"),
        ({"chunk_steps": 8}, "chunk_steps= is now plan=Planning(chunk_steps=8)"),
        ({"bucket_pages": 2}, "bucket_pages= is now plan=Planning(bucket_pages=2)"),
        ({"cost_model": "cpu"}, "cost_model= is now plan=Planning(cost_model='cpu')"),
        ({"eviction": "lru"}, "eviction= is now plan=Planning(options={'eviction': 'lru'})"),
        ({"partition": "off"}, "partition= is now plan=Planning(options={'partition': 'off'})"),
        ({"backend": "numpy"}, "backend= is now run=Running(backend='numpy')"),
        ({"mode": "random"}, "mode= is now run=Running(mode='random')"),
        ({"seed": 3}, "seed= is now sampling=Sampling(..., seed=3)"),
        ({"colour": "red"}, "no keyword 'colour' (it takes model, prompt, new_tokens, budget, "),
    ],
)
def test_an_old_keyword_of_generate_says_where_it_went(keywords, words):
    with pytest.raises(GenerationError) as caught:
        generate(CFG, PROMPT, 3, "1MiB", run=None, **keywords)
    assert str(caught.value).startswith("generate: ") and words in str(caught.value)


@pytest.mark.parametrize("run", [True, False])
def test_run_true_or_false_says_what_replaced_it(run):
    with pytest.raises(GenerationError, match=r"run=False is now run=None \(plan only\), run=Tr"):
        generate(CFG, PROMPT, 3, "1MiB", weights=weights_of(CFG), run=run)


def test_weights_where_the_prompt_now_goes_are_refused():
    """The old positional order was (model, weights, prompt, new_tokens, budget)."""
    with pytest.raises(GenerationError, match="the prompt is a mapping, weights perhaps"):
        generate(CFG, weights_of(CFG), PROMPT, 3)


@pytest.mark.parametrize(
    "args, keywords, words",
    [
        (("steps",), {}, r"plan_generation takes a Planning after the budget, got 'steps': Pl"),
        ((), {"way": "steps"}, "way= is now Planning(way='steps')"),
        ((), {"chunk_steps": 3}, "chunk_steps= is now Planning(chunk_steps=3)"),
        ((), {"eviction": "lru"}, "eviction= is now Planning(options={'eviction': 'lru'})"),
    ],
)
def test_an_old_call_of_plan_generation_says_where_its_arguments_went(args, keywords, words):
    spec = GenerationSpec(llama.FAMILY, CFG, 1, 4, 3, page_size=4)
    with pytest.raises(GenerationError) as caught:
        plan_generation(spec, "1MiB", *args, **keywords)
    assert words in str(caught.value)


# -- weights by their names -------------------------------------------------------------


def test_weights_with_a_name_more_or_less_are_refused_naming_it():
    """A mapping must have the program's weight names, no more and no fewer: an extra key
    used to be ignored (any superset passed as the program's weights)."""
    weights = weights_of(CFG)
    extra = {**weights, "lm_head.bias": np.zeros(CFG.vocab_size, np.float32)}
    with pytest.raises(GenerationError, match=r"exactly .* not the program's: 'lm_head.bias'"):
        generate(CFG, prompt=PROMPT, new_tokens=2, budget="1MiB", weights=extra)
    fewer = {k: v for k, v in weights.items() if k != "norm"}
    with pytest.raises(GenerationError, match=r"exactly .*: missing 'norm'$"):
        generate(CFG, prompt=PROMPT, new_tokens=2, budget="1MiB", weights=fewer)


# -- what the records mean --------------------------------------------------------------


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_the_cost_model_is_the_one_the_plans_are_made_and_simulated_for(way):
    """It used to reach the stats only: the plans' prefetches were timed on the default
    machine whatever the cost model (the CLI's --cost-model says 'prefetching and
    tokens/s')."""
    out = generate(CFG, PROMPT, 3, "60%", plan=Planning(way=way, cost_model="cpu"), run=None)
    assert {c.plan.info["cost_model"] for c in out.plan.plans.values()} == {"cpu"}
    assert out.stats.cost_model == "cpu" == out.plan.stats().cost_model
    default = generate(CFG, PROMPT, 3, "60%", plan=Planning(way=way), run=None)
    assert {c.plan.info["cost_model"] for c in default.plan.plans.values()} == {"h100-pcie5"}


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_planning_options_reach_every_plan(way):
    planning = Planning(way=way, options={"eviction": "lru", "lookahead": 3})
    out = generate(CFG, PROMPT, 3, "60%", plan=planning, run=None)
    for compiled in out.plan.plans.values():
        info = compiled.plan.info
        assert (info["eviction"], info["lookahead"]) == ("lru", 3)
        assert info["outputs"] == ("host" if way == "steps" else "device")


def test_the_seed_is_the_samplings_and_a_plan_can_run_again_with_another():
    spec = GenerationSpec(llama.FAMILY, CFG, 2, 4, 5, page_size=4, sampling=Sampling(top_k=8))
    weights, prompt = weights_of(CFG), np.arange(8).reshape(2, 4)
    plan = plan_generation(spec, "100%")
    first = plan.run(weights, prompt).ids
    again = plan.run(weights, prompt, seed=1).ids
    seeded = replace(spec, sampling=Sampling(top_k=8, seed=1))
    np.testing.assert_array_equal(plan_generation(seeded, "100%").run(weights, prompt).ids, again)
    np.testing.assert_array_equal(plan.run(weights, prompt, seed=0).ids, first)
    assert not np.array_equal(first, again)
    with pytest.raises(GenerationError, match="seed must be an int >= 0, got -2"):
        plan.run(weights, prompt, seed=-2)
