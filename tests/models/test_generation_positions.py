"""The positions a generation fills, checked where its programs are built, both ways:
a Mistral generation inside its sliding window plans and equals transformers whatever
the page size (a step plan's bucket may hold more positions than are filled); one
beyond the model's positions (GPT-2's learned ones) or the window is refused at plan
time, with the same numbers both ways – never a gather out of range at run time."""

from __future__ import annotations

import numpy as np
import pytest

from einpage.models import gpt2, mistral
from einpage.models.errors import GenerationError, UnsupportedConfigError
from einpage.models.generation import decode_program
from einpage.workloads.generation import WAYS, GenerationSpec, Planning, plan_generation

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import randomize  # noqa: E402

torch.set_num_threads(1)


def hf_mistral(window: int):
    config = transformers.MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        sliding_window=window, attn_implementation="eager",
    )  # fmt: skip
    return randomize(transformers.MistralForCausalLM(config), seed=window)


@pytest.mark.parametrize("page_size", [4, 64, 256])
@pytest.mark.parametrize("way", WAYS)
def test_mistral_inside_its_window_generates_transformers_tokens(way, page_size):
    """Window 8, a prompt of 5 and 3 new tokens: 7 positions are filled (the last new
    token is never fed back), whatever a step plan's bucket could hold."""
    hf = hf_mistral(8)
    cfg = mistral.MistralConfig.from_hf(hf.config)
    weights = mistral.weights_from_state_dict(cfg, hf.state_dict())
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 5))
    spec = GenerationSpec(mistral.FAMILY, cfg, 2, 5, 3, page_size=page_size)
    got = plan_generation(spec, "100%", Planning(way=way)).run(weights, prompt).ids
    with torch.no_grad():
        want = hf.generate(
            torch.from_numpy(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=3, do_sample=False, eos_token_id=cfg.vocab_size, pad_token_id=0,
        )[:, 5:].numpy()  # fmt: skip
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("way", WAYS)
def test_mistral_beyond_its_window_is_refused_both_ways(way):
    cfg = mistral.PRESETS["tiny"]  # window 256
    spec = GenerationSpec(mistral.FAMILY, cfg, 1, 250, 8, page_size=64)  # 257 positions
    with pytest.raises(UnsupportedConfigError, match="257 positions exceed the sliding window"):
        plan_generation(spec, "100%", Planning(way=way))


def test_mistral_7b_inside_its_window_plans_its_step_programs():
    """Prompt 4000 + 96 new: 4095 positions of the window's 4096 (the programs are built,
    not planned: building is where the positions are checked)."""
    spec = GenerationSpec(mistral.FAMILY, mistral.PRESETS["7b"], 1, 4000, 96, "float16")
    last = -(-(4000 + 94) // spec.page_size)  # the pages of the last step's cache
    tg = spec.decode_program(last).build()
    assert tg[tg.inputs["rope.cos"]].shape == (4095, 128)


@pytest.mark.parametrize("way", WAYS)
def test_gpt2_beyond_its_positions_is_refused_at_plan_time_both_ways(way):
    spec = GenerationSpec(gpt2.FAMILY, gpt2.PRESETS["tiny"], 1, 30, 8, page_size=4)
    with pytest.raises(GenerationError, match="37 positions, but 'gpt2-tiny' has 32"):
        plan_generation(spec, "100%", Planning(way=way))


def test_gpt2_up_to_its_positions_generates_both_ways_alike():
    """30 + 3 new fills 32 positions, all GPT-2 tiny has: both ways plan, run and agree
    (the step plans' buckets of 64 positions would reach beyond the table)."""
    cfg = gpt2.PRESETS["tiny"]
    rng = np.random.default_rng(0)
    weights = {
        n: (0.3 * rng.standard_normal(s)).astype("float32") for n, s in cfg.weight_shapes().items()
    }
    prompt = rng.integers(0, cfg.vocab_size, (1, 30))
    spec = GenerationSpec(gpt2.FAMILY, cfg, 1, 30, 3)
    ids = [
        plan_generation(spec, "100%", Planning(way=way)).run(weights, prompt).ids for way in WAYS
    ]
    np.testing.assert_array_equal(ids[0], ids[1])


def test_a_decode_program_says_which_positions_it_serves():
    cfg = gpt2.PRESETS["tiny"]
    tg = decode_program(gpt2.FAMILY, cfg, 1, 1, positions=20, page_size=64).build()
    assert tg[tg.outputs["ids"]].shape == (1, 1)
    with pytest.raises(GenerationError, match="positions=3 leaves no cache before the 3 steps"):
        decode_program(gpt2.FAMILY, cfg, 1, 1, positions=3, steps=3, page_size=64)
    whole_bucket = "up to position 64 need 65 positions, but 'gpt2-tiny' has 32"
    with pytest.raises(GenerationError, match=whole_bucket):
        decode_program(gpt2.FAMILY, cfg, 1, 1, page_size=64)
