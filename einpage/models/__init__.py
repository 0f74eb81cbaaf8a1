"""Models as einsum programs: LLaMA (`einpage.models.llama`) and GPT-2 (`einpage.models.gpt2`).

Each model module has the same shape: a frozen config with `from_hf` and `PRESETS`,
`prefill_program(cfg, batch, seq, dtype, logits)` returning an `einpage.Program`, and
weight loaders from a Hugging Face state dict or safetensors checkpoint.

>>> from einpage.models import llama
>>> llama.PRESETS["7b"].num_parameters()
6738415616
"""

from einpage.models import errors, gpt2, llama
from einpage.models.errors import *  # noqa: F403

__all__ = ["llama", "gpt2", "errors", *errors.__all__]
