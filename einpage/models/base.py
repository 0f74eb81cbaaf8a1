"""One base for model families: the config, its Hugging Face checkpoints, the family record.

A model family (LLaMA, GPT-2, ...) is one module of `einpage.models`. What every family
does the same way lives here, so a family module holds only what is its own: its
fields, its weight layout and its program.

* `ModelConfig`, the base of each family's frozen config dataclass: field checks
  (positive ints and floats, bools, heads that divide the hidden size, then the
  family's own `check`), `head_dim`, `weight_shapes` and `num_parameters` (from the
  family's `weight_specs`), and the Hugging Face constructors: `from_hf` (the
  `model_type` check, then the family's `hf_fields`) and `from_checkpoint` (the
  `config.json` of a `save_pretrained` directory).
* `HFLayout`: where a family's tensors sit in a Hugging Face checkpoint (model prefixes,
  the embedding, the layers, the LM head). The loaders use it to check a checkpoint
  against the config (sizes, layer count, a tied head) before they read a byte.
* `weights_from_state_dict` and `weights_from_safetensors`, the same for every family.
* `ModelFamily`: a family's name, config class, presets and program builders;
  `einpage.models.FAMILIES` lists them (for presets, the CLI and table-driven tests).

Program pieces every family uses (argument checks, the prefill scaffolding, the layer
loop, the logits head, causal attention) are in `einpage.models.common`.

How to add a family
-------------------
1. Write `einpage/models/<family>.py` (see `gpt2.py`, the smaller example) with a
   config::

       @dataclass(frozen=True)
       class MyConfig(ModelConfig):
           hidden_size: int          # the base reads these four by name
           num_layers: int
           num_heads: int
           vocab_size: int = 32000
           ...                       # the family's own fields
           name: str = field(default="my", compare=False)

           model_type = "my"         # Hugging Face's `model_type`
           hf_layout = HFLayout(prefixes=("model.", ""), embedding="embed_tokens.weight",
                                layers="layers.")
           positive_ints = ("hidden_size", "num_layers", "num_heads", "vocab_size", ...)
           positive_floats = (...)   # and `bools`, when there are any

           def weight_specs(self, prefix="model.") -> list[WeightSpec]: ...
           @classmethod
           def hf_fields(cls, get) -> dict[str, Any]: ...

   `weight_specs` lists one `WeightSpec` per weight input, in the order the program
   declares them (the program's name and shape, the checkpoint key and shape, the
   conversion). `hf_fields` reads a Hugging Face config (`get(name, default)`) into
   the constructor's arguments and raises `UnsupportedConfigError` for a setting the
   program does not implement. Override `check` (calling `super().check()`) for
   relations between fields, `hf_shapes` when more tensors than the embedding tell
   the sizes, `ties_lm_head` and `untied_head_error` when the LM head can be the
   embedding.
2. Add `PRESETS` (published shapes and a "tiny" one for tests), and
   `prefill_program(cfg, batch, seq, dtype="float32", logits="all")` built on
   `common.begin_prefill`, `common.decoder_layers` and `common.logits_head`, and
   `prefill_inputs(cfg, tokens, weights=None, dtype="float32")`.
3. For generation, write the attention as two blocks shared by the prefill and the
   decode steps – `_qkv(x, ...) -> common.Heads` (norm, projections, positions) and
   `_attn_out(x, attention, ...)` (output projection, residual) – and a
   `decoder(cfg, prog, weight, dtype, positions) -> common.Decoder` over them, with
   `position_inputs(cfg, positions, dtype)` for the inputs it declares (see
   `llama.decoder`); `einpage.models.generation` builds the generation and decode step
   programs from those alone (paged KV cache, next-token choice).
4. Export the loaders (`weights_from_state_dict = base.weights_from_state_dict`, the
   same for safetensors, and `weight_specs`/`weight_shapes`), define
   `FAMILY = ModelFamily("my", MyConfig, PRESETS, prefill_program, prefill_inputs,
   decoder=decoder, position_inputs=position_inputs)`, and add it to `FAMILIES` in
   `einpage/models/__init__.py`.
5. Tests: `tests/models/test_families.py` runs over every family in `FAMILIES`
   (presets build, parameters equal weight bytes, specs follow the program). Add an
   equality test against the Hugging Face model (`tests/models/hf_models.py` builds
   small random ones) and the family's config errors; `tests/models/test_generation.py`
   compares generated tokens with `generate(do_sample=False)` (add the model to MODELS).

A family that is another one with a few changes (a sliding window, Q/K/V biases) can
subclass that family's config and reuse its program builders.
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from einpage.models.checkpoint import (
    SafetensorsSource,
    Source,
    open_source,
    read_hf_config,
    require_hf_config,
)
from einpage.models.errors import (
    CheckpointError,
    ConfigError,
    ConfigMismatchError,
    ModelError,
    UnsupportedConfigError,
)
from einpage.models.weights import WeightSpec, check_layer_count, load_weights, resolve_prefix
from einpage.pipeline.weight_files import Stored, weight_places
from memgraph.tiers import CheckpointPlace
from taskgraph import dtypes
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input

if TYPE_CHECKING:
    from einpage.models.common import Decoder
    from einpage.program.program import Program

__all__ = [
    "ModelConfig",
    "HFLayout",
    "ModelFamily",
    "weights_from_state_dict",
    "weights_from_safetensors",
    "checkpoint_places",
    "hf_getter",
    "check_positive_int",
    "check_positive_float",
    "check_same_config",
]

Getter = Callable[[str, Any], Any]
"""`get(name, default)`: one setting of a Hugging Face config."""

C = TypeVar("C", bound="ModelConfig")


# -- field checks and Hugging Face configs -------------------------------------------


def hf_getter(config: Any) -> Getter:
    """`get(name, default)` over a transformers config object or a `config.json` dict."""
    if isinstance(config, Mapping):
        return lambda name, default: config.get(name, default)
    return lambda name, default: getattr(config, name, default)


def check_positive_int(owner: str, field: str, value: Any) -> None:
    """Raise `ConfigError` naming `owner.field` unless `value` is an int > 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{owner}: {field} must be a positive int, got {value!r}")


