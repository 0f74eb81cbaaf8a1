"""Quantized generation (`generate(..., quant=...)`, `einpage generate --quant`): int8 and
int4 weights through the unrolled plan and the step plans of every generating family.

Checked against references independent of the plans: the reference evaluator
(`taskgraph.evaluate`) of the same quantized program on the same quantized weights, and
the float generation on weights dequantized by NumPy integer arithmetic
(`einpage.program.quantize.dequantize`), whose logits must equal the quantized run's
(so the device's rebuilt weights equal NumPy's formula). The README's promise that only
quantized bytes cross PCIe is checked on plans that move weights: every weight reload is
a quantized input (or a weight the model does not quantize), and no tensor computed from
weights alone – a rebuilt float weight – is ever moved.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import runtime
import taskgraph
from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK, main
from einpage.cli.generate import random_weights
from einpage.models import gpt2, llama, mistral, qwen2
from einpage.models.errors import GenerationError
from einpage.program.quantize import Quantization, dequantize, quantize_weights
from einpage.workloads.generate import generate
from einpage.workloads.generation import GenerationSpec, Planning, plan_generation
from memgraph import NodeKind
from taskgraph.nodes import Input

FAMILIES = {
    "llama": (llama.FAMILY, llama.PRESETS["tiny-gqa"]),
    "gpt2": (gpt2.FAMILY, gpt2.PRESETS["tiny"]),
    "qwen2": (qwen2.FAMILY, qwen2.PRESETS["tiny"]),
    "mistral": (mistral.FAMILY, mistral.PRESETS["tiny"]),
}
GROUP = 32


def _weights(cfg, seed=3):
    """Random float32 weights, drawn larger than the CLI's (N(0, 0.2²)) so the tokens
    depend on every weight."""
    weights = random_weights(cfg, "float32", seed)
    return {n: w * 10 if w.ndim > 1 else w for n, w in weights.items()}


def _dequantized(cfg, weights, quant):
    """The float weights the quantized ones stand for, by NumPy's formula."""
    stored = quantize_weights(cfg, weights, quant.bits, quant.group)
    out = {}
    for name, w in weights.items():
        if name in cfg.quantized_weights():
            out[name] = dequantize(stored[f"{name}.q"], stored[f"{name}.scale"], quant)
        else:
            out[name] = w
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_quantized_generation_equals_the_reference_and_dequantized_weights(family, bits, way):
    fam, cfg = FAMILIES[family]
    quant = Quantization(bits, GROUP)
    weights = _weights(cfg)
    ids = np.random.default_rng(bits).integers(0, cfg.vocab_size, (2, 5))
    plan = Planning(way=way)
    got = generate(cfg, ids, 4, "60%", weights=weights, page_size=4, logits=True, plan=plan,
                   quant=quant)  # fmt: skip
    assert got.spec.quant == quant and got.plan.plans  # planned quantized
    # the reference evaluator of the same quantized program on the same quantized weights
    spec = GenerationSpec(fam, cfg, 2, 5, 4, page_size=4, logits=True, quant=quant)
    tg = spec.generation_program().build()
    inputs = {"tokens": ids, **fam.position_inputs(cfg, spec.positions, "float32")}
    ref = taskgraph.evaluate(tg, {**inputs, **spec.program_weights(weights)})
    np.testing.assert_array_equal(got.new_ids, ref["ids"])
    np.testing.assert_allclose(got.logits, ref["logits"], rtol=1e-4, atol=1e-4)
    # the float model on NumPy's dequantized weights: the same logits, the same tokens
    floats = generate(cfg, ids, 4, "100%", weights=_dequantized(cfg, weights, quant),
                      page_size=4, logits=True)  # fmt: skip
    np.testing.assert_array_equal(got.new_ids, floats.new_ids)
    np.testing.assert_allclose(got.logits, floats.logits, rtol=1e-4, atol=1e-4)
    # and quantization changed something: the float weights give other logits
    plain = generate(cfg, ids, 4, "100%", weights=weights, page_size=4, logits=True)
    assert not np.allclose(plain.logits, got.logits, rtol=1e-4, atol=1e-4)


def _derived_from_weights(tg) -> set[int]:
    """The tasks computed from weight inputs alone (the rebuilt float weights and their
    views), by the graph's edges."""
    derived: set[int] = set()
    for task in tg:
        if isinstance(task.op, Input):
            if task.op.role == "weight":
                derived.add(task.id)
        elif task.inputs and all(i in derived for i in task.inputs):
            derived.add(task.id)
    return derived


