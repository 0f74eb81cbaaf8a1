"""Mistral: the LLaMA architecture with sliding-window attention.

Mistral-7B is LLaMA with grouped-query attention and attention limited to the last
`sliding_window` positions (4096). Within the window that attention is the causal
one, so the family reuses `einpage.models.llama`'s programs and refuses a prefill or a
generation longer than the window (`UnsupportedConfigError`): the banded mask is not
implemented. `from_hf` reads `MistralConfig` (`model_type` "mistral").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from einpage.models import base, llama
from einpage.models.base import Getter, ModelFamily

__all__ = [
    "weight_specs",
    "weight_shapes",
    "prefill_program",
    "prefill_inputs",
    "rope_tables",
    "weights_from_state_dict",
    "weights_from_safetensors",
    "MistralConfig",
    "PRESETS",
    "FAMILY",
]


@dataclass(frozen=True)
class MistralConfig(llama.LlamaConfig):
    """A Mistral model: a `LlamaConfig` with a `sliding_window` (None: unlimited)."""

    sliding_window: int | None = 4096
    name: str = field(default="mistral", compare=False)

    model_type: ClassVar[str] = "mistral"

    @classmethod
    def hf_fields(cls, get: Getter) -> dict[str, Any]:
        return {**super().hf_fields(get), "sliding_window": get("sliding_window", None)}


weights_from_state_dict = base.weights_from_state_dict
weights_from_safetensors = base.weights_from_safetensors
weight_specs = llama.weight_specs
weight_shapes = llama.weight_shapes
prefill_program = llama.prefill_program
prefill_inputs = llama.prefill_inputs
rope_tables = llama.rope_tables

PRESETS: dict[str, MistralConfig] = {
    # Mistral-7B-v0.1: 32 query heads over 8 K/V heads, MLP 14336, window 4096.
    "7b": MistralConfig(4096, 32, 32, 8, 14336, rms_norm_eps=1e-5, name="mistral-7b"),
    "tiny": MistralConfig(
        64, 2, 4, 2, 128, vocab_size=256, sliding_window=256, name="mistral-tiny"
    ),  # fmt: skip
}
"""Mistral-7B's shape and a small one for tests."""

FAMILY = ModelFamily(
    "mistral",
    MistralConfig,
    PRESETS,
    llama.prefill_program,
    llama.prefill_inputs,
    decoder=llama.decoder,
    position_inputs=llama.position_inputs,
)
"""Mistral as a family of `einpage.models.FAMILIES`."""
