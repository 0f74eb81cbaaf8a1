"""Stopping (issue 27, item 4): end-of-sequence ids and stop strings, per sequence.

Against transformers' `generate` with `eos_token_id` on small random models, both ways
of planning: a batch where one sequence stops and the other goes on, a batch where all
stop early (step plans then run no more plans; an unrolled plan's later tokens are
masked), the checkpoint's own eos ids (generation_config.json, an int or a list), and
the tokens counted being the tokens kept. Stop strings against a reference that decodes
the whole generation and cuts it. The end-of-sequence ids are chosen from transformers'
own unstopped generation (a token one sequence makes early and the other never), not
hard-coded."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import hf_llama  # noqa: E402

from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK, main  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.models.errors import GenerationError  # noqa: E402
from einpage.workloads import text  # noqa: E402
from einpage.workloads.generate import Planning, generate  # noqa: E402
from einpage.workloads.stop import Stopping  # noqa: E402

torch.set_num_threads(1)

NEW = 8
NEVER = 10_000  # an id no model here makes: transformers then never stops


def hf_generate(model, ids, new_tokens, eos, pad):
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(ids),
            attention_mask=torch.ones(ids.shape, dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    return out.numpy()


@pytest.fixture(scope="module")
def setup():
    """The model, its config and converted weights, and a batch of two prompts."""
    hf = hf_llama("gqa-tied")
    cfg = llama.LlamaConfig.from_hf(hf.config)
    weights = llama.weights_from_state_dict(cfg, hf.state_dict())
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 5))
    free = hf_generate(hf, ids, NEW, NEVER, 0)[:, ids.shape[1] :]
    return hf, cfg, weights, ids, free


def first_at(row, token):
    return int(np.flatnonzero(row == token)[0]) if token in row else None


def eos_only_in_first(free):
    """A token the first sequence makes early (not at its last step) and the second
    never: the first stops, the second goes on."""
    for t in range(NEW - 2):
        token = free[0, t]
        if token not in free[1] and first_at(free[0], token) == t:
            return int(token)
    pytest.fail(f"no token only the first sequence makes: {free.tolist()}")


def eos_in_both(free):
    """Two ids, one early in each sequence: both stop before the end."""
    return [int(free[0, 1]), int(free[1, 2])]


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_one_sequence_stops_and_the_other_goes_on(setup, way):
    hf, cfg, weights, ids, free = setup
    eos = eos_only_in_first(free)
    want = hf_generate(hf, ids, NEW, eos, eos)
    out = generate(cfg, ids, NEW, "100%", weights=weights, page_size=4, eos=eos,
                   plan=Planning(way=way))  # fmt: skip
    np.testing.assert_array_equal(out.ids, want)
    kept = first_at(free[0], eos) + 1
    assert out.new_lengths.tolist() == [kept, NEW]
    assert out.stats.tokens == kept + NEW
    assert np.all(out.new_ids[0, kept:] == eos)  # masked with the pad id (here the eos)


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_when_every_sequence_stops_step_plans_run_no_more(setup, way):
    hf, cfg, weights, ids, free = setup
    eos = eos_in_both(free)
    want = hf_generate(hf, ids, NEW, eos, eos[0])  # transformers pads with the first eos
    out = generate(cfg, ids, NEW, "100%", weights=weights, page_size=4, eos=eos, logits=True,
                   plan=Planning(way=way))  # fmt: skip
    np.testing.assert_array_equal(out.ids, want)
    kept = [min(first_at(free[b], e) for e in eos if e in free[b]) + 1 for b in range(2)]
    assert out.new_lengths.tolist() == kept and max(kept) < NEW
    assert out.stats.tokens == sum(kept)
    full = generate(cfg, ids, NEW, "100%", weights=weights, page_size=4, eos=(), logits=True,
                    plan=Planning(way=way))  # fmt: skip
    assert full.stats.tokens == 2 * NEW and full.new_lengths.tolist() == [NEW, NEW]
    # the kept tokens' logits are those of the unstopped run; masked ones are NaN
    for b, n in enumerate(kept):
        np.testing.assert_array_equal(out.logits[b, :n], full.logits[b, :n])
        assert np.isnan(out.logits[b, n:]).all()
    if way == "steps":  # the loop ended: fewer plans ran, and the stats say so
        assert len(out.reports) == max(kept) < len(full.reports) == NEW
        assert out.stats.simulated_seconds < full.stats.simulated_seconds
    else:  # one plan, run whole, then masked: the same time for fewer tokens
        assert len(out.reports) == len(full.reports) == 1
        assert out.stats.simulated_seconds == full.stats.simulated_seconds
        assert out.stats.tokens_per_s == pytest.approx(
            full.stats.tokens_per_s * sum(kept) / (2 * NEW)
        )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, setup):
    """The model saved with save_pretrained, its generation_config.json naming a list of
    two eos ids (one early in each sequence) and a pad id."""
    hf, _, _, _, free = setup
    folder = tmp_path_factory.mktemp("stop-checkpoint")
    hf.save_pretrained(folder)
    eos = eos_in_both(free)
    file = folder / "generation_config.json"
    config = json.loads(file.read_text())
    config.update(eos_token_id=eos, pad_token_id=1)
    file.write_text(json.dumps(config))
    return folder, eos


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_the_checkpoints_eos_ids_stop_it_by_default(setup, checkpoint, way):
    hf, _, _, ids, _ = setup
    folder, eos = checkpoint
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():  # transformers with the checkpoint's own generation config
        want = reloaded.generate(
            torch.from_numpy(ids), attention_mask=torch.ones(ids.shape, dtype=torch.long),
            max_new_tokens=NEW, do_sample=False,
        ).numpy()  # fmt: skip
    out = generate(folder, ids, NEW, "100%", page_size=4, plan=Planning(way=way))
    assert out.stopping == Stopping(eos, pad_id=1)
    np.testing.assert_array_equal(out.ids, want)
    assert max(out.new_lengths) < NEW
    ignored = generate(folder, ids, NEW, "100%", page_size=4, eos=(), plan=Planning(way=way))
    np.testing.assert_array_equal(ignored.ids, hf_generate(hf, ids, NEW, NEVER, 0))


def test_an_int_eos_in_config_json(tmp_path, setup):
    hf, _, _, ids, free = setup
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    eos = eos_only_in_first(free)
    config["eos_token_id"] = eos
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = generate(tmp_path, ids, NEW, "100%", page_size=4)
    assert out.stopping.eos_ids == (eos,)
    np.testing.assert_array_equal(out.ids, hf_generate(hf, ids, NEW, eos, eos))


# -- stop strings ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    """A random LLaMA with a BPE tokenizer (as tests/models/test_generate_api.py)."""
    from test_generate_api import train_tokenizer

    folder = tmp_path_factory.mktemp("stop-text")
    tok = train_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=500.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(10.0)
    model.save_pretrained(folder)
    tok.save(str(folder / text.TOKENIZER_FILE))
    return folder, tok


PROMPTS = ["the planner keeps", "the weights and"]


def reference_cut(tok, prompt_ids, new_ids, stops):
    """The reference: decode the whole unstopped generation, cut before the first stop
    string in the new text, and the fewest new tokens whose text holds it."""
    prompt_text = tok.decode(prompt_ids.tolist())
    whole = tok.decode(np.concatenate([prompt_ids, new_ids]).tolist())
    assert whole.startswith(prompt_text)
    new_text = whole[len(prompt_text) :]
    found = [new_text.find(s) for s in stops if s in new_text]
    if not found:
        return whole, len(new_ids)
    at = min(found)
    for t in range(1, len(new_ids) + 1):
        part = tok.decode(np.concatenate([prompt_ids, new_ids[:t]]).tolist())[len(prompt_text) :]
        if any(s in part for s in stops):
            return prompt_text + new_text[:at], t


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_stop_strings_cut_the_text_where_a_reference_cuts_it(text_checkpoint, way):
    folder, tok = text_checkpoint
    plan = Planning(way=way)
    free = generate(folder, PROMPTS, 10, "100%", page_size=4, eos=(), plan=plan)
    prompt_len = free.ids.shape[1] - 10
    new_text = free.text[0][len(tok.decode(free.ids[0, :prompt_len].tolist())) :]
    stop = new_text[len(new_text) // 3 :][:3]  # three characters a third of the way in
    assert stop.strip(), new_text
    out = generate(folder, PROMPTS, 10, "100%", page_size=4, eos=(), stop=[stop], plan=plan)
    for b in range(2):
        want_text, want_kept = reference_cut(tok, free.ids[b, :prompt_len],
                                             free.ids[b, prompt_len:], [stop])  # fmt: skip
        assert out.text[b] == want_text
        assert out.new_lengths[b] == want_kept
        np.testing.assert_array_equal(out.new_ids[b, :want_kept], free.new_ids[b, :want_kept])
    assert out.new_lengths[0] < 10 and stop not in out.text[0][len(PROMPTS[0]) :]
    assert out.stats.tokens == int(out.new_lengths.sum())


def test_the_command_line_stops_and_counts_the_tokens_kept(text_checkpoint, capsys):
    folder, tok = text_checkpoint
    free = generate(folder, PROMPTS[0], 10, "100%", page_size=4, eos=())
    new_text = free.text[0][len(PROMPTS[0]) :]
    stop = new_text[len(new_text) // 3 :][:3]
    out = generate(folder, PROMPTS[0], 10, "100%", page_size=4, eos=(), stop=[stop])
    argv = ["generate", "--checkpoint", str(folder), "--budget", "100%", "--new-tokens", "10",
            "--page-size", "4", "--prompt", PROMPTS[0], "--run", "--backend", "numpy",
            "--ignore-eos"]  # fmt: skip
    assert main([*argv, "--stop", stop]) == EXIT_OK
    printed = capsys.readouterr().out
    kept = int(out.new_lengths[0])
    assert f"{kept} of 10 tokens kept ({kept})" in printed
    line = printed.split("text (prompt | new)")[1].strip().splitlines()[0]
    assert "".join(line.split(None, 1)[1].replace(" | ", "", 1).split()) == "".join(
        out.text[0].split()
    )
    assert main(argv) == EXIT_OK and "tokens kept" not in capsys.readouterr().out


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keywords, words",
    [
        ({"stop": ["x"]}, "stop strings need a tokenizer"),
        ({"stop": [""]}, "strings must be non-empty strings"),
        ({"stop": [5]}, "strings must be non-empty strings"),
        ({"eos": -1}, "eos_ids must hold token ids"),
        ({"eos": "2"}, "eos_ids must be a token id or a list"),
        ({"eos": [1.5]}, "eos_ids must hold token ids"),
    ],
)
def test_bad_stops_are_named(setup, keywords, words):
    _, cfg, _, ids, _ = setup
    with pytest.raises(GenerationError, match=words):
        generate(cfg, ids, 2, "100%", run=None, **keywords)


def test_stop_on_the_command_line_needs_text(capsys):
    code = main(["generate", "llama:tiny", "--budget", "100%", "--stop", "x"])
    assert code == EXIT_BAD_INPUT and "stop strings need a text prompt" in capsys.readouterr().err
