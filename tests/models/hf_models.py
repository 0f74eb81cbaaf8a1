"""Small random Hugging Face models for the equality tests, and how their logits compare.

Each model is built locally from a config (no download), with every parameter redrawn
at a scale that makes attention sharp, in float32 with eager attention. Logits compare
by the max abs error relative to the logit scale (max |logit|).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import transformers

TOLERANCE = 1e-4
"""Max abs logit error allowed, relative to max |logit|, in float32."""

LLAMA_VARIANTS = {
    "mha": {"num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": False},
    "gqa-tied": {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "mqa": {"num_attention_heads": 8, "num_key_value_heads": 1, "tie_word_embeddings": False},
}
GPT2_VARIANTS = {
    "base": {},
    "n_inner": {"n_inner": 80, "layer_norm_epsilon": 1e-4},
}


def randomize(model, seed: int, std: float = 0.2):
    """Redraw every parameter: norm scales near 1, everything else (biases too) N(0, std²),
    so attention is far from uniform and every weight matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_scale = param.ndim == 1 and name.endswith("weight")
            param.copy_(1 + 0.1 * noise if is_scale else std * noise)
    return model.eval()


@functools.cache
def hf_llama(variant: str):
    """A 2-layer `LlamaForCausalLM` (hidden 32, vocabulary 96) of a `LLAMA_VARIANTS` kind."""
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        rms_norm_eps=1e-5,
        rope_theta=500.0,
        attn_implementation="eager",
        **LLAMA_VARIANTS[variant],
    )
    return randomize(transformers.LlamaForCausalLM(config), seed=len(variant))


@functools.cache
def hf_gpt2(variant: str):
    """A 2-layer `GPT2LMHeadModel` (hidden 32, vocabulary 96) of a `GPT2_VARIANTS` kind."""
    config = transformers.GPT2Config(
        vocab_size=96,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
        **GPT2_VARIANTS[variant],
    )
    return randomize(transformers.GPT2LMHeadModel(config), seed=len(variant))


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / np.abs(want).max())
