"""GPT-2 as an einsum program: config, presets, prefill program, weights.

`prefill_program(cfg, batch, seq)` is the forward pass of Hugging Face
`GPT2LMHeadModel` over a prompt (tested equal to 1e-4 of the logit scale in float32),
with the same API as `einpage.models.llama`.

Inputs of the program
---------------------
* `tokens`: int64 [batch, seq].
* Positions are derived, not an input: they are always 0..seq-1 (a prefill from the
  start of the context), so the position embeddings are the first `seq` rows of
  `pos_embed` – one slice task instead of a gather and a position-id input.
* the weights (role "weight"). As in LLaMA, every matrix keeps its wide axis (heads,
  MLP features, vocabulary) first and the hidden axis `d` last:

  =========================  ==================  ==========================================
  input                      shape               Hugging Face tensor (`transformer.` ...)
  =========================  ==================  ==========================================
  `embed`                    [vocab, d]          `wte.weight` (also the tied LM head)
  `pos_embed`                [positions, d]      `wpe.weight`
  `layers.{i}.attn.norm`     [d]                 `h.{i}.ln_1.weight`
  `layers.{i}.attn.norm_bias` [d]                `h.{i}.ln_1.bias`
  `layers.{i}.attn.wq/wk/wv` [heads, e, d]       `h.{i}.attn.c_attn.weight` [d, 3d]: columns
                                                 [0, d), [d, 2d), [2d, 3d), transposed
  `layers.{i}.attn.bq/bk/bv` [heads, e]          `h.{i}.attn.c_attn.bias` [3d], same thirds
  `layers.{i}.attn.wo`       [heads, e, d]       `h.{i}.attn.c_proj.weight` [d, d] (a view)
  `layers.{i}.attn.bo`       [d]                 `h.{i}.attn.c_proj.bias`
  `layers.{i}.mlp.norm`      [d]                 `h.{i}.ln_2.weight` (and `norm_bias`)
  `layers.{i}.mlp.w_fc`      [ffn, d]            `h.{i}.mlp.c_fc.weight` [d, ffn], transposed
  `layers.{i}.mlp.b_fc`      [ffn]               `h.{i}.mlp.c_fc.bias`
  `layers.{i}.mlp.w_proj`    [ffn, d]            `h.{i}.mlp.c_proj.weight` (a view)
  `layers.{i}.mlp.b_proj`    [d]                 `h.{i}.mlp.c_proj.bias`
  `norm`, `norm_bias`        [d]                 `ln_f.weight`, `ln_f.bias`
  =========================  ==================  ==========================================

  The fused QKV projection (`Conv1D`, stored [in, out]) is split when loading, not
  sliced in the program: the split is paid once, on the host, and reads only the
  columns each part needs; in the program Q, K and V are then three independent
  weights the planner can page separately, with no slice task per layer and no fused
  [b, s, 3d] activation that must live until its last third is used.

The einsums of one layer (h heads, e head_dim, m MLP features)
---------------------------------------------------------------
* LayerNorm: `bsd->bs` (mean), `bsd,bs->bs` (variance), `bsd,bs,bs,d,d->bsd`.
* projections `bsd,hed->bhse`; the bias add `bhse,he->bhse` for Q also applies the
  1/sqrt(head_dim) attention scale (`(a + b) * scale`), so scaling costs no task.
* attention: `bhqe,bhke->bhqk`, causal mask, softmax over k, `bhqk,bhke->bhqe`;
  output projection `bhse,hed->bsd`; bias and residual in one task
  (`bsd,bsd,d->bsd`, `a + b + c`).
* MLP: `bsd,md->bsm`, bias and GELU (tanh approximation, HF "gelu_new") in one task
  (`gelu(a + b)`), `bsm,md->bsd`, bias and residual.
* head: final LayerNorm, `bsd,vd->bsv` against the tied embedding (or `bd,vd->bv`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from einpage.models import base
from einpage.models.base import Getter, HFLayout, ModelConfig, ModelFamily, check_positive_int
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
    shard,
    token_ids,
)
from einpage.models.errors import ModelError, UnsupportedConfigError
from einpage.models.weights import WeightSpec
from einpage.program import ops
from einpage.program.program import Program, Tensor
from taskgraph import dtypes

__all__ = [
    "GPT2Config",
    "PRESETS",
    "FAMILY",
    "prefill_program",
    "prefill_inputs",
    "decoder",
    "position_inputs",
    "generation_program",
    "decode_program",
    "weight_specs",
    "weight_shapes",
    "weights_from_state_dict",
    "weights_from_safetensors",
]

_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""Hugging Face names of the tanh-approximated GELU (the same function)."""


