"""`einpage.workloads.generate.generate`: from a checkpoint folder with a tokenizer (a small random
LLaMA saved by `save_pretrained` and a BPE tokenizer trained here on a paragraph: no
network), from a config and weights converted from a state dict (a state dict as it is
is refused, saying how to convert it), sampling reproducibly – and the typed errors for
bad input."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from hf_models import hf_gpt2, hf_llama  # noqa: E402

from einpage.models import gpt2, llama  # noqa: E402
from einpage.models.decode import Sampling  # noqa: E402
from einpage.models.errors import CheckpointError, GenerationBudgetError, GenerationError  # noqa: E402
from einpage.workloads import text  # noqa: E402
from einpage.workloads.generate import Planning, Running, generate  # noqa: E402
from einpage_core.errors import InfeasibleBudgetError  # noqa: E402

torch.set_num_threads(1)

PARAGRAPH = (
    "einpage compiles tensor programs written as einsums into memory plans that run on a "
    "GPU whose memory is smaller than the program needs. The planner keeps the pages of "
    "the cache on the device or sends them to host memory by their reuse distance, under "
    "one budget shared with the weights and the activations of every step."
)


def train_tokenizer():
    """A small BPE tokenizer (Metaspace: decoding restores the spaces)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=90, special_tokens=["[UNK]"])
    tok.train_from_iterator([PARAGRAPH], trainer)
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint folder: config.json, model.safetensors and tokenizer.json."""
    folder = tmp_path_factory.mktemp("llama-checkpoint")
    tok = train_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(10.0)  # sharper than the default init: varied tokens
    model.save_pretrained(folder)
    tok.save(str(folder / text.TOKENIZER_FILE))
    return folder, model, tok


def hf_greedy(model, ids: np.ndarray, new_tokens: int) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(ids),
            attention_mask=torch.ones(ids.shape, dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=model.config.vocab_size,  # no id: generation never stops early
            pad_token_id=0,
        )
    return out.numpy()


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_text_in_text_out_from_a_checkpoint_folder(checkpoint, way):
    folder, model, tok = checkpoint
    out = generate(
        folder, "the planner keeps", 5, "60KiB", batch=2, page_size=4, plan=Planning(way=way)
    )
    ids = text.encode(tok, "the planner keeps", 2)
    np.testing.assert_array_equal(out.ids, hf_greedy(model, ids, 5))
    assert out.text == text.decode(tok, out.ids)
    assert out.text[0].startswith("the planner keeps")
    assert out.stats.transfers.weight_reload > 0 and out.stats.tokens_per_s > 0


def test_config_and_converted_state_dict_and_ids():
    hf = hf_gpt2("base")
    cfg = gpt2.GPT2Config.from_hf(hf.config)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 6))
    weights = gpt2.weights_from_state_dict(cfg, hf.state_dict())
    out = generate(cfg, ids, 4, "64KiB", weights=weights, page_size=4, run=Running(mode="random"))
    np.testing.assert_array_equal(out.ids, hf_greedy(hf, ids, 4))
    assert out.ids.shape == (2, 10) and out.new_ids.shape == (2, 4) and out.text is None


def test_a_state_dict_as_it_is_is_refused_saying_how_to_convert_it(monkeypatch):
    """No guessing the convention from the keys (issue 22): a Hugging Face state dict is
    refused, before anything is planned, with the call that converts it."""
    import einpage.workloads.generate as generate_module

    hf = hf_gpt2("base")
    cfg = gpt2.GPT2Config.from_hf(hf.config)
    ids = np.zeros((1, 3), np.int64)
    def never(*args, **kwargs):
        raise AssertionError("planned before the weights were checked")

    monkeypatch.setattr(generate_module, "plan_generation", never)
    with pytest.raises(GenerationError) as caught:
        generate(cfg, prompt=ids, new_tokens=2, budget="64KiB", weights=hf.state_dict())
    message = str(caught.value)
    assert "einpage.models.gpt2.weights_from_state_dict(cfg, state_dict)" in message
    assert "none of the program's weight names" in message
    assert "'transformer.h.0.attn.c_attn.weight'" in message  # what it has, named


def test_sampling_is_reproducible_per_seed_and_the_same_both_ways():
    hf = hf_llama("gqa-tied")
    cfg = llama.LlamaConfig.from_hf(hf.config)
    weights = llama.weights_from_state_dict(cfg, hf.state_dict())
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 5))
    sampling = Sampling(temperature=1.5, top_k=20)

    def draw(seed, way="unrolled"):
        return generate(
            cfg, ids, 6, "1MiB", weights=weights, sampling=replace(sampling, seed=seed),
            plan=Planning(way=way), page_size=4,
        ).new_ids  # fmt: skip

    first = draw(0)
    np.testing.assert_array_equal(first, draw(0))
    np.testing.assert_array_equal(first, draw(0, "steps"))
    assert not np.array_equal(first, draw(1))
    greedy = generate(cfg, ids, 6, "1MiB", weights=weights, page_size=4).new_ids
    assert not np.array_equal(first, greedy)


def test_plan_only_needs_no_weights():
    out = generate(llama.PRESETS["tiny-gqa"], np.zeros((2, 9), np.int64), 3, "200KiB",
                   page_size=4, plan=Planning(way="steps"), run=None)  # fmt: skip
    assert out.ids is None and sorted(out.plan.decoders) == [(3, 1)]
    assert {"prefill", "decode (pages 3)"} == set(out.plan.plans)


# -- bad input ---------------------------------------------------------------------------

CFG = llama.PRESETS["tiny"]
PROMPT = np.zeros((1, 4), np.int64)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"new_tokens": 0}, "new_tokens must be a positive int, got 0"),
        ({"new_tokens": -2}, "new_tokens must be a positive int"),
        ({"page_size": 0}, "page_size must be a positive int, got 0"),
        ({"prompt": np.array([[1, 256, 3]])}, r"token 256 at prompt \[0, 1\] is outside"),
        ({"prompt": np.array([[-1, 2]])}, "token -1"),
        ({"sampling": Sampling(top_k=300)}, "top_k=300 exceeds the vocabulary"),
        ({"prompt": "text"}, "a text prompt needs a tokenizer: give tokenizer="),
        ({"prompt": None}, "a prompt is needed"),
        ({"run": Running()}, "weights are needed"),
    ],
)
def test_bad_arguments_raise_generation_errors(kwargs, words):
    args = {"prompt": PROMPT, "new_tokens": 3, "budget": "1MiB", "run": None, **kwargs}
    with pytest.raises(GenerationError, match=words):
        generate(CFG, **args)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"way": "sideways"}, "way must be one of"),
        ({"bucket_pages": 0, "way": "steps"}, "bucket_pages must be a positive int"),
        ({"chunk_steps": -1, "way": "steps"}, "chunk_steps must be a positive int"),
    ],
)
def test_bad_planning_raises_generation_errors(fields, words):
    """The planning arguments are `Planning`'s fields now, checked when it is made."""
    with pytest.raises(GenerationError, match=words):
        generate(CFG, PROMPT, 3, "1MiB", plan=Planning(**fields), run=None)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True])
