"""The einsum programs equal Hugging Face transformers: logits of small random models.

The models (`hf_models`: built locally, parameters redrawn so attention is sharp, float32,
eager attention) are compared with `taskgraph.evaluate` of our program: the max abs
error must be at most 1e-4 of the logit scale (max |logit|).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    GPT2_VARIANTS,
    LLAMA_VARIANTS,
    TOLERANCE,
    hf_gpt2,
    hf_llama,
    hf_logits,
    relative_error,
)

import taskgraph  # noqa: E402
from einpage.models import gpt2, llama  # noqa: E402
from einpage.models.errors import ConfigError, UnsupportedConfigError  # noqa: E402

torch.set_num_threads(1)

SHAPES = [(1, 1), (1, 9), (3, 5)]


@pytest.mark.parametrize("logits", ["all", "last"])
@pytest.mark.parametrize("batch, seq", SHAPES)
@pytest.mark.parametrize("variant", sorted(LLAMA_VARIANTS))
def test_llama_logits_equal_transformers(variant, batch, seq, logits):
    model = hf_llama(variant)
    cfg = llama.LlamaConfig.from_hf(model.config)
    assert cfg.tie_embeddings == model.config.tie_word_embeddings
    weights = llama.weights_from_state_dict(cfg, model.state_dict())
    tokens = np.random.default_rng(seq).integers(0, cfg.vocab_size, (batch, seq))
    tg = llama.prefill_program(cfg, batch, seq, logits=logits).build()
    got = taskgraph.evaluate(tg, llama.prefill_inputs(cfg, tokens, weights))["logits"]
    want = hf_logits(model, tokens)
    want = want if logits == "all" else want[:, -1]
    assert relative_error(got, want) <= TOLERANCE


@pytest.mark.parametrize("logits", ["all", "last"])
@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 7), (1, 16)])
@pytest.mark.parametrize("variant", sorted(GPT2_VARIANTS))
def test_gpt2_logits_equal_transformers(variant, batch, seq, logits):
    model = hf_gpt2(variant)
    cfg = gpt2.GPT2Config.from_hf(model.config)
    weights = gpt2.weights_from_state_dict(cfg, model.state_dict())
    tokens = np.random.default_rng(seq).integers(0, cfg.vocab_size, (batch, seq))
    tg = gpt2.prefill_program(cfg, batch, seq, logits=logits).build()
    got = taskgraph.evaluate(tg, gpt2.prefill_inputs(cfg, tokens, weights))["logits"]
    want = hf_logits(model, tokens)
    want = want if logits == "all" else want[:, -1]
    assert relative_error(got, want) <= TOLERANCE


def test_attention_in_the_test_models_is_sharp():
    """The comparison means something only if attention is not near-uniform."""
    model = hf_llama("gqa-tied")
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 96, (1, 9)))
    with torch.no_grad():
        attentions = model(tokens, output_attentions=True).attentions
    assert max(float(a[..., 1:, :].max()) for a in attentions) > 0.5


@pytest.mark.parametrize("module, model", [(llama, "llama"), (gpt2, "gpt2")])
def test_float16_program_stays_close_to_float32_transformers(module, model):
    hf = hf_llama("gqa-tied") if model == "llama" else hf_gpt2("base")
    cfg = (llama.LlamaConfig if model == "llama" else gpt2.GPT2Config).from_hf(hf.config)
    weights = module.weights_from_state_dict(cfg, hf.state_dict(), "float16")
    assert all(w.dtype == np.float16 for w in weights.values())
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 6))
    tg = module.prefill_program(cfg, 2, 6, "float16").build()
    got = taskgraph.evaluate(tg, module.prefill_inputs(cfg, tokens, weights, "float16"))["logits"]
    assert got.dtype == np.float16
    assert relative_error(got.astype(np.float32), hf_logits(hf, tokens)) <= 1e-2


def test_state_dicts_of_bare_models_and_numpy_arrays_load_too():
    model = hf_llama("mha")
    cfg = llama.LlamaConfig.from_hf(model.config)
    full = llama.weights_from_state_dict(cfg, model.state_dict())
    bare = {k: v.numpy() for k, v in model.model.state_dict().items()}
    bare["lm_head.weight"] = model.lm_head.weight.detach().numpy()
    loaded = llama.weights_from_state_dict(cfg, bare)
    assert loaded.keys() == full.keys()
    assert all(np.array_equal(loaded[k], full[k]) for k in full)
    gpt = hf_gpt2("base")
    gcfg = gpt2.GPT2Config.from_hf(gpt.config)
    bare_gpt = gpt2.weights_from_state_dict(gcfg, gpt.transformer.state_dict())
    assert bare_gpt.keys() == gpt2.weights_from_state_dict(gcfg, gpt.state_dict()).keys()


# -- configs from Hugging Face ---------------------------------------------------------


def test_from_hf_reads_config_objects_and_config_json_alike(tmp_path):
    for model, cls in (
        (hf_llama("gqa-tied"), llama.LlamaConfig),
        (hf_gpt2("n_inner"), gpt2.GPT2Config),
    ):
        model.config.save_pretrained(tmp_path)
        on_disk = json.loads((tmp_path / "config.json").read_text())
        assert cls.from_hf(on_disk) == cls.from_hf(model.config)
    cfg = llama.LlamaConfig.from_hf(hf_llama("gqa-tied").config)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta, cfg.rms_norm_eps) == (
        4,
        2,
        500.0,
        1e-5,
    )
    assert gpt2.GPT2Config.from_hf(hf_gpt2("n_inner").config).intermediate_size == 80


def test_llama_presets_match_transformers_parameter_counts():
    config = transformers.LlamaConfig()  # LLaMA-7B's shape
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    assert llama.LlamaConfig.from_hf(config) == llama.PRESETS["7b"]
    assert model.num_parameters() == llama.PRESETS["7b"].num_parameters()
    config = transformers.GPT2Config()  # GPT-2 124M
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    assert gpt2.GPT2Config.from_hf(config) == gpt2.PRESETS["124m"]
    assert model.num_parameters() == gpt2.PRESETS["124m"].num_parameters()


LLAMA_BASE = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "vocab_size": 96,
}


@pytest.mark.parametrize(
    "change, words",
    [
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, ["RoPE scaling", "yarn"]),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5}}, ["dynamic"]),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, ["partial"]),
        ({"attention_bias": True}, ["attention_bias=True"]),
        ({"mlp_bias": True}, ["mlp_bias=True"]),
        ({"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
        ({"head_dim": 16}, ["head_dim=16"]),
        ({"model_type": "mistral"}, ["mistral"]),
    ],
)
def test_llama_from_hf_rejects_unsupported_settings(change, words):
    with pytest.raises(UnsupportedConfigError) as info:
        llama.LlamaConfig.from_hf({**LLAMA_BASE, **change})
    for word in words:
        assert word in str(info.value)


def test_llama_from_hf_accepts_default_rope_parameters_and_missing_kv_heads():
    params = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    cfg = llama.LlamaConfig.from_hf({**LLAMA_BASE, **params, "num_key_value_heads": None})
    assert (cfg.num_kv_heads, cfg.rope_theta) == (4, 1e4)
    old_style = {**LLAMA_BASE, "rope_theta": 250.0, "rope_scaling": None}
    assert llama.LlamaConfig.from_hf(old_style).rope_theta == 250.0
    with pytest.raises(ConfigError, match="vocab_size"):
        llama.LlamaConfig.from_hf({**LLAMA_BASE, "vocab_size": None})


def test_llama_from_hf_rejects_a_transformers_config_with_biases():
    config = transformers.LlamaConfig(**{**LLAMA_BASE, "attention_bias": True})
    with pytest.raises(UnsupportedConfigError, match="attention_bias"):
        llama.LlamaConfig.from_hf(config)


GPT2_BASE = {
    "model_type": "gpt2",
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 4,
    "n_positions": 16,
    "vocab_size": 96,
}


@pytest.mark.parametrize(
    "change, words",
    [
        ({"activation_function": "relu"}, ["activation_function='relu'"]),
        ({"add_cross_attention": True}, ["add_cross_attention"]),
        ({"scale_attn_weights": False}, ["scale_attn_weights"]),
        ({"scale_attn_by_inverse_layer_idx": True}, ["scale_attn_by_inverse_layer_idx"]),
        ({"tie_word_embeddings": False}, ["tie_word_embeddings"]),
    ],
)
def test_gpt2_from_hf_rejects_unsupported_settings(change, words):
    with pytest.raises(UnsupportedConfigError) as info:
        gpt2.GPT2Config.from_hf({**GPT2_BASE, **change})
    for word in words:
        assert word in str(info.value)


def test_gpt2_from_hf_accepts_the_other_name_of_tanh_gelu():
    cfg = gpt2.GPT2Config.from_hf({**GPT2_BASE, "activation_function": "gelu_pytorch_tanh"})
    assert cfg.intermediate_size == 128