def check_positive_float(owner: str, field: str, value: Any) -> None:
    """Raise `ConfigError` naming `owner.field` unless `value` is a finite number > 0."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{owner}: {field} must be a positive finite number, got {value!r}")


def check_same_config(cfg: Any, on_disk: Any, path: Any) -> None:
    """Raise `ConfigMismatchError` listing every field where `cfg` differs from the config
    read from the checkpoint's `config.json` (`name` is ignored)."""
    diffs = [
        f"{f.name}={getattr(cfg, f.name)!r} (checkpoint: {getattr(on_disk, f.name)!r})"
        for f in fields(cfg)
        if f.compare and getattr(cfg, f.name) != getattr(on_disk, f.name)
    ]
    if diffs:
        raise ConfigMismatchError(
            f"the config does not describe the checkpoint {str(path)!r} (its config.json): "
            + ", ".join(diffs)
        )


# -- the config ----------------------------------------------------------------------


@dataclass(frozen=True)
class HFLayout:
    """Where a family's tensors sit in a Hugging Face checkpoint.

    `prefixes`: the model prefixes tried in order (`("model.", "")` loads both
    `LlamaForCausalLM` and bare `LlamaModel` state dicts); `embedding`: the embedding
    table's key under the prefix (how the prefix is found); `layers`: the key prefix of
    layer `i` is `prefix + layers + f"{i}."`; `lm_head`: the LM head's key (no prefix).
    """

    prefixes: tuple[str, ...]
    embedding: str
    layers: str
    lm_head: str = "lm_head.weight"


