"""Greedy generation equals Hugging Face `generate(do_sample=False)`, token for token.

Small random LLaMA (multi-head, grouped-query with a tied head, multi-query) and GPT-2
models (`hf_models`) generate from random prompts – prompt lengths that are and are not
multiples of the page size – planned both ways (one unrolled plan; step plans per
length bucket, of one step or a chunk of steps) under budgets that force KV pages and
weights off the device, and run on the NumPy runtime in sequential, streams and random
order. Each step's logits stay within the prefill tests' tolerance of Hugging Face's.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import TOLERANCE, hf_gpt2, hf_llama, relative_error  # noqa: E402

import taskgraph  # noqa: E402
from einpage.models import FAMILIES, gpt2, llama  # noqa: E402
from einpage.models.generation import generation_inputs  # noqa: E402
from einpage.workloads.generation import GenerationSpec, Planning, plan_generation  # noqa: E402

torch.set_num_threads(1)

MODES = ("sequential", "streams", "random")
CASES = [(1, 5, 6, 4), (2, 7, 5, 4), (3, 4, 4, 2), (2, 8, 3, 4)]
"""(batch, prompt_len, new_tokens, page_size): prompts of 5 and 7 end in a partial page."""
MODELS = [("llama", "mha"), ("llama", "gqa-tied"), ("llama", "mqa"), ("gpt2", "base")]
BUDGETS = ("25%", "20%", "16%", "13%")
"""Of the unrolled plan's resident peak, tried in turn: the first where KV pages are
offloaded and reloaded and weights are streamed more than once is the one tested."""


@functools.cache
def model_of(family: str, variant: str):
    """(HF model, our family module, config, weights)."""
    hf = hf_llama(variant) if family == "llama" else hf_gpt2(variant)
    module = llama if family == "llama" else gpt2
    cfg = module.FAMILY.config.from_hf(hf.config)
    return hf, module, cfg, module.weights_from_state_dict(cfg, hf.state_dict())


@functools.cache
def reference(family: str, variant: str, batch: int, prompt_len: int, new_tokens: int):
    """(prompt, HF's new ids [batch, new_tokens], HF's logits [batch, new_tokens, vocab])."""
    hf, _, cfg, _ = model_of(family, variant)
    tokens = np.random.default_rng(prompt_len + 10 * batch).integers(
        0, cfg.vocab_size, (batch, prompt_len)
    )
    with torch.no_grad():
        out = hf.generate(
            torch.from_numpy(tokens),
            attention_mask=torch.ones(tokens.shape, dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=cfg.vocab_size,  # no id: generation never stops early
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ids = out.sequences.numpy()[:, prompt_len:]
    return tokens, ids, torch.stack(out.logits, 1).numpy()


def spec_of(family, variant, batch, prompt_len, new_tokens, page_size) -> GenerationSpec:
    _, module, cfg, _ = model_of(family, variant)
    return GenerationSpec(
        module.FAMILY, cfg, batch, prompt_len, new_tokens, page_size=page_size, logits=True
    )


def check_run(plan, family, variant, case) -> None:
    _, _, cfg, weights = model_of(family, variant)
    tokens, want_ids, want_logits = reference(family, variant, *case[:3])
    for mode in MODES:
        out = plan.run(weights, tokens, mode=mode, run_seed=7)
        np.testing.assert_array_equal(out.ids, want_ids, err_msg=mode)
        assert relative_error(out.logits, want_logits) <= TOLERANCE, mode


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-p{}-n{}-page{}".format(*c))
@pytest.mark.parametrize("family, variant", MODELS)
def test_unrolled_greedy_generation_equals_transformers(family, variant, case):
    spec = spec_of(family, variant, *case)
    weight_bytes = 4 * spec.cfg.num_parameters()
    for budget in BUDGETS:
        plan = plan_generation(spec, budget, Planning(way="unrolled"))
        moved = plan.stats().transfers
        if moved.kv_offload and moved.kv_reload and moved.weight_reload > weight_bytes:
            break
    else:
        pytest.fail(f"no budget of {BUDGETS} pages the KV cache and streams the weights")
    check_run(plan, family, variant, case)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: "b{}-p{}-n{}-page{}".format(*c))
@pytest.mark.parametrize("family, variant", MODELS)
def test_step_plans_generate_the_same_tokens(family, variant, case):
    plan = plan_generation(spec_of(family, variant, *case), "40KiB", Planning(way="steps"))
    assert len(plan.decoders) >= 2, "the steps should cross a page boundary"
    moved = plan.stats().transfers
    assert moved.kv_reload > 0 and moved.weight_reload > 0
    check_run(plan, family, variant, case)


def test_buckets_of_several_pages_serve_several_lengths():
    case = (2, 7, 5, 2)
    plan = plan_generation(
        spec_of("llama", "gqa-tied", *case), "40KiB", Planning(way="steps", bucket_pages=4)
    )
    assert sorted(plan.decoders) == [(4, 1), (8, 1)]  # lengths 7..10: 4 and 5 pages of 2
    check_run(plan, "llama", "gqa-tied", case)


@pytest.mark.parametrize("family, variant", [("llama", "gqa-tied"), ("gpt2", "base")])
def test_chunks_of_steps_generate_the_same_tokens(family, variant):
    """Decode plans of 3 steps each (and a shorter last chunk) across page boundaries."""
    case = (2, 5, 8, 2)
    plan = plan_generation(
        spec_of(family, variant, *case), "48KiB", Planning(way="steps", chunk_steps=3)
    )
    assert [(c.first, c.steps, c.pages) for c in plan.chunks] == [(1, 3, 3), (4, 3, 4), (7, 1, 6)]
    check_run(plan, family, variant, case)


def test_the_program_evaluates_to_the_same_tokens():
    """The reference evaluator on the unrolled program: no planning involved."""
    family, variant, case = "llama", "gqa-tied", CASES[1]
    _, module, cfg, weights = model_of(family, variant)
    tokens, want_ids, want_logits = reference(family, variant, *case[:3])
    tg = spec_of(family, variant, *case).generation_program().build()
    inputs = generation_inputs(module.FAMILY, cfg, tokens, case[2], weights=weights)
    out = taskgraph.evaluate(tg, inputs)
    np.testing.assert_array_equal(out["ids"], want_ids)
    assert relative_error(out["logits"], want_logits) <= TOLERANCE


def test_one_new_token_is_the_prefill_argmax():
    family, variant = "gpt2", "base"
    _, _, cfg, weights = model_of(family, variant)
    tokens, want_ids, _ = reference(family, variant, 2, 7, 1)
    for way in ("unrolled", "steps"):
        plan = plan_generation(spec_of(family, variant, 2, 7, 1, 4), "1MiB", Planning(way=way))
        np.testing.assert_array_equal(plan.run(weights, tokens).ids, want_ids)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_builds_generation_and_decode_programs(name):
    """A family with a decoder gets both programs from the shared code (random weights:
    the unrolled program and the step loop agree on the tokens)."""
    family = FAMILIES[name]
    cfg = family.presets["tiny"]
    spec = GenerationSpec(family, cfg, 2, 6, 4, page_size=4, logits=True)
    tg = spec.generation_program().build()
    assert tg[tg.outputs["ids"]].shape == (2, 4)
    step = spec.decode_program(2).build()
    assert step[step.outputs["ids"]].shape == (2, 1)
    assert {f"kv.{i}.k.new" for i in range(cfg.num_layers)} <= set(step.outputs)
    rng = np.random.default_rng(0)
    weights = {
        n: (0.3 * rng.standard_normal(s)).astype("float32") for n, s in cfg.weight_shapes().items()
    }
    tokens = rng.integers(0, cfg.vocab_size, (2, 6))
    ids = [
        plan_generation(spec, "1MiB", Planning(way=way)).run(weights, tokens).ids
        for way in ("unrolled", "steps")
    ]
    np.testing.assert_array_equal(ids[0], ids[1])
