"""LLaMA (LLaMA-1 and Llama-2, with grouped-query attention) as an einsum program.

`prefill_program(cfg, batch, seq)` builds the forward pass over a prompt – the prefill
of LLM inference – as an `einpage.Program` whose output "logits" equals Hugging Face
`LlamaForCausalLM` (tested to 1e-4 of the logit scale in float32). `PRESETS` holds the
published shapes; a preset program builds in well under a second and needs no weights, so
the 7B..70B models can be planned from their shapes alone.

Inputs of the program
---------------------
* `tokens`: int64 [batch, seq], the token ids.
* `rope.cos`, `rope.sin`: [seq, head_dim] in the program dtype, the rotary tables for
  positions 0..seq-1 in Hugging Face's layout (each row is `cat(freqs, freqs)`); make
  them with `rope_tables`. `prefill_inputs` assembles all inputs.
* the weights (role "weight"), named and laid out as below. Every weight keeps its
  *wide* axis (vocabulary, heads, MLP features) first and the hidden axis `d` last.
  That is Hugging Face's [out, in] layout for the embedding, Q/K/V, gate/up and the LM
  head (loaded as views, no copy); `wo` and `w_down` are transposed once at load. With
  one rule every einsum reads `d` as the last, contiguous axis, and a block of heads
  or of MLP features – the split that runs a layer block by block – is one contiguous
  slab of each weight.

  ======================  ======================  =============================================
  input                   shape                   Hugging Face tensor
  ======================  ======================  =============================================
  `embed`                 [vocab, d]              `model.embed_tokens.weight`
  `layers.{i}.attn.norm`  [d]                     `model.layers.{i}.input_layernorm.weight`
  `layers.{i}.attn.wq`    [kv_heads, group, e, d] `...self_attn.q_proj.weight` [heads*e, d]
  `layers.{i}.attn.wk`    [kv_heads, e, d]        `...self_attn.k_proj.weight` [kv_heads*e, d]
  `layers.{i}.attn.wv`    [kv_heads, e, d]        `...self_attn.v_proj.weight` [kv_heads*e, d]
  `layers.{i}.attn.wo`    [kv_heads, group, e, d] `...self_attn.o_proj.weight` [d, heads*e], ᵀ
  `layers.{i}.mlp.norm`   [d]                     `...post_attention_layernorm.weight`
  `layers.{i}.mlp.w_gate` [ffn, d]                `...mlp.gate_proj.weight`
  `layers.{i}.mlp.w_up`   [ffn, d]                `...mlp.up_proj.weight`
  `layers.{i}.mlp.w_down` [ffn, d]                `...mlp.down_proj.weight` [d, ffn], ᵀ
  `norm`                  [d]                     `model.norm.weight`
  `lm_head`               [vocab, d]              `lm_head.weight` (absent when tied: the
                                                  program reads `embed` instead)
  ======================  ======================  =============================================

  Query head `n` of Hugging Face is (kv-head `n // group`, member `n % group`), the
  order in which `repeat_kv` shares a K/V head, so `[heads*e, d]` is viewed as
  `[kv_heads, group, e, d]` without moving data.

The einsums of one layer (b batch, s/q/k positions, d hidden, g kv-heads, r group,
e head_dim, t/u halves of e and c a feature within a half, m MLP features)
-----------------------------------------------------------------------------------
* RMSNorm: `bsd->bs` (mean square), `bsd,bs,d->bsd` (`a * rsqrt(b + eps) * c`).
* projections: `bsd,gred->bgrse` (Q), `bsd,ged->bgse` (K, V): heads come out in the
  layout attention reads, no transpose task.
* rotary embedding, rotate-half convention: q viewed as [b,g,r,s,2,e/2] (a free view),
  then `bgrsuc,stuc->bgrstc` with a per-position 2x2 rotation table
  `rot[s,t,u,c] = [[cos, -sin], [sin, cos]]` that pairs feature c with c + e/2 exactly
  like `q * cos + rotate_half(q) * sin`. The table is made once per program from the
  cos/sin inputs (one einsum); the query's copy also carries the 1/sqrt(head_dim)
  attention scale, so scaling costs no task per layer.
* attention: `bgrqe,bgke->bgrqk`, causal mask (`qk`), softmax over k (`bgrqk->bgrq`
  max, `exp(a - b)` sum, normalize), `bgrqk,bgke->bgrqe`; then `bgrse,gred->bsd` (O)
  and the residual add.
* SwiGLU MLP: `bsd,md->bsm` (gate, up), `silu(a) * b`, `bsm,md->bsd` (down), residual.
* head: final RMSNorm, `bsd,vd->bsv` (or `bd,vd->bv` for the last position only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from einpage.models import base
from einpage.models.base import Getter, HFLayout, ModelConfig, ModelFamily
from einpage.models.common import (
    Decoder,
    Heads,
    Positions,
    Weight,
    begin_prefill,
    causal_attention,
    decoder_layers,
    head_logits,
    logits_head,
    scaled,
    shard,
    token_ids,
)
from einpage.models.errors import ConfigError, ConfigMismatchError, UnsupportedConfigError
from einpage.models.weights import WeightSpec
from einpage.program import ops
from einpage.program.program import Program, Tensor
from taskgraph import dtypes

__all__ = [
    "LlamaConfig",
    "PRESETS",
    "FAMILY",
    "prefill_program",
    "prefill_inputs",
    "rope_tables",
    "decoder",
    "position_inputs",
    "generation_program",
    "decode_program",
    "weight_specs",
    "weight_shapes",
    "weights_from_state_dict",
    "weights_from_safetensors",
]


@dataclass(frozen=True)
class RopeScaling:
    """A scaled rotary embedding: `rope_type` "llama3" (Llama 3.1's: frequencies whose
    wavelength exceeds `original_max_position_embeddings / low_freq_factor` divided by
    `factor`, those below `... / high_freq_factor` kept, the band between interpolated
    smoothly) or "linear" (every frequency divided by `factor`)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    TYPES: ClassVar[tuple[str, ...]] = ("llama3", "linear")

    def __post_init__(self) -> None:
        if self.rope_type not in self.TYPES:
            raise UnsupportedConfigError(
                f"RoPE scaling {self.rope_type!r} is not supported (only {self.TYPES})"
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"RopeScaling: {name} must be a positive number, got {value!r}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"RopeScaling: high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )

    @classmethod
    def from_hf(cls, params: Mapping[str, Any], where: str) -> RopeScaling | None:
        """The scaling a HF `rope_parameters`/`rope_scaling` dict asks for (None: the
        default RoPE); `UnsupportedConfigError` for another kind or unknown keys."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        fields = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
        if rope_type == "default" and not fields:
            return None
        allowed = {
            "linear": {"factor"},
            "llama3": {"factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"},
        }.get(rope_type)  # fmt: skip
        if allowed is None or set(fields) - allowed:
            raise UnsupportedConfigError(
                f"{where}: RoPE scaling {dict(params)} is not supported; only the default, "
                "'linear' and 'llama3' rotary embeddings are"
            )
        missing = sorted(allowed - set(fields))
        if missing:
            raise ConfigError(f"{where}: RoPE scaling {rope_type!r} needs {missing}")
        return cls(rope_type, **fields)

    def apply(self, inv_freq: np.ndarray) -> np.ndarray:
        """The scaled inverse frequencies (float32, as transformers computes them)."""
        f32 = np.float32
        factor = f32(self.factor)
        if self.rope_type == "linear":
            return (inv_freq / factor).astype(f32)
        old = f32(self.original_max_position_embeddings)
        low, high = f32(self.low_freq_factor), f32(self.high_freq_factor)
        wavelen = (f32(2 * math.pi) / inv_freq).astype(f32)
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq).astype(f32)
        smooth = ((old / wavelen - low) / (high - low)).astype(f32)
        smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(f32)
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled).astype(f32)


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """The shape of a LLaMA model.

    `num_kv_heads` < `num_heads` is grouped-query attention (Llama-2-70B: 64 query
    heads share 8 K/V heads); equal is multi-head attention. `name` only labels
    programs and is ignored by `==`.

    Variants of the same architecture: `rope_scaling` (Llama 3's `"llama3"` frequency
    scaling, or `"linear"`), `qkv_bias` (biases on the Q/K/V projections, as Qwen2),
    `sliding_window` (Mistral: attention to the last `sliding_window` positions; programs
    longer than the window are refused, within it attention is the causal one).

    `from_hf` rejects settings this program does not implement with
    `UnsupportedConfigError`: other RoPE scalings, an output-projection or MLP bias, an
    activation other than SiLU, a head_dim other than hidden_size / num_heads.

    >>> cfg = PRESETS["7b"]
    >>> cfg.head_dim, cfg.group_size, cfg.num_parameters()
    (128, 1, 6738415616)
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 32000
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    sliding_window: int | None = None
    name: str = field(default="llama", compare=False)

    model_type: ClassVar[str] = "llama"
    hf_layout: ClassVar[HFLayout] = HFLayout(
        prefixes=("model.", ""), embedding="embed_tokens.weight", layers="layers."
    )
    positive_ints: ClassVar[tuple[str, ...]] = (
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "intermediate_size",
        "vocab_size",
    )
    positive_floats: ClassVar[tuple[str, ...]] = ("rope_theta", "rms_norm_eps")
    bools: ClassVar[tuple[str, ...]] = ("tie_embeddings",)

    def check(self) -> None:
        super().check()
        owner = type(self).__name__
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{owner}: num_kv_heads={self.num_kv_heads} does not divide "
                f"num_heads={self.num_heads} (each K/V head serves a whole group of query heads)"
            )
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool)
            or not isinstance(self.sliding_window, int)
            or self.sliding_window <= 0
        ):
            raise ConfigError(
                f"{owner}: sliding_window must be a positive int or None, got "
                f"{self.sliding_window!r}"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(
                f"{owner}: rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"{owner}: head_dim={self.head_dim} (hidden_size / num_heads) must be even "
                "for the rotary embedding"
            )

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (1 without grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def ties_lm_head(self) -> bool:
        return self.tie_embeddings

    def untied_head_error(self, where: str) -> ConfigMismatchError:
        return ConfigMismatchError(
            f"the config ties the LM head to the embedding, but {where} has an "
            "'lm_head.weight' that differs from it (set tie_embeddings=False)"
        )

    def weight_specs(self, prefix: str = "model.") -> list[WeightSpec]:
        """Every weight of the program and the Hugging Face tensor it comes from (the keys
        of `LlamaForCausalLM`; `prefix=""` for a bare `LlamaModel`)."""
        d, e, m, v = self.hidden_size, self.head_dim, self.intermediate_size, self.vocab_size
        g, r = self.num_kv_heads, self.group_size
        specs = [WeightSpec("embed", (v, d), f"{prefix}embed_tokens.weight", (v, d))]
        for i in range(self.num_layers):
            ours, hf = f"layers.{i}.", f"{prefix}layers.{i}."
            specs += [
                WeightSpec(ours + "attn.norm", (d,), hf + "input_layernorm.weight", (d,)),
                WeightSpec(
                    ours + "attn.wq",
                    (g, r, e, d),
                    hf + "self_attn.q_proj.weight",
                    (g * r * e, d),
                    quantize=True,
                ),
                WeightSpec(
                    ours + "attn.wk",
                    (g, e, d),
                    hf + "self_attn.k_proj.weight",
                    (g * e, d),
                    quantize=True,
                ),
                WeightSpec(
                    ours + "attn.wv",
                    (g, e, d),
                    hf + "self_attn.v_proj.weight",
                    (g * e, d),
                    quantize=True,
                ),
            ]
            if self.qkv_bias:
                specs += [
                    WeightSpec(
                        ours + "attn.bq", (g, r, e), hf + "self_attn.q_proj.bias", (g * r * e,)
                    ),
                    WeightSpec(ours + "attn.bk", (g, e), hf + "self_attn.k_proj.bias", (g * e,)),
                    WeightSpec(ours + "attn.bv", (g, e), hf + "self_attn.v_proj.bias", (g * e,)),
                ]
            specs += [
                WeightSpec(
                    ours + "attn.wo",
                    (g, r, e, d),
                    hf + "self_attn.o_proj.weight",
                    (d, g * r * e),
                    transpose=True,
                    quantize=True,
                ),
                WeightSpec(ours + "mlp.norm", (d,), hf + "post_attention_layernorm.weight", (d,)),
                WeightSpec(
                    ours + "mlp.w_gate", (m, d), hf + "mlp.gate_proj.weight", (m, d), quantize=True
                ),
                WeightSpec(
                    ours + "mlp.w_up", (m, d), hf + "mlp.up_proj.weight", (m, d), quantize=True
                ),
                WeightSpec(
                    ours + "mlp.w_down",
                    (m, d),
                    hf + "mlp.down_proj.weight",
                    (d, m),
                    transpose=True,
                    quantize=True,
                ),
            ]
        specs.append(WeightSpec("norm", (d,), f"{prefix}norm.weight", (d,)))
        if not self.tie_embeddings:
            specs.append(WeightSpec("lm_head", (v, d), "lm_head.weight", (v, d), quantize=True))
        return specs

    @classmethod
    def hf_fields(cls, get: Getter) -> dict[str, Any]:
        owner = f"{cls.__name__}.from_hf"
        act = get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedConfigError(
                f"{owner}: hidden_act={act!r} is not supported (the SwiGLU MLP uses 'silu')"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if get(flag, False):
                raise UnsupportedConfigError(
                    f"{owner}: {flag}=True is not supported (biases on the output projection "
                    "or the MLP; Q/K/V biases alone are the qwen2 family)"
                )
        hidden, heads = get("hidden_size", None), get("num_attention_heads", None)
        kv_heads = get("num_key_value_heads", None)
        head_dim = get("head_dim", None)
        known = isinstance(hidden, int) and isinstance(heads, int) and heads > 0
        if head_dim is not None and known and head_dim != hidden // heads:
            raise UnsupportedConfigError(
                f"{owner}: head_dim={head_dim} differs from hidden_size / "
                f"num_attention_heads = {hidden} / {heads}; only the default is supported"
            )
        return {
            "hidden_size": hidden,
            "num_layers": get("num_hidden_layers", None),
            "num_heads": heads,
            "num_kv_heads": heads if kv_heads is None else kv_heads,
            "intermediate_size": get("intermediate_size", None),
            "vocab_size": get("vocab_size", None),
            **_rope(get, owner),
            "rms_norm_eps": get("rms_norm_eps", 1e-6),
            "tie_embeddings": bool(get("tie_word_embeddings", False)),
        }


def _rope(get: Getter, owner: str) -> dict[str, Any]:
    """RoPE's base and scaling from a HF config: `rope_theta` and `rope_scaling`.

    transformers >= 5 keeps them in `rope_parameters` (`{"rope_type": "default",
    "rope_theta": ...}`); older versions in `rope_theta` and `rope_scaling`. Both are
    read, so a `config.json` that has both (e.g. edited by hand) cannot hide a scaled
    RoPE behind a default one; two different scalings are refused.
    """
    theta = get("rope_theta", 10000.0)
    scaling: RopeScaling | None = None
    for key in ("rope_parameters", "rope_scaling"):
        params = get(key, None)
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise ConfigError(f"{owner}: {key} must be a dict, got {params!r}")
        theta = params.get("rope_theta", theta)
        found = RopeScaling.from_hf(params, f"{owner}: {key}")
        if found is not None and scaling is not None and found != scaling:
            raise ConfigError(f"{owner}: rope_parameters and rope_scaling disagree")
        scaling = found or scaling
    return {"rope_theta": theta, "rope_scaling": scaling}


PRESETS: dict[str, LlamaConfig] = {
    # LLaMA-1 (Touvron et al. 2023, table 2), vocabulary 32000, eps 1e-6, theta 10000.
    "7b": LlamaConfig(4096, 32, 32, 32, 11008, name="llama-7b"),
    "13b": LlamaConfig(5120, 40, 40, 40, 13824, name="llama-13b"),
    "65b": LlamaConfig(8192, 80, 64, 64, 22016, name="llama-65b"),
    # Llama-2-70B: grouped-query attention with 8 K/V heads, eps 1e-5.
    "70b": LlamaConfig(8192, 80, 64, 8, 28672, rms_norm_eps=1e-5, name="llama2-70b"),
    # Llama-3.1-8B: GQA, a 128,256-token vocabulary, theta 500000 and llama3 RoPE scaling.
    "3-8b": LlamaConfig(
        4096,
        32,
        32,
        8,
        14336,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        name="llama3.1-8b",
    ),  # fmt: skip
    # Small shapes for tests and examples.
    "tiny": LlamaConfig(64, 2, 4, 4, 128, vocab_size=256, name="llama-tiny"),
    "tiny-gqa": LlamaConfig(64, 2, 8, 2, 160, vocab_size=256, name="llama-tiny-gqa"),
}
"""Published LLaMA shapes ("7b", "13b", "65b", "70b", Llama 3.1's "3-8b") and small ones
("tiny", "tiny-gqa")."""


# -- weights --------------------------------------------------------------------

weight_specs = LlamaConfig.weight_specs
weight_shapes = LlamaConfig.weight_shapes
weights_from_state_dict = base.weights_from_state_dict
weights_from_safetensors = base.weights_from_safetensors


# -- rotary tables and inputs ------------------------------------------------------


def rope_tables(
    cfg: LlamaConfig, seq: int, dtype: Any = "float32"
) -> tuple[np.ndarray, np.ndarray]:
    """The `rope.cos` and `rope.sin` inputs for positions 0..seq-1: [seq, head_dim] each.

    Computed as Hugging Face's `LlamaRotaryEmbedding` does, in float32 with the same
    operations: `inv_freq = 1 / theta ** (arange(0, e, 2) / e)`, angles
    `position * inv_freq`, duplicated to `cat(freqs, freqs)`, then cos and sin, cast to
    `dtype`. The power and the cos/sin are rounded correctly from float64: the angles
    then equal torch's bit for bit, and cos/sin are within one float32 ulp of torch's
    (whose vectorized float32 cos/sin are not correctly rounded).
    """
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise ConfigError(f"rope_tables: seq must be a positive int, got {seq!r}")
    e = cfg.head_dim
    exponents = np.arange(0, e, 2, dtype=np.int64).astype(np.float32) / np.float32(e)
    powers = (float(cfg.rope_theta) ** exponents.astype(np.float64)).astype(np.float32)
    inv_freq = np.float32(1.0) / powers
    if cfg.rope_scaling is not None:
        inv_freq = cfg.rope_scaling.apply(inv_freq)
    positions = np.arange(seq, dtype=np.int64).astype(np.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = np.concatenate([freqs, freqs], axis=-1).astype(np.float64)
    name = dtypes.canonical(dtype)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return cos.astype(name), sin.astype(name)


def prefill_inputs(
    cfg: LlamaConfig,
    tokens: Any,
    weights: Mapping[str, np.ndarray] | None = None,
    dtype: Any = "float32",
) -> dict[str, np.ndarray]:
    """Every input of `prefill_program(cfg, *tokens.shape, dtype)`: the tokens as int64,
    the RoPE tables and the weights (as given). Without `weights`, only the activations:
    what each run of a `runtime.Session` whose weights are staged needs."""
    ids = token_ids(tokens)
    cos, sin = rope_tables(cfg, ids.shape[1], dtype)
    inputs = {"tokens": ids, "rope.cos": cos, "rope.sin": sin}
    return {**inputs, **(weights or {})}


# -- the program ----------------------------------------------------------------------


def prefill_program(
    cfg: LlamaConfig,
    batch: int,
    seq: int,
    dtype: Any = "float32",
    logits: str = "all",
    quant: Any = None,
) -> Program:
    """The prefill forward pass of `cfg` over `batch` prompts of `seq` tokens.

    Output "logits": [batch, seq, vocab] (`logits="all"`) or the last position's
    [batch, vocab] (`logits="last"`, what choosing the next token needs). Inputs and
    einsums are described in the module docstring; tasks are scoped `rope`, `embed`,
    `layers.{i}.attn`, `layers.{i}.mlp` and `head`.

    >>> tg = prefill_program(PRESETS["7b"], 1, 2048, "float16").build()
    >>> len(tg), len(tg.inputs), tg.tasks[tg.outputs["logits"]].shape
    (1167, 294, (1, 2048, 32000))
    """
    check_window(cfg, seq, "prefill_program")
    build = begin_prefill(cfg, batch, seq, dtype, logits, quant=quant)
    prog, weight = build.prog, build.weight
    with prog.scope("rope"):
        cos = prog.input("rope.cos", (seq, cfg.head_dim), build.dtype)
        sin = prog.input("rope.sin", (seq, cfg.head_dim), build.dtype)
        rot_q, rot_k = _rotation_tables(cos, sin, 1.0 / math.sqrt(cfg.head_dim))
    with prog.scope("embed"):
        embed = weight("embed")
        x = prog.gather(embed, build.tokens, label="x")
    x = decoder_layers(
        x,
        cfg.num_layers,
        lambda x, prefix: _attention(cfg, x, rot_q, rot_k, weight, prefix),
        lambda x, prefix: _mlp(cfg, x, weight, prefix),
    )
    logits_head(
        x,
        logits,
        norm=lambda x: ops.rmsnorm(x, weight("norm"), cfg.rms_norm_eps),
        table=lambda: embed if cfg.tie_embeddings else weight("lm_head"),
    )
    return prog


def _rotation_tables(cos: Tensor, sin: Tensor, q_scale: float) -> tuple[Tensor, Tensor]:
    """The rotation tables for queries and keys, from the [seq, e] cos/sin inputs (or
    their rows [batch, seq, e] at each sequence's own positions: a ragged batch).

    `rot[s, t, u, c]` is the 2x2 matrix [[cos, -sin], [sin, cos]] that rotates the pair
    (feature c, feature c + e/2) at position s; the queries' table is also multiplied
    by `q_scale`. The identity δ and J = [[0, -1], [1, 0]] come from one causal fill
    `up[t, u] = (u > t)`: δ = 1 - up[t,u] - up[u,t] and J = up[u,t] - up[t,u]. Rows per
    sequence give tables `rot[b, s, t, u, c]`.
    """
    prog = cos.program
    *lead, seq, e = cos.shape
    halves = (*lead, seq, 2, e // 2)
    cos3, sin3 = prog.view(cos, halves), prog.view(sin, halves)
    up = prog.fill((2, 2), 1.0, cos.dtype, pattern="causal", label="up")
    rotation = "a * (1 - c - d) + b * (d - c)"
    batch = "b" if lead else ""
    tables = []
    for factor, label in ((q_scale, "rot_q"), (1.0, "rot_k")):
        tables.append(
            prog.einsum(
                f"{batch}stc,{batch}stc,tu,ut->{batch}stuc",
                cos3,
                sin3,
                up,
                up,
                join=scaled(rotation, factor),
                label=label,
            )
        )
    return tables[0], tables[1]


def _rotate(x: Tensor, rot: Tensor) -> Tensor:
    """The rotary embedding of x ([..., s, e], heads first) with a table from
    `_rotation_tables` (one for every sequence, or one per sequence: batch first)."""
    prog = x.program
    *lead, seq, e = x.shape
    halves = prog.view(x, (*lead, seq, 2, e // 2))
    heads = "bgr"[: len(lead)]
    table = "bstuc" if rot.ndim == 5 else "stuc"
    out = prog.einsum(f"{heads}suc,{table}->{heads}stc", halves, rot, label="rope")
    return prog.view(out, x.shape)


def _qkv(
    cfg: LlamaConfig, x: Tensor, rot_q: Tensor, rot_k: Tensor, weight: Weight, prefix: str
) -> Heads:
    """The layer's RMSNorm and Q/K/V projections, rotated (q also scaled): `Heads`."""
    prog = x.program
    h = ops.rmsnorm(x, weight(prefix + "norm"), cfg.rms_norm_eps)
    q = prog.einsum("bsd,gred->bgrse", h, shard(weight(prefix + "wq")), label="q")
    k = prog.einsum("bsd,ged->bgse", h, shard(weight(prefix + "wk")), label="k")
    v = prog.einsum("bsd,ged->bgse", h, shard(weight(prefix + "wv")), label="v")
    if cfg.qkv_bias:
        add = "a + b"
        q = prog.einsum(
            "bgrse,gre->bgrse", q, shard(weight(prefix + "bq")), join=add, label="q.bias"
        )
        k = prog.einsum("bgse,ge->bgse", k, shard(weight(prefix + "bk")), join=add, label="k.bias")
        v = prog.einsum("bgse,ge->bgse", v, shard(weight(prefix + "bv")), join=add, label="v.bias")
    return Heads(_rotate(q, rot_q), _rotate(k, rot_k), v)


def check_window(cfg: LlamaConfig, positions: int, where: str) -> None:
    """`UnsupportedConfigError` when a program of `positions` positions would need
    sliding-window attention beyond the window (within it, attention is causal)."""
    if cfg.sliding_window is not None and positions > cfg.sliding_window:
        raise UnsupportedConfigError(
            f"{where}: {positions} positions exceed the sliding window of {cfg.sliding_window}; "
            "attention limited to the window is not implemented (programs up to the window "
            "are exact)"
        )


def _attn_out(x: Tensor, out: Tensor, weight: Weight, prefix: str) -> Tensor:
    """The output projection of the attention `out` [b, g, r, s, e], plus the residual."""
    prog = x.program
    o = prog.einsum("bgrse,gred->bsd", out, shard(weight(prefix + "wo")), label="o")
    return prog.einsum("bsd,bsd->bsd", x, o, join="a + b", label="residual")


def _attention(
    cfg: LlamaConfig, x: Tensor, rot_q: Tensor, rot_k: Tensor, weight: Weight, prefix: str
) -> Tensor:
    heads = _qkv(cfg, x, rot_q, rot_k, weight, prefix)
    return _attn_out(x, causal_attention(heads.q, heads.k, heads.v), weight, prefix)


def _mlp(cfg: LlamaConfig, x: Tensor, weight: Weight, prefix: str) -> Tensor:
    prog = x.program
    h = ops.rmsnorm(x, weight(prefix + "norm"), cfg.rms_norm_eps)
    gate = prog.einsum("bsd,md->bsm", h, shard(weight(prefix + "w_gate")), label="gate")
    up = prog.einsum("bsd,md->bsm", h, shard(weight(prefix + "w_up")), label="up")
    act = prog.einsum("bsm,bsm->bsm", gate, up, join="silu(a) * b", label="swiglu")
    down = prog.einsum("bsm,md->bsd", act, shard(weight(prefix + "w_down")), label="down")
    return prog.einsum("bsd,bsd->bsd", x, down, join="a + b", label="residual")


# -- generation --------------------------------------------------------------------------


def decoder(cfg: LlamaConfig, prog: Program, weight: Weight, dtype: str, positions: int) -> Decoder:
    """LLaMA's blocks for `einpage.models.generation`: declares the rotary tables
    `rope.cos`, `rope.sin` [positions, head_dim] (`position_inputs` makes them) and
    rotates each chunk by their rows at the chunk's positions."""
    check_window(cfg, positions, "generation")
    e = cfg.head_dim
    with prog.scope("rope"):
        cos = prog.input("rope.cos", (positions, e), dtype)
        sin = prog.input("rope.sin", (positions, e), dtype)

    def features(where: Positions) -> tuple[Tensor, Tensor]:
        with prog.scope("rope"):
            rows = where.rows(cos, "rope.cos"), where.rows(sin, "rope.sin")
            return _rotation_tables(*rows, 1.0 / math.sqrt(e))

    def head(x: Tensor) -> Tensor:
        table = weight("embed") if cfg.tie_embeddings else weight("lm_head")
        return head_logits(
            x, lambda h: ops.rmsnorm(h, weight("norm"), cfg.rms_norm_eps), lambda: table
        )

    return Decoder(
        features=features,
        embed=lambda tokens, rot: prog.gather(weight("embed"), tokens, label="x"),
        qkv=lambda x, prefix, rot: _qkv(cfg, x, rot[0], rot[1], weight, prefix),
        attn_out=lambda x, out, prefix: _attn_out(x, out, weight, prefix),
        mlp=lambda x, prefix: _mlp(cfg, x, weight, prefix),
        head=head,
    )


def position_inputs(
    cfg: LlamaConfig, positions: int, dtype: Any = "float32"
) -> dict[str, np.ndarray]:
    """The inputs `decoder` declares for `positions` positions: the rotary tables."""
    cos, sin = rope_tables(cfg, positions, dtype)
    return {"rope.cos": cos, "rope.sin": sin}


def generation_program(
    cfg: LlamaConfig,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    dtype: Any = "float32",
    **options: Any,
) -> Program:
    """`einpage.models.generation.generation_program` for LLaMA."""
    return FAMILY.generation_program(cfg, batch, prompt_len, new_tokens, dtype, **options)


def decode_program(
    cfg: LlamaConfig, batch: int, pages: int, dtype: Any = "float32", **options: Any
) -> Program:
    """`einpage.models.generation.decode_program` for LLaMA."""
    return FAMILY.decode_program(cfg, batch, pages, dtype, **options)


FAMILY = ModelFamily(
    "llama",
    LlamaConfig,
    PRESETS,
    prefill_program,
    prefill_inputs,
    decoder=decoder,
    position_inputs=position_inputs,
)
"""LLaMA as a family of `einpage.models.FAMILIES`."""
