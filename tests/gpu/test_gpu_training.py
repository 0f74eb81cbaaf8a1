"""Training steps on the CuPy backend: a mixed-precision (float16) AdamW step and a
float32 step whose learning rate changes between runs of one plan equal the reference
evaluator (`einpage.cli.checks.compare_outputs`, its per-dtype tolerances, of the least
precise dtype each output is computed from: cuBLAS and the GPU's functions round
differently from NumPy, and a float32 AdamW moment inherits the float16 gradient's
rounding). Inputs are random, drawn in
each input's stated domain (`einpage.cli.presets.random_inputs`), so none is NaN.

Skipped cleanly without CuPy or a usable GPU. (bfloat16 steps: `test_gpu_bfloat16.py`.)
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import runtime

if not runtime.cupy_usable():
    pytest.skip(
        "needs CuPy and a CUDA GPU (pip install 'einpage[gpu]' or '.[gpu-cuda13]')",
        allow_module_level=True,
    )

import einpage as ep  # noqa: E402
import memgraph  # noqa: E402
import taskgraph  # noqa: E402
from einpage.cli.checks import compare_outputs, tolerance_dtypes  # noqa: E402
from einpage.cli.presets import random_inputs  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.program.optim import AdamW  # noqa: E402
from einpage.workloads.training import training_graph  # noqa: E402

pytestmark = pytest.mark.gpu

OPT = AdamW(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)


def assert_equal_to_the_evaluator(tg, plan, inputs, mode):
    want = taskgraph.evaluate(tg, inputs)
    got = runtime.run(plan, inputs, "cupy", mode=mode, seed=1)
    bad = [c.row() for c in compare_outputs(got, want, tolerance_dtypes(tg)) if not c.ok]
    assert not bad, bad


@pytest.mark.parametrize("mode", ["streams", "random"])
def test_a_planned_mixed_precision_training_step_runs_on_the_gpu(mode):
    tg = training_graph(llama.PRESETS["tiny"], 2, 16, OPT, "float16")
    smallest, _ = memgraph.min_budget(runtime.declare_workspaces(tg))
    plan = ep.compile(tg, smallest, outputs="host").plan
    inputs = random_inputs(tg, 0)
    assert inputs["step"].dtype.name == "int64" and inputs["step"] >= 1
    assert_equal_to_the_evaluator(tg, plan, inputs, mode)


def test_a_learning_rate_schedule_runs_one_plan_on_the_gpu():
    tg = training_graph(llama.PRESETS["tiny"], 2, 16, OPT)
    plan = ep.compile(tg, "50%", outputs="host").plan
    inputs = random_inputs(tg, 1)
    for step, lr in enumerate([1e-2, 3e-3, 1e-4], start=1):
        inputs.update(replace(OPT, lr=lr).inputs(step, "float32"))
        assert_equal_to_the_evaluator(tg, plan, inputs, "streams")
