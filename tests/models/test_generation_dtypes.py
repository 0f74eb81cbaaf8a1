"""Generation in every float dtype, both ways, greedy and top-k sampling: the plans run
on the NumPy runtime and give the ids of the reference evaluator on the unrolled
program of the same dtype (the same noise), so a dtype whose limits are read wrongly
(`numpy.finfo` knows no bfloat16) fails here, not in a user's run."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import taskgraph
from einpage.models import FAMILIES
from einpage.models.decode import Sampling, masked_score
from einpage.models.generation import generation_inputs
from einpage.workloads.generation import WAYS, GenerationSpec, Planning, plan_generation
from taskgraph import dtypes

SAMPLINGS = {"greedy": None, "top-k": Sampling(temperature=0.8, top_k=5)}
BATCH, PROMPT, NEW, PAGE = 2, 5, 4, 4
"""Prompts of 5 tokens end in a partial page of 4; 4 new tokens cross into a third."""


@functools.cache
def weights_of(family: str, dtype: str) -> dict[str, np.ndarray]:
    """Random weights of the family's tiny preset (N(0, 0.3²), sharp enough that the
    tokens vary), drawn once in float32 and cast to `dtype`."""
    cfg = FAMILIES[family].presets["tiny"]
    rng = np.random.default_rng(5)
    return {
        name: (0.3 * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
        for name, shape in cfg.weight_shapes().items()
    }


@functools.cache
def reference_ids(family: str, dtype: str, how: str) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, the reference evaluator's ids of the unrolled program)."""
    spec = spec_of(family, dtype, how)
    prompt = np.random.default_rng(9).integers(0, spec.cfg.vocab_size, (BATCH, PROMPT))
    inputs = generation_inputs(
        spec.family, spec.cfg, prompt, NEW, dtype, weights_of(family, dtype), spec.gumbel(3)
    )
    return prompt, taskgraph.evaluate(spec.generation_program().build(), inputs)["ids"]


def spec_of(family: str, dtype: str, how: str) -> GenerationSpec:
    family_ = FAMILIES[family]
    cfg = family_.presets["tiny"]
    return GenerationSpec(family_, cfg, BATCH, PROMPT, NEW, dtype, PAGE, SAMPLINGS[how])


@pytest.mark.parametrize("how", sorted(SAMPLINGS))
@pytest.mark.parametrize("dtype", dtypes.FLOAT_DTYPES)
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_way_dtype_and_sampling_generates_the_reference_ids(family, way, dtype, how):
    prompt, want = reference_ids(family, dtype, how)
    plan = plan_generation(spec_of(family, dtype, how), "60%", Planning(way=way))
    moved = plan.stats().transfers
    assert moved.weight_reload > 0  # the budget makes the plans move weights
    got = plan.run(weights_of(family, dtype), prompt, seed=3, backend="numpy").ids
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", dtypes.FLOAT_DTYPES)
def test_the_masked_score_is_exact_and_finite_in_every_float_dtype(dtype):
    score = masked_score(dtype)
    stored = np.array(score, dtype=dtypes.numpy_dtype(dtype))
    assert np.isfinite(stored) and float(stored) == score
    assert score <= -(2.0**14)  # far below any real score


def test_float_limits_come_from_the_dtype_table():
    assert float(dtypes.finfo("bfloat16").min) == -(2 - 2**-7) * 2.0**127  # 8 bits of mantissa
    assert dtypes.finfo("f16").maxexp == 16
    with pytest.raises(dtypes.DTypeError, match="int64 is not a float type"):
        dtypes.finfo("int64")