@dataclass(frozen=True)
class GPT2Config(ModelConfig):
    """The shape of a GPT-2 model. `intermediate_size` defaults to 4 * hidden_size;
    `max_positions` is the number of learned positions (the longest prompt). The LM head
    is always the embedding (tied).

    `from_hf` rejects settings this program does not implement with
    `UnsupportedConfigError`: cross-attention, an untied LM head, activations other than
    the tanh GELU, unscaled or layer-scaled attention.

    >>> PRESETS["124m"].num_parameters()
    124439808
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int = 50257
    max_positions: int = 1024
    intermediate_size: int | None = None
    layer_norm_eps: float = 1e-5
    name: str = field(default="gpt2", compare=False)

    model_type: ClassVar[str] = "gpt2"
    hf_layout: ClassVar[HFLayout] = HFLayout(
        prefixes=("transformer.", ""), embedding="wte.weight", layers="h."
    )
    positive_ints: ClassVar[tuple[str, ...]] = (
        "hidden_size",
        "num_layers",
        "num_heads",
        "vocab_size",
        "max_positions",
        "intermediate_size",
    )
    positive_floats: ClassVar[tuple[str, ...]] = ("layer_norm_eps",)

    def __post_init__(self) -> None:
        if self.intermediate_size is None:
            check_positive_int(type(self).__name__, "hidden_size", self.hidden_size)
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        super().__post_init__()

    @property
    def ties_lm_head(self) -> bool:
        return True

    def untied_head_error(self, where: str) -> ModelError:
        return UnsupportedConfigError(
            f"{where} has an 'lm_head.weight' that differs from the embedding; "
            "only GPT-2 with a tied LM head is supported"
        )

    def hf_shapes(self) -> dict[str, dict[str, int]]:
        return {
            **super().hf_shapes(),
            "wpe.weight": {"max_positions": self.max_positions, "hidden_size": self.hidden_size},
        }

    def weight_specs(self, prefix: str = "transformer.") -> list[WeightSpec]:
        """Every weight of the program and the Hugging Face tensor it comes from (the keys
        of `GPT2LMHeadModel`; `prefix=""` for `GPT2Model` and the original checkpoints)."""
        d, h, e, v = self.hidden_size, self.num_heads, self.head_dim, self.vocab_size
        m = self.intermediate_size
        assert m is not None  # set by __post_init__
        p = self.max_positions
        specs = [
            WeightSpec("embed", (v, d), f"{prefix}wte.weight", (v, d)),
            WeightSpec("pos_embed", (p, d), f"{prefix}wpe.weight", (p, d)),
        ]
        for i in range(self.num_layers):
            specs += _layer_specs(f"layers.{i}.", f"{prefix}h.{i}.", d, h, e, m)
        specs += [
            WeightSpec("norm", (d,), f"{prefix}ln_f.weight", (d,)),
            WeightSpec("norm_bias", (d,), f"{prefix}ln_f.bias", (d,)),
        ]
        return specs

    @classmethod
    def hf_fields(cls, get: Getter) -> dict[str, Any]:
        owner = f"{cls.__name__}.from_hf"
        act = get("activation_function", "gelu_new")
        if act not in _ACTIVATIONS:
            raise UnsupportedConfigError(
                f"{owner}: activation_function={act!r} is not supported; "
                f"valid: {', '.join(_ACTIVATIONS)} (the tanh-approximated GELU)"
            )
        required = {
            "add_cross_attention": False,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "tie_word_embeddings": True,
        }
        for flag, value in required.items():
            if bool(get(flag, value)) != value:
                raise UnsupportedConfigError(
                    f"{owner}: {flag}={not value} is not supported (only {value})"
                )
        # reorder_and_upcast_attn changes only where mixed-precision training rounds:
        # the function is the same, so it is accepted.
        return {
            "hidden_size": get("n_embd", None),
            "num_layers": get("n_layer", None),
            "num_heads": get("n_head", None),
            "vocab_size": get("vocab_size", None),
            "max_positions": get("n_positions", None),
            "intermediate_size": get("n_inner", None),
            "layer_norm_eps": get("layer_norm_epsilon", 1e-5),
        }


def _layer_specs(ours: str, hf: str, d: int, h: int, e: int, m: int) -> list[WeightSpec]:
    """The weights of one layer: `ours` is `"layers.{i}."`, `hf` the checkpoint's
    `"transformer.h.{i}."`; the fused QKV weight and bias are split into thirds."""
    specs = [
        WeightSpec(ours + "attn.norm", (d,), hf + "ln_1.weight", (d,)),
        WeightSpec(ours + "attn.norm_bias", (d,), hf + "ln_1.bias", (d,)),
    ]
    for third, part in enumerate("qkv"):
        columns = (third * d, (third + 1) * d)
        specs += [
            WeightSpec(
                ours + f"attn.w{part}",
                (h, e, d),
                hf + "attn.c_attn.weight",
                (d, 3 * d),
                part=columns,
                transpose=True,
                quantize=True,
            ),
            WeightSpec(
                ours + f"attn.b{part}", (h, e), hf + "attn.c_attn.bias", (3 * d,), part=columns
            ),
        ]
    return specs + [
        WeightSpec(ours + "attn.wo", (h, e, d), hf + "attn.c_proj.weight", (d, d), quantize=True),
        WeightSpec(ours + "attn.bo", (d,), hf + "attn.c_proj.bias", (d,)),
        WeightSpec(ours + "mlp.norm", (d,), hf + "ln_2.weight", (d,)),
        WeightSpec(ours + "mlp.norm_bias", (d,), hf + "ln_2.bias", (d,)),
        WeightSpec(
            ours + "mlp.w_fc", (m, d), hf + "mlp.c_fc.weight", (d, m), transpose=True, quantize=True
        ),
        WeightSpec(ours + "mlp.b_fc", (m,), hf + "mlp.c_fc.bias", (m,)),
        WeightSpec(ours + "mlp.w_proj", (m, d), hf + "mlp.c_proj.weight", (m, d), quantize=True),
        WeightSpec(ours + "mlp.b_proj", (d,), hf + "mlp.c_proj.bias", (d,)),
    ]


PRESETS: dict[str, GPT2Config] = {
    # The four released GPT-2 models (Radford et al. 2019), vocabulary 50257, 1024 positions.
    "124m": GPT2Config(768, 12, 12, name="gpt2-124m"),
    "355m": GPT2Config(1024, 24, 16, name="gpt2-355m"),
    "774m": GPT2Config(1280, 36, 20, name="gpt2-774m"),
    "1.5b": GPT2Config(1600, 48, 25, name="gpt2-1.5b"),
    # A small shape for tests and examples.
    "tiny": GPT2Config(64, 2, 4, vocab_size=256, max_positions=32, name="gpt2-tiny"),
}
"""GPT-2 shapes by size ("124m", "355m", "774m", "1.5b") and a small one ("tiny")."""


# -- weights --------------------------------------------------------------------

weight_specs = GPT2Config.weight_specs
weight_shapes = GPT2Config.weight_shapes
weights_from_state_dict = base.weights_from_state_dict
weights_from_safetensors = base.weights_from_safetensors


def prefill_inputs(
    cfg: GPT2Config,
    tokens: Any,
    weights: Mapping[str, np.ndarray] | None = None,
    dtype: Any = "float32",
) -> dict[str, np.ndarray]:
    """Every input of `prefill_program(cfg, *tokens.shape, dtype)`: the tokens as int64 and
    the weights (as given; without them, only the tokens, for a `runtime.Session` whose
    weights are staged). `dtype` is accepted for symmetry with LLaMA."""
    dtypes.canonical(dtype)
    return {"tokens": token_ids(tokens), **(weights or {})}


# -- the program ----------------------------------------------------------------------


def prefill_program(
    cfg: GPT2Config,
    batch: int,
    seq: int,
    dtype: Any = "float32",
    logits: str = "all",
    quant: Any = None,
) -> Program:
    """The prefill forward pass of `cfg` over `batch` prompts of `seq` tokens (positions
    0..seq-1, so `seq` <= max_positions).

    Output "logits": [batch, seq, vocab] (`logits="all"`) or [batch, vocab] for the last
    position (`logits="last"`). Tasks are scoped `embed`, `layers.{i}.attn`,
    `layers.{i}.mlp` and `head`.
    """
    build = begin_prefill(
        cfg, batch, seq, dtype, logits, max_positions=cfg.max_positions, quant=quant
    )
    prog, weight = build.prog, build.weight
    with prog.scope("embed"):
        embed = weight("embed")
        positions = weight("pos_embed")
        if seq < cfg.max_positions:
            positions = prog.slice(positions, (0, 0), (seq, cfg.hidden_size), label="positions")
        x = prog.gather(embed, build.tokens, label="tokens")
        x = prog.einsum("bsd,sd->bsd", x, positions, join="a + b", label="x")
    x = decoder_layers(
        x,
        cfg.num_layers,
        lambda x, prefix: _attention(cfg, x, weight, prefix),
        lambda x, prefix: _mlp(cfg, x, weight, prefix),
    )
    logits_head(
        x,
        logits,
        norm=lambda x: ops.layernorm(x, weight("norm"), weight("norm_bias"), cfg.layer_norm_eps),
        table=lambda: embed,
    )
    return prog


def _qkv(cfg: GPT2Config, x: Tensor, weight: Weight, prefix: str) -> Heads:
    """The layer's LayerNorm and Q/K/V projections with their biases (q also scaled)."""
    prog = x.program
    h = ops.layernorm(x, weight(prefix + "norm"), weight(prefix + "norm_bias"), cfg.layer_norm_eps)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    heads = {}
    for part, join in (("q", f"(a + b) * {scale!r}"), ("k", "a + b"), ("v", "a + b")):
        y = prog.einsum("bsd,hed->bhse", h, shard(weight(prefix + "w" + part)), label=part)
        heads[part] = prog.einsum(
            "bhse,he->bhse", y, shard(weight(prefix + "b" + part)), join=join, label=part + ".bias"
        )
    return Heads(heads["q"], heads["k"], heads["v"])


