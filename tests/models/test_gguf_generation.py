"""GGUF files through `generate()` and `einpage generate --gguf`: the file's quantized
tensors stay quantized (planned as its own `Quantization`s, read as stored, rebuilt on
the device at each step), the file's dtype is the default, its chat template and eos
drive chats and stopping. On files the tests write with the gguf package's writer,
checked against the reference evaluator of the same quantized program, transformers
loading the same file (`gguf_file=`) and the plans' own transfers."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_files import hf_model, write_gguf
from test_quant_generation import _derived_from_weights

import taskgraph
from einpage.cli.commands import EXIT_OK, main
from einpage.models.gguf import from_gguf
from einpage.workloads.generate import generate, run_weights
from einpage.workloads.generation import GenerationSpec, Planning, plan_generation
from memgraph import NodeKind
from taskgraph.nodes import Input

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MIXED = {  # block formats of each kind, and float matrices beside them
    "token_embd.weight": "Q8_0",
    "blk.0.attn_q.weight": "Q4_K",
    "blk.0.attn_k.weight": "Q4_0",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q4_1",
    "blk.0.ffn_gate.weight": "Q5_K",
    "blk.0.ffn_up.weight": "F16",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "F32",
    "blk.1.attn_k.weight": "Q8_0",
    "blk.1.attn_v.weight": "Q4_1",
    "blk.1.attn_output.weight": "Q4_K",
    "blk.1.ffn_gate.weight": "Q4_0",
    "blk.1.ffn_up.weight": "Q5_K",
    "blk.1.ffn_down.weight": "Q8_0",
    "output.weight": "Q6_K",
}
IDS = np.array([[3, 17, 250, 99, 4], [8, 8, 1, 200, 31]])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: path}: a mixed-type LLaMA (float16 by its first float matrix) and a Q4_K
    Qwen2 with a tied head (float32: every matrix quantized)."""
    folder = tmp_path_factory.mktemp("gguf-gen")
    made = {}
    for name, arch, types, tied in [
        ("llama-mixed", "llama", MIXED, False),
        ("qwen2-q4k", "qwen2", "Q4_K", True),
    ]:
        made[name] = write_gguf(folder / f"{name}.gguf", hf_model(arch, tied=tied), arch, types)
    return made


