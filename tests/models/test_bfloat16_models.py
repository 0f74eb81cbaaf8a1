"""bfloat16 models end to end: checkpoints read as bfloat16 (no float32 detour), programs
in bfloat16 equal to Hugging Face transformers run in bfloat16, and planned under
offloading budgets, run in every runtime mode, equal to the reference evaluator.

Tolerance against transformers: bfloat16 keeps 8 significant bits, so one rounding is up
to 2**-8 = 0.39% of a value, and both sides round at every op (ours once per task,
transformers once per torch op, at different points: our softmax rounds its max and
sum, torch's fused one does not; our RMSNorm folds the weight into one task). On the
small random models of `hf_models` (sharp attention, two layers) the max abs logit
error relative to the logit scale measured at most 3.8e-2 against transformers in
bfloat16 – the same size as transformers' own bfloat16 error against its float32
(up to 4.1e-2 on the same cases) – so the check allows `BF16_TOLERANCE` = 6e-2 of the
scale against both. A wrong program is off by the scale itself.

Against the reference evaluator of the same bfloat16 program the runtime is exact: it
runs the same kernels (float32 compute, one rounding per task) on arena views.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_models import (  # noqa: E402
    GPT2_VARIANTS,
    LLAMA_VARIANTS,
    hf_gpt2,
    hf_llama,
    hf_logits,
    relative_error,
)

import memgraph  # noqa: E402
import runtime  # noqa: E402
import taskgraph  # noqa: E402
from einpage.models import gpt2, llama  # noqa: E402
from einpage.models.checkpoint import SafetensorsSource, to_numpy  # noqa: E402

torch.set_num_threads(1)

BF16_TOLERANCE = 6e-2
"""Max abs logit error allowed against transformers in bfloat16 (and float32), relative
to max |logit| (see the module docstring: measured at most 3.8e-2)."""

MODELS = {
    "llama": (llama, llama.LlamaConfig, hf_llama),
    "gpt2": (gpt2, gpt2.GPT2Config, hf_gpt2),
}
CASES = [("llama", v) for v in sorted(LLAMA_VARIANTS)] + [
    ("gpt2", v) for v in sorted(GPT2_VARIANTS)
]
MODES = ("sequential", "random", "threaded")


@functools.cache
def loaded(model: str, variant: str):
    """(module, config, bfloat16 weights, the HF model in bfloat16, the HF model in float32)."""
    module, config_cls, make = MODELS[model]
    hf32 = make(variant)
    hf = copy.deepcopy(hf32).to(torch.bfloat16)
    cfg = config_cls.from_hf(hf.config)
    return module, cfg, module.weights_from_state_dict(cfg, hf.state_dict(), "bfloat16"), hf, hf32


def bf16_logits(hf, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.from_numpy(tokens)).logits.float().numpy()


def tokens_for(vocab: int, batch: int, seq: int) -> np.ndarray:
    return np.random.default_rng(batch * 31 + seq).integers(0, vocab, (batch, seq))


@pytest.mark.parametrize("batch, seq, logits", [(1, 1, "all"), (1, 9, "all"), (3, 5, "last")])
@pytest.mark.parametrize("model, variant", CASES)
def test_bfloat16_programs_equal_transformers_in_bfloat16(model, variant, batch, seq, logits):
    module, cfg, weights, hf, hf32 = loaded(model, variant)
    assert all(w.dtype.name == "bfloat16" for w in weights.values())
    tokens = tokens_for(cfg.vocab_size, batch, seq)
    tg = module.prefill_program(cfg, batch, seq, "bfloat16", logits=logits).build()
    assert all(t.dtype in ("bfloat16", "int64") for t in tg)
    inputs = module.prefill_inputs(cfg, tokens, weights, "bfloat16")
    got = taskgraph.evaluate(tg, inputs)["logits"]
    assert got.dtype.name == "bfloat16"
    got = got.astype(np.float32)
    want, want32 = bf16_logits(hf, tokens), hf_logits(hf32, tokens)
    if logits == "last":
        want, want32 = want[:, -1], want32[:, -1]
    assert relative_error(got, want) <= BF16_TOLERANCE
    assert relative_error(got, want32) <= BF16_TOLERANCE


@functools.cache
def planned(model: str, variant: str, budget: str):
    """The bfloat16 prefill (batch 2, seq 7) planned at `min_budget` or halfway to the
    streaming minimum, verified."""
    module, cfg, _, _, _ = loaded(model, variant)
    tg = module.prefill_program(cfg, 2, 7, "bfloat16").build()
    smallest, _ = memgraph.min_budget(tg)
    peak = memgraph.streaming_minimum(tg)
    mg = memgraph.plan(tg, smallest if budget == "min" else (smallest + peak) // 2)
    memgraph.verify(mg)
    return mg


@pytest.mark.parametrize("budget", ["min", "mid"])
@pytest.mark.parametrize("model, variant", [("llama", "gqa-tied"), ("gpt2", "base")])
def test_planned_bfloat16_models_run_exactly_as_the_reference(model, variant, budget):
    module, cfg, weights, _, _ = loaded(model, variant)
    mg = planned(model, variant, budget)
    tg = mg.taskgraph
    weight_bytes = sum(w.nbytes for w in weights.values())
    assert weight_bytes == sum(tg[i].nbytes for n, i in tg.inputs.items() if n in weights)
    assert mg.budget < memgraph.streaming_minimum(tg)
    assert mg.stats.offload_count + mg.stats.drop_count > 0
    if budget == "min":
        assert mg.stats.offload_count > 0
    inputs = module.prefill_inputs(cfg, tokens_for(cfg.vocab_size, 2, 7), weights, "bfloat16")
    want = taskgraph.evaluate(tg, inputs)["logits"]
    for mode in MODES:
        got = runtime.run(mg, inputs, backend="numpy", mode=mode, seed=5)["logits"]
        assert got.dtype.name == "bfloat16"
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=mode)


def test_the_planner_counts_two_bytes_per_bfloat16_element():
    cfg = llama.PRESETS["tiny"]
    half = llama.prefill_program(cfg, 1, 8, "bfloat16").build()
    full = llama.prefill_program(cfg, 1, 8, "float32").build()
    for a, b in zip(half.tasks, full.tasks, strict=True):
        assert 2 * a.nbytes == b.nbytes or a.dtype == b.dtype == "int64", a.line()
    assert memgraph.streaming_minimum(half) < memgraph.streaming_minimum(full)


# -- checkpoints ----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_bfloat16_checkpoints_load_as_bfloat16_without_a_float32_detour(
    model, tmp_path, monkeypatch
):
    module, config_cls, _ = MODELS[model]
    _, _, _, hf, _ = loaded(model, "gqa-tied" if model == "llama" else "base")
    hf.save_pretrained(tmp_path)  # safetensors with BF16 tensors
    cfg = config_cls.from_checkpoint(tmp_path)
    reads = []
    original = SafetensorsSource.read

    def spy(self, key, part=None):
        array = original(self, key, part)
        reads.append(array.dtype.name)
        return array

    monkeypatch.setattr(SafetensorsSource, "read", spy)
    loaded_bf16 = module.weights_from_safetensors(cfg, tmp_path, "bfloat16")
    assert reads and set(reads) == {"bfloat16"}  # what the file holds, never widened
    state = module.weights_from_state_dict(cfg, hf.state_dict(), "bfloat16")
    assert loaded_bf16.keys() == state.keys()
    for name, array in loaded_bf16.items():
        assert array.dtype.name == "bfloat16" and array.flags.c_contiguous
        np.testing.assert_array_equal(array.view(np.uint16), state[name].view(np.uint16))
    widened = module.weights_from_safetensors(cfg, tmp_path, "float32")
    for name, array in widened.items():  # widening is exact
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, loaded_bf16[name].astype(np.float32))


def test_torch_bfloat16_tensors_keep_their_bits():
    tensor = torch.randn(3, 5).to(torch.bfloat16)
    array = to_numpy(tensor.T)  # a non-contiguous view too
    assert array.dtype.name == "bfloat16" and array.shape == (5, 3)
    np.testing.assert_array_equal(array.astype(np.float32), tensor.T.float().numpy())
    rounded = to_numpy(torch.tensor([1.00390625, 1.01171875]).to(torch.bfloat16))
    np.testing.assert_array_equal(
        rounded.view(np.uint16),
        np.array([1.00390625, 1.01171875], np.float32).astype("bfloat16").view(np.uint16),
    )  # torch's and ml_dtypes' round-to-nearest-even agree on ties