def _attn_out(x: Tensor, out: Tensor, weight: Weight, prefix: str) -> Tensor:
    """The output projection of the attention `out` [b, h, s, e], its bias and the residual."""
    prog = x.program
    o = prog.einsum("bhse,hed->bsd", out, shard(weight(prefix + "wo")), label="o")
    bias = weight(prefix + "bo")
    return prog.einsum("bsd,bsd,d->bsd", x, o, bias, join="a + b + c", label="residual")


def _attention(cfg: GPT2Config, x: Tensor, weight: Weight, prefix: str) -> Tensor:
    heads = _qkv(cfg, x, weight, prefix)
    return _attn_out(x, causal_attention(heads.q, heads.k, heads.v), weight, prefix)


def _mlp(cfg: GPT2Config, x: Tensor, weight: Weight, prefix: str) -> Tensor:
    prog = x.program
    h = ops.layernorm(x, weight(prefix + "norm"), weight(prefix + "norm_bias"), cfg.layer_norm_eps)
    fc = prog.einsum("bsd,md->bsm", h, shard(weight(prefix + "w_fc")), label="fc")
    act = prog.einsum(
        "bsm,m->bsm", fc, shard(weight(prefix + "b_fc")), join="gelu(a + b)", label="gelu"
    )
    proj = prog.einsum("bsm,md->bsd", act, shard(weight(prefix + "w_proj")), label="proj")
    bias = weight(prefix + "b_proj")
    return prog.einsum("bsd,bsd,d->bsd", x, proj, bias, join="a + b + c", label="residual")


