"""Model programs from shapes alone: presets, parameter counts, einsum specs, scopes, checks.

None of these tests needs torch or any weights: the published 7B..70B programs build
from their configs in about a second.
"""

from __future__ import annotations

import doctest
import time

import numpy as np
import pytest

import taskgraph
from einpage import models
from einpage.errors import EinpageError, ProgramError
from einpage.models import gpt2, llama
from einpage.models.errors import ConfigError
from taskgraph.nodes import Einsum, Input

# Parameter counts derived from the published shapes (and equal to what Hugging Face's
# models of those configs report; test_llama_hf checks 7B against it on the meta device).
LLAMA_PARAMETERS = {
    "7b": 6_738_415_616,
    "13b": 13_015_864_320,
    "65b": 65_285_660_672,
    "70b": 68_976_648_192,
}
GPT2_PARAMETERS = {
    "124m": 124_439_808,
    "355m": 354_823_168,
    "774m": 774_030_080,
    "1.5b": 1_557_611_200,
}


def weight_bytes(tg: taskgraph.TaskGraph) -> int:
    return sum(t.nbytes for t in tg.tasks if isinstance(t.op, Input) and t.op.role == "weight")


def einsum_specs(tg: taskgraph.TaskGraph, scope: str) -> dict[str, str]:
    """Label -> spec of the einsums in `scope` (first occurrence of each label)."""
    specs: dict[str, str] = {}
    for task in tg.tasks:
        if task.scope == scope and isinstance(task.op, Einsum):
            specs.setdefault(task.label, str(task.op.spec))
    return specs


def test_llama_7b_builds_fast_with_fp16_weight_bytes_twice_the_parameters():
    start = time.perf_counter()
    tg = llama.prefill_program(llama.PRESETS["7b"], 1, 2048, "float16").build()
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"building the 7B program took {elapsed:.2f} s"
    assert weight_bytes(tg) == 2 * 6_738_415_616
    assert tg.tasks[tg.outputs["logits"]].shape == (1, 2048, 32000)


@pytest.mark.parametrize("size", sorted(LLAMA_PARAMETERS))
def test_llama_preset_parameter_counts(size):
    cfg = llama.PRESETS[size]
    assert cfg.num_parameters() == LLAMA_PARAMETERS[size]
    tg = llama.prefill_program(cfg, 1, 16, "float16", logits="last").build()
    assert weight_bytes(tg) == 2 * LLAMA_PARAMETERS[size]
    assert tg.tasks[tg.outputs["logits"]].shape == (1, 32000)


def test_llama_70b_is_grouped_query_attention():
    cfg = llama.PRESETS["70b"]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.group_size, cfg.head_dim) == (64, 8, 8, 128)
    assert cfg.rms_norm_eps == 1e-5
    shapes = llama.weight_shapes(cfg)
    assert shapes["layers.0.attn.wq"] == (8, 8, 128, 8192)
    assert shapes["layers.0.attn.wk"] == (8, 128, 8192)


@pytest.mark.parametrize("size", sorted(GPT2_PARAMETERS))
def test_gpt2_preset_parameter_counts(size):
    cfg = gpt2.PRESETS[size]
    assert cfg.num_parameters() == GPT2_PARAMETERS[size]
    tg = gpt2.prefill_program(cfg, 1, 1024, "float16", logits="last").build()
    assert weight_bytes(tg) == 2 * GPT2_PARAMETERS[size]


