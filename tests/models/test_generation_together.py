"""Issue 27's generation options together: stopping on a ragged batch, stopping with
quantized weights, and the command line's several `--prompt`s with `--stop`.

Each was built on its own branch (stop tokens; ragged batches and quantized weights);
these check the combinations against references independent of the plans:
transformers' `generate` with left padding, an attention mask and `eos_token_id` (one
sequence stopping early, the other going on; the padding's id among the eos ids, which
must not stop anything: padding is not a generated token), a reference that decodes
each sequence without its padding and cuts it at the stop string (with a tokenizer whose
id 0 – the padding id – is an ordinary character, so padding left in the text shows),
and the reference evaluator of the quantized program, masked after each stop."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from hf_models import hf_llama  # noqa: E402
from test_generate_api import PARAGRAPH  # noqa: E402
from test_stop import reference_cut  # noqa: E402

import taskgraph  # noqa: E402
from einpage.cli.commands import EXIT_OK, main  # noqa: E402
from einpage.cli.generate import random_weights  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.program.quantize import Quantization  # noqa: E402
from einpage.workloads import text  # noqa: E402
from einpage.workloads.generate import generate  # noqa: E402
from einpage.workloads.generation import GenerationSpec, Planning  # noqa: E402

torch.set_num_threads(1)

NEW = 8
NEVER = 10_000  # an id no model here makes: transformers then never stops
WAYS = ["unrolled", "steps"]


def left_padded(rows):
    """The rows left padded with 0 (the padding id `pad_prompts` uses) and transformers'
    attention mask, written out here."""
    longest = max(len(r) for r in rows)
    ids = np.zeros((len(rows), longest), np.int64)
    mask = np.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, longest - len(row) :] = row
        mask[i, longest - len(row) :] = 1
    return ids, mask


def hf_generate(model, ids, mask, eos, pad):
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    return out.numpy()


def first_at(row, token):
    return int(np.flatnonzero(row == token)[0]) if token in row else None


def early_in(free, b):
    """A token sequence `b` makes early (before its last step, first there) and the
    other sequence never: `b` stops, the other goes on."""
    other = free[1 - b]
    for t in range(NEW - 2):
        token = int(free[b, t])
        if token not in other and first_at(free[b], token) == t:
            return token
    pytest.fail(f"no token only sequence {b} makes: {free.tolist()}")


# -- stop tokens on a ragged batch -------------------------------------------------------


@pytest.fixture(scope="module")
def ragged():
    """A random LLaMA, its weights, prompts of lengths 3 and 7 (ids from 1: 0 is the
    padding) and transformers' unstopped new ids for them, left padded."""
    hf = hf_llama("gqa-tied")
    cfg = llama.LlamaConfig.from_hf(hf.config)
    weights = llama.weights_from_state_dict(cfg, hf.state_dict())
    rng = np.random.default_rng(4)
    rows = [rng.integers(1, cfg.vocab_size, n) for n in (3, 7)]
    ids, mask = left_padded(rows)
    free = hf_generate(hf, ids, mask, NEVER, 0)[:, ids.shape[1] :]
    return hf, cfg, weights, rows, free


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("stopper", [0, 1])
def test_stop_on_a_ragged_batch_equals_transformers_left_padded(ragged, way, stopper):
    """Sequence `stopper` (the short, padded prompt or the long one) stops early, the
    other goes on; the padding id 0 is an eos id too, and stops nothing."""
    hf, cfg, weights, rows, free = ragged
    eos = [early_in(free, stopper), 0]
    ids, mask = left_padded(rows)
    want = hf_generate(hf, ids, mask, eos, eos[0])
    out = generate(cfg, [list(r) for r in rows], NEW, "100%", weights=weights, page_size=4,
                   eos=eos, plan=Planning(way=way))  # fmt: skip
    assert out.prompt_lengths == (3, 7)
    np.testing.assert_array_equal(out.ids, want)
    kept = [NEW, NEW]
    kept[stopper] = first_at(free[stopper], eos[0]) + 1
    assert out.new_lengths.tolist() == kept and min(kept) < NEW
    assert out.stats.tokens == sum(kept)
    assert np.all(out.new_ids[stopper, kept[stopper] :] == eos[0])  # masked with the pad id


