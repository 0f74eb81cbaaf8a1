"""Weight-only quantization (`einpage.program.quantize`): the stored layout against independent
NumPy integer arithmetic, the program's dequantization against it exactly, and
quantized LLaMA and GPT-2 models planned under offloading budgets and run by the NumPy
runtime in every mode against the reference evaluator of the same quantized program.

Tolerance against the float32 model (tiny random models, weights ~ N(0, 0.05²), group
32; relative to the largest logit): int8 at most 1% (measured 0.2-0.6%), int4 at most
20% (measured 3-12%): round to nearest with no calibration, as documented.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import pytest

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.models import gpt2, llama, qwen2
from einpage.models.common import weight_input
from einpage.models.errors import ConfigError
from einpage.models.weights import WeightSpec
from einpage.program.quantize import (
    Quantization,
    dequantize,
    dequantized_weight,
    quantize,
    quantize_weights,
)
from einpage_core.errors import ProgramError

RNG = np.random.default_rng(11)
MODES = ("sequential", "random", "threaded")
MODEL_TOLERANCE = {8: 0.01, 4: 0.2}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape, group", [((6, 64), 16), ((3, 2, 96), 32), ((5, 30), 128)])
def test_round_to_nearest_is_within_half_a_step(bits, shape, group):
    quant = Quantization(bits, group)
    w = RNG.standard_normal(shape).astype(np.float32)
    q, scale = quantize(w, quant)
    back = dequantize(q, scale, quant)
    g = quant.group_size(shape[-1])
    step = np.repeat(scale, g, axis=-1).reshape(shape)
    assert back.shape == shape
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6 * np.abs(w))
    assert np.all(np.abs(w) <= step * quant.qmax * (1 + 1e-6))  # the group's max sets its step


def test_int4_packs_two_values_a_byte_low_nibble_first():
    quant = Quantization(4, 4)
    w = np.array([[-8.0, -1.0, 0.0, 7.0]], np.float32)  # scale 8/7: q = -7, -1, 0, 6
    q, scale = quantize(w, quant)
    assert q.dtype == np.uint8 and q.shape == (1, 1, 2)
    want = np.rint(w / scale[..., None]).astype(int).reshape(-1) + 8  # biased by 8
    assert q[0, 0, 0] == want[0] | (want[2] << 4) and q[0, 0, 1] == want[1] | (want[3] << 4)
    np.testing.assert_array_equal(q[..., :] & 0xF, [[want[:2]]])


def test_the_group_is_the_largest_divisor_at_most_the_configured_size():
    assert Quantization(8, 128).group_size(4096) == 128
    assert Quantization(8, 128).group_size(96) == 96
    assert Quantization(8, 128).group_size(11008) == 128
    assert Quantization(8, 128).group_size(4104) == 114  # 2^3 * 3^3 * 19
    assert Quantization(4, 128).group_size(30) == 30
    with pytest.raises(ConfigError, match="even size"):
        Quantization(4, 128).group_size(7)


@pytest.mark.parametrize("bad", [{"bits": 3}, {"bits": 16}, {"group": 1}, {"group": 2.5}])
def test_bad_quantization_settings_are_refused(bad):
    with pytest.raises(ConfigError, match="quantization"):
        Quantization(**bad)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_program_dequantizes_exactly_as_numpy(bits, dtype):
    quant = Quantization(bits, 32)
    shape = (3, 4, 64)
    w = RNG.standard_normal(shape)
    q, scale = quantize(w, quant)
    prog = ep.Program()
    prog.output(dequantized_weight(prog, "w", shape, dtype, quant), "w")
    got = taskgraph.evaluate(prog.build(), {"w.q": q, "w.scale": scale.astype(dtype)})["w"]
    assert got.dtype == dtype and got.shape == shape
    np.testing.assert_array_equal(got, dequantize(q, scale.astype(dtype), quant, dtype))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_matmul_equals_numpy_dequantize_then_matmul(bits):
    quant = Quantization(bits, 16)
    w = RNG.standard_normal((24, 48))
    x = RNG.standard_normal((5, 48))
    q, scale = quantize(w, quant)
    prog = ep.Program()
    xin = prog.input("x", x.shape, "float64")
    weight = dequantized_weight(prog, "w", w.shape, "float64", quant)
    prog.output(prog.einsum("bd,md->bm", xin, weight), "y")
    got = taskgraph.evaluate(prog.build(), {"x": x, "w.q": q, "w.scale": scale.astype("float64")})
    want = x @ dequantize(q, scale, quant, "float64").T
    np.testing.assert_allclose(got["y"], want, rtol=1e-12, atol=1e-12)


def test_only_matmul_weights_are_quantized():
    quantized = llama.PRESETS["tiny"].quantized_weights()
    chosen = sorted(n for n in quantized if n.startswith("layers.0"))
    parts = ("attn.wk", "attn.wo", "attn.wq", "attn.wv", "mlp.w_down", "mlp.w_gate", "mlp.w_up")
    assert chosen == [f"layers.0.{p}" for p in parts]
    assert "lm_head" in quantized
    assert "embed" not in quantized and "norm" not in quantized
    for module in (qwen2, gpt2):  # Q/K/V biases (Qwen2's, GPT-2's) stay in the float dtype
        quantized = module.PRESETS["tiny"].quantized_weights()
        assert "layers.0.attn.wq" in quantized and "layers.0.attn.bq" not in quantized


@dataclass(frozen=True)
class _OpaqueNames(llama.LlamaConfig):
    """LLaMA tiny's weights under names that say nothing (`p0`, `p1`, ...)."""

    def weight_specs(self, prefix: str = "model.") -> list[WeightSpec]:
        specs = super().weight_specs(prefix)
        return [replace(spec, name=f"p{i}") for i, spec in enumerate(specs)]


