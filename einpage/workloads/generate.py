"""`generate(...)`: tokens out of a model under a device-memory budget, in one call.

`generate(model, prompt, new_tokens, budget)` plans the generation
(`einpage.workloads.generation`: unrolled or step plans, under the one budget shared by
weights, KV pages and activations), runs it (NumPy or CuPy runtime) and returns the ids
with the plans and their stats.

* `model`: a family config (`llama.LlamaConfig`, `gpt2.GPT2Config`, ...), a checkpoint
  folder as `save_pretrained` writes it (its `config.json` names the family; its
  safetensors are the weights unless given; its `tokenizer.json` encodes text), or a
  GGUF file (`.gguf`: config, weights and tokenizer from the one file,
  `einpage.models.gguf`; its quantized tensors planned and held quantized, rebuilt on
  the device: `run_weights`).
* `prompt`: token ids [batch, prompt_len] (a NumPy array or torch tensor), or text (a
  string, repeated `batch` times, or one string per sequence) with a tokenizer. Prompts
  of different lengths – a list of strings, or of id lists – are one ragged batch: left
  padded to the longest, with each sequence's positions and an attention mask that hides
  its padding (`GenerationSpec.lengths`, `Generation.prompt_lengths`), as Hugging Face
  generates with `padding_side="left"`.
* `messages=` instead of a prompt: a conversation (`[{"role": "user", "content": ...}]`,
  repeated `batch` times) or one per sequence (of different lengths: a ragged batch),
  written as the checkpoint's chat template says (`einpage.workloads.chat`: as
  transformers' `apply_chat_template(..., add_generation_prompt=True)`), or as
  `chat_template=` (a `ChatTemplate`) says.
* `stop=`: strings that end a sequence (with a tokenizer), and `eos=`: the ids that do
  (None: the checkpoint's `eos_token_id`; `()`: none), per sequence
  (`einpage.workloads.stop`; a ragged batch's padding never stops one): step plans end
  once every sequence has stopped, an unrolled plan's tokens after a stop are masked;
  the stats count the tokens kept (`Generation.new_lengths`: each sequence's).
* `weights=`: the program's weights, a mapping whose keys are exactly the program's
  weight names (`cfg.weight_shapes()`; `<family>.weights_from_state_dict(cfg, sd)` makes
  one from a Hugging Face state dict, which is not taken as it is), or a safetensors
  checkpoint path; None with a checkpoint folder as the model.

The rest is said by three records, each checked once, when made:

* `sampling=Sampling(temperature, top_k, seed)`: how the next token is drawn (None:
  the greedy argmax);
* `plan=Planning(way, bucket_pages, chunk_steps, cost_model, options, devices)`: how it
  is planned (`einpage.workloads.generation.Planning`); `devices=N` places the
  generation on N devices (a pipeline, the budget read per device: the unrolled plan as
  a `DevicesPlan`, step plans as a `DevicesStepPlans`); `host_budget=` and `spill=` plan
  host memory too (`memgraph.tiers`): the weights of a checkpoint folder read where
  they are, when the plan needs them, and what does not fit the host budget written to
  a spill file in the folder `spill` (one device, the unrolled way);
* `run=Running(backend, mode, runner)`: how it runs (`runner` "ray": the devices of a
  placed generation as Ray actors); `run=None` only plans (no weights needed).

The keywords of the old signature that moved into these records (`way=`, `chunk_steps=`,
`backend=`, `seed=`, `eviction=`, ...) and `run=True`/`run=False` are refused with a
`GenerationError` that says where each went.

>>> from einpage.models import llama
>>> out = generate(llama.PRESETS["tiny"], np.zeros((1, 5), np.int64), 4, "8MiB",
...                page_size=4, run=None)
>>> out.ids is None, out.stats.plans, out.plan.way
(True, 1, 'unrolled')
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

import runtime
from einpage.errors import EinpageError
from einpage.models import FAMILIES, family_of
from einpage.models.base import ModelConfig, ModelFamily, weights_from_safetensors
from einpage.models.checkpoint import CONFIG_FILE, checkpoint_dtype, require_hf_config
from einpage.models.decode import Sampling
from einpage.models.errors import GenerationError
from einpage.models.generation import (
    DEFAULT_PAGE_SIZE,
    check_tokens,
    pad_prompts,
    quant_by_weight,
)
from einpage.models.gguf import is_gguf, opened_gguf
from einpage.models.weights import load_weights
from einpage.pipeline.devices import RUNNERS
from einpage.program.quantize import Quantization
from einpage.workloads import text
from einpage.workloads.chat import ChatError, ChatTemplate, chat_rows
from einpage.workloads.generation import (
    ON_DEVICES,
    DevicesNotBuiltError,
    DevicesPlan,
    DevicesStepPlans,
    GenerationSpec,
    GenerationStats,
    Planning,
    StepPlans,
    UnrolledPlan,
    moved_keywords,
    plan_generation,
    planning_homes,
)
from einpage.workloads.stop import Stopping, checkpoint_stopping, kept_stats, run_stopping
from einpage_core.host import available_memory
from einpage_core.units import format_bytes
from runtime.schedule import resolve_mode
from runtime.tiers import disk_inputs
from taskgraph import dtypes

__all__ = [
    "generate",
    "Sampling",
    "Planning",
    "Running",
    "Generation",
    "HostMemoryError",
    "check_run_memory",
    "weight_bytes",
    "resolve_model",
    "family_of",
    "program_weights",
    "choose_dtype",
    "DEFAULT_DTYPE",
    "ChatTemplate",
    "Stopping",
    "unpadded",
    "quantized_weight_bytes",
    "run_weights",
    "reads_in_place",
    "file_quantization",
]

DEFAULT_DTYPE = "float32"
"""The dtype of a generation whose model names none (a config, or a checkpoint whose
config.json has no `dtype`/`torch_dtype`) when none is given."""


@dataclass(frozen=True)
class Running:
    """How `generate` runs its plans, checked when made: on `backend` ("numpy", "cupy",
    "auto" – CuPy when a GPU is usable –, a name `runtime.register_backend` added, or a
    `runtime.Backend`) in `mode` (`runtime.MODES`: "sequential", "streams", "random";
    None: the backend's own). `generate(..., run=None)` plans without running.

    >>> Running(backend="auto", mode="streams")
    Running(backend='auto', mode='streams', runner='local', direct_io=False)
    """

    backend: Any = "numpy"
    mode: str | None = None
    runner: str = "local"
    """Where a generation placed on several devices (`Planning(devices=N)`) runs
    (`einpage.pipeline.RUNNERS`): "local" (a thread and an arena per device, in this
    process) or "ray" (a Ray actor per device: `pip install 'einpage[cluster]'`). One
    device runs in this process, "local"."""
    direct_io: bool = False
    """A generation planned with a host tier (`Planning(host_budget=...)`) moves its disk
    bytes with O_DIRECT where the file system allows, keeping the page cache out of the
    way (`runtime.Session(direct_io=)`); off: through the page cache."""

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise GenerationError(
                f"Running: runner must be one of {', '.join(map(repr, RUNNERS))}, got "
                f"{self.runner!r}"
            )
        names = runtime.backend_names()
        if not isinstance(self.backend, runtime.Backend) and self.backend not in names:
            raise GenerationError(
                f"Running: backend must be one of {', '.join(map(repr, names))} or a "
                f"runtime.Backend, got {self.backend!r}"
            )
        if self.mode is not None:
            try:
                resolve_mode(self.mode, "sequential")
            except EinpageError as err:
                raise GenerationError(f"Running: {err}") from err
        if not isinstance(self.direct_io, bool):
            raise GenerationError(
                f"Running: direct_io must be True or False, got {self.direct_io!r}"
            )


DEFAULT_PLANNING = Planning()
"""`generate`'s planning unless given: one unrolled plan, on the default cost model."""

DEFAULT_RUNNING = Running()
"""`generate`'s run unless given: on NumPy, in its default mode."""

MOVED = {
    **planning_homes("plan="),
    "backend": "run=Running(backend={v})",
    "mode": "run=Running(mode={v})",
    "seed": "sampling=Sampling(..., seed={v})",
}
"""Where the keywords of `generate`'s old signature went (`moved_keywords`)."""

PARAMETERS = (
    "model, prompt, new_tokens, budget, weights=, tokenizer=, batch=, dtype=, page_size=, "
    "logits=, sampling=, plan=, run=, quant=, messages=, chat_template=, stop=, eos="
)
"""`generate`'s parameters, as its errors list them."""


@dataclass(frozen=True)
class Generation:
    """What `generate` made: `ids` [batch, prompt_len + n] (the prompt – left padded in a
    ragged batch, see `prompt_lengths` –, then the new tokens; None when not run),
    `new_ids` [batch, n], each step's `logits` when asked for, `text` (each sequence
    decoded without its padding and up to where it stopped, when a tokenizer was used),
    the `plan` (`UnrolledPlan`, `StepPlans`, or on several devices `DevicesPlan` or
    `DevicesStepPlans`: its `plans` are the compiled plans) and
    its `stats` (after a run, of the tokens kept). `new_lengths` [batch]: the new tokens
    each sequence kept – all `new_tokens` unless it stopped (`stopping`:
    `einpage.workloads.stop`; then n is the longest kept, and a shorter sequence's later
    ids are the pad id)."""

    spec: GenerationSpec
    plan: UnrolledPlan | StepPlans | DevicesPlan | DevicesStepPlans
    stats: GenerationStats
    ids: np.ndarray | None = None
    new_ids: np.ndarray | None = None
    logits: np.ndarray | None = None
    text: list[str] | None = None
    reports: tuple[Any, ...] = field(default=(), repr=False)
    new_lengths: np.ndarray | None = None
    stopping: Stopping | None = None
    prompt_lengths: tuple[int, ...] | None = None
    """Each prompt's length in a ragged batch (None: every prompt is `prompt_len` long):
    row i of `ids` starts with `prompt_len - prompt_lengths[i]` padding ids (0)."""


def resolve_model(model: Any) -> tuple[ModelFamily, ModelConfig, Path | None]:
    """(family, config, checkpoint folder or None) of a config or a checkpoint path."""
    if isinstance(model, ModelConfig):
        return family_of(model), model, None
    if is_gguf(model):
        opened = opened_gguf(model)
        return opened.family, opened.config, Path(model)
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


def choose_dtype(dtype: str | None, checkpoint: Path | None) -> tuple[str, str]:
    """The dtype a generation is planned in, and why: `dtype` when given ("given"); else
    the checkpoint's own, as its config.json names it (`checkpoint_dtype`: "the
    checkpoint's"; a bfloat16 checkpoint planned in float32 would silently take twice
    its memory) or a GGUF file's float tensors are stored (`GGUFModel.dtype`); else
    `DEFAULT_DTYPE` ("the default"). `CheckpointError` when the checkpoint names a dtype
    einpage does not plan in and none is given."""
    if dtype is not None:
        return dtype, "given"
    if checkpoint is not None and is_gguf(checkpoint):
        return opened_gguf(checkpoint).dtype, "the GGUF file's"
    if checkpoint is not None:
        config, _ = require_hf_config(checkpoint, "", caller="generate")
        folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
        own = checkpoint_dtype(config, str(folder / CONFIG_FILE))
        if own is not None:
            return own, "the checkpoint's"
    return DEFAULT_DTYPE, "the default"


def program_weights(
    cfg: ModelConfig, weights: Any, dtype: str, checkpoint: Path | None
) -> dict[str, np.ndarray]:
    """The program's weights in `dtype` from what `generate` was given (the module
    docstring says what it takes): checked by `_weights_source`, then read."""
    return _read_weights(cfg, _weights_source(cfg, weights, checkpoint), dtype)


def _weights_source(
    cfg: ModelConfig, weights: Any, checkpoint: Path | None
) -> Path | Mapping[str, Any]:
    """Where the weights come from, checked before anything is read: a checkpoint path,
    or a mapping whose keys are exactly the program's weight names. Nothing is guessed
    from keys: a mapping with other names (a Hugging Face state dict) is refused, saying
    how to convert it."""
    if weights is None:
        if checkpoint is None:
            raise GenerationError("weights are needed to run: give weights or a checkpoint path")
        return checkpoint
    if isinstance(weights, str | os.PathLike):
        return Path(weights)
    if not isinstance(weights, Mapping):
        raise GenerationError(
            f"weights must be a mapping or a checkpoint path, got {type(weights).__name__}"
        )
    names = set(cfg.weight_shapes())
    missing = sorted(names - set(weights))
    others = sorted(str(k) for k in weights if k not in names)
    if not missing and not others:
        return weights
    if len(missing) == len(names):
        family = family_of(cfg).name
        raise GenerationError(
            f"weights has none of the program's weight names (such as {missing[0]!r}; "
            f"it has {_few(others)}): a Hugging Face state dict is not taken as it is; "
            f"convert it with einpage.models.{family}.weights_from_state_dict(cfg, "
            "state_dict)"
        )
    said = [f"missing {_few(missing)}"] if missing else []
    said += [f"not the program's: {_few(others)}"] if others else []
    raise GenerationError(
        "weights must have exactly the program's weight names (cfg.weight_shapes()): "
        + "; ".join(said)
    )


def _few(names: list[str], shown: int = 3) -> str:
    """Up to `shown` names, and how many more."""
    text = ", ".join(map(repr, names[:shown]))
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _read_weights(
    cfg: ModelConfig, source: Path | Mapping[str, Any], dtype: str
) -> dict[str, np.ndarray]:
    """The weights of a checked `source` (`_weights_source`) as arrays of `dtype`."""
    if isinstance(source, Path) and is_gguf(source):  # read against `cfg`, checked
        return load_weights(cfg.weight_specs(), opened_gguf(source).source(), dtype)
    if isinstance(source, Path):
        return weights_from_safetensors(cfg, source, dtype)
    return {name: np.asarray(source[name], dtype=dtype) for name in cfg.weight_shapes()}


def run_weights(
    spec: GenerationSpec, weights: Any, checkpoint: Path | None
) -> dict[str, np.ndarray]:
    """The inputs a run of `spec`'s plans reads for its weights, from what `generate` was
    given (`weights`, else the checkpoint): a GGUF file planned with its own quantization
    (`GGUFModel.quantization()`, `generate`'s default for one) gives its stored integers,
    scales and minimums as they are (`GGUFModel.quantized`: never dequantized on the
    host); other weights are read as floats in the spec's dtype and, with `spec.quant`,
    quantized (`GenerationSpec.program_weights`)."""
    source = _weights_source(spec.cfg, weights, checkpoint)
    if isinstance(source, Path) and is_gguf(source) and spec.quant is not None:
        opened = opened_gguf(source)
        if opened.config == spec.cfg and spec.weight_quants == opened.quantization():
            return opened.quantized(spec.dtype)
    return spec.program_weights(_read_weights(spec.cfg, source, spec.dtype))


def file_quantization(checkpoint: Path | None, quant: Any) -> Any:
    """`quant` as given, else a GGUF checkpoint's own quantization (one `Quantization` per
    block-quantized tensor, `GGUFModel.quantization()`; None when it has none): a GGUF
    file's quantized tensors stay quantized on the host and over the link."""
    if quant is not None or checkpoint is None or not is_gguf(checkpoint):
        return quant
    return opened_gguf(checkpoint).quantization() or None


class HostMemoryError(GenerationError):
    """A run would need more host memory than is available (checked before any weight is
    read or drawn, so it fails in a second, not killed by the kernel minutes in)."""


def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of the program's weights in `dtype`."""
    size = dtypes.itemsize(dtypes.canonical(dtype))
    return sum(math.prod(shape) for shape in cfg.weight_shapes().values()) * size


def quantized_weight_bytes(cfg: ModelConfig, quant: Any, dtype: str) -> int:
    """Bytes of the quantized inputs (`{name}.q`, `{name}.scale` and `{name}.min` in
    `dtype`) of the weights `quant` quantizes (`quant_by_weight`: one `Quantization` for
    all, or one per weight): what `GenerationSpec.program_weights` makes beside the float
    weights it is given, or what `run_weights` reads from a GGUF file."""
    total = 0
    shapes = cfg.weight_shapes()
    for name, chosen in quant_by_weight(cfg, quant).items():
        for shape, stored in chosen.stored(shapes[name], dtype).values():
            total += math.prod(shape) * dtypes.itemsize(dtypes.canonical(stored))
    return total


def check_run_memory(
    plan: UnrolledPlan | StepPlans | DevicesPlan | DevicesStepPlans,
    backend: Any,
    weights: str | None,
) -> int:
    """The host memory a run of `plan` on `backend` needs, checked against what is
    available now (`einpage_core.host.available_memory`) before anything is allocated;
    `HostMemoryError` with the numbers when it does not fit. `weights` says what the
    run will make besides the plans' own needs (`host_bytes`): "random" (drawn, one weight
    at a time in float32 at most, then cast), "checkpoint" (read, one tensor at a time
    converted), or None (the caller holds them already); a quantized generation also
    holds the weights' quantized copy (`quantized_weight_bytes`)."""
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
    if spec.quant is not None:
        stored = quantized_weight_bytes(spec.cfg, spec.quant, spec.dtype)
        kind = f"int{spec.quant.bits}" if isinstance(spec.quant, Quantization) else "quantized"
        rows.append((stored, f"their {kind} copy, {format_bytes(stored)}"))
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
            "(no --run; run=None)"
        )
    return need


