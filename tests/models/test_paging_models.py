"""Small LLaMA and GPT-2 models, partitioned hard (attention split by batch, head and
query block), still give Hugging Face transformers' logits: compiled with
`einpage.compile` (which partitions at a tight budget) and run on the NumPy runtime, and
evaluated as partitioned graphs."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import TOLERANCE, hf_gpt2, hf_llama, hf_logits, relative_error  # noqa: E402

import einpage as ep  # noqa: E402
import memgraph  # noqa: E402
import runtime  # noqa: E402
import taskgraph  # noqa: E402
from einpage.models import gpt2, llama  # noqa: E402
from memgraph.planner import min_budget  # noqa: E402

torch.set_num_threads(1)

BATCH, SEQ = 2, 12
ALIGNMENT = 64
KiB = 1024

MODELS = {  # name -> (our module, the Hugging Face model of `hf_models`)
    "llama-mha": (llama, lambda: hf_llama("mha")),
    "llama-gqa": (llama, lambda: hf_llama("gqa-tied")),
    "gpt2": (gpt2, lambda: hf_gpt2("base")),
}


def program_and_inputs(name: str, logits: str):
    """Our program of the model, its inputs for random tokens, and HF's logits."""
    module, build = MODELS[name]
    model = build()
    config_class = llama.LlamaConfig if module is llama else gpt2.GPT2Config
    cfg = config_class.from_hf(model.config)
    weights = module.weights_from_state_dict(cfg, model.state_dict())
    tokens = np.random.default_rng(len(name)).integers(0, cfg.vocab_size, (BATCH, SEQ))
    tg = module.prefill_program(cfg, BATCH, SEQ, logits=logits).build()
    want = hf_logits(model, tokens)
    return tg, module.prefill_inputs(cfg, tokens, weights), want if logits == "all" else want[:, -1]


def split_hard(tg: taskgraph.TaskGraph, parted: taskgraph.TaskGraph) -> None:
    """The attention scores ([..., heads, q, k]) are split by head and by query block."""
    scores = [t for t in parted if t.label == "scores" and t.block.kind == "block"]
    assert scores
    for block in (t.block for t in scores):
        whole = tg[block.of].shape
        heads = slice(1, len(whole) - 2)  # the axes between batch and the query axis
        assert math.prod(block.shape[heads]) < math.prod(whole[heads]), block
        assert block.shape[-2] < whole[-2] and block.shape[-1] == whole[-1], block


@pytest.mark.parametrize("name", sorted(MODELS))
def test_auto_partitioned_prefill_runs_to_transformers_logits(name):
    """logits="last": at a budget far below what one attention task needs, `compile`
    partitions (block limit a quarter of the budget) and the plan runs to HF's logits."""
    tg, inputs, want = program_and_inputs(name, "last")
    scores = max(t.nbytes for t in tg if t.label == "scores")
    budget = 8 * KiB
    assert min_budget(tg, ALIGNMENT)[0] > budget
    mg = ep.compile(tg, budget, alignment=ALIGNMENT, verify=False).plan
    limit = mg.info["block_limit"]
    assert limit == budget // 4 and 2 * limit <= scores
    split_hard(tg, mg.taskgraph)
    memgraph.verify(mg)
    for seed in (1, 2):
        got = runtime.run(mg, inputs, backend="numpy", mode="random", seed=seed)["logits"]
        assert relative_error(got, want) <= TOLERANCE
    evaluated = taskgraph.evaluate(mg.taskgraph, inputs)["logits"]
    assert relative_error(evaluated, want) <= TOLERANCE


@pytest.mark.parametrize("name", sorted(MODELS))
def test_all_logits_with_an_explicit_block_limit_match_transformers(name):
    """logits="all": the [batch, seq, vocab] output is split and rebuilt under its name."""
    tg, inputs, want = program_and_inputs(name, "all")
    mg = ep.compile(tg, "32KiB", alignment=ALIGNMENT, partition="2KiB", verify=False).plan
    parted = mg.taskgraph
    assert mg.info["block_limit"] == 2 * KiB
    assert parted[parted.outputs["logits"]].block.kind == "output"
    split_hard(tg, parted)
    got = runtime.run(mg, inputs, backend="numpy", mode="random", seed=3)["logits"]
    assert relative_error(got, want) <= TOLERANCE
    assert relative_error(taskgraph.evaluate(parted, inputs)["logits"], want) <= TOLERANCE