def _transformers(path):
    pytest.importorskip("accelerate", reason="transformers loads GGUF models with accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("way", ["unrolled", "steps"])
@pytest.mark.parametrize("name", ["llama-mixed", "qwen2-q4k"])
def test_generation_keeps_the_file_quantized(files, name, way):
    """generate("x.gguf") plans with the file's quantizations and runs on its stored
    integers: the tokens and logits equal the reference evaluator of that quantized
    program on `GGUFModel.quantized`, and transformers' greedy tokens."""
    path = files[name]
    opened = from_gguf(path)
    quant = opened.quantization()
    got = generate(str(path), IDS, 4, "60%", dtype="float32", page_size=4, logits=True,
                   plan=Planning(way=way))  # fmt: skip
    assert got.spec.quant == quant and quant  # planned with the file's own quantization
    stored = run_weights(got.spec, None, path)
    for weight in quant:  # the run reads the file's integers, never a float copy
        assert stored[f"{weight}.q"].dtype in (np.int8, np.uint8), weight
        assert weight not in stored
    spec = GenerationSpec(
        opened.family, opened.config, 2, 5, 4, page_size=4, logits=True, quant=quant
    )
    tg = spec.generation_program().build()
    positions = opened.family.position_inputs(opened.config, spec.positions, "float32")
    ref = taskgraph.evaluate(tg, {"tokens": IDS, **positions, **opened.quantized("float32")})
    np.testing.assert_array_equal(got.new_ids, ref["ids"])
    np.testing.assert_allclose(got.logits, ref["logits"], rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        want = _transformers(path).generate(
            torch.from_numpy(IDS), max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    np.testing.assert_array_equal(got.ids, want.numpy())


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_only_the_files_quantized_bytes_cross_pcie(files, way):
    """On plans that stream weights, every weight reload is the file's stored integers,
    scales and minimums (or a weight the file keeps in float), and no rebuilt float
    weight is ever moved."""
    opened = from_gguf(files["llama-mixed"])
    quant = opened.quantization()
    spec = GenerationSpec(opened.family, opened.config, 1, 6, 5, page_size=4, quant=quant)
    planned = plan_generation(spec, "150%streaming", Planning(way=way))
    reloaded = set()
    for compiled in planned.plans.values():
        mg, tg = compiled.plan, compiled.plan.taskgraph
        derived = _derived_from_weights(tg)
        for node in mg.nodes:
            if node.kind not in (NodeKind.RELOAD, NodeKind.OFFLOAD):
                continue
            moved = node.tensor
            if tg.is_input_slice(moved):
                moved = tg[moved].inputs[0]
            root = tg[tg.storage_root(moved)]
            if isinstance(root.op, Input) and root.op.role == "weight":
                weight, _, part = root.op.name.rpartition(".")
                if part == "q":
                    assert root.dtype in ("int8", "uint8"), root.op.name
                elif part not in ("scale", "min"):
                    assert root.op.name not in quant, f"{root.op.name} moved in float"
                reloaded.add(root.op.name)
            else:
                assert root.id not in derived, f"a rebuilt float weight moved: {root.line()}"
    assert any(name.endswith(".q") for name in reloaded)  # the budget streams weights


def test_the_cli_generates_from_the_files_quantized_weights(files, capsys):
    path = files["qwen2-q4k"]
    code = main(["generate", "--gguf", str(path), "--prompt", "the hen", "--new-tokens", "3",
                 "--run", "--backend", "numpy", "--budget", "100%"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "quantized weights as stored" in out and "uint4+min" in out, out
    ours = from_gguf(path).tokenizer()
    same = generate(str(path), "the hen", 3, "100%", tokenizer=ours)
    assert same.spec.quant and f"the hen | {same.text[0][len('the hen') :]}" in out


def test_the_files_dtype_is_the_default_in_python_and_on_the_command_line(tmp_path, capsys):
    """A bfloat16 GGUF plans in bfloat16 unless a dtype is given (`choose_dtype`, one
    function for config.json and GGUF files), in `generate()` as with `--gguf`."""
    path = write_gguf(tmp_path / "bf16.gguf", hf_model("llama"), "llama", "BF16")
    assert generate(str(path), IDS, 2, "100%", run=None).spec.dtype == "bfloat16"
    assert generate(str(path), IDS, 2, "100%", dtype="float32", run=None).spec.dtype == "float32"
    code = main(["generate", "--gguf", str(path), "--prompt-len", "4", "--new-tokens", "2",
                 "--budget", "100%"])  # fmt: skip
    assert code == EXIT_OK
    assert "bfloat16 (the GGUF file's)" in capsys.readouterr().out


TEMPLATE = (  # a ChatML-like template that reads the file's eos token by name
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "an inn"},
    {"role": "user", "content": "the hen at the inn"},
]


def test_a_chat_uses_the_files_template_and_tokens_as_transformers(tmp_path, capsys):
    """`generate(path, messages=...)` and `--chat` write the prompt with the file's
    `tokenizer.chat_template` and its eos token's text, as transformers'
    `apply_chat_template` does on a tokenizer loaded from the same file, and generate its
    greedy tokens."""
    from einpage.workloads.chat import ChatTemplate, chat_rows

    path = write_gguf(tmp_path / "chat.gguf", hf_model("qwen2"), "qwen2", "Q8_0",
                      chat_template=TEMPLATE)  # fmt: skip
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    want_ids = theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    want_ids = list(getattr(want_ids, "input_ids", want_ids))
    template = ChatTemplate.of_checkpoint(path)
    assert template.special_tokens["eos_token"] == "<|endoftext|>"
    rows, _ = chat_rows(template, from_gguf(path).tokenizer(), CHAT, None)
    assert rows[0] == want_ids
    got = generate(str(path), messages=CHAT, new_tokens=3, dtype="float32", eos=())
    assert got.ids[0, : len(want_ids)].tolist() == want_ids
    with torch.no_grad():
        want = _transformers(path).generate(
            torch.tensor([want_ids]), max_new_tokens=3, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    np.testing.assert_array_equal(got.ids, want.numpy())
    code = main(["generate", "--gguf", str(path), "--chat", "--prompt", "the hen at the inn",
                 "--new-tokens", "2", "--budget", "100%", "--run",
                 "--backend", "numpy"])  # fmt: skip
    assert code == EXIT_OK
    # the chat's prompt as written by the template (special tokens are not printed)
    assert "user\nthe hen at the inn\nassistant\n |" in capsys.readouterr().out


def test_a_generation_stops_at_the_files_eos_as_transformers(tmp_path):
    """The file's `tokenizer.ggml.eos_token_id` stops a sequence by default (and
    `eos=()` does not): written as the id greedy decoding makes second, the sequence
    stops there, as transformers' `generate` stops reading the same file."""
    model = hf_model("llama")
    plain = write_gguf(tmp_path / "plain.gguf", model, "llama", "Q4_0")
    going = generate(str(plain), IDS[:1], 6, "100%", dtype="float32", eos=())
    eos = int(going.new_ids[0, 1])
    path = write_gguf(tmp_path / "eos.gguf", model, "llama", "Q4_0", eos=eos)
    stops = generate(str(path), IDS[:1], 6, "100%", dtype="float32")
    assert stops.stopping.eos_ids == (eos,)
    assert stops.new_lengths.tolist() == [2]
    np.testing.assert_array_equal(stops.new_ids[0], going.new_ids[0, :2])
    hf = _transformers(path)
    assert hf.generation_config.eos_token_id == eos  # transformers reads the same id
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(IDS[:1]), max_new_tokens=6, do_sample=False)
    np.testing.assert_array_equal(stops.ids, want.numpy())
    ignored = generate(str(path), IDS[:1], 6, "100%", dtype="float32", eos=())
    np.testing.assert_array_equal(ignored.new_ids, going.new_ids)
