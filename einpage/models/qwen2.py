"""Qwen2: the LLaMA architecture with biases on the Q, K and V projections.

Everything else – RMSNorm, SwiGLU MLP, grouped-query attention, RoPE (theta 1e6),
often a tied LM head – is LLaMA's, so the family reuses `einpage.models.llama`'s
programs with `qkv_bias=True`: `q = h·Wq + bq` (likewise k, v) before the rotation.
`from_hf` reads `Qwen2Config` (`model_type` "qwen2"); sliding-window attention
(`use_sliding_window=True`) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from einpage.models import base, llama
from einpage.models.base import Getter, ModelFamily
from einpage.models.errors import UnsupportedConfigError

__all__ = [
    "weight_specs",
    "weight_shapes",
    "prefill_program",
    "prefill_inputs",
    "rope_tables",
    "weights_from_state_dict",
    "weights_from_safetensors",
    "Qwen2Config",
    "PRESETS",
    "FAMILY",
]


@dataclass(frozen=True)
class Qwen2Config(llama.LlamaConfig):
    """A Qwen2 model: a `LlamaConfig` whose Q/K/V projections have biases."""

    qkv_bias: bool = True
    name: str = field(default="qwen2", compare=False)

    model_type: ClassVar[str] = "qwen2"

    @classmethod
    def hf_fields(cls, get: Getter) -> dict[str, Any]:
        if get("use_sliding_window", False):
            raise UnsupportedConfigError(
                "Qwen2Config.from_hf: use_sliding_window=True is not supported"
            )
        return {**super().hf_fields(get), "qkv_bias": True}


weights_from_state_dict = base.weights_from_state_dict
weights_from_safetensors = base.weights_from_safetensors
weight_specs = llama.weight_specs
weight_shapes = llama.weight_shapes
prefill_program = llama.prefill_program
prefill_inputs = llama.prefill_inputs
rope_tables = llama.rope_tables

PRESETS: dict[str, Qwen2Config] = {
    # Qwen2-7B: 28 layers, 28 query heads over 4 K/V heads, vocabulary 152,064.
    "7b": Qwen2Config(
        3584, 28, 28, 4, 18944, vocab_size=152064, rope_theta=1e6, name="qwen2-7b"
    ),  # fmt: skip
    "tiny": Qwen2Config(64, 2, 4, 2, 128, vocab_size=256, tie_embeddings=True, name="qwen2-tiny"),
}
"""Qwen2-7B's shape and a small one for tests."""

FAMILY = ModelFamily(
    "qwen2",
    Qwen2Config,
    PRESETS,
    llama.prefill_program,
    llama.prefill_inputs,
    decoder=llama.decoder,
    position_inputs=llama.position_inputs,
)
"""Qwen2 as a family of `einpage.models.FAMILIES`."""