def _prompt_ids(
    prompt: Any, tokenizer: Any, checkpoint: Path | None, batch: int | None, vocab: int
) -> tuple[np.ndarray, Any, tuple[int, ...] | None]:
    """The prompt as ids [batch, prompt_len] (left padded when the prompts have different
    lengths), the tokenizer used (None for ids) and the prompts' lengths when ragged."""
    if prompt is None:
        raise GenerationError("a prompt is needed: token ids [batch, prompt_len] or text")
    if isinstance(prompt, Mapping):
        raise GenerationError(
            "the prompt is a mapping, weights perhaps: generate takes (model, prompt, "
            "new_tokens, budget) and the weights as weights=..."
        )
    is_text = isinstance(prompt, str) or (
        isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(p, str) for p in prompt)
    )
    if not is_text:
        if _is_ragged(prompt):
            ids, lengths = pad_prompts(prompt, vocab)
        else:
            ids, lengths = check_tokens(prompt, vocab), None
        if batch is not None and ids.shape[0] != batch:
            raise GenerationError(f"batch={batch} but the prompt has {ids.shape[0]} rows")
        return ids, None, lengths
    if tokenizer is None:
        found = None if checkpoint is None else checkpoint_tokenizer(checkpoint)
        if found is None:
            raise GenerationError(text.missing_tokenizer(checkpoint, "tokenizer=..."))
        tokenizer = found
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = text.load_tokenizer(tokenizer)
    if not isinstance(prompt, str) and batch is not None and len(prompt) != batch:
        raise GenerationError(f"batch={batch} but {len(prompt)} prompts are given")
    ids, lengths = text.encode_padded(tokenizer, prompt, vocab, batch)
    return ids, tokenizer, lengths