def test_which_weights_are_quantized_is_the_models_word_not_their_names():
    tiny = llama.PRESETS["tiny"]
    opaque = _OpaqueNames(**{f.name: getattr(tiny, f.name) for f in fields(tiny) if f.init})
    renamed = dict(zip(tiny.weight_shapes(), opaque.weight_shapes(), strict=True))
    shapes = tiny.weight_shapes()
    weights = {k: RNG.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    want = quantize_weights(tiny, weights, bits=8, group=32)
    got = quantize_weights(opaque, {renamed[k]: w for k, w in weights.items()}, bits=8, group=32)
    assert "layers.0.attn.wq.q" in want and len(want) == len(got)  # the same ones quantized
    for name in weights:
        for suffix in (".q", ".scale", ""):
            if name + suffix in want:
                np.testing.assert_array_equal(got[renamed[name] + suffix], want[name + suffix])
    # a program declares quantized inputs for the weights the model names, whatever they are
    prog = ep.Program()
    weight = weight_input(prog, {"kernel": (8, 32), "w_plain": (8, 32)}, "float32",
                          Quantization(8, 32), quantized={"kernel"})  # fmt: skip
    prog.output(ep.add(weight("kernel"), weight("w_plain")), "y")
    assert set(prog.build().inputs) == {"kernel.q", "kernel.scale", "w_plain"}


def _model(module, bits):
    cfg = module.PRESETS["tiny"]
    weights = {
        k: (RNG.standard_normal(s) * 0.05).astype(np.float32)
        for k, s in cfg.weight_shapes().items()
    }
    tokens = RNG.integers(0, cfg.vocab_size, (2, 16))
    quantized = quantize_weights(cfg, weights, bits=bits, group=32)
    tg = module.prefill_program(cfg, 2, 16, quant=Quantization(bits, 32)).build()
    return cfg, weights, tokens, quantized, tg


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("module", [llama, gpt2], ids=["llama", "gpt2"])
def test_quantized_models_plan_under_offloading_budgets_and_run_as_the_reference(module, bits):
    cfg, weights, tokens, quantized, tg = _model(module, bits)
    inputs = module.prefill_inputs(cfg, tokens, quantized)
    want = taskgraph.evaluate(tg, inputs)["logits"]
    full = taskgraph.evaluate(
        module.prefill_program(cfg, 2, 16).build(), module.prefill_inputs(cfg, tokens, weights)
    )["logits"]
    error = np.abs(want - full).max() / np.abs(full).max()
    assert error <= MODEL_TOLERANCE[bits], error
    low, _ = memgraph.min_budget(tg)
    peak = memgraph.streaming_minimum(tg)
    for budget in (low, (low + peak) // 2):
        mg = memgraph.plan(tg, budget)
        memgraph.verify(mg)
        assert mg.stats.offload_bytes + mg.stats.reload_bytes > 0 or budget > low
        for mode in MODES:
            got = runtime.run(mg, inputs, backend="numpy", mode=mode, seed=budget)["logits"]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_quantized_weights_are_what_the_host_holds_and_moves():
    """The weight inputs are the quantized bytes; the float weights exist only as tasks."""
    sizes = {}
    for bits in (None, 8, 4):
        cfg = llama.PRESETS["tiny"]
        quant = None if bits is None else Quantization(bits, 32)
        tg = llama.prefill_program(cfg, 1, 8, "float16", quant=quant).build()
        sizes[bits] = sum(
            t.nbytes for t in tg.tasks if t.op.kind == "input" and t.op.role == "weight"
        )
    assert sizes[4] < sizes[8] < sizes[None]
    # int8 (1 byte + a 2-byte scale per 32) and int4 (half a byte + the same scales)
    # against float16 on the quantized matrices; embeddings and norms stay float16
    assert sizes[8] < 0.75 * sizes[None] and sizes[4] < 0.55 * sizes[None]


def test_quantize_weights_checks_shapes_and_passes_the_rest_through():
    cfg = llama.PRESETS["tiny"]
    weights = {k: np.zeros(s, np.float32) for k, s in cfg.weight_shapes().items()}
    q = quantize_weights(cfg, weights, bits=4, group=32)
    assert "embed" in q and "layers.0.attn.wq.q" in q and "layers.0.attn.wq" not in q
    assert (
        q["layers.0.attn.wq.q"].dtype == np.uint8
        and q["layers.0.attn.wq.scale"].dtype == np.float32
    )
    weights["layers.0.mlp.w_up"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ConfigError, match="layers.0.mlp.w_up"):
        quantize_weights(cfg, weights, bits=8)


def test_prefill_refuses_a_quant_that_is_not_a_quantization():
    with pytest.raises(ProgramError, match="Quantization"):
        llama.prefill_program(llama.PRESETS["tiny"], 1, 8, quant=8)
