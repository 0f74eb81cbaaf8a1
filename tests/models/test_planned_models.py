"""Planned models give Hugging Face's logits: the small LLaMA and GPT-2 models of the
equality tests (`hf_models`), planned with `memgraph.plan` under budgets that force
offloads, verified, and executed by the NumPy runtime in every mode.

Budgets: `min_budget` (the largest single step: the tightest plan there is) and halfway
between it and the streaming minimum. These models are so small that the logits or one
MLP step is most of the peak (`min_budget` is 40-90% of it), so "under pressure" is
checked, not assumed: every plan reloads more than the one load of each weight, and
the plans at `min_budget` offload.

The arena is one NumPy buffer and tensors are views at their planned offsets, so a bad
offset, a missing dependency (random order, with freed memory poisoned to NaN) or a
lost offload shows up as wrong logits. Tolerance as in the evaluator tests: 1e-4 of
the logit scale in float32 (measured: at most 1.1e-6 for LLaMA, 6.9e-7 for GPT-2).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    GPT2_VARIANTS,
    LLAMA_VARIANTS,
    TOLERANCE,
    hf_gpt2,
    hf_llama,
    hf_logits,
    relative_error,
)

import memgraph  # noqa: E402
import runtime  # noqa: E402
from einpage.models import gpt2, llama  # noqa: E402
from taskgraph.nodes import Input  # noqa: E402

torch.set_num_threads(1)

MODELS = {
    "llama": (llama, llama.LlamaConfig, hf_llama),
    "gpt2": (gpt2, gpt2.GPT2Config, hf_gpt2),
}
CASES = [("llama", v) for v in sorted(LLAMA_VARIANTS)] + [
    ("gpt2", v) for v in sorted(GPT2_VARIANTS)
]
SHAPES = [(1, 16, "all"), (2, 16, "all"), (3, 5, "last")]
BUDGETS = ("min", "mid")
MODES = ("sequential", "random", "threaded")


@functools.cache
def loaded(model: str, variant: str, dtype: str = "float32"):
    """(module, config, weights, HF model) of one test model."""
    module, config_cls, make = MODELS[model]
    hf = make(variant)
    cfg = config_cls.from_hf(hf.config)
    return module, cfg, module.weights_from_state_dict(cfg, hf.state_dict(), dtype), hf


@functools.cache
def planned(model: str, variant: str, batch: int, seq: int, logits: str, budget: str, dtype: str):
    """The verified plan of one program at the `budget` kind, and its two reference sizes."""
    module, cfg, _, _ = loaded(model, variant, dtype)
    tg = module.prefill_program(cfg, batch, seq, dtype, logits=logits).build()
    smallest, _ = memgraph.min_budget(tg)
    peak = memgraph.streaming_minimum(tg)
    nbytes = smallest if budget == "min" else (smallest + peak) // 2
    mg = memgraph.plan(tg, nbytes)
    memgraph.verify(mg)
    return mg, smallest, peak


def host_input_bytes(tg) -> int:
    """Bytes every plan must reload at least once: the inputs that start on the host."""
    return sum(t.nbytes for t in tg if isinstance(t.op, Input) and t.op.location == "host")


def tokens_for(vocab: int, batch: int, seq: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq))


def want_logits(hf, tokens: np.ndarray, logits: str) -> np.ndarray:
    want = hf_logits(hf, tokens)
    return want if logits == "all" else want[:, -1]


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("batch, seq, logits", SHAPES)
@pytest.mark.parametrize("model, variant", CASES)
def test_planned_models_under_pressure_give_transformers_logits(
    model, variant, batch, seq, logits, budget
):
    module, cfg, weights, hf = loaded(model, variant)
    mg, smallest, peak = planned(model, variant, batch, seq, logits, budget, "float32")
    stats = mg.stats
    assert smallest <= mg.budget < peak and stats.peak_bytes <= mg.budget
    # The plan is under real pressure: tensors leave the device (offloaded, or dropped
    # when a host copy exists) and come back, more than the one load of each weight.
    assert stats.offload_count + stats.drop_count > 0
    assert stats.reload_bytes > host_input_bytes(mg.taskgraph)
    if budget == "min":
        assert stats.offload_count > 0
    tokens = tokens_for(cfg.vocab_size, batch, seq, seed=batch * seq)
    inputs = module.prefill_inputs(cfg, tokens, weights)
    want = want_logits(hf, tokens, logits)
    for mode in MODES:
        got = runtime.run(mg, inputs, backend="numpy", mode=mode, seed=seq)["logits"]
        assert got.dtype == np.float32
        assert relative_error(got, want) <= TOLERANCE, mode


@pytest.mark.parametrize("mode", ["sequential", "random"])
@pytest.mark.parametrize("model, variant", [("llama", "gqa-tied"), ("gpt2", "base")])
def test_a_session_staged_once_runs_two_token_batches(model, variant, mode):
    module, cfg, weights, hf = loaded(model, variant)
    batch, seq = 2, 7
    mg, _, _ = planned(model, variant, batch, seq, "all", "min", "float32")
    first = tokens_for(cfg.vocab_size, batch, seq, seed=1)
    second = tokens_for(cfg.vocab_size, batch, seq, seed=2)
    with runtime.Session(mg, "numpy", mode=mode) as session:
        session.stage(weights)
        assert set(session.staged) == set(weights)
        outs = [
            session.run(module.prefill_inputs(cfg, t), seed=i)["logits"]
            for i, t in enumerate([first, second, first])
        ]
    assert relative_error(outs[0], want_logits(hf, first, "all")) <= TOLERANCE
    assert relative_error(outs[1], want_logits(hf, second, "all")) <= TOLERANCE
    assert np.array_equal(outs[0], outs[2])  # nothing stale carried over between runs
    assert not np.allclose(outs[0], outs[1])


@pytest.mark.parametrize("model, variant", [("llama", "mha"), ("gpt2", "n_inner")])
def test_float16_planned_models_stay_close_to_float32_transformers(model, variant):
    module, cfg, weights, hf = loaded(model, variant, "float16")
    mg, _, _ = planned(model, variant, 3, 5, "all", "min", "float16")
    assert mg.stats.offload_count > 0
    tokens = tokens_for(cfg.vocab_size, 3, 5, seed=3)
    inputs = module.prefill_inputs(cfg, tokens, weights, "float16")
    got = runtime.run(mg, inputs, backend="numpy", mode="random", seed=0)["logits"]
    assert got.dtype == np.float16
    assert relative_error(got.astype(np.float32), want_logits(hf, tokens, "all")) <= 1e-2