def _is_ragged(prompt: Any) -> bool:
    """Whether `prompt` is a list of id rows of different lengths (a ragged batch)."""
    if isinstance(prompt, np.ndarray) or not isinstance(prompt, Sequence) or not prompt:
        return False
    if not all(isinstance(row, Sequence | np.ndarray) for row in prompt):
        return False
    return len({len(row) for row in prompt}) > 1 or any(len(row) == 0 for row in prompt)


def unpadded(ids: np.ndarray, lengths: tuple[int, ...] | None, prompt_len: int) -> list[Any]:
    """Each row of `ids` [batch, prompt_len + n] without its left padding (all of each
    row when not ragged)."""
    if lengths is None:
        return list(ids)
    return [row[prompt_len - n :] for row, n in zip(ids, lengths, strict=True)]


def _chat_ids(
    messages: Any,
    template: ChatTemplate | None,
    tokenizer: Any,
    checkpoint: Path | None,
    batch: int | None,
    vocab: int,
) -> tuple[np.ndarray, Any, tuple[int, ...] | None]:
    """The ids of a chat prompt (`messages` as `template` writes them, by default the
    checkpoint's, or that of the tokenizer's folder), the tokenizer used, and each
    conversation's length when they differ (a ragged batch, left padded to the longest,
    as `_prompt_ids` pads prompts of different lengths)."""
    if tokenizer is None:
        found = None if checkpoint is None else checkpoint_tokenizer(checkpoint)
        if found is None:
            raise GenerationError(text.missing_tokenizer(checkpoint, "tokenizer=..."))
        tokenizer = found
    if template is None:
        folder = checkpoint if checkpoint is not None else tokenizer
        if not isinstance(folder, str | os.PathLike):
            raise ChatError(
                "messages need a chat template: give a checkpoint folder that has one as "
                "the model, or chat_template=ChatTemplate(source, where)"
            )
        template = ChatTemplate.of_checkpoint(folder)
    elif not isinstance(template, ChatTemplate):
        raise ChatError(f"chat_template must be a ChatTemplate, got {type(template).__name__}")
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = text.load_tokenizer(tokenizer)
    rows, _ = chat_rows(template, tokenizer, messages, batch)
    ids, lengths = text.padded(rows, vocab)
    return ids, tokenizer, lengths


