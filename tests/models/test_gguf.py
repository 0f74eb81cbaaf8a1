"""GGUF checkpoints (`einpage.models.gguf`) on files the tests write with the gguf
package's writer: each block format's split against `gguf.quants.dequantize`, the
program's dequantization tasks against NumPy, the logits against transformers loading
the same file (`gguf_file=`), greedy tokens against transformers' `generate`, the
tokenizer's ids against transformers', and bad files refused with typed errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf_files import encode_tensor, gguf, hf_model, random_blocks, write_gguf

import taskgraph
from einpage.errors import CheckpointError, UnsupportedConfigError
from einpage.models import llama
from einpage.models.gguf import BLOCK_FORMATS, TYPES, dequantize_blocks, from_gguf, split_blocks
from einpage.program.program import Program
from einpage.program.quantize import Quantization, dequantize, dequantized_weight

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MIXED = {  # every supported type in one file: a Q4_K_M-like mixture and more
    "token_embd.weight": "Q8_0",
    "blk.0.attn_q.weight": "Q4_K",
    "blk.0.attn_k.weight": "Q4_0",
    "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q4_1",
    "blk.0.ffn_gate.weight": "Q5_K",
    "blk.0.ffn_up.weight": "F16",
    "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "BF16",
    "blk.1.attn_k.weight": "Q8_0",
    "blk.1.attn_v.weight": "Q4_1",
    "blk.1.attn_output.weight": "Q4_K",
    "blk.1.ffn_gate.weight": "Q4_0",
    "blk.1.ffn_up.weight": "Q5_K",
    "blk.1.ffn_down.weight": "Q8_0",
    "output.weight": "Q6_K",
}


def test_every_supported_type_is_in_the_mixed_file():
    assert set(MIXED.values()) | {"F32"} == set(TYPES)


@pytest.mark.parametrize("kind", sorted(BLOCK_FORMATS))
def test_each_block_format_dequantizes_as_gguf_does(kind):
    rng = np.random.default_rng(1)
    values = rng.standard_normal((6, 512)).astype(np.float32)
    raw, qtype = encode_tensor(rng, values, kind)
    want = gguf.quants.dequantize(np.asarray(raw), qtype)
    got = dequantize_blocks(raw, kind)
    assert got.shape == want.shape == (6, 512)
    np.testing.assert_array_equal(got, want)
    q, scale, minimum = split_blocks(raw, kind)  # the stored layout the program reads
    quant = BLOCK_FORMATS[kind].quant
    assert q.shape == quant.stored((6, 512), "float32")["q"][0]
    assert (minimum is not None) == quant.minimum


@pytest.mark.parametrize("kind", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("transposed", [False, True])
def test_the_program_rebuilds_each_block_format_as_numpy(kind, transposed):
    """The device tasks (`dequantized_weight`) give exactly NumPy's dequantization of the
    same stored integers, scales and minimums (transposed: the groups along the rows)."""
    rng = np.random.default_rng(2)
    raw, _ = encode_tensor(rng, rng.standard_normal((8, 256)).astype(np.float32), kind)
    q, scale, minimum = split_blocks(raw, kind)
    fmt = BLOCK_FORMATS[kind].quant
    quant = Quantization(fmt.bits, fmt.group, fmt.minimum, transposed)
    shape = (4, 64, 8) if transposed else (2, 4, 256)  # the program's weight
    prog = Program("dequant")
    prog.output(dequantized_weight(prog, "w", shape, "float32", quant), "w")
    stored = quant.stored(shape, "float32")
    parts = {"q": q, "scale": scale, "min": minimum}
    inputs = {f"w.{part}": parts[part].reshape(stored[part][0]) for part in stored}
    got = taskgraph.evaluate(prog.build(), inputs)["w"]
    matrix = dequantize(q, scale, fmt, "float32", minimum)  # [8, 256]
    want = matrix.T.reshape(shape) if transposed else matrix.reshape(shape)
    np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(folder, {name: (hf model, file name)}): a mixed-type LLaMA, a Q4_K Qwen2 with a
    tied head and an F16 LLaMA, written once for the module."""
    folder = tmp_path_factory.mktemp("gguf")
    made = {}
    for name, arch, types, tied in [
        ("llama-mixed", "llama", MIXED, False),
        ("qwen2-q4k", "qwen2", "Q4_K", True),
        ("llama-f16", "llama", "F16", False),
    ]:
        model = hf_model(arch, tied=tied)
        write_gguf(folder / f"{name}.gguf", model, arch, types)
        made[name] = folder / f"{name}.gguf"
    return folder, made