@pytest.mark.parametrize("way", ["unrolled", "steps"])
@pytest.mark.parametrize("bits", [8, 4])
def test_only_quantized_weight_bytes_cross_pcie(way, bits):
    cfg = llama.PRESETS["tiny"]
    quant = Quantization(bits, GROUP)
    spec = GenerationSpec(llama.FAMILY, cfg, 1, 6, 5, page_size=4, quant=quant)
    # 1.5x the streaming minimum streams weights every step; nearer the minimum an int4
    # weight's two rebuilt halves may be offloaded before their Concat (operands with no
    # host copy cannot be recomputed: the README's quantization section says so)
    planned = plan_generation(spec, "150%streaming", Planning(way=way))
    quantized = cfg.quantized_weights()
    reloaded_weights = 0
    for compiled in planned.plans.values():
        mg, tg = compiled.plan, compiled.plan.taskgraph
        derived = _derived_from_weights(tg)
        for node in mg.nodes:
            if node.kind not in (NodeKind.RELOAD, NodeKind.OFFLOAD):
                continue
            moved = node.tensor
            if tg.is_input_slice(moved):  # a block of a partitioned input: the input's
                moved = tg[moved].inputs[0]
            root = tg[tg.storage_root(moved)]
            if isinstance(root.op, Input) and root.op.role == "weight":
                name = root.op.name
                if name.endswith(".q"):
                    assert root.dtype == ("int8" if bits == 8 else "uint8"), name
                elif not name.endswith(".scale"):
                    assert name not in quantized, f"{name} moved in float"
                reloaded_weights += tg[node.tensor].nbytes
            else:
                assert root.id not in derived, f"a rebuilt float weight moved: {root.line()}"
    assert reloaded_weights > 0  # the budget makes the plans stream weights
    if way == "unrolled":  # (step plans' stats count a plan once per chunk it runs)
        assert planned.stats().transfers.weight_reload == reloaded_weights


def test_a_quantized_plan_streams_fewer_weight_bytes_than_the_float_plan():
    cfg = llama.PRESETS["tiny"]
    stats = {}
    for quant in (None, "int8", "int4"):
        spec = GenerationSpec(llama.FAMILY, cfg, 1, 6, 5, page_size=4, quant=quant)
        stats[quant] = plan_generation(spec, "120KiB", Planning(way="steps")).stats()
    reload = {q: s.transfers.weight_reload for q, s in stats.items()}
    assert reload["int4"] < reload["int8"] < reload[None], reload


@pytest.mark.parametrize("bad", ["int3", "float8", 8, True])
def test_a_bad_quant_is_refused_naming_what_is_valid(bad):
    with pytest.raises(GenerationError, match="quant must be one of 'int8', 'int4'"):
        generate(llama.PRESETS["tiny"], np.zeros((1, 3), np.int64), 2, "100%", quant=bad,
                 run=None)  # fmt: skip


def test_the_cli_generates_with_quantized_weights(capsys):
    argv = ["generate", "llama:tiny", "--prompt-len", "5", "--new-tokens", "3", "--budget",
            "100%", "--page-size", "4", "--run", "--backend", "numpy"]  # fmt: skip
    assert main([*argv, "--quant", "int4"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "weights int4 (groups of up to 128)" in out and "tokens (prompt | new)" in out
    assert main([*argv, "--quant", "int2"]) == EXIT_BAD_INPUT
    assert "invalid choice: 'int2'" in capsys.readouterr().err


def test_the_host_memory_check_counts_the_quantized_copy(monkeypatch):
    import einpage.workloads.generate as generate_module
    from einpage.workloads.generate import check_run_memory, quantized_weight_bytes, weight_bytes

    cfg = llama.PRESETS["tiny"]
    spec = GenerationSpec(llama.FAMILY, cfg, 1, 6, 3, "bfloat16", page_size=4, quant="int4")
    made = spec.program_weights(random_weights(cfg, "bfloat16", 0))
    stored = sum(a.nbytes for n, a in made.items() if n.endswith((".q", ".scale")))
    assert quantized_weight_bytes(cfg, spec.quant, "bfloat16") == stored > 0
    planned = plan_generation(spec, "100%")
    need = check_run_memory(planned, "numpy", "drawn at random")
    monkeypatch.setattr(generate_module, "available_memory", lambda: need - 1)
    with pytest.raises(generate_module.HostMemoryError, match=rf"\({need} B\).*their int4 copy"):
        check_run_memory(planned, "numpy", "drawn at random")
    # the rest: the float weights drawn (and one weight's float32 draw), and the run
    backend = runtime.get_backend("numpy", dtypes={"bfloat16"})
    largest = max(math.prod(shape) for shape in cfg.weight_shapes().values())
    floats = weight_bytes(cfg, "bfloat16") + 4 * largest
    assert need - floats - planned.host_bytes(backend) == stored
