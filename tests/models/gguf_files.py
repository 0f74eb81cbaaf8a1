"""GGUF files the tests write themselves with the gguf package's writer: small random
LLaMA and Qwen2 models (every supported tensor type), a byte-level BPE vocabulary.

The tensors are a Hugging Face model's state dict renamed to llama.cpp's names, LLaMA's
Q/K rows interleaved as llama.cpp's converter does, and stored as asked: float types as
they are, Q8_0/Q4_0/Q4_1 quantized by `gguf.quants.quantize`, and the K-quants (which
the gguf package cannot quantize) as random blocks with small finite scales.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (the test extra) is not installed")

SUPER = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
"""Bytes of a 256-weight super-block of each K-quant."""


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """Random K-quant bytes [rows, cols / 256 * bytes] whose float16 scales are small
    finite numbers (so the weights are of order 0.1)."""
    blocks = rng.integers(0, 256, (rows, cols // 256, SUPER[kind]), dtype=np.uint8)

    def put(at: int, low: float, high: float) -> None:
        values = rng.uniform(low, high, blocks.shape[:2]).astype("<f2")
        blocks[..., at : at + 2] = values.view(np.uint8).reshape(*blocks.shape[:2], 2)

    if kind == "Q6_K":
        put(208, 1e-5, 2e-5)
    else:
        scale = 1e-4 if kind == "Q4_K" else 5e-5
        put(0, scale / 2, scale)
        put(2, scale / 4, scale / 2)
    return blocks.reshape(rows, -1)


def encode_tensor(rng: np.random.Generator, array: np.ndarray, kind: str) -> tuple[np.ndarray, int]:
    """(data, raw type) of `array` stored as GGUF type `kind`."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return array.astype(np.float32), qtype
    if kind == "F16":
        return array.astype(np.float16), qtype
    if kind == "BF16":
        return gguf.quants.quantize(array.astype(np.float32), qtype), qtype
    if kind in SUPER:
        return random_blocks(rng, array.shape[0], array.shape[-1], kind), qtype
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's interleaving of a LLaMA Q/K projection's rows."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def byte_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: the 256 bytes, a few merges, and two control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelled = bytes_to_unicode()
    tokens = [spelled[b] for b in range(256)]
    pairs = [("t", "h"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("Ġ", "t"),
             ("Ġt", "h"), ("Ġ", "a"), ("Ġth", "e"), ("o", "n"), ("a", "t")]  # fmt: skip
    merges = [f"{left} {right}" for left, right in pairs]
    tokens += [left + right for left, right in pairs]
    types = [1] * len(tokens)
    for special in ("<|endoftext|>", "<|im_start|>"):
        tokens.append(special)
        types.append(3)
    return tokens, merges, types


def write_gguf(
    path: Path,
    hf_model,
    arch: str,
    types: dict[str, str] | str = "F32",
    name: str = "tiny",
    seed: int = 0,
    tokenizer: bool = True,
    chat_template: str | None = None,
    eos: int | None = None,
    sliding_window: int | None = None,
) -> Path:
    """Write the transformers model `hf_model` (LLaMA or Qwen2) to `path` as architecture
    `arch`, each tensor of llama.cpp name `n` as type `types[n]` (or the `types` for
    every matrix; norms and biases stay F32), with a `chat_template` if given, `eos`
    as the end-of-sequence id (default: "<|endoftext|>"'s) and a `sliding_window` key if
    given. Returns `path`."""
    rng = np.random.default_rng(seed)
    cfg = hf_model.config
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, ours in layer.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{ours}"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    writer.add_rope_freq_base(theta)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if sliding_window is not None:
        writer.add_uint32(f"{arch}.attention.sliding_window", sliding_window)
    if tokenizer:
        tokens, merges, token_types = byte_vocab()
        assert len(tokens) == cfg.vocab_size, (len(tokens), cfg.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_token_types(token_types)
        writer.add_eos_token_id(len(tokens) - 2 if eos is None else eos)
        writer.add_bos_token_id(len(tokens) - 2)
        writer.add_add_bos_token(False)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
    for hf, ours in names.items():
        if hf not in sd:  # LLaMA has no Q/K/V biases
            continue
        array = sd[hf]
        if arch in ("llama", "mistral") and ours.endswith("attn_q.weight"):
            array = permute(array, cfg.num_attention_heads)
        if arch in ("llama", "mistral") and ours.endswith("attn_k.weight"):
            array = permute(array, cfg.num_key_value_heads)
        kind = types.get(ours, "F32") if isinstance(types, dict) else types
        if array.ndim == 1:
            kind = "F32"
        data, qtype = encode_tensor(rng, array, kind)
        writer.add_tensor(ours, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


VOCAB = len(byte_vocab()[0])
"""The vocabulary of the files' tokenizer (the models are made with it)."""


def hf_model(
    arch: str, hidden: int = 256, ffn: int = 512, layers: int = 2, tied: bool = False, seed: int = 0
):
    """A small random transformers LLaMA or Qwen2 whose matrices K-quants can store
    (rows of 256): 4 query heads over 2 K/V heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = {
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
    }
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1e6))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=1e4))
    with torch.no_grad():  # norms away from 1, so a swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.copy_(
                    1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p)
                )
    return model.eval()