class ModelConfig(abc.ABC):
    """The base of a family's config: a frozen dataclass with at least `hidden_size`,
    `num_layers`, `num_heads`, `vocab_size` and `name` (compare=False).

    Subclasses set the class attributes below and define `weight_specs` and `hf_fields`;
    the module docstring says how to add a family.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    name: str

    model_type: ClassVar[str]
    """Hugging Face's `model_type` for this family; `from_hf` rejects any other."""
    hf_layout: ClassVar[HFLayout]
    positive_ints: ClassVar[tuple[str, ...]] = ()
    positive_floats: ClassVar[tuple[str, ...]] = ()
    bools: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in self.positive_ints:
            check_positive_int(owner, name, getattr(self, name))
        for name in self.positive_floats:
            check_positive_float(owner, name, getattr(self, name))
        for name in self.bools:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"{owner}: {name} must be a bool, got {value!r}")
        self.check()

    def check(self) -> None:
        """Checks of relations between fields, after the per-field ones; raises
        `ConfigError` naming the fields and values. Here: heads divide the hidden size.
        A family adds its own by overriding this and calling `super().check()` first."""
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"{type(self).__name__}: num_heads={self.num_heads} does not divide "
                f"hidden_size={self.hidden_size}"
            )

    @property
    def head_dim(self) -> int:
        """Features per attention head: hidden_size / num_heads."""
        return self.hidden_size // self.num_heads

    @abc.abstractmethod
    def weight_specs(self, prefix: str) -> list[WeightSpec]:
        """Every weight of the program, in the order the program declares them, and the
        Hugging Face tensor it comes from (keys under the model `prefix`)."""

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight input's name and shape, in program order."""
        return {spec.name: spec.shape for spec in self.weight_specs(self.hf_layout.prefixes[0])}

    def quantized_weights(self) -> frozenset[str]:
        """The weights that weight-only quantization stores in fewer bits: those whose
        spec says `quantize` (the matrices matmuls read)."""
        specs = self.weight_specs(self.hf_layout.prefixes[0])
        return frozenset(spec.name for spec in specs if spec.quantize)

    def num_parameters(self) -> int:
        """Number of parameters (a tied LM head counted once)."""
        return sum(math.prod(shape) for shape in self.weight_shapes().values())

    # -- Hugging Face configs ----------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def hf_fields(cls, get: Getter) -> dict[str, Any]:
        """The constructor's arguments (all but `name`) from a Hugging Face config read
        with `get(name, default)`; raises `UnsupportedConfigError` for a setting the
        program does not implement."""

    @classmethod
    def from_hf(cls: type[C], config: Any, name: str | None = None) -> C:
        """The config of a Hugging Face config object (or its `config.json` as a dict),
        named `name` (else the family's default name). Raises `UnsupportedConfigError`
        for another `model_type` or a setting the program does not implement (listed in
        the family's `hf_fields`), `ConfigError` for a missing or invalid size."""
        get = hf_getter(config)
        model_type = get("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise UnsupportedConfigError(
                f"{cls.__name__}.from_hf: model_type {model_type!r} is not {cls.model_type!r}"
            )
        values = cls.hf_fields(get)
        if name is not None:
            values["name"] = name
        return cls(**values)

    @classmethod
    def from_checkpoint(cls: type[C], path: str | os.PathLike[str], name: str | None = None) -> C:
        """The config of a checkpoint directory as `save_pretrained` writes it (its
        `config.json`; a weights file inside it also works), named after the directory
        unless `name` is given. Raises `CheckpointError` when there is no `config.json`,
        and what `from_hf` raises for a config this program does not implement."""
        config, folder = require_hf_config(path, cls.__name__)
        return cls.from_hf(config, name=folder if name is None else name)

    # -- checking a checkpoint against the config -----------------------------------

    def hf_shapes(self) -> dict[str, dict[str, int]]:
        """Checkpoint tensors whose shapes tell the config's sizes: key (under the model
        prefix) -> {config field: size} per axis. A checkpoint that disagrees raises
        `ConfigMismatchError` naming the fields. By default, the embedding table."""
        return {
            self.hf_layout.embedding: {
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
            }
        }

    @property
    def ties_lm_head(self) -> bool:
        """Whether the LM head is the embedding table (then a checkpoint's separate LM
        head must equal it). Untied by default."""
        return False

    def untied_head_error(self, where: str) -> ModelError:
        """The error for a checkpoint whose LM head differs from the embedding although
        this config ties them."""
        return ConfigMismatchError(
            f"the config ties the LM head to the embedding, but {where} has an "
            f"{self.hf_layout.lm_head!r} that differs from it"
        )