def test_llama_attention_is_written_with_explicit_batch_head_group_query_key_indices():
    tg = llama.prefill_program(llama.PRESETS["tiny-gqa"], 2, 8).build()
    specs = einsum_specs(tg, "layers.0.attn")
    assert specs["q"] == "bsd,gred->bgrse"
    assert specs["k"] == specs["v"] == "bsd,ged->bgse"
    assert specs["rope"] == "bgrsuc,stuc->bgrstc"
    assert specs["scores"] == "bgrqe,bgke->bgrqk"
    assert specs["attn"] == "bgrqk,bgke->bgrqe"
    assert specs["o"] == "bgrse,gred->bsd"
    # The softmax reduces the key axis (the last) and nothing else.
    assert specs["softmax.max"] == "abcde->abcd"
    mlp = einsum_specs(tg, "layers.0.mlp")
    assert (mlp["gate"], mlp["up"], mlp["down"]) == ("bsd,md->bsm",) * 2 + ("bsm,md->bsd",)


def test_gpt2_attention_specs():
    tg = gpt2.prefill_program(gpt2.PRESETS["tiny"], 2, 8).build()
    specs = einsum_specs(tg, "layers.1.attn")
    assert specs["q"] == "bsd,hed->bhse"
    assert specs["scores"] == "bhqe,bhke->bhqk"
    assert specs["attn"] == "bhqk,bhke->bhqe"
    assert specs["o"] == "bhse,hed->bsd"


@pytest.mark.parametrize(
    "module, cfg", [(llama, llama.PRESETS["tiny"]), (gpt2, gpt2.PRESETS["tiny"])]
)
def test_every_layer_has_its_scope_and_weight_inputs_follow_weight_shapes(module, cfg):
    tg = module.prefill_program(cfg, 1, 4).build()
    scopes = {task.scope for task in tg.tasks}
    for i in range(cfg.num_layers):
        assert {f"layers.{i}.attn", f"layers.{i}.mlp"} <= scopes
    weights = {
        t.op.name: t.shape for t in tg.tasks if isinstance(t.op, Input) and t.op.role == "weight"
    }
    assert list(weights.items()) == list(module.weight_shapes(cfg).items())
    assert tg.tasks[tg.inputs["tokens"]].dtype == "int64"


def test_llama_tied_embeddings_read_the_embedding_as_lm_head():
    cfg = llama.LlamaConfig(64, 1, 4, 2, 96, vocab_size=50, tie_embeddings=True)
    tg = llama.prefill_program(cfg, 1, 3).build()
    assert "lm_head" not in tg.inputs
    logits = tg.tasks[tg.outputs["logits"]]
    assert tg.inputs["embed"] in logits.inputs


def test_rope_tables_match_the_formula():
    cfg = llama.PRESETS["tiny"]
    cos, sin = llama.rope_tables(cfg, 7)
    e = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, e, 2) / e)
    angles = np.arange(7)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    assert cos.shape == sin.shape == (7, e) and cos.dtype == np.float32
    np.testing.assert_allclose(cos, np.cos(angles), atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angles), atol=1e-6)
    assert llama.rope_tables(cfg, 3, "float16")[0].dtype == np.float16


