"""The `Layer` fact on every family's weights: each weight of decoder layer i (and each
quantized input of one) states `Layer(i)`, the embeddings, final norm and head none – in
prefill, generation (unrolled and step) and training programs, quantized and GGUF-loaded.

The oracle is the checkpoint mapping (`weight_specs`: the Hugging Face key of each
weight names its layer, `model.layers.{i}.` or GPT-2's `h.{i}.`), not the program builder
under test."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from einpage.models import gpt2, llama, mistral, qwen2
from einpage.program.optim import SGD
from einpage.program.quantize import Quantization
from einpage.workloads.training import training_graph
from taskgraph import Input, TaskGraph
from taskgraph.facts import Layer, facts_of

FAMILIES = {
    "llama": (llama.FAMILY, llama.PRESETS["tiny"]),
    "llama-gqa": (llama.FAMILY, llama.PRESETS["tiny-gqa"]),
    "gpt2": (gpt2.FAMILY, gpt2.PRESETS["tiny"]),
    "qwen2": (qwen2.FAMILY, qwen2.PRESETS["tiny"]),
    "mistral": (mistral.FAMILY, mistral.PRESETS["tiny"]),
}
QUANTIZED_PARTS = ("q", "scale", "min")


def expected_layers(cfg) -> dict[str, int | None]:
    """Each weight's layer by its checkpoint key (None: embeddings, norm, head)."""
    found = {}
    for spec in cfg.weight_specs():
        match = re.search(r"(?:^|\.)(?:layers|h)\.(\d+)\.", spec.key)
        found[spec.name] = None if match is None else int(match.group(1))
    assert {i for i in found.values() if i is not None} == set(range(cfg.num_layers))
    return found


def stated_layers(tg: TaskGraph) -> dict[str, list[int]]:
    """Each weight input's `Layer` facts, by input name."""
    return {
        name: [fact.index for fact in facts_of(tg[i], Layer)]
        for name, i in tg.inputs.items()
        if tg[i].op.role == "weight"
    }


def check(tg: TaskGraph, cfg, quantized: frozenset[str] = frozenset()) -> None:
    """Every weight of `tg` (a quantized one through its inputs `name.q`, ...) states its
    layer and nothing else does; no other task states a `Layer`."""
    expected = expected_layers(cfg)
    want = {}
    for name, layer in expected.items():
        names = [f"{name}.{part}" for part in QUANTIZED_PARTS] if name in quantized else [name]
        for input_name in names:
            if input_name in tg.inputs:
                want[input_name] = [] if layer is None else [layer]
    assert stated_layers(tg) == want
    for name in expected:  # every weight is an input, or its quantized inputs are
        assert name in tg.inputs or (name in quantized and f"{name}.q" in tg.inputs), name
    others = [t for t in tg if facts_of(t, Layer) and not isinstance(t.op, Input)]
    assert not others
    assert not [t for t in tg if facts_of(t, Layer) and t.op.role != "weight"]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_s_prefill_states_the_layer_of_every_layer_weight(name):
    family, cfg = FAMILIES[name]
    check(family.prefill_program(cfg, 1, 4).build(), cfg)


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_generation_programs_state_each_weight_s_layer_once(name):
    """Unrolled: a weight is declared once and read by every step, keeping the fact of
    the layer that declared it; a decode step plan states the same facts."""
    family, cfg = FAMILIES[name]
    unrolled = family.generation_program(cfg, 1, 4, 3).build()
    check(unrolled, cfg)
    for name in expected_layers(cfg):
        assert len(unrolled.consumers[unrolled.inputs[name]]) >= 1
    step = family.decode_program(cfg, 1, 2, page_size=4).build()
    check(step, cfg)
    assert stated_layers(step) == stated_layers(unrolled)  # one session shares the weights


@pytest.mark.parametrize(
    "quant",
    [Quantization(8, 32), Quantization(4, 32, minimum=True)],
    ids=["int8", "int4-min"],
)
def test_quantized_inputs_state_their_weight_s_layer(quant):
    cfg = llama.PRESETS["tiny"]
    quantized = cfg.quantized_weights()
    check(llama.prefill_program(cfg, 1, 4, quant=quant).build(), cfg, quantized)
    check(llama.generation_program(cfg, 1, 4, 2, quant=quant).build(), cfg, quantized)


def test_weights_quantized_each_their_own_way_as_a_gguf_file_gives_them():
    """A mapping of weight names to quantizations (what `GGUFModel.quantization` returns),
    the embedding table quantized too and some matrices left in float."""
    cfg = replace(llama.PRESETS["tiny"], num_layers=3)
    quant = {
        "embed": Quantization(8, 32),
        "layers.0.attn.wq": Quantization(4, 32, minimum=True, transposed=True),
        "layers.2.mlp.w_down": Quantization(8, 32),
        "lm_head": Quantization(4, 32),
    }
    check(llama.prefill_program(cfg, 1, 4, quant=quant).build(), cfg, frozenset(quant))


def test_a_training_step_keeps_the_facts_and_states_none_on_optimizer_states():
    cfg = llama.PRESETS["tiny"]
    tg = training_graph(cfg, 1, 4, SGD(lr=0.1, momentum=0.9))
    check(tg, cfg)
    states = [t for t in tg if isinstance(t.op, Input) and t.op.role == "state"]
    assert states and not any(facts_of(t, Layer) for t in states)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A LLaMA GGUF file (Q8_0 matrices, F32 norms) written by the tests' own writer."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gguf_files import hf_model, write_gguf

    path = tmp_path_factory.mktemp("gguf") / "llama-q8.gguf"
    return write_gguf(path, hf_model("llama", hidden=256, ffn=512, layers=3), "llama", "Q8_0")


def test_a_gguf_file_s_programs_state_the_layers(gguf_file):
    """Loaded from a GGUF file, whose tensors each have their own quantization: prefill
    and unrolled generation, every layer's quantized and float weights stating it."""
    from einpage.models.gguf import from_gguf

    opened = from_gguf(gguf_file)
    cfg, quant = opened.config, opened.quantization()
    assert cfg.num_layers == 3 and quant
    family = opened.family
    check(family.prefill_program(cfg, 1, 4, quant=quant).build(), cfg, frozenset(quant))
    unrolled = family.generation_program(cfg, 1, 4, 2, quant=quant).build()
    check(unrolled, cfg, frozenset(quant))
