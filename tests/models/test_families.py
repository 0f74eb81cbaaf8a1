"""Every model family, through its `ModelFamily` record, and the shared base on a toy family.

The table-driven tests run over `einpage.models.FAMILIES`, so a new family is checked
as soon as it is registered. The toy family below is what `einpage.models.base` asks of
a family, and nothing more: it shows the base's config checks, Hugging Face
constructors and checkpoint checks work for any family, without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np
import pytest

from einpage import models
from einpage.errors import EinpageError
from einpage.models import base
from einpage.models.base import HFLayout, ModelConfig, ModelFamily
from einpage.models.errors import (
    ConfigError,
    ConfigMismatchError,
    UnsupportedConfigError,
    WeightError,
)
from einpage.models.weights import WeightSpec
from taskgraph.nodes import Input

FAMILIES = sorted(models.FAMILIES.values(), key=lambda family: family.name)


def family_ids(family: ModelFamily) -> str:
    return family.name


def weight_inputs(tg) -> dict[str, tuple[int, ...]]:
    return {
        t.op.name: t.shape for t in tg.tasks if isinstance(t.op, Input) and t.op.role == "weight"
    }


def source_state_dict(cfg: ModelConfig, prefix: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random checkpoint tensors with the keys and shapes `cfg`'s weight specs read."""
    rng = np.random.default_rng(seed)
    state = {}
    for spec in cfg.weight_specs(prefix):
        if spec.key not in state:
            state[spec.key] = rng.standard_normal(spec.source_shape).astype(np.float32)
    return state


def test_families_are_registered_by_their_names():
    assert sorted(models.FAMILIES) == ["gpt2", "llama", "mistral", "qwen2"]
    for name, family in models.FAMILIES.items():
        assert family.name == name
        assert issubclass(family.config, ModelConfig)
        assert family.config.model_type == name
        assert all(isinstance(cfg, family.config) for cfg in family.presets.values())
    assert models.FAMILIES["llama"].presets is models.llama.PRESETS
    assert models.FAMILIES["gpt2"].prefill_program is models.gpt2.prefill_program
    assert "presets" not in repr(models.FAMILIES["llama"])  # a short repr


@pytest.mark.parametrize("family", FAMILIES, ids=family_ids)
def test_small_presets_build_with_their_weights_in_spec_order(family):
    for size, cfg in family.presets.items():
        if not size.startswith("tiny"):
            continue
        for logits in ("all", "last"):
            tg = family.prefill_program(cfg, 2, 8, "float32", logits=logits).build()
            assert weight_inputs(tg) == cfg.weight_shapes()
            assert list(weight_inputs(tg)) == list(cfg.weight_shapes())
            shape = (2, 8, cfg.vocab_size) if logits == "all" else (2, cfg.vocab_size)
            assert tg.tasks[tg.outputs["logits"]].shape == shape
            assert sum(math.prod(s) for s in weight_inputs(tg).values()) == cfg.num_parameters()


@pytest.mark.parametrize("family", FAMILIES, ids=family_ids)
def test_prefill_inputs_cover_the_program_inputs(family):
    cfg = family.presets["tiny"]
    tokens = np.arange(8).reshape(2, 4) % cfg.vocab_size
    tg = family.prefill_program(cfg, 2, 4).build()
    weights = {name: np.zeros(shape, np.float32) for name, shape in cfg.weight_shapes().items()}
    inputs = family.prefill_inputs(cfg, tokens, weights)
    assert inputs.keys() == tg.inputs.keys()
    assert inputs["tokens"].dtype == np.int64
    activations = family.prefill_inputs(cfg, tokens)
    assert activations.keys() == inputs.keys() - weights.keys()
    with pytest.raises(ConfigError, match="tokens must be an integer array"):
        family.prefill_inputs(cfg, np.zeros((2, 4)))


@pytest.mark.parametrize("family", FAMILIES, ids=family_ids)
def test_weights_load_from_any_model_prefix_through_the_shared_loader(family):
    cfg = family.presets["tiny"]
    module = getattr(models, family.name)
    for prefix in cfg.hf_layout.prefixes:
        state = source_state_dict(cfg, prefix)
        weights = module.weights_from_state_dict(cfg, state, "float16")
        assert {name: w.shape for name, w in weights.items()} == cfg.weight_shapes()
        assert all(w.dtype == np.float16 and w.flags.c_contiguous for w in weights.values())
    first = cfg.weight_specs()[0]
    assert first.key.startswith(cfg.hf_layout.prefixes[0])
    assert cfg.weight_specs() == module.weight_specs(cfg)


@pytest.mark.parametrize("family", FAMILIES, ids=family_ids)
def test_from_hf_rejects_another_model_type_naming_the_class(family):
    with pytest.raises(UnsupportedConfigError) as info:
        family.config.from_hf({"model_type": "bert"})
    assert f"{family.config.__name__}.from_hf" in str(info.value)
    assert "'bert'" in str(info.value) and repr(family.name) in str(info.value)


@dataclass(frozen=True)
class _MyQwen2(models.qwen2.Qwen2Config):
    """A user's config built on Qwen2's (which is itself a `LlamaConfig`)."""


@pytest.mark.parametrize("family", FAMILIES, ids=family_ids)
def test_one_family_of_names_each_configs_own_family_for_generate_and_training(family):
    """Qwen2 and Mistral configs subclass LLaMA's: generate and training each had a
    `family_of`, and training's (the first family whose config class `cfg` is an
    instance of) named LLaMA for both."""
    from einpage.workloads import generate, training

    for cfg in family.presets.values():
        assert training.family_of(cfg) is family and generate.family_of(cfg) is family
    assert generate.family_of is training.family_of is models.family_of


