"""The README's first Python example runs as written (as a script, in a scratch folder)
and checks something that could fail: random inputs through a plan that moves bytes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
CHECKS = """
assert mg.stats.offload_bytes + mg.stats.reload_bytes > 0, "the plan moves nothing"
assert len({float(v.std()) for v in inputs.values()}) == len(inputs), "constant inputs"
print("README example ran")
"""


def test_the_first_readme_example_runs(tmp_path):
    pytest.importorskip("matplotlib")
    from taskgraph.dot import find_dot

    source = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    if find_dot() is None:
        source = source.replace('mg.render("plan.svg"); ', "")
    script = tmp_path / "example.py"
    script.write_text(source + CHECKS)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "README example ran" in result.stdout and (tmp_path / "map.png").exists()


CHECKPOINT_PRELUDE = '''
# Written by tests/test_readme_example.py: what the README's examples take as given – a
# checkpoint folder as `save_pretrained` writes it, with a tokenizer.json – here a tiny
# random LLaMA (2 layers, hidden 32) and a BPE tokenizer trained on one sentence.
import tokenizers, torch, transformers

_tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
_tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
_tok.decoder = tokenizers.decoders.Metaspace()
_tok.train_from_iterator(
    ["The capital of France is Paris, and the capital of Italy is Rome."],
    tokenizers.trainers.BpeTrainer(vocab_size=64, special_tokens=["[UNK]"]),
)
_config = transformers.LlamaConfig(
    vocab_size=_tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
)
torch.manual_seed(0)
transformers.LlamaForCausalLM(_config).save_pretrained("checkpoint")
_tok.save("checkpoint/tokenizer.json")

# and a GGUF file for the GGUF example (its path replaced by this one): a random LLaMA with
# Q4_1 matrices and a byte-level vocabulary, as tests/models/test_gguf.py writes them
import sys as _sys
_sys.path.insert(0, {models!r})
from gguf_files import hf_model as _hf_model, write_gguf as _write_gguf
_write_gguf(__import__("pathlib").Path("model.gguf"), _hf_model("llama"), "llama", "Q4_1")
'''.replace("{models!r}", repr(str(Path(__file__).resolve().parent / "models")))

MODEL_CHECKS = """
assert np.isfinite(logits.astype("float32")).all() and logits.shape == (1, cfg.vocab_size)
assert set(quant) and "layers.0.attn.wq.min" in stored  # the GGUF example's Q4_1 weights
assert answer.ids.shape[1] == len(prompt_ids) + 8
assert set(qweights) > {"layers.0.attn.wq.q", "layers.0.attn.wq.scale"}
assert quantized.new_ids.shape == (1, 4) and quantized.spec.quant.bits == 4
assert more.new_ids.shape == (1, 16) and more.ids.shape[1] > 32 + 16
assert float(out["loss"]) > 0 and set(weights) < set(state)  # new weights and their states
print("README model examples ran")
"""


def test_every_other_readme_python_block_runs(tmp_path):
    """Every Python block after the first, in order, in one script – after a prelude that
    writes the tiny checkpoint they read from "path/to/checkpoint" – then checks on what
    they made. A block that stops running as written fails here."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[1:]
    assert len(blocks) >= 4, "the README's model, quantization, generation and training blocks"
    pytest.importorskip("gguf")
    source = "\n".join(blocks).replace("path/to/checkpoint", "checkpoint")
    source = source.replace("/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "model.gguf")
    script = tmp_path / "examples.py"
    script.write_text(CHECKPOINT_PRELUDE + source + MODEL_CHECKS)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "README model examples ran" in result.stdout