def checkpoint_tokenizer(checkpoint: Path) -> Any:
    """The tokenizer a checkpoint brings: a GGUF file's own (built from its vocabulary),
    else the path of the `tokenizer.json` beside it, or None."""
    if is_gguf(checkpoint):
        return opened_gguf(checkpoint).tokenizer()
    return text.find_tokenizer(checkpoint)


def reads_in_place(plan: Any) -> bool:
    """Whether a generation's `plan` reads its weights from their checkpoint itself (an
    unrolled plan whose host tier places them there: `runtime.tiers.disk_inputs`), so a
    run is given none of them: the checkpoint's places cover every weight input of the
    program (`einpage.models.base.checkpoint_places`)."""
    return isinstance(plan, UnrolledPlan) and bool(disk_inputs(plan.plan))


def _tier_checkpoint(plan: Planning, weights: Any, checkpoint: Path | None) -> Planning:
    """`plan` with the checkpoint its host tier reads weights from in place: none asked
    (no host tier, or `Planning.checkpoint` given), the `weights` path given, else the
    model's folder when the weights come from it; `GenerationError` for a GGUF file,
    which is not read in place (not built), and for weights given as arrays besides a
    checkpoint to read them from."""
    if plan.checkpoint is not None and isinstance(weights, Mapping):
        raise GenerationError(
            f"weights= are given, and Planning(checkpoint={str(plan.checkpoint)!r}) reads "
            "the weights from that checkpoint: give one of them"
        )
    if not plan.tiered or plan.checkpoint is not None:
        return plan
    source = weights if isinstance(weights, str | os.PathLike) else None
    if weights is None:
        source = checkpoint
    if source is not None and is_gguf(source):
        raise GenerationError(
            f"a host tier reads a safetensors checkpoint's weights where they are; reading "
            f"a GGUF file's ({str(source)!r}) in place is not built: plan without "
            "host_budget/spill, or convert the model to a save_pretrained folder"
        )
    return plan if source is None else replace(plan, checkpoint=source)