def test_family_of_a_subclassed_config_is_its_nearest_familys():
    tiny = models.qwen2.PRESETS["tiny"]
    mine = _MyQwen2(**{f.name: getattr(tiny, f.name) for f in fields(tiny) if f.init})
    from einpage.workloads import generate

    assert generate.family_of(mine).name == "qwen2"
    with pytest.raises(ConfigError, match="no model family has the config ToyConfig; known: "):
        models.family_of(ToyConfig(8, 1, 1, 16))


# -- a toy family: what the base asks of one ------------------------------------------------


@dataclass(frozen=True)
class ToyConfig(ModelConfig):
    """Embedding, one [d, d] matrix per layer (stored transposed), an untied LM head."""

    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int = 10
    scale: float = 1.0
    name: str = field(default="toy", compare=False)

    model_type: ClassVar[str] = "toy"
    hf_layout: ClassVar[HFLayout] = HFLayout(
        prefixes=("model.", ""), embedding="embed.weight", layers="blocks."
    )
    positive_ints: ClassVar[tuple[str, ...]] = (
        "hidden_size",
        "num_layers",
        "num_heads",
        "vocab_size",
    )
    positive_floats: ClassVar[tuple[str, ...]] = ("scale",)

    def check(self) -> None:
        super().check()
        if self.num_layers > 4:
            raise ConfigError(f"ToyConfig: num_layers={self.num_layers} is more than 4")

    def weight_specs(self, prefix: str = "model.") -> list[WeightSpec]:
        d, v = self.hidden_size, self.vocab_size
        specs = [WeightSpec("embed", (v, d), f"{prefix}embed.weight", (v, d))]
        for i in range(self.num_layers):
            key = f"{prefix}blocks.{i}.weight"
            specs.append(WeightSpec(f"layers.{i}.w", (d, d), key, (d, d), transpose=True))
        return specs + [WeightSpec("lm_head", (v, d), "lm_head.weight", (v, d))]

    @classmethod
    def hf_fields(cls, get: base.Getter) -> dict[str, Any]:
        if get("bias", False):
            raise UnsupportedConfigError("ToyConfig.from_hf: bias=True is not supported")
        return {
            "hidden_size": get("d", None),
            "num_layers": get("layers", None),
            "num_heads": get("heads", 1),
            "vocab_size": get("vocab", None),
        }


def test_toy_config_checks_fields_in_order_then_relations():
    cases = [
        ({"hidden_size": 0}, "ToyConfig: hidden_size must be a positive int, got 0"),
        ({"num_heads": True}, "ToyConfig: num_heads must be a positive int, got True"),
        ({"scale": float("nan")}, "ToyConfig: scale must be a positive finite number, got nan"),
        ({"num_heads": 3}, "ToyConfig: num_heads=3 does not divide hidden_size=8"),
        ({"num_layers": 5}, "ToyConfig: num_layers=5 is more than 4"),
    ]
    for change, message in cases:
        with pytest.raises(ConfigError) as info:
            ToyConfig(**{"hidden_size": 8, "num_layers": 2, "num_heads": 2, **change})
        assert str(info.value) == message
        assert isinstance(info.value, EinpageError)
    cfg = ToyConfig(8, 2, 2)
    assert cfg.head_dim == 4
    assert cfg.num_parameters() == 10 * 8 + 2 * 8 * 8 + 10 * 8
    assert list(cfg.weight_shapes()) == ["embed", "layers.0.w", "layers.1.w", "lm_head"]


def test_toy_config_from_hf():
    cfg = ToyConfig.from_hf({"model_type": "toy", "d": 8, "layers": 1, "vocab": 12})
    assert cfg == ToyConfig(8, 1, 1, vocab_size=12) and cfg.name == "toy"
    assert ToyConfig.from_hf({"d": 8, "layers": 1, "vocab": 12}, name="mine").name == "mine"
    with pytest.raises(UnsupportedConfigError, match="model_type 'llama' is not 'toy'"):
        ToyConfig.from_hf({"model_type": "llama", "d": 8, "layers": 1, "vocab": 12})
    with pytest.raises(UnsupportedConfigError, match="bias=True"):
        ToyConfig.from_hf({"d": 8, "layers": 1, "vocab": 12, "bias": True})
    with pytest.raises(ConfigError, match="vocab_size must be a positive int, got None"):
        ToyConfig.from_hf({"d": 8, "layers": 1})


def test_toy_weights_are_converted_and_the_checkpoint_checked():
    cfg = ToyConfig(8, 2, 2)
    state = source_state_dict(cfg, "model.")
    weights = base.weights_from_state_dict(cfg, state)
    np.testing.assert_array_equal(weights["layers.1.w"], state["model.blocks.1.weight"].T)
    assert np.shares_memory(weights["embed"], state["model.embed.weight"])  # not copied
    bare = {key.removeprefix("model."): value for key, value in state.items()}
    assert base.weights_from_state_dict(cfg, bare).keys() == weights.keys()

    wide = ToyConfig(16, 2, 2)
    with pytest.raises(ConfigMismatchError) as info:
        base.weights_from_state_dict(wide, state)
    assert str(info.value) == (
        "the config has vocab_size=10, hidden_size=16, but 'model.embed.weight' in "
        "the state dict has shape (10, 8)"
    )
    with pytest.raises(ConfigMismatchError, match="num_layers=1, but the state dict holds 2"):
        base.weights_from_state_dict(ToyConfig(8, 1, 2), state)
    del state["lm_head.weight"]
    with pytest.raises(WeightError, match="'lm_head'"):
        base.weights_from_state_dict(cfg, state)
