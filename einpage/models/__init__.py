"""Models as einsum programs: the families LLaMA 1/2/3 (`einpage.models.llama`), Qwen2
(`qwen2`), Mistral (`mistral`) and GPT-2 (`gpt2`).

Each model module is a family with the same shape: a frozen config (a
`base.ModelConfig`) with `from_hf`, `from_checkpoint` and `PRESETS`,
`prefill_program(cfg, batch, seq, dtype, logits)` returning an `einpage.Program`,
`prefill_inputs`, and weight loaders from a Hugging Face state dict or safetensors
checkpoint. `FAMILIES` maps each family's name to its `base.ModelFamily` record;
`einpage.models.base` says how to add a family.

>>> from einpage.models import llama
>>> llama.PRESETS["7b"].num_parameters()
6738415616

Running a real checkpoint – a directory written by `save_pretrained`, e.g. a download of
`meta-llama/Llama-2-7b-hf` (RoPE scalings other than Llama 3's and linear are refused
by `from_hf`, naming them) – on a GPU with less memory than the model::

    import memgraph, runtime
    from einpage.models import llama

    cfg = llama.LlamaConfig.from_checkpoint("Llama-2-7b-hf")  # its config.json
    weights = llama.weights_from_safetensors(cfg, "Llama-2-7b-hf", "float16")  # host RAM
    tokens = np.array([tokenizer("The capital of France is").input_ids])  # [batch, seq]
    tg = llama.prefill_program(cfg, *tokens.shape, "float16", logits="last").build()
    mg = memgraph.plan(tg, "8GiB")  # any budget >= memgraph.min_budget(tg)[0]
    with runtime.Session(mg, "auto") as session:  # CuPy on a GPU, else NumPy
        session.stage(weights)  # once; each run then passes only the activations
        logits = session.run(llama.prefill_inputs(cfg, tokens, dtype="float16"))["logits"]
    next_token = logits.argmax(-1)  # [batch]

A program has fixed (batch, seq): prompts of another length need another program and
plan (plans are fast: ~0.1 s for 7B). Generating tokens – a prefill and decode steps
over a paged KV cache, planned under the same budget – is `einpage.workloads.generate.generate`
(programs: `einpage.models.generation`, built from each family's `decoder`).
`notebooks/03_llama.py` walks through the same steps with a small model, and
`benchmarks/llama_plans.py` plans the 7B and 65B shapes.
"""

from einpage.models import base, decode, errors, generation, gpt2, llama, mistral, qwen2
from einpage.models.base import ModelConfig, ModelFamily
from einpage.models.errors import *  # noqa: F403
from einpage.models.errors import ConfigError

FAMILIES: dict[str, ModelFamily] = {
    family.name: family for family in (llama.FAMILY, gpt2.FAMILY, qwen2.FAMILY, mistral.FAMILY)
}
"""Every model family by name (`"llama"`, `"gpt2"`, `"qwen2"`, `"mistral"`), as the CLI's
presets name them."""


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family of `FAMILIES` whose config class is the nearest class of `cfg`: its own,
    else its closest base with a family (a config subclassing `Qwen2Config` is Qwen2, not
    LLaMA, although `Qwen2Config` is itself a `LlamaConfig`). `ConfigError` for an object
    no family's config class is a base of.

    >>> family_of(qwen2.PRESETS["tiny"]).name, family_of(mistral.PRESETS["tiny"]).name
    ('qwen2', 'mistral')
    """
    by_config = {family.config: family for family in FAMILIES.values()}
    for cls in type(cfg).__mro__:
        if cls in by_config:
            return by_config[cls]
    known = ", ".join(f"{f.config.__name__} ({f.name})" for f in FAMILIES.values())
    raise ConfigError(f"no model family has the config {type(cfg).__name__}; known: {known}")


__all__ = [
    "llama",
    "gpt2",
    "qwen2",
    "mistral",
    "base",
    "decode",
    "generation",
    "errors",
    "FAMILIES",
    "family_of",
    "ModelConfig",
    "ModelFamily",
    *errors.__all__,
]