# -- loading weights -----------------------------------------------------------------


def weights_from_state_dict(
    cfg: ModelConfig, state_dict: Mapping[str, Any], dtype: Any = "float32"
) -> dict[str, np.ndarray]:
    """The program's weights ({input name: array of `dtype`}) from a Hugging Face state dict
    of the family's model, with or without its model prefix (`LlamaForCausalLM` or
    `LlamaModel`, `GPT2LMHeadModel` or `GPT2Model`; torch tensors or NumPy arrays).
    `dtype` is any float dtype: float16, bfloat16 (NumPy arrays of `ml_dtypes.bfloat16`;
    torch bfloat16 tensors keep their bits), float32, float64.

    Arrays that need no conversion may share memory with the state dict's tensors.
    Raises `ConfigMismatchError` when the checkpoint's sizes (vocabulary, hidden size,
    positions) or layer count differ from `cfg`, and `WeightError` for a missing or
    mis-shaped weight.
    """
    return _load(cfg, open_source(state_dict), dtype)


def weights_from_safetensors(
    cfg: ModelConfig, path: str | os.PathLike[str], dtype: Any = "float32"
) -> dict[str, np.ndarray]:
    """The program's weights from a safetensors checkpoint directory (`save_pretrained`:
    `model.safetensors`, or shards listed in `model.safetensors.index.json`) or file,
    reading only the tensors (and parts of tensors) the program uses, each converted
    once from the dtype it is stored in (a bfloat16 checkpoint read as bfloat16 is never
    widened). A `config.json` beside the weights must describe the same model as `cfg`
    (`ConfigMismatchError` otherwise)."""
    _check_config_beside(cfg, path)
    with open_source(path) as source:
        return _load(cfg, source, dtype)


def checkpoint_places(
    cfg: ModelConfig, path: str | os.PathLike[str], tg: TaskGraph
) -> dict[str, CheckpointPlace]:
    """Where each weight input of `tg` (a program of `cfg`) is in the safetensors
    checkpoint at `path` (as `save_pretrained` writes it), for a plan with a host tier
    to read it in place (`einpage.compile(..., checkpoint=)`): the family's Hugging Face
    names and layouts (`ModelConfig.weight_specs`; `o_proj` and `down_proj` stored
    transposed, read transposed back). The checkpoint is checked against `cfg` as
    `weights_from_safetensors` checks it; a weight it stores as part of a fused tensor
    (GPT-2's `c_attn`: queries, keys and values side by side) cannot be read in place
    (`CheckpointError`, naming it), nor one in another dtype than the program's."""
    _check_config_beside(cfg, path)
    with SafetensorsSource(path) as source:
        prefix = _checked_prefix(cfg, source)
        where = source.where
    inputs = {task.op.name for task in tg if isinstance(task.op, Input)}
    specs = [spec for spec in cfg.weight_specs(prefix) if spec.name in inputs]
    fused = [spec for spec in specs if spec.part is not None]
    if fused:
        raise CheckpointError(
            f"{where}: {fused[0].key!r} holds several of the program's weights side by side "
            f"({', '.join(s.name for s in fused[:3])}, ...), which a plan cannot read in "
            "place; write the program's weights with einpage.weight_files.save_weights and "
            "plan with that file"
        )
    stored = {spec.name: Stored(spec.key, spec.source_shape, spec.transpose) for spec in specs}
    return weight_places(path, tg, stored)