def _transformers(path):
    pytest.importorskip("accelerate", reason="transformers loads GGUF models with accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


IDS = np.array([[3, 17, 250, 99, 4, 260, 7], [8, 8, 1, 200, 31, 5, 266]])


@pytest.mark.parametrize("name", ["llama-mixed", "qwen2-q4k", "llama-f16"])
def test_logits_equal_transformers_loading_the_same_file(files, name):
    """Float weights (dequantized on the host) and the quantized program (integers on
    the host, dequantized by tasks) both give transformers' logits."""
    path = files[1][name]
    opened = from_gguf(path)
    with torch.no_grad():
        want = _transformers(path)(torch.from_numpy(IDS)).logits.numpy()
    cfg = opened.config
    inputs = llama.prefill_inputs(cfg, IDS, dtype="float32")
    prog = llama.prefill_program(cfg, *IDS.shape, "float32").build()
    got = taskgraph.evaluate(prog, {**opened.weights("float32"), **inputs})["logits"]
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)
    quant = opened.quantization()
    if name != "llama-f16":
        assert quant, "block-quantized matrices stay quantized"
    qprog = llama.prefill_program(cfg, *IDS.shape, "float32", quant=quant or None).build()
    stored = opened.quantized("float32")
    for weight in quant:  # the file's integers, not floats
        assert stored[f"{weight}.q"].dtype in (np.int8, np.uint8)
        assert weight not in stored
    got_q = taskgraph.evaluate(qprog, {**stored, **inputs})["logits"]
    np.testing.assert_allclose(got_q, want, atol=1e-5 * scale, rtol=0)


