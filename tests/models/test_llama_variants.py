"""Llama 3 (RoPE scaling), Qwen2 (Q/K/V biases) and Mistral (sliding window) against
Hugging Face `transformers`: small random models built locally, logits within the
float32 tolerance of the equality tests; presets against transformers' parameter
counts; what is refused is refused with the setting named."""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import TOLERANCE, hf_logits, randomize, relative_error  # noqa: E402

import memgraph  # noqa: E402
import runtime  # noqa: E402
import taskgraph  # noqa: E402
from einpage.models import generation, llama, mistral, qwen2  # noqa: E402
from einpage.models.errors import ConfigError, UnsupportedConfigError  # noqa: E402

torch.set_num_threads(1)

SMALL = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "attn_implementation": "eager",
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so every band of the scaling is hit
}


@functools.cache
def hf_model(kind: str):
    """A 2-layer random model of `kind`: llama3, llama-linear, qwen2, mistral."""
    if kind == "llama3":
        config = transformers.LlamaConfig(
            **SMALL, rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE}
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "llama-linear":
        config = transformers.LlamaConfig(
            **SMALL, rope_parameters={"rope_theta": 500.0, "rope_type": "linear", "factor": 4.0}
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**SMALL, rope_theta=1e6, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.MistralConfig(**SMALL, sliding_window=12)
        model = transformers.MistralForCausalLM(config)
    return randomize(model, seed=len(kind))


FAMILIES = {"llama3": llama, "llama-linear": llama, "qwen2": qwen2, "mistral": mistral}
CONFIGS = {
    "llama3": llama.LlamaConfig,
    "llama-linear": llama.LlamaConfig,
    "qwen2": qwen2.Qwen2Config,
    "mistral": mistral.MistralConfig,
}


def loaded(kind: str):
    model = hf_model(kind)
    cfg = CONFIGS[kind].from_hf(model.config)
    return model, cfg, FAMILIES[kind].weights_from_state_dict(cfg, model.state_dict())


@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 12), (1, 9)])
@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_logits_equal_transformers(kind, batch, seq):
    model, cfg, weights = loaded(kind)
    module = FAMILIES[kind]
    tokens = np.random.default_rng(seq).integers(0, cfg.vocab_size, (batch, seq))
    tg = module.prefill_program(cfg, batch, seq).build()
    got = taskgraph.evaluate(tg, module.prefill_inputs(cfg, tokens, weights))["logits"]
    assert relative_error(got, hf_logits(model, tokens)) <= TOLERANCE


def test_the_configs_read_from_transformers_carry_the_variant():
    assert loaded("llama3")[1].rope_scaling == llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    assert loaded("llama-linear")[1].rope_scaling == llama.RopeScaling("linear", 4.0)
    assert loaded("qwen2")[1].qkv_bias and loaded("qwen2")[1].tie_embeddings
    assert loaded("mistral")[1].sliding_window == 12
    names = set(loaded("qwen2")[2])
    assert {"layers.0.attn.bq", "layers.0.attn.bk", "layers.0.attn.bv"} <= names


def test_llama3_scaling_changes_the_rotary_tables_as_transformers_does():
    model, cfg, _ = loaded("llama3")
    rotary = model.model.rotary_emb
    positions = torch.arange(40)[None]
    cos, sin = rotary(torch.zeros(1, 40, 8), positions)
    ours_cos, ours_sin = llama.rope_tables(cfg, 40)
    np.testing.assert_allclose(ours_cos, cos[0].numpy(), atol=2e-6)
    np.testing.assert_allclose(ours_sin, sin[0].numpy(), atol=2e-6)
    plain = llama.rope_tables(llama.LlamaConfig(32, 2, 4, 2, 48, rope_theta=500000.0), 40)[0]
    assert not np.allclose(plain, ours_cos)


def test_qwen2_generation_equals_transformers_greedy():
    model, cfg, weights = loaded("qwen2")
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 5))
    tg = generation.generation_program(qwen2.FAMILY, cfg, 2, 5, 4).build()
    inputs = generation.generation_inputs(qwen2.FAMILY, cfg, prompt, 4, weights=weights)
    mg = memgraph.plan(tg, memgraph.min_budget(tg)[0])
    got = runtime.run(mg, inputs, backend="numpy")["ids"]
    want = model.generate(
        torch.from_numpy(prompt), max_new_tokens=4, do_sample=False, pad_token_id=0
    )[:, 5:].numpy()
    np.testing.assert_array_equal(got, want)


def test_mistral_refuses_programs_longer_than_its_window():
    _, cfg, _ = loaded("mistral")
    with pytest.raises(UnsupportedConfigError, match="sliding window of 12"):
        mistral.prefill_program(cfg, 1, 13)
    with pytest.raises(UnsupportedConfigError, match="sliding window"):
        generation.generation_program(mistral.FAMILY, cfg, 1, 10, 4)
    mistral.prefill_program(cfg, 1, 12)  # the window itself is exact


@pytest.mark.parametrize(
    "config, preset",
    [
        (lambda: transformers.MistralConfig(rms_norm_eps=1e-5), mistral.PRESETS["7b"]),
        (
            lambda: transformers.Qwen2Config(
                vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                rope_theta=1e6, tie_word_embeddings=False,
            ),
            qwen2.PRESETS["7b"],
        ),
        (
            lambda: transformers.LlamaConfig(
                vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_key_value_heads=8, rms_norm_eps=1e-5,
                rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE,
                                 "original_max_position_embeddings": 8192},
            ),
            llama.PRESETS["3-8b"],
        ),
    ],
)  # fmt: skip
def test_presets_match_transformers_parameter_counts(config, preset):
    config = config()
    family = {"mistral": mistral, "qwen2": qwen2, "llama": llama}[config.model_type]
    cfg = type(preset).from_hf(config)
    assert cfg == preset
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.num_parameters() == preset.num_parameters()
    assert family.FAMILY.config is type(preset)


@pytest.mark.parametrize(
    "params, error, words",
    [
        ({"rope_type": "yarn", "factor": 2.0}, UnsupportedConfigError, ["yarn"]),
        ({"rope_type": "llama3", "factor": 8.0}, ConfigError, ["low_freq_factor"]),
        ({**LLAMA3_ROPE, "low_freq_factor": 4.0}, ConfigError, ["high_freq_factor"]),
        ({"rope_type": "linear", "factor": -1.0}, ConfigError, ["factor"]),
    ],
)
def test_bad_rope_scalings_are_refused_with_the_setting_named(params, error, words):
    config = {"model_type": "llama", **{k: v for k, v in SMALL.items() if "attn" not in k}}
    with pytest.raises(error) as info:
        llama.LlamaConfig.from_hf({**config, "rope_scaling": params})
    for word in words:
        assert word in str(info.value)


def test_qwen2_refuses_its_sliding_window_option():
    config = {"model_type": "qwen2", **{k: v for k, v in SMALL.items() if "attn" not in k}}
    with pytest.raises(UnsupportedConfigError, match="use_sliding_window"):
        qwen2.Qwen2Config.from_hf({**config, "use_sliding_window": True})