def test_llama_program_equals_a_numpy_reference_with_random_weights():
    """A NumPy transcription of the HF forward pass (independent of torch)."""
    cfg = llama.LlamaConfig(32, 2, 4, 2, 40, vocab_size=30, rope_theta=100.0)
    rng = np.random.default_rng(0)
    weights = {
        name: (
            rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 0.1) + (len(shape) == 1)
        ).astype(np.float32)
        for name, shape in llama.weight_shapes(cfg).items()
    }
    tokens = rng.integers(0, cfg.vocab_size, (2, 6))
    tg = llama.prefill_program(cfg, 2, 6).build()
    got = taskgraph.evaluate(tg, llama.prefill_inputs(cfg, tokens, weights))["logits"]
    want = numpy_llama(cfg, tokens, weights)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def numpy_llama(cfg, tokens, w):
    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * g

    def rotate_half(x):
        half = x.shape[-1] // 2
        return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)

    b, s = tokens.shape
    nh, e = cfg.num_heads, cfg.head_dim
    cos, sin = (t.astype(np.float64) for t in llama.rope_tables(cfg, s))
    x = w["embed"][tokens].astype(np.float64)
    mask = np.triu(np.full((s, s), -np.inf), 1)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = rms(x, w[p + "attn.norm"])
        q = h @ w[p + "attn.wq"].reshape(nh * e, -1).T
        k = h @ w[p + "attn.wk"].reshape(cfg.num_kv_heads * e, -1).T
        v = h @ w[p + "attn.wv"].reshape(cfg.num_kv_heads * e, -1).T
        q = q.reshape(b, s, nh, e).transpose(0, 2, 1, 3)
        k = k.reshape(b, s, -1, e).transpose(0, 2, 1, 3).repeat(cfg.group_size, axis=1)
        v = v.reshape(b, s, -1, e).transpose(0, 2, 1, 3).repeat(cfg.group_size, axis=1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(e) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, nh * e)
        x = x + out @ w[p + "attn.wo"].reshape(nh * e, -1)
        h = rms(x, w[p + "mlp.norm"])
        gate, up = h @ w[p + "mlp.w_gate"].T, h @ w[p + "mlp.w_up"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.w_down"]
    return rms(x, w["norm"]) @ w["lm_head"].T


# -- argument and config errors -------------------------------------------------------


@pytest.mark.parametrize(
    "hidden, heads, kv_heads, words",
    [
        (64, 5, 5, ["num_heads=5", "hidden_size=64"]),
        (64, 8, 3, ["num_kv_heads=3", "num_heads=8"]),
        (72, 8, 8, ["head_dim=9", "even"]),
        (0, 1, 1, ["hidden_size", "0"]),
        (64, True, 1, ["num_heads", "True"]),
    ],
)
def test_llama_config_validation_names_the_field(hidden, heads, kv_heads, words):
    with pytest.raises(ConfigError) as info:
        llama.LlamaConfig(hidden, 1, heads, kv_heads, intermediate_size=8)
    for word in words:
        assert word in str(info.value)
    assert isinstance(info.value, EinpageError)


def test_llama_config_other_fields():
    with pytest.raises(ConfigError, match="rms_norm_eps"):
        llama.LlamaConfig(64, 1, 4, 4, 8, rms_norm_eps=0.0)
    with pytest.raises(ConfigError, match="rope_theta"):
        llama.LlamaConfig(64, 1, 4, 4, 8, rope_theta=float("inf"))
    with pytest.raises(ConfigError, match="tie_embeddings"):
        llama.LlamaConfig(64, 1, 4, 4, 8, tie_embeddings=1)


def test_gpt2_config_validation():
    with pytest.raises(ConfigError, match="num_heads=5 does not divide hidden_size=64"):
        gpt2.GPT2Config(64, 1, 5)
    assert gpt2.GPT2Config(64, 1, 4).intermediate_size == 256
    assert gpt2.GPT2Config(64, 1, 4, intermediate_size=100).intermediate_size == 100


def test_config_equality_ignores_the_name():
    assert llama.LlamaConfig(64, 1, 4, 4, 8, name="a") == llama.LlamaConfig(64, 1, 4, 4, 8)


@pytest.mark.parametrize(
    "args, words",
    [
        ((0, 4), ["batch", "0"]),
        ((1, -1), ["seq", "-1"]),
        ((1, 4, "int64"), ["dtype", "int64"]),
        ((1, 4, "float32", "first"), ["logits", "first"]),
    ],
)
def test_prefill_program_argument_errors(args, words):
    for module in (llama, gpt2):
        with pytest.raises(ProgramError) as info:
            module.prefill_program(module.PRESETS["tiny"], *args)
        for word in words:
            assert word in str(info.value)


def test_gpt2_seq_longer_than_its_positions():
    with pytest.raises(ProgramError, match="seq=33 exceeds the model's 32 positions"):
        gpt2.prefill_program(gpt2.PRESETS["tiny"], 1, 33)


@pytest.mark.parametrize("module", [models, llama, gpt2], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
