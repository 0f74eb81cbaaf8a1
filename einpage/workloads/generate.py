"""`generate(...)`: tokens out of a model under a device-memory budget, in one call.

`generate(model, weights, prompt, new_tokens, budget)` plans the generation
(`einpage.workloads.generation`: unrolled or step plans, under the one budget shared by
weights, KV pages and activations), runs it (NumPy or CuPy runtime) and returns the ids
with the plans and their stats.

* `model`: a family config (`llama.LlamaConfig`, `gpt2.GPT2Config`, ...) or a checkpoint
  folder as `save_pretrained` writes it (its `config.json` names the family; its
  safetensors are the weights unless given; its `tokenizer.json` encodes text).
* `weights`: the program's weights (`{input name: array}`), a Hugging Face state dict,
  or a safetensors checkpoint path.
* `prompt`: token ids [batch, prompt_len] (a NumPy array or torch tensor), or text (a
  string, repeated `batch` times, or one string per sequence) with a tokenizer.

>>> from einpage.models import llama
>>> out = generate(llama.PRESETS["tiny"], prompt=np.zeros((1, 5), np.int64),
...                new_tokens=4, budget="8MiB", run=False, page_size=4)
>>> out.ids is None, out.stats.plans, out.plan.way
(True, 1, 'unrolled')
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import runtime
from einpage.models import FAMILIES, family_of
from einpage.models.base import (
    ModelConfig,
    ModelFamily,
    weights_from_safetensors,
    weights_from_state_dict,
)
from einpage.models.checkpoint import require_hf_config
from einpage.models.decode import Sampling
from einpage.models.errors import GenerationError
from einpage.models.generation import DEFAULT_PAGE_SIZE, check_tokens
from einpage.workloads import text
from einpage.workloads.generation import (
    GenerationSpec,
    GenerationStats,
    StepPlans,
    UnrolledPlan,
    plan_generation,
)
from einpage_core.host import available_memory
from einpage_core.units import format_bytes
from taskgraph import dtypes

__all__ = [
    "generate",
    "Generation",
    "HostMemoryError",
    "check_run_memory",
    "weight_bytes",
    "resolve_model",
    "family_of",
    "program_weights",
]


@dataclass(frozen=True)
class Generation:
    """What `generate` made: `ids` [batch, prompt_len + new_tokens] (the prompt, then the
    new tokens; None when not run), `new_ids` [batch, new_tokens], each step's `logits`
    when asked for, `text` (each sequence decoded, when a tokenizer was used), the `plan`
    (`UnrolledPlan` or `StepPlans`: its `plans` are the compiled plans) and its `stats`."""

    spec: GenerationSpec
    plan: UnrolledPlan | StepPlans
    stats: GenerationStats
    ids: np.ndarray | None = None
    new_ids: np.ndarray | None = None
    logits: np.ndarray | None = None
    text: list[str] | None = None
    reports: tuple[Any, ...] = field(default=(), repr=False)


def resolve_model(model: Any) -> tuple[ModelFamily, ModelConfig, Path | None]:
    """(family, config, checkpoint folder or None) of a config or a checkpoint path."""
    if isinstance(model, ModelConfig):
        return family_of(model), model, None
    if isinstance(model, str | os.PathLike):
        config, _ = require_hf_config(model, "", caller="generate")
        kind = config.get("model_type")
        for family in FAMILIES.values():
            if family.config.model_type == kind:
                return family, family.config.from_checkpoint(model), Path(model)
        raise GenerationError(
            f"the checkpoint {str(model)!r} has model_type {kind!r}; supported: "
            + ", ".join(f.config.model_type for f in FAMILIES.values())
        )
    raise GenerationError(
        f"model must be a model config or a checkpoint path, got {type(model).__name__}"
    )


def program_weights(
    cfg: ModelConfig, weights: Any, dtype: str, checkpoint: Path | None
) -> dict[str, np.ndarray]:
    """The program's weights from what `generate` was given (see the module docstring)."""
    if weights is None:
        if checkpoint is None:
            raise GenerationError("weights are needed to run: give weights or a checkpoint path")
        return weights_from_safetensors(cfg, checkpoint, dtype)
    if isinstance(weights, str | os.PathLike):
        return weights_from_safetensors(cfg, weights, dtype)
    if not isinstance(weights, Mapping):
        raise GenerationError(
            f"weights must be a mapping or a checkpoint path, got {type(weights).__name__}"
        )
    if set(cfg.weight_shapes()) <= set(weights):
        return {name: np.asarray(weights[name], dtype=dtype) for name in cfg.weight_shapes()}
    return weights_from_state_dict(cfg, weights, dtype)


class HostMemoryError(GenerationError):
    """A run would need more host memory than is available (checked before any weight is
    read or drawn, so it fails in a second, not killed by the kernel minutes in)."""


def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of the program's weights in `dtype`."""
    size = dtypes.itemsize(dtypes.canonical(dtype))
    return sum(math.prod(shape) for shape in cfg.weight_shapes().values()) * size


