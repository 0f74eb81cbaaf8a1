"""Ragged batches: prompts of different lengths in one generation, left padded to the
longest with each sequence's positions and an attention mask over its padding.

Greedy tokens equal Hugging Face `generate` given the same left-padded ids and their
attention mask (what a tokenizer with `padding_side="left"` makes: checked once with a
`PreTrainedTokenizerFast`), and every step's logits stay within the prefill tests'
tolerance, for small random models of every family – LLaMA (grouped-query, tied head),
GPT-2 (learned positions), Qwen2 (Q/K/V biases) and Mistral (a sliding window the
generation stays within) –, planned as one unrolled plan and as step plans (of one step
and of chunks), under budgets that page the KV cache. Then `generate(prompt=[...])`
with id lists and with text, the CLI's several `--prompt`s, and the typed errors.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import TOLERANCE, hf_gpt2, hf_llama, randomize, relative_error  # noqa: E402

import taskgraph  # noqa: E402
from einpage.cli.generate import random_weights  # noqa: E402
from einpage.models import gpt2, llama, mistral, qwen2  # noqa: E402
from einpage.models.decode import Sampling  # noqa: E402
from einpage.models.errors import GenerationError  # noqa: E402
from einpage.models.generation import (  # noqa: E402
    decode_inputs,
    generation_inputs,
    pad_prompts,
    padding_inputs,
)
from einpage.workloads.generate import generate  # noqa: E402
from einpage.workloads.generation import GenerationSpec, Planning, plan_generation  # noqa: E402

torch.set_num_threads(1)

SMALL = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "attn_implementation": "eager",
}
LENGTHS = (3, 7)
NEW_TOKENS = 5
PAGE_SIZE = 4


@functools.cache
def model_of(family: str):
    """(HF model, our family module, config, weights) of a small random model."""
    if family == "llama":
        hf, module = hf_llama("gqa-tied"), llama
    elif family == "gpt2":
        hf, module = hf_gpt2("base"), gpt2
    elif family == "qwen2":
        config = transformers.Qwen2Config(**SMALL, rope_theta=1e6)
        hf, module = randomize(transformers.Qwen2ForCausalLM(config), seed=5), qwen2
    else:  # the generation's 3 + 7 - 1 ... 7 + 5 - 1 = 11 slots stay within the window
        config = transformers.MistralConfig(**SMALL, sliding_window=12)
        hf, module = randomize(transformers.MistralForCausalLM(config), seed=7), mistral
    cfg = module.FAMILY.config.from_hf(hf.config)
    return hf, module, cfg, module.weights_from_state_dict(cfg, hf.state_dict())


def prompts_of(cfg, lengths=LENGTHS, seed=1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, cfg.vocab_size, n) for n in lengths]


def hf_reference(hf, ids: np.ndarray, mask: np.ndarray, new_tokens: int):
    """HF's new ids [batch, new_tokens] and logits [batch, new_tokens, vocab]."""
    with torch.no_grad():
        out = hf.generate(
            torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=hf.config.vocab_size,  # no id: generation never stops early
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences.numpy()[:, ids.shape[1] :], torch.stack(out.logits, 1).numpy()


def left_padded(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The ids left padded with 0 and HF's attention mask, written out here."""
    longest = max(len(r) for r in rows)
    ids = np.zeros((len(rows), longest), np.int64)
    mask = np.zeros((len(rows), longest), np.int64)
    for i, row in enumerate(rows):
        ids[i, longest - len(row) :] = row
        mask[i, longest - len(row) :] = 1
    return ids, mask


PLANNINGS = {
    "unrolled": Planning(way="unrolled"),
    "steps": Planning(way="steps"),
    "chunks": Planning(way="steps", chunk_steps=2, bucket_pages=2),
}


@pytest.mark.parametrize("way", sorted(PLANNINGS))
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2", "mistral"])
def test_a_ragged_batch_generates_what_transformers_does_with_left_padding(family, way):
    hf, module, cfg, weights = model_of(family)
    rows = prompts_of(cfg)
    ids, mask = left_padded(rows)
    want_ids, want_logits = hf_reference(hf, ids, mask, NEW_TOKENS)
    padded, lengths = pad_prompts(rows, cfg.vocab_size)
    np.testing.assert_array_equal(padded, ids)
    spec = GenerationSpec(module.FAMILY, cfg, 2, 7, NEW_TOKENS, page_size=PAGE_SIZE,
                          logits=True, lengths=lengths)  # fmt: skip
    assert spec.ragged and spec.pads == (4, 0)
    plan = plan_generation(spec, "30%", PLANNINGS[way])
    assert plan.stats().transfers.kv_reload > 0  # the padded pages are paged too
    mode = "random" if way == "chunks" else "sequential"
    out = plan.run(weights, ids, mode=mode, run_seed=3)
    np.testing.assert_array_equal(out.ids, want_ids)
    assert relative_error(out.logits, want_logits) <= TOLERANCE


def test_the_padding_changes_the_tokens_unless_masked():
    """The check above can fail: the same padded ids without the mask (every position
    attended, positions from 0 at the first slot) give other logits."""
    hf, module, cfg, weights = model_of("llama")
    ids, mask = left_padded(prompts_of(cfg))
    _, want_logits = hf_reference(hf, ids, mask, NEW_TOKENS)
    spec = GenerationSpec(module.FAMILY, cfg, 2, 7, NEW_TOKENS, page_size=PAGE_SIZE, logits=True)
    out = plan_generation(spec, "100%").run(weights, ids)
    assert relative_error(out.logits[0], want_logits[0]) > 100 * TOLERANCE  # the padded row
    assert relative_error(out.logits[1], want_logits[1]) <= TOLERANCE  # the longest, unpadded


def test_generate_takes_id_lists_of_different_lengths():
    hf, _, cfg, weights = model_of("gpt2")
    rows = prompts_of(cfg, (6, 1, 4), seed=2)
    ids, mask = left_padded(rows)
    want_ids, _ = hf_reference(hf, ids, mask, 3)
    out = generate(cfg, [list(r) for r in rows], 3, "100%", weights=weights, page_size=4)
    assert out.prompt_lengths == (6, 1, 4) and out.spec.prompt_len == 6
    np.testing.assert_array_equal(out.new_ids, want_ids)
    np.testing.assert_array_equal(out.ids, np.concatenate([ids, want_ids], axis=1))


def test_text_prompts_of_different_lengths_match_a_left_padding_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from test_generate_api import PARAGRAPH, train_tokenizer

    tok = train_tokenizer()
    hf, _, cfg, weights = model_of("llama")  # vocabulary 96 > the tokenizer's 90
    texts = ["the planner keeps the pages of the cache", "einpage"]
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[UNK]")
    fast.padding_side = "left"
    batch = fast(texts, padding=True, return_tensors="np")
    want_ids, _ = hf_reference(hf, batch["input_ids"].astype(np.int64),
                               batch["attention_mask"].astype(np.int64), 4)  # fmt: skip
    out = generate(cfg, texts, 4, "100%", weights=weights, tokenizer=tok, page_size=4)
    np.testing.assert_array_equal(out.new_ids, want_ids)
    assert out.prompt_lengths == tuple(int(n) for n in batch["attention_mask"].sum(axis=1))
    for line, prompt in zip(out.text, texts, strict=True):  # no padding in the text
        assert line.startswith(prompt) and "[UNK]" not in line
    assert PARAGRAPH and isinstance(tok, tokenizers.Tokenizer)


def test_the_cli_takes_several_prompts(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from test_generate_api import train_tokenizer

    from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK, main

    path = tmp_path / "tokenizer.json"
    train_tokenizer().save(str(path))
    argv = ["generate", "llama:tiny", "--tokenizer", path, "--prompt", "the planner",
            "--prompt", "einpage compiles tensor programs", "--new-tokens", "3",
            "--budget", "100%", "--page-size", "4"]  # fmt: skip
    assert main([str(a) for a in [*argv, "--run", "--backend", "numpy"]]) == EXIT_OK
    out = capsys.readouterr().out
    assert "left padded" in out
    rows = out.split("text (prompt | new)")[1].strip().splitlines()
    assert rows[0].split()[1:3] == ["the", "planner"] and "|" in rows[0]  # no padding shown
    assert rows[1].split()[1:5] == ["einpage", "compiles", "tensor", "programs"]
    assert main([str(a) for a in [*argv, "--batch", "3"]]) == EXIT_BAD_INPUT
    assert "2 prompts are given" in capsys.readouterr().err


def test_padding_inputs_and_decode_inputs_follow_each_sequence():
    got = padding_inputs([2, 4], 4, 6)
    np.testing.assert_array_equal(got["position_ids"], [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(got["attention_mask"], [[0, 0, 1, 1, 1, 1], [1] * 6])
    step = decode_inputs(np.array([5, 6]), 5, 2, 4, steps=2, pads=(2, 0))
    np.testing.assert_array_equal(step["positions"], [[3, 4], [5, 6]])
    np.testing.assert_array_equal(
        step["kv.mask"].reshape(2, -1), [[0, 0, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    )


@pytest.mark.parametrize(
    "prompt, words",
    [
        ([[1, 2, 3], []], "prompt 1 is empty: every prompt needs a token"),
        ([[]], "prompt 0 is empty"),
        ([[1, 2], [3, 999]], "token 999 at prompt [1, 1] is outside the vocabulary"),
        ([[1.5, 2.0], [3.0]], "prompt 0 has float64 ids"),
    ],
)
def test_bad_ragged_prompts_are_refused(prompt, words):
    with pytest.raises(GenerationError) as caught:
        generate(llama.PRESETS["tiny"], prompt, 2, "100%", run=None)
    assert words in str(caught.value)


def test_a_batch_over_the_position_limit_for_its_longest_prompt_is_refused():
    cfg = gpt2.PRESETS["tiny"]  # 32 positions
    prompt = [[1] * 30, [2] * 3]
    with pytest.raises(GenerationError, match="longest prompt has 30 tokens.*needs 33 posit"):
        generate(cfg, prompt, 4, "1MiB", run=None)
    generate(cfg, prompt, 3, "1MiB", run=None)  # 32: within


def test_an_empty_text_prompt_in_a_batch_is_refused():
    pytest.importorskip("tokenizers")
    from test_generate_api import train_tokenizer

    with pytest.raises(GenerationError, match="prompt 1 .* encodes to no tokens"):
        generate(llama.PRESETS["tiny"], ["the planner", ""], 2, "100%", tokenizer=train_tokenizer(),
                 run=None)  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_ragged_quantized_sampled_generation_equals_the_reference_evaluator(way, dtype):
    """The options together: a ragged batch of three, int8 weights, top-k sampling, in
    float32 and float16, against the reference evaluator of the unrolled program."""
    cfg = qwen2.PRESETS["tiny"]
    weights = {n: w * 10 if w.ndim > 1 else w for n, w in random_weights(cfg, dtype, 1).items()}
    rows = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13]]
    sampling = Sampling(temperature=0.9, top_k=20, seed=4)
    plan = Planning(way=way, chunk_steps=2)
    out = generate(cfg, rows, 5, "50%", weights=weights, dtype=dtype, page_size=4,
                   sampling=sampling, quant="int8", plan=plan)  # fmt: skip
    spec = out.spec
    assert spec.lengths == (3, 7, 1) and spec.quant.bits == 8
    ids, lengths = pad_prompts(rows, cfg.vocab_size)
    inputs = generation_inputs(qwen2.FAMILY, cfg, ids, 5, dtype, spec.program_weights(weights),
                               spec.gumbel(), lengths)  # fmt: skip
    want = taskgraph.evaluate(spec.generation_program().build(), inputs)["ids"]
    np.testing.assert_array_equal(out.new_ids, want)