def test_a_quantized_gguf_program_runs_planned_under_half_its_memory(files):
    import memgraph
    import runtime

    opened = from_gguf(files[1]["llama-mixed"])
    cfg = opened.config
    tg = llama.prefill_program(cfg, *IDS.shape, "float32", quant=opened.quantization()).build()
    inputs = {**opened.quantized("float32"), **llama.prefill_inputs(cfg, IDS, dtype="float32")}
    want = taskgraph.evaluate(tg, inputs)["logits"]
    peak = memgraph.plan(tg, 2**40).stats.peak_bytes
    mg = memgraph.plan(tg, max(memgraph.min_budget(tg)[0], peak // 2))
    memgraph.verify(mg)
    assert mg.stats.reload_bytes > 0
    got = runtime.run(mg, inputs, backend="numpy")["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama-mixed", "qwen2-q4k"])
def test_greedy_generation_equals_transformers(files, name):
    from einpage.workloads.generate import generate

    path = files[1][name]
    ids = IDS[:1, :5]
    with torch.no_grad():
        want = _transformers(path).generate(
            torch.from_numpy(ids), max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    out = generate(str(path), ids, 5, "100%", page_size=4)
    np.testing.assert_array_equal(out.ids, want.numpy())


def test_a_gguf_file_as_the_weights_of_a_config(files):
    """`weights="model.gguf"` beside a config: read against that config, whose shapes
    must match (a config of another size is refused naming the weight)."""
    from einpage.errors import WeightError
    from einpage.workloads.generate import generate

    path = files[1]["qwen2-q4k"]
    cfg = from_gguf(path).config
    out = generate(cfg, IDS[:1, :5], 3, "100%", weights=str(path))
    same = generate(str(path), IDS[:1, :5], 3, "100%")
    np.testing.assert_array_equal(out.ids, same.ids)
    smaller = dataclasses.replace(cfg, intermediate_size=256)
    with pytest.raises(WeightError, match="mlp.w_gate"):
        generate(smaller, IDS[:1, :5], 3, "100%", weights=str(path))


def test_the_tokenizer_gives_transformers_ids(files):
    for name in ("llama-mixed", "qwen2-q4k"):
        path = files[1][name]
        theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        ours = from_gguf(path).tokenizer()
        for text in ["the thin hen at the inn", "Hello <|endoftext|> world  an\n\nat 12345!"]:
            assert ours.encode(text).ids == theirs(text).input_ids, (name, text)


def test_text_generation_through_the_cli(files, capsys):
    from einpage.cli import main

    path = files[1]["qwen2-q4k"]
    code = main(["generate", "--gguf", str(path), "--prompt", "the hen", "--new-tokens", "3",
                 "--run", "--backend", "numpy", "--budget", "100%"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "qwen2" in out and "float32" in out  # the family, and the file's dtype
    assert "the hen |" in out  # the prompt's text, then the new tokens'


def test_the_file_dtype_is_the_default(files):
    assert from_gguf(files[1]["llama-f16"]).dtype == "float16"
    assert from_gguf(files[1]["llama-mixed"]).dtype == "float16"  # its first float matrix
    assert from_gguf(files[1]["qwen2-q4k"]).dtype == "float32"  # every matrix is Q4_K


def test_a_llama_file_named_mistral_is_llama(tmp_path):
    """llama.cpp writes Mistral models as "llama" and runs them as LLaMA (no sliding
    window is recorded): a file's name is not a fact, so one named Mistral is LLaMA, with
    transformers' logits for the same file."""
    path = write_gguf(tmp_path / "m.gguf", hf_model("llama", layers=1), "llama", "Q8_0",
                      name="Mistral-7B-Instruct-v0.2")  # fmt: skip
    opened = from_gguf(path)
    assert opened.family.name == "llama"
    theirs = _transformers(path)
    with torch.no_grad():
        want = theirs(torch.from_numpy(IDS)).logits.numpy()
    inputs = llama.prefill_inputs(opened.config, IDS, dtype="float32")
    prog = llama.prefill_program(opened.config, *IDS.shape, "float32").build()
    got = taskgraph.evaluate(prog, {**opened.weights("float32"), **inputs})["logits"]
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("window", [None, 4])
def test_a_file_whose_metadata_says_mistral_is_mistral(tmp_path, window):
    """An architecture key "mistral" is the Mistral family (Q/K rows interleaved as for
    "llama"), with the sliding window its metadata gives (none: full attention). Its
    weights are those of the same model written as "llama", and with no window its
    logits are transformers' for that file. (transformers does not read a "mistral"
    GGUF in gguf 0.19.)"""
    from einpage.models import mistral

    model = hf_model("llama", layers=1)
    as_llama = write_gguf(tmp_path / "l.gguf", model, "llama", "Q8_0")
    path = write_gguf(tmp_path / "m.gguf", model, "mistral", "Q8_0", sliding_window=window)
    opened = from_gguf(path)
    assert opened.family.name == "mistral"
    assert opened.config.sliding_window == window
    want_weights = from_gguf(as_llama).weights("float32")
    for name, array in opened.weights("float32").items():
        np.testing.assert_array_equal(array, want_weights[name], err_msg=name)
    if window is None:
        with torch.no_grad():
            want = _transformers(as_llama)(torch.from_numpy(IDS)).logits.numpy()
        inputs = mistral.FAMILY.prefill_inputs(opened.config, IDS, dtype="float32")
        prog = mistral.FAMILY.prefill_program(opened.config, *IDS.shape, "float32").build()
        got = taskgraph.evaluate(prog, {**opened.weights("float32"), **inputs})["logits"]
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


# -- bad files ---------------------------------------------------------------------------


def test_a_truncated_file_is_refused(files, tmp_path):
    data = files[1]["llama-f16"].read_bytes()
    for keep in (len(data) - 1000, 100, 10):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(CheckpointError, match="truncated"):
            from_gguf(cut)


def test_a_missing_file_and_a_non_gguf_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        from_gguf(tmp_path / "none.gguf")
    (tmp_path / "text.gguf").write_text("not a gguf at all, but long enough to read a header")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        from_gguf(tmp_path / "text.gguf")


def _tiny_file(path, arch="llama", kind="F32", drop=None):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in [("embedding_length", 256), ("block_count", 1),
                       ("attention.head_count", 4), ("feed_forward_length", 256)]:  # fmt: skip
        if key != drop:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_vocab_size(8)
    if kind == "Q2_K":  # 84-byte blocks the gguf package cannot write from floats
        data, qtype = np.zeros((8, 84), np.uint8), gguf.GGMLQuantizationType.Q2_K
    else:
        data, qtype = encode_tensor(np.random.default_rng(0), np.ones((8, 256)), kind)
    writer.add_tensor("token_embd.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedConfigError, match="'gemma3'.*supported: llama, qwen2"):
        from_gguf(_tiny_file(tmp_path / "g.gguf", arch="gemma3"))


def test_an_unsupported_tensor_type_is_named_with_the_supported_ones(tmp_path):
    with pytest.raises(UnsupportedConfigError, match="Q2_K.*supported: F32, F16, BF16, Q8_0"):
        from_gguf(_tiny_file(tmp_path / "q2k.gguf", kind="Q2_K"))
    with pytest.raises(UnsupportedConfigError, match="IQ4_NL is not supported; supported"):
        dequantize_blocks(np.zeros((1, 18), np.uint8), "IQ4_NL")


def test_a_file_without_a_size_names_the_missing_key(tmp_path):
    with pytest.raises(CheckpointError, match="no 'llama.attention.head_count'"):
        from_gguf(_tiny_file(tmp_path / "h.gguf", drop="attention.head_count"))


def test_a_file_without_a_tokenizer_says_so(tmp_path):
    opened = from_gguf(_tiny_file(tmp_path / "t.gguf"))
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        opened.tokenizer()


def _vocabulary_file(path, model, tokens, types, scores=None, **flags):
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("embedding_length", 256), ("block_count", 1),
                       ("attention.head_count", 4), ("feed_forward_length", 256)]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for flag, value in flags.items():
        getattr(writer, f"add_{flag}")(value)
    writer.add_tensor("token_embd.weight", np.ones((len(tokens), 256), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sentencepiece_vocabulary():
    """Llama 2's kind of vocabulary, small: <unk>, <s>, </s>, the 256 byte tokens, then
    pieces with scores (no merges: they are implied by the scores)."""
    tokens, types, scores = ["<unk>", "<s>", "</s>"], [2, 3, 3], [0.0, 0.0, 0.0]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores += [0.0] * 256
    pieces = ["▁", "t", "h", "e", "a", "n", "i", "o", "s", "r", "▁t", "th", "he", "▁th",
              "▁the", "an", "▁a", "▁an", "in", "on", "er", "▁in", "at", "is", "▁is"]  # fmt: skip
    tokens += pieces
    types += [1] * len(pieces)
    scores += [-float(i) for i in range(len(pieces))]
    tokens.append("<tool>")  # user-defined: matched whole
    types.append(4)
    scores.append(0.0)
    return tokens, types, scores


def test_a_sentencepiece_vocabulary_gives_transformers_ids(tmp_path):
    tokens, types, scores = sentencepiece_vocabulary()
    path = _vocabulary_file(tmp_path / "spm.gguf", "llama", tokens, types, scores)
    ours = from_gguf(path).tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["the thin hen is in an inn", "  the  é 中 <tool> </s>x", "hat\nis"]:
        assert ours.encode(text).ids == theirs(text).input_ids, text
        ids = theirs(text).input_ids
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_a_sentencepiece_file_without_the_space_prefix_gets_none(tmp_path):
    """`tokenizer.ggml.add_space_prefix = false` is llama.cpp's word for "put no '▁'
    before the text"; einpage follows the file (transformers' GGUF reader ignores the
    flag, so it is no reference here)."""
    tokens, types, scores = sentencepiece_vocabulary()
    path = _vocabulary_file(tmp_path / "spm.gguf", "llama", tokens, types, scores,
                            add_space_prefix=False, add_bos_token=False)  # fmt: skip
    ours = from_gguf(path).tokenizer()
    assert ours.encode("the is").tokens == ["th", "e", "▁is"]
    assert ours.decode(ours.encode("the is").ids) == "the is"
    prefixed = _vocabulary_file(tmp_path / "p.gguf", "llama", tokens, types, scores)
    assert from_gguf(prefixed).tokenizer().encode("the is").tokens == ["<s>", "▁the", "▁is"]


def test_another_tokenizer_model_is_refused_by_name(tmp_path):
    path = _vocabulary_file(tmp_path / "t5.gguf", "t5", ["<pad>", "</s>", "<unk>"], [3, 3, 2])
    with pytest.raises(UnsupportedConfigError, match="tokenizer model 't5'.*gpt2, llama"):
        from_gguf(path).tokenizer()


def test_random_k_blocks_have_finite_scales():
    rng = np.random.default_rng(3)
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        values = dequantize_blocks(random_blocks(rng, 4, 512, kind), kind)
        assert np.isfinite(values).all() and 0.01 < np.abs(values).max() < 1