def no_special_tokenizer():
    """A BPE tokenizer with no special tokens: its id 0 (the padding id) is the
    character ',', which a text left padded by mistake would start with."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=90, special_tokens=[])
    tok.train_from_iterator([PARAGRAPH], trainer)
    assert tok.decode([0]) == ","
    return tok


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    """A random LLaMA checkpoint (weights sharpened for varied tokens) with that
    tokenizer."""
    folder = tmp_path_factory.mktemp("together-text")
    tok = no_special_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=500.0,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(10.0)
    model.save_pretrained(folder)
    tok.save(str(folder / text.TOKENIZER_FILE))
    return folder, tok, model


PROMPTS = ["the planner keeps the pages of the cache", "einpage"]


def text_reference(text_checkpoint, stop):
    """Each sequence's text and kept tokens: transformers' left-padded greedy ids,
    decoded without the padding and cut at `stop` (`reference_cut`)."""
    _, tok, model = text_checkpoint
    rows = [np.array(tok.encode(p).ids) for p in PROMPTS]
    ids, mask = left_padded(rows)
    free = hf_generate(model, ids, mask, NEVER, 0)[:, ids.shape[1] :]
    return [reference_cut(tok, row, free[b], [stop]) for b, row in enumerate(rows)], free


def a_stop_string(text_checkpoint):
    """Three characters a third of the way into the short prompt's unstopped new text."""
    unstopped, _ = text_reference(text_checkpoint, "\0")  # no such text: uncut
    whole, _ = unstopped[1]
    new_text = whole[len(PROMPTS[1]) :]
    stop = new_text[len(new_text) // 3 :][:3]
    assert stop.strip(), new_text
    return stop


@pytest.mark.parametrize("way", WAYS)
def test_a_ragged_batchs_text_has_no_padding_and_ends_at_the_stop(text_checkpoint, way):
    folder, _, _ = text_checkpoint
    stop = a_stop_string(text_checkpoint)
    want, free = text_reference(text_checkpoint, stop)
    plan = Planning(way=way)
    unstopped = generate(folder, PROMPTS, NEW, "100%", page_size=4, eos=(), plan=plan)
    assert unstopped.prompt_lengths is not None  # ragged
    np.testing.assert_array_equal(unstopped.new_ids, free)
    for line, prompt in zip(unstopped.text, PROMPTS, strict=True):
        assert line.startswith(prompt)  # not ",,,,": the padding is not text
    out = generate(folder, PROMPTS, NEW, "100%", page_size=4, eos=(), stop=[stop], plan=plan)
    assert out.text == [w for w, _ in want]
    assert out.new_lengths.tolist() == [n for _, n in want] and out.new_lengths[1] < NEW
    for b, (_, n) in enumerate(want):
        np.testing.assert_array_equal(out.new_ids[b, :n], free[b, :n])
    assert out.stats.tokens == int(out.new_lengths.sum())


def test_the_command_line_with_several_prompts_and_a_stop(text_checkpoint, capsys):
    folder, _, _ = text_checkpoint
    stop = a_stop_string(text_checkpoint)
    want, _ = text_reference(text_checkpoint, stop)
    argv = ["generate", "--checkpoint", str(folder), "--budget", "100%", "--new-tokens",
            str(NEW), "--page-size", "4", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
            "--stop", stop, "--ignore-eos", "--run", "--backend", "numpy"]  # fmt: skip
    assert main(argv) == EXIT_OK
    printed = capsys.readouterr().out
    assert "left padded" in printed
    kept = [n for _, n in want]
    assert f"{sum(kept)} of {2 * NEW} tokens kept ({kept[0]}, {kept[1]})" in printed
    lines = printed.split("text (prompt | new)")[1].strip().splitlines()[:2]
    for line, (whole, _), prompt in zip(lines, want, PROMPTS, strict=True):
        shown = line.split(None, 1)[1]
        assert shown.startswith(prompt + " | ")  # the prompt without padding, then the mark
        assert "".join(shown.replace(" | ", "", 1).split()) == "".join(whole.split())


# -- quantized weights with stop tokens --------------------------------------------------


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("both", [False, True], ids=["one-stops", "both-stop"])
def test_quantized_generation_stops_where_the_reference_evaluator_does(way, both):
    cfg = llama.PRESETS["tiny-gqa"]
    quant = Quantization(8, 32)
    weights = {n: w * 10 if w.ndim > 1 else w for n, w in random_weights(cfg, "float32", 3).items()}
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 5))
    # the reference evaluator of the quantized program, on the same quantized weights
    spec = GenerationSpec(llama.FAMILY, cfg, 2, 5, NEW, page_size=4, quant=quant)
    inputs = {"tokens": ids, **llama.FAMILY.position_inputs(cfg, spec.positions, "float32")}
    free = taskgraph.evaluate(spec.generation_program().build(),
                              {**inputs, **spec.program_weights(weights)})["ids"]  # fmt: skip
    eos = [early_in(free, 0), early_in(free, 1)] if both else [early_in(free, 0)]
    kept = [min(first_at(row, e) for e in eos if e in row) + 1 if set(eos) & set(row.tolist())
            else NEW for row in free]  # fmt: skip
    want = free[:, : max(kept)].copy()
    for b, n in enumerate(kept):
        want[b, n:] = eos[0]
    out = generate(cfg, ids, NEW, "60%", weights=weights, page_size=4, quant=quant, eos=eos,
                   plan=Planning(way=way))  # fmt: skip
    assert out.spec.quant == quant
    np.testing.assert_array_equal(out.new_ids, want)
    assert out.new_lengths.tolist() == kept and out.stats.tokens == sum(kept)
    if both and way == "steps":  # every sequence stopped: the step loop ended early
        assert len(out.reports) == max(kept) < NEW