def test_bad_sampling_settings(bad):
    with pytest.raises(GenerationError, match="temperature"):
        Sampling(temperature=bad)
    with pytest.raises(GenerationError, match="top_k"):
        Sampling(top_k=bad if bad is not True else 0)


def test_a_prompt_longer_than_the_models_positions():
    cfg = gpt2.PRESETS["tiny"]  # 32 positions
    with pytest.raises(GenerationError, match="needs 33 positions.*32"):
        generate(cfg, np.zeros((1, 30), np.int64), 4, "1MiB", run=None)


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_a_budget_below_the_minimum_names_the_step_and_the_task(way):
    with pytest.raises(GenerationBudgetError) as caught:
        generate(CFG, PROMPT, 3, "2KiB", plan=Planning(way=way), run=None)
    err = caught.value
    assert isinstance(err, InfeasibleBudgetError) and err.budget == 2048 and err.needed > 2048
    assert err.step == "prefill" or err.step.startswith("step ")
    assert err.step in str(err) and err.plan in str(err)
    assert err.task is not None and f"%{err.task}" in str(err)


def test_text_prompts_of_different_lengths(checkpoint):
    folder, _, tok = checkpoint
    with pytest.raises(GenerationError, match="different lengths .* encode_padded"):
        text.encode(tok, ["the", "the planner keeps the pages"])
    ids, lengths = text.encode_padded(tok, ["the", "the planner keeps the pages"], 90)
    short, long = (tok.encode(t).ids for t in ["the", "the planner keeps the pages"])
    assert lengths == (len(short), len(long)) and ids.shape == (2, len(long))
    assert ids[1].tolist() == long and ids[0].tolist() == [0] * (len(long) - len(short)) + short
    same, none = text.encode_padded(tok, "the planner", 90, batch=2)
    assert none is None and same.tolist() == [tok.encode("the planner").ids] * 2
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        text.load_tokenizer(folder.parent)


def test_the_cli_generates_text_from_a_checkpoint(checkpoint, capsys):
    from einpage.cli.commands import main

    folder, model, tok = checkpoint
    argv = ["generate", "--checkpoint", str(folder), "--prompt", "the planner keeps"]
    argv += ["--budget", "60KiB", "--new-tokens", "3", "--page-size", "4", "--run"]
    assert main([*argv, "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    ids = text.encode(tok, "the planner keeps")
    want = text.decode(tok, hf_greedy(model, ids, 3))[0]
    assert "weights                 checkpoint" in out
    prompt = text.decode(tok, ids)[0]
    assert want.startswith(prompt)  # the prompt's text, then " | " and the new text
    marked = f"{prompt} | {want[len(prompt) :].lstrip()}"
    assert f"  0  {marked}" in out.split("\ntext (prompt | new)\n")[1]


def test_a_checkpoint_without_a_tokenizer_says_so(checkpoint, tmp_path, capsys):
    """Not the message for no tokenizer given at all: the folder is named, and what to do."""
    import shutil

    from einpage.cli.commands import EXIT_BAD_INPUT, main

    folder, _, _ = checkpoint
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, tmp_path / name)
    with pytest.raises(GenerationError, match=f"the checkpoint folder '{tmp_path}' has no tok"):
        generate(tmp_path, "the planner", 2, "1MiB", run=None)
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt", "the planner"]
    assert main([*argv, "--budget", "1MiB"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"the checkpoint folder '{tmp_path}' has no tokenizer.json: give --tokenizer" in err
    with pytest.raises(GenerationError, match="needs a tokenizer: give tokenizer=.*or a check"):
        generate(CFG, "the planner", 2, "1MiB", run=None)


def test_a_run_beyond_the_host_memory_is_refused_before_it_starts(monkeypatch):
    import einpage.workloads.generate as generate_module
    from einpage.workloads.generate import HostMemoryError

    weights = {n: np.zeros(s, np.float32) for n, s in CFG.weight_shapes().items()}
    monkeypatch.setattr(generate_module, "available_memory", lambda: 1000)
    with pytest.raises(HostMemoryError, match=r"needs about .* and 1000 B \(1000 B\) is avail"):
        generate(CFG, PROMPT, 3, "1MiB", weights=weights, run=Running(backend="numpy"))