def check_run_memory(plan: UnrolledPlan | StepPlans, backend: Any, weights: str | None) -> int:
    """The host memory a run of `plan` on `backend` needs, checked against what is
    available now (`einpage_core.host.available_memory`) before anything is allocated;
    `HostMemoryError` with the numbers when it does not fit. `weights` says what the
    run will make besides the plans' own needs (`host_bytes`): "random" (drawn, one weight
    at a time in float32 at most, then cast), "checkpoint" (read, one tensor at a time
    converted), or None (the caller holds them already)."""
    spec = plan.spec
    chosen = runtime.get_backend(backend, dtypes={spec.dtype})  # as the run will choose
    rows = []
    if weights is not None:
        held = weight_bytes(spec.cfg, spec.dtype)
        largest = max(math.prod(s) for s in spec.cfg.weight_shapes().values())
        scratch = largest * max(4, dtypes.itemsize(spec.dtype))
        rows.append((held + scratch, f"the weights in {spec.dtype}, {weights}, "
                     f"{format_bytes(held)}, and one weight's {format_bytes(scratch)} "
                     "while it is made"))  # fmt: skip
    runs = plan.host_bytes(chosen)
    parts = ["the plans' host storage", "the inputs"]
    if chosen.arena_on_host:
        parts.insert(0, "the arena (the budget) in host memory")
    if plan.way == "steps":
        parts.insert(-1, "the KV pages kept between step plans")
    rows.append((runs, f"the run on {chosen.name}, {format_bytes(runs)}: {', '.join(parts)}"))
    need = sum(n for n, _ in rows)
    available = available_memory()
    if available is not None and need > available:
        ways = ["a smaller model", "a machine with more memory"]
        if dtypes.itemsize(spec.dtype) > 2 and weights is not None:
            ways.insert(0, "--dtype float16 or bfloat16 (half the weight bytes or less)")
        if chosen.arena_on_host:
            ways.insert(0, "the cupy backend (its arena in GPU memory)")
        raise HostMemoryError(
            f"the run needs about {format_bytes(need)} ({need} B) of host memory and "
            f"{format_bytes(available)} ({available} B) is available: "
            + "; ".join(what for _, what in rows)
            + f". Nothing was allocated; try {', '.join(ways)}, or plan without running "
            "(no --run; run=False)"
        )
    return need


def _prompt_ids(
    prompt: Any, tokenizer: Any, checkpoint: Path | None, batch: int | None, vocab: int
) -> tuple[np.ndarray, Any]:
    """The prompt as ids, and the tokenizer used (None for ids)."""
    if prompt is None:
        raise GenerationError("a prompt is needed: token ids [batch, prompt_len] or text")
    is_text = isinstance(prompt, str) or (
        isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(p, str) for p in prompt)
    )
    if not is_text:
        ids = check_tokens(prompt, vocab)
        if batch is not None and ids.shape[0] != batch:
            raise GenerationError(f"batch={batch} but the prompt has {ids.shape[0]} rows")
        return ids, None
    if tokenizer is None:
        found = None if checkpoint is None else text.find_tokenizer(checkpoint)
        if found is None:
            raise GenerationError(text.missing_tokenizer(checkpoint, "tokenizer=..."))
        tokenizer = found
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = text.load_tokenizer(tokenizer)
    return check_tokens(text.encode(tokenizer, prompt, batch), vocab), tokenizer


def generate(
    model: Any,
    weights: Any = None,
    prompt: Any = None,
    new_tokens: int = 16,
    budget: int | str = "100%",
    *,
    way: str = "unrolled",
    sampling: Sampling | None = None,
    seed: int = 0,
    dtype: str = "float32",
    page_size: int = DEFAULT_PAGE_SIZE,
    batch: int | None = None,
    tokenizer: Any = None,
    run: bool = True,
    backend: Any = "numpy",
    mode: str | None = None,
    logits: bool = False,
    cost_model: str = "h100-pcie5",
    bucket_pages: int = 1,
    chunk_steps: int = 1,
    **plan_options: Any,
) -> Generation:
    """Generate `new_tokens` tokens after `prompt` (module docstring) with the model
    planned under `budget` (bytes, a size string, or a percentage of the plans' resident
    peak, `"100%"` by default: nothing moves, or of one token's streaming minimum,
    `"50%streaming"`, the same bytes both ways: `read_generation_budget`; `plan.budget`
    says how it was read) one `way` ("unrolled" or "steps"); greedy unless `sampling` is
    given (its
    noise drawn from `seed`); step plans serve buckets of `bucket_pages` pages and
    chunks of `chunk_steps` steps. With `run=False` it only plans (no weights needed).
    `plan_options` go to `einpage.compile`. Raises `GenerationError` for bad arguments
    and `GenerationBudgetError` when the budget is too small (naming the step and task).
    """
    family, cfg, checkpoint = resolve_model(model)
    ids, used = _prompt_ids(prompt, tokenizer, checkpoint, batch, cfg.vocab_size)
    spec = GenerationSpec(
        family,
        cfg,
        ids.shape[0],
        ids.shape[1],
        new_tokens,
        dtype,
        page_size,
        sampling,
        logits,
    )
    plan = plan_generation(
        spec, budget, way, bucket_pages=bucket_pages, chunk_steps=chunk_steps, **plan_options
    )
    stats = plan.stats(cost_model)
    if not run:
        return Generation(spec, plan, stats)
    reads = weights is None or isinstance(weights, str | os.PathLike)
    check_run_memory(plan, backend, "read from the checkpoint" if reads else None)
    values = program_weights(cfg, weights, spec.dtype, checkpoint)
    out = plan.run(values, ids, seed=seed, backend=backend, mode=mode)
    full = np.concatenate([ids, out.ids], axis=1)
    decoded = None if used is None else text.decode(used, full)
    return Generation(spec, plan, stats, full, out.ids, out.logits, decoded, out.reports)