# -- generation --------------------------------------------------------------------------


def decoder(cfg: GPT2Config, prog: Program, weight: Weight, dtype: str, positions: int) -> Decoder:
    """GPT-2's blocks for `einpage.models.generation`: a chunk's position embeddings are
    the rows of `pos_embed` at its positions (so at most `max_positions` positions)."""

    def features(where: Positions) -> Tensor:
        with prog.scope("embed"):
            return where.rows(weight("pos_embed"), "positions")

    def embed(tokens: Tensor, rows: Tensor) -> Tensor:
        x = prog.gather(weight("embed"), tokens, label="tokens")
        spec = "bsd,bsd->bsd" if rows.ndim == 3 else "bsd,sd->bsd"  # rows per sequence
        return prog.einsum(spec, x, rows, join="a + b", label="x")

    def norm(h: Tensor) -> Tensor:
        return ops.layernorm(h, weight("norm"), weight("norm_bias"), cfg.layer_norm_eps)

    return Decoder(
        features=features,
        embed=embed,
        qkv=lambda x, prefix, rows: _qkv(cfg, x, weight, prefix),
        attn_out=lambda x, out, prefix: _attn_out(x, out, weight, prefix),
        mlp=lambda x, prefix: _mlp(cfg, x, weight, prefix),
        head=lambda x: head_logits(x, norm, lambda: weight("embed")),
        max_positions=cfg.max_positions,
    )


def position_inputs(
    cfg: GPT2Config, positions: int, dtype: Any = "float32"
) -> dict[str, np.ndarray]:
    """None: GPT-2's positions are rows of a weight (`pos_embed`)."""
    dtypes.canonical(dtype)
    return {}


def generation_program(
    cfg: GPT2Config,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    dtype: Any = "float32",
    **options: Any,
) -> Program:
    """`einpage.models.generation.generation_program` for GPT-2."""
    return FAMILY.generation_program(cfg, batch, prompt_len, new_tokens, dtype, **options)


def decode_program(
    cfg: GPT2Config, batch: int, pages: int, dtype: Any = "float32", **options: Any
) -> Program:
    """`einpage.models.generation.decode_program` for GPT-2."""
    return FAMILY.decode_program(cfg, batch, pages, dtype, **options)


FAMILY = ModelFamily(
    "gpt2",
    GPT2Config,
    PRESETS,
    prefill_program,
    prefill_inputs,
    decoder=decoder,
    position_inputs=position_inputs,
)
"""GPT-2 as a family of `einpage.models.FAMILIES`."""