def generate(
    model: Any,
    prompt: Any = None,
    new_tokens: int = 16,
    budget: int | str | Sequence[int | str] = "100%",
    *,
    weights: Any = None,
    tokenizer: Any = None,
    batch: int | None = None,
    dtype: str | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    logits: bool = False,
    sampling: Sampling | None = None,
    plan: Planning = DEFAULT_PLANNING,
    run: Running | None = DEFAULT_RUNNING,
    messages: Any = None,
    chat_template: ChatTemplate | None = None,
    stop: Any = (),
    eos: Any = None,
    quant: Any = None,
    **moved: Any,
) -> Generation:
    """Generate `new_tokens` tokens after `prompt` (module docstring) with the model
    planned under `budget` (bytes, a size string, or a percentage of the plans' resident
    peak, `"100%"` by default: nothing moves, or of one token's streaming minimum,
    `"50%streaming"`, the same bytes both ways: `read_generation_budget`; `plan.budget`
    says how it was read). With `plan=Planning(devices=N)` it is each device's budget,
    a percentage read against that device's own graph (of its resident peak, or its
    streaming minimum), or a sequence of N budgets, one per device.

    `weights`, `tokenizer`: see the module docstring; `batch`: the sequences of a text
    prompt (a string is repeated), checked against an ids prompt's rows; `dtype`: the
    weights' and activations' float type (None: the checkpoint's own, as its config.json
    names it, else float32: `choose_dtype`); `page_size`: positions per KV page; `logits`:
    return each step's logits too. `sampling` (None: greedy), `plan` and `run` (None:
    plan only, no weights needed) are the records that say how tokens are drawn, how it
    is planned and how it runs. `messages` (instead of `prompt`) and `chat_template`:
    a chat prompt; `stop` and `eos`: when sequences stop (module docstring). `quant`:
    "int8" or "int4" (or an `einpage.quantize.Quantization`) plans and runs the model
    with those weights quantized (`GenerationSpec.quant`): the weights given are float,
    quantized here before the run; only the quantized bytes are kept on the host and
    cross PCIe. A GGUF file's quantized tensors are so by default (`quant=None`: the
    file's own `Quantization`s, read as stored: `file_quantization`, `run_weights`).

    Raises `GenerationError` for bad arguments (and for a keyword of the old signature,
    saying where it went), `GenerationBudgetError` when the budget is too small (naming
    the step and task), and `HostMemoryError` before a run that would not fit in host
    memory. On several devices: `memgraph.multi.DeviceBudgetError` (an
    `InfeasibleBudgetError`) names the device whose budget is too small and its smallest,
    the placement's `PlanError`s pass through, and what is not built (the "streams"
    mode) raises `DevicesNotBuiltError`.
    """
    moved_keywords("generate", moved, MOVED, PARAMETERS)
    if not isinstance(plan, Planning):
        hint = f": plan=Planning(way={plan!r})" if isinstance(plan, str) else ""
        raise GenerationError(f"plan must be a Planning, got {plan!r}{hint}")
    if isinstance(run, bool):
        raise GenerationError(
            f"run must be a Running or None, got {run!r}: run=False is now run=None (plan "
            "only), run=True the default, run=Running()"
        )
    if run is not None and not isinstance(run, Running):
        raise GenerationError(f"run must be a Running or None (plan only), got {run!r}")
    if run is not None and run.mode == "streams" and plan.devices > 1:
        raise DevicesNotBuiltError(
            f"run=Running(mode='streams') is not built for a generation on {plan.devices} "
            "devices (each device runs its nodes one at a time): mode None, 'sequential' "
            "or 'random'"
        )
    if run is not None and run.direct_io and not plan.tiered:
        raise GenerationError(
            "run=Running(direct_io=True) moves a host tier's disk bytes with O_DIRECT: plan "
            "one with plan=Planning(host_budget=..., spill=...)"
        )
    if run is not None and run.runner != "local" and plan.devices == 1:
        raise GenerationError(
            f"run=Running(runner={run.runner!r}) runs a generation placed on several "
            "devices: give plan=Planning(devices=N) with N > 1 (one device runs in this "
            "process)"
        )
    family, cfg, checkpoint = resolve_model(model)
    if messages is not None:
        if prompt is not None:
            raise GenerationError(
                "give a prompt or messages, not both (messages are the chat's prompt)"
            )
        ids, used, lengths = _chat_ids(
            messages, chat_template, tokenizer, checkpoint, batch, cfg.vocab_size
        )
    else:
        if chat_template is not None:
            raise ChatError("chat_template= is for messages=: give the chat's messages too")
        ids, used, lengths = _prompt_ids(prompt, tokenizer, checkpoint, batch, cfg.vocab_size)
    stopping = checkpoint_stopping(checkpoint, eos, stop)
    if stopping.strings and used is None:
        raise GenerationError(
            f"stop={list(stopping.strings)!r}: stop strings need a tokenizer to read the "
            "text; give a text prompt (or messages) with a tokenizer, or stop at ids (eos=)"
        )
    plan = _tier_checkpoint(plan, weights, checkpoint)
    if run is not None and plan.checkpoint is None:  # else the plan reads them itself
        _weights_source(cfg, weights, checkpoint)  # checked before anything is planned
    dtype, _ = choose_dtype(dtype, checkpoint)
    quant = file_quantization(checkpoint, quant)
    spec = GenerationSpec(
        family, cfg, ids.shape[0], ids.shape[1], new_tokens, dtype, page_size, sampling, logits,
        quant, lengths,
    )  # fmt: skip
    planned = plan_generation(spec, budget, plan)
    if run is not None and isinstance(planned, ON_DEVICES):
        planned = planned.on(run.runner)
    stats = planned.stats()
    if run is None:
        return Generation(spec, planned, stats, prompt_lengths=spec.lengths)
    in_place = reads_in_place(planned)
    reads = (weights is None or isinstance(weights, str | os.PathLike)) and not in_place
    check_run_memory(planned, run.backend, "read from the checkpoint" if reads else None)
    values = {} if in_place else run_weights(spec, weights, checkpoint)
    out = run_stopping(
        planned, values, ids, stopping, used, run.backend, run.mode, run.direct_io
    )
    full = np.concatenate([ids, out.new_ids], axis=1)
    stats = kept_stats(planned, stats, out)
    return Generation(
        spec, planned, stats, full, out.new_ids, out.logits, out.text, out.reports,
        out.new_lengths, stopping, spec.lengths,
    )  # fmt: skip
