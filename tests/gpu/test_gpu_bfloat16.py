"""bfloat16 (and the other dtypes generated kernels take) on the CuPy backend on a CUDA GPU:
kernels against NumPy's task by task, whole plans within the plan's memory, generation,
training steps, and the deterministic scatter-add.

The standards are `tests/runtime/dtype_checks.py`'s, which the CPU stand-in meets too
(`tests/runtime/test_runtime_kernel_dtypes_on_cpu.py`): bit for bit where both backends
compute a task by the same correctly rounded float32 operations and round once, within
one rounding of the dtype where the float32 value may differ (cuBLAS's order, CUDA's
`expf`); CuPy compiles with `-ftz=true`, so a float32 result below the smallest normal
may be zero here. Memory is strict: a run's device peak is at most the plan's budget,
and CuPy's default pool is left as it was.

Skipped cleanly without CuPy or a usable GPU (`make test-gpu` runs these).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import runtime

if not runtime.cupy_usable():
    pytest.skip(
        "needs CuPy and a CUDA GPU (pip install 'einpage[gpu]' or '.[gpu-cuda13]')",
        allow_module_level=True,
    )

import cupy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from dtype_checks import compare_every_task, differing  # noqa: E402
from runtime_cases import bfloat16_llama_programs  # noqa: E402

import einpage as ep  # noqa: E402
import taskgraph  # noqa: E402
from einpage.cli.checks import compare_outputs, tolerance_dtypes  # noqa: E402
from einpage.cli.presets import load_program, random_inputs  # noqa: E402
from einpage.models import FAMILIES, llama  # noqa: E402
from einpage.program.optim import AdamW  # noqa: E402
from einpage.program.quantize import Quantization  # noqa: E402
from einpage.workloads.generation import GenerationSpec, Planning, plan_generation  # noqa: E402
from einpage.workloads.training import training_graph  # noqa: E402
from runtime.cupy_backend import CupyKernels  # noqa: E402
from taskgraph import dtypes  # noqa: E402
from taskgraph.nodes import ScatterAdd  # noqa: E402

pytestmark = pytest.mark.gpu

TINY = llama.PRESETS["tiny"]
MODELS = bfloat16_llama_programs(batch=2, seq=16)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_task_of_llama_in_bfloat16_equals_numpys_on_the_gpu(model):
    tg = MODELS[model]()
    kernels = CupyKernels(cupy)
    counts = compare_every_task(
        tg, random_inputs(tg, 0), kernels, cupy.asarray, cupy.asnumpy, flushed=True
    )
    assert counts["bit for bit"] >= 20, counts


def strict_run(mg, inputs, mode):
    """Run `mg` on CuPy; assert its device peak is within the plan's budget and that
    CuPy's default pool did not grow."""
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    with runtime.Session(mg, "cupy", mode=mode) as session:
        got = session.run(inputs, seed=1)
        memory = session.last.memory
    assert memory["device_peak_bytes"] <= mg.budget, memory
    assert pool.used_bytes() == before
    return got


@pytest.mark.parametrize("mode", ["streams", "random"])
@pytest.mark.parametrize("budget", ["100%", "50%"])
def test_a_bfloat16_llama_plan_runs_within_its_budget_on_the_gpu(budget, mode):
    tg = load_program("llama:tiny", batch=2, seq=16, dtype="bfloat16")
    inputs = random_inputs(tg, 2)
    mg = ep.compile(tg, budget).plan
    got = strict_run(mg, inputs, mode)
    want = runtime.run(mg, inputs, "numpy")
    bad = [c.row() for c in compare_outputs(got, want, tolerance_dtypes(tg)) if not c.ok]
    assert not bad, bad


def test_int4_and_int8_bfloat16_plans_cast_with_generated_kernels_on_the_gpu():
    for bits in (4, 8):
        tg = llama.prefill_program(TINY, 1, 8, "bfloat16", "last", quant=Quantization(bits, 32))
        tg = tg.build()
        inputs = random_inputs(tg, 3)
        mg = ep.compile(tg, "50%").plan
        with runtime.Session(mg, "cupy") as session:
            got = session.run(inputs)
            counters = session.last.counters
        assert "generic_fallback" not in counters and counters["elementwise_kernel"] > 0
        want = runtime.run(mg, inputs, "numpy")
        bad = [c.row() for c in compare_outputs(got, want, tolerance_dtypes(tg)) if not c.ok]
        assert not bad, (bits, bad)


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_bfloat16_generation_on_the_gpu_chooses_numpys_ids_but_for_near_ties(way):
    """Greedy ids equal NumPy's until a step whose two best logits are within bfloat16's
    tolerance of each other in NumPy's run (cuBLAS may order that tie otherwise)."""
    family = FAMILIES["llama"]
    spec = GenerationSpec(family, family.presets["tiny"], 2, 5, 6, "bfloat16", 4, None,
                          logits=True)  # fmt: skip
    rng = np.random.default_rng(5)
    weights = {name: (0.3 * rng.standard_normal(shape, dtype=np.float32)).astype("bfloat16")
               for name, shape in spec.cfg.weight_shapes().items()}  # fmt: skip
    prompt = np.random.default_rng(9).integers(0, spec.cfg.vocab_size, (2, 5))
    plan = plan_generation(spec, "60%", Planning(way=way))
    want = plan.run(weights, prompt, backend="numpy")
    got = plan.run(weights, prompt, backend="cupy")
    rtol = 8e-2  # einpage.cli.checks.TOLERANCES["bfloat16"]
    for row in range(2):
        for step in range(spec.new_tokens):
            if got.ids[row, step] == want.ids[row, step]:
                continue
            logits = want.logits[row, step].astype(np.float32)
            best, chosen = logits[want.ids[row, step]], logits[got.ids[row, step]]
            assert best - chosen <= rtol * max(1.0, abs(best)), (row, step, best, chosen)
            break  # the sequences part here: later steps read different histories


def test_a_bfloat16_training_step_equals_the_evaluator_on_the_gpu():
    tg = training_graph(TINY, 2, 16, AdamW(lr=1e-2), "bfloat16")
    plan = ep.compile(tg, "50%", outputs="host").plan
    inputs = random_inputs(tg, 0)
    got = strict_run(plan, inputs, "streams")
    want = taskgraph.evaluate(tg, inputs)
    bad = [c.row() for c in compare_outputs(got, want, tolerance_dtypes(tg)) if not c.ok]
    assert not bad, bad
    again = strict_run(plan, inputs, "streams")
    for name, value in got.items():  # deterministic: no float atomics left
        assert not differing(again[name], value).any(), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_scatter_add_equals_numpys_add_at_bit_for_bit_on_the_gpu(dtype):
    rng = np.random.default_rng(3)
    rows, n, row = 50, 4096, 64
    prog = ep.Program("scatter")
    src = prog.input("src", (n, row), dtype)
    ids = prog.input("ids", (n,), "int64")
    prog.output(prog._add(ScatterAdd(0), (src, ids), (rows, row), None), "table")
    tg = prog.build()
    inputs = {
        "src": (rng.standard_normal((n, row)) * 10.0 ** rng.integers(-3, 4, (n, 1))).astype(
            dtypes.numpy_dtype(dtype)
        ),
        "ids": rng.integers(0, rows, n).astype(np.int64),
    }
    want = taskgraph.evaluate(tg, inputs)["table"]
    for _ in range(3):
        got = runtime.run(ep.compile(tg, "100%").plan, inputs, "cupy")["table"]
        assert not differing(got, want).any()
