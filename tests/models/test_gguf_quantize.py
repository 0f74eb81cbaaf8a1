"""The quantization GGUF's block formats need (`einpage.program.quantize`): groups with
minimums (zero points; unsigned integers) and groups along a weight's first axis
(`transposed`), round-tripped against NumPy and rebuilt by the program's tasks exactly
as `dequantize` computes them."""

from __future__ import annotations

import numpy as np
import pytest

import taskgraph
from einpage.errors import ConfigError
from einpage.program.program import Program
from einpage.program.quantize import Quantization, dequantize, dequantized_weight, quantize


@pytest.mark.parametrize("bits", [8, 4])
def test_groups_with_minimums_round_trip_within_half_a_step(bits):
    quant = Quantization(bits, 16, minimum=True)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 64)).astype(np.float32) + 3.0  # far from symmetric
    q, scale, low = quantize(w, quant)
    assert q.dtype == np.uint8
    back = dequantize(q, scale, quant, "float32", low)
    step = np.repeat(scale, 16, axis=-1)
    assert np.all(np.abs(back - w) <= step / 2 * (1 + 1e-5))
    # the minimum is the group's least value: the zero point spends no levels below it
    np.testing.assert_allclose(low, w.reshape(6, 4, 16).min(axis=-1))


def test_a_transposed_quantization_groups_the_first_axis():
    quant = Quantization(8, 8, transposed=True)
    w = np.random.default_rng(1).standard_normal((16, 3, 2)).astype(np.float32)
    q, scale = quantize(w, quant)
    assert q.shape == (2, 48 // 8, 8) and quant.matrix(w.shape) == (2, 48)
    back = dequantize(q, scale, quant, "float32")  # the stored matrix [2, 48]
    np.testing.assert_allclose(back.T.reshape(w.shape), w, atol=float(scale.max()))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("minimum", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_the_program_rebuilds_exactly_what_numpy_does(bits, minimum, transposed):
    quant = Quantization(bits, 16, minimum, transposed)
    shape = (4, 8, 32)
    w = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    stored = quantize(w, quant)
    prog = Program("dequant")
    prog.output(dequantized_weight(prog, "w", shape, "float32", quant), "w")
    names = ["w.q", "w.scale", "w.min"]
    got = taskgraph.evaluate(prog.build(), dict(zip(names, stored, strict=False)))["w"]
    matrix = dequantize(stored[0], stored[1], quant, "float32", *stored[2:])
    want = matrix.T.reshape(shape) if transposed else matrix.reshape(shape)
    np.testing.assert_array_equal(got, want)


def test_a_minimum_must_be_given_exactly_when_the_quantization_has_them():
    quant = Quantization(4, 16, minimum=True)
    q, scale, low = quantize(np.ones((2, 16), np.float32), quant)
    with pytest.raises(ConfigError, match="has minimums"):
        dequantize(q, scale, quant)
    with pytest.raises(ConfigError, match="has no minimums"):
        dequantize(q, scale, Quantization(4, 16), minimum=low)


def test_flags_must_be_booleans():
    with pytest.raises(ConfigError, match="minimum must be True or False"):
        Quantization(8, 32, minimum="yes")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cupy_kernels_rebuild_gguf_formats_as_numpy_on_the_cpu_stand_in(dtype):
    """Every task of a LLaMA prefill whose weights have minimums and transposed groups –
    uint4 and uint8 casts, the three-operand `a * b + c`, the transpose – run by the CuPy
    backend's kernels on the CPU stand-in (`tests/runtime/cpu_cuda.py`) equals NumPy's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    from cpu_cuda import CXX, fake_cupy
    from dtype_checks import compare_every_task

    if CXX is None:
        pytest.skip("no host C++ compiler (g++)")
    from einpage.cli.presets import random_inputs
    from einpage.models import llama
    from runtime.cupy_backend import CupyKernels

    tiny = llama.PRESETS["tiny"]
    quant = {
        name: Quantization(4 if "attn" in name else 8, 32, minimum=True, transposed=spec)
        for name, spec in ((s.name, s.transpose) for s in tiny.weight_specs())
        if name in tiny.quantized_weights()
    }
    tg = llama.prefill_program(tiny, 1, 8, dtype, "last", quant=quant).build()
    cp = fake_cupy()
    counts = compare_every_task(
        tg, random_inputs(tg, 0), CupyKernels(cp), to_device=cp.asarray, to_host=cp.asnumpy
    )
    assert counts["bit for bit"] >= 20, counts