def _check_config_beside(cfg: ModelConfig, path: str | os.PathLike[str]) -> None:
    """`ConfigMismatchError` when a `config.json` beside the checkpoint at `path` describes
    another model than `cfg` (none there: nothing to check)."""
    on_disk = read_hf_config(path)
    if on_disk is not None:
        check_same_config(cfg, type(cfg).from_hf(on_disk), path)


def _load(cfg: ModelConfig, source: Source, dtype: Any) -> dict[str, np.ndarray]:
    """Check `source` against `cfg` (sizes, layers, a tied head), then read the weights."""
    prefix = _checked_prefix(cfg, source)
    return load_weights(cfg.weight_specs(prefix), source, dtypes.canonical(dtype))


def _checked_prefix(cfg: ModelConfig, source: Source) -> str:
    """The prefix of `source`'s keys, after checking `source` against `cfg` (sizes,
    layers, a tied head)."""
    layout, where = cfg.hf_layout, source.where
    keys = source.keys()
    prefix = resolve_prefix(keys, layout.embedding, layout.prefixes, where)
    for key, sizes in cfg.hf_shapes().items():
        key = prefix + key
        if key in keys and source.shape(key) != tuple(sizes.values()):
            said = ", ".join(f"{name}={size}" for name, size in sizes.items())
            raise ConfigMismatchError(
                f"the config has {said}, but {key!r} in {where} has shape {source.shape(key)}"
            )
    check_layer_count(keys, prefix + layout.layers, cfg.num_layers, "num_layers", where)
    if cfg.ties_lm_head and layout.lm_head in keys:
        head, embed = source.read(layout.lm_head), source.read(prefix + layout.embedding)
        if head.shape != embed.shape or not np.array_equal(head, embed):
            raise cfg.untied_head_error(where)
    return prefix


# -- the family record ---------------------------------------------------------------


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its `name` (as in `einpage.models.FAMILIES` and the CLI's
    `llama:7b` presets), its config class, its `presets` (size -> config) and its
    program builders: `prefill_program(cfg, batch, seq, dtype, logits)` and
    `prefill_inputs(cfg, tokens, weights, dtype)`.

    >>> from einpage.models import FAMILIES
    >>> FAMILIES["gpt2"]
    ModelFamily(name='gpt2', config=<class 'einpage.models.gpt2.GPT2Config'>)
    >>> sorted(FAMILIES["llama"].presets)
    ['13b', '3-8b', '65b', '70b', '7b', 'tiny', 'tiny-gqa']
    """

    name: str
    config: type[ModelConfig]
    presets: Mapping[str, ModelConfig] = field(repr=False)
    prefill_program: Callable[..., Program] = field(repr=False)
    prefill_inputs: Callable[..., dict[str, np.ndarray]] = field(repr=False)
    decoder: Callable[..., Decoder] | None = field(default=None, repr=False)
    """`decoder(cfg, prog, weight, dtype, positions) -> common.Decoder`: the family's
    blocks for generation programs (None: the family cannot generate)."""
    position_inputs: Callable[..., dict[str, np.ndarray]] | None = field(default=None, repr=False)
    """`position_inputs(cfg, positions, dtype)`: the inputs `decoder` declared."""

    def generation_program(self, cfg: ModelConfig, *args: Any, **options: Any) -> Program:
        """`einpage.models.generation.generation_program` for this family: prefill and
        decode steps unrolled into one program."""
        from einpage.models import generation

        return generation.generation_program(self, cfg, *args, **options)

    def decode_program(self, cfg: ModelConfig, *args: Any, **options: Any) -> Program:
        """`einpage.models.generation.decode_program` for this family: one decode step
        over a paged KV cache of a length bucket."""
        from einpage.models import generation

        return generation.decode_program(self, cfg, *args, **options)
