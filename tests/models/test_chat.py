"""Chat prompts (issue 27, item 3): a checkpoint's chat template applied as transformers'
`apply_chat_template(..., add_generation_prompt=True)` does – the same token ids on a
LLaMA-2-style, a ChatML (Qwen) and a Zephyr-style template, with system messages and
several turns – and the same greedy text as transformers' `generate` from them, through
`generate(messages=...)` and `einpage generate --chat`; and the errors: no template, a
template that does not parse or fails to render, a template that tries to change what
it is given (the sandbox), malformed messages.

The checkpoints are made here: a small random LLaMA and a BPE tokenizer trained on a
paragraph, saved with transformers' `save_pretrained` (no network)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK, main  # noqa: E402
from einpage.workloads import text  # noqa: E402
from einpage.workloads.chat import ChatError, ChatTemplate, encode_chat  # noqa: E402
from einpage.workloads.generate import Planning, generate  # noqa: E402

torch.set_num_threads(1)

PARAGRAPH = (
    "You are a helpful assistant. The planner keeps the pages of the cache on the device "
    "or sends them to host memory by their reuse distance. Hello, how are you? What is a "
    "page? A page holds keys and values of a few positions."
)
SPECIAL = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|user|>", "<|system|>",
           "<|assistant|>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"]  # fmt: skip

TEMPLATES = {
    # Llama 2 chat's template: a system message folded into the first user turn, roles
    # checked to alternate (raise_exception), bos/eos tokens; no generation prompt.
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}"
        "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"  # noqa: E501
        "{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"  # noqa: E501
        "{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"  # noqa: E501
        "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
        "{% endif %}{% endfor %}"
    ),
    # Qwen2's ChatML template: a default system message when none is given.
    "chatml": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Zephyr's: one statement a line, which trim_blocks and lstrip_blocks must clean up.
    "zephyr": (
        "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
        "{{ '<|user|>\\n' + message['content'] + eos_token }}\n"
        "{% elif message['role'] == 'system' %}\n"
        "{{ '<|system|>\\n' + message['content'] + eos_token }}\n"
        "{% elif message['role'] == 'assistant' %}\n"
        "{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n{% endif %}\n"
        "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
        "{% endfor %}"
    ),
}

CHATS = {
    "user": [{"role": "user", "content": "Hello, how are you?"}],
    "system": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is a page?"},
    ],
    "turns": [
        {"role": "user", "content": "What is a page?"},
        {"role": "assistant", "content": "A page holds keys and values."},
        {"role": "user", "content": "Hello, how are you?"},
    ],
}


def train_tokenizer():
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIAL)
    tok.train_from_iterator([PARAGRAPH], trainer)
    return tok


def save_tokenizer(folder, template):
    """The tokenizer as transformers saves it: tokenizer.json, tokenizer_config.json (bos,
    eos) and, with a template, chat_template.jinja."""
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(), bos_token="<s>", eos_token="</s>",
        chat_template=template,
    )  # fmt: skip
    hf.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def model():
    config = transformers.LlamaConfig(
        vocab_size=train_tokenizer().get_vocab_size(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500.0,
        attn_implementation="eager",
    )
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.mul_(10.0)  # sharper than the default init: varied tokens
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model):
    """A checkpoint folder per template (the model and its tokenizer), and transformers'
    tokenizer loaded back from it."""
    made = {}
    for name, template in TEMPLATES.items():
        folder = tmp_path_factory.mktemp(f"chat-{name}")
        model.save_pretrained(folder)
        made[name] = folder, save_tokenizer(folder, template)
    return made


def hf_chat_ids(hf_tok, messages):
    out = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return np.array([ids], np.int64)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("name", TEMPLATES)
def test_the_ids_equal_transformers_apply_chat_template(checkpoints, name, chat):
    folder, hf_tok = checkpoints[name]
    template = ChatTemplate.of_checkpoint(folder)
    ids, rendered = encode_chat(template, text.load_tokenizer(folder), CHATS[chat])
    want = hf_tok.apply_chat_template(CHATS[chat], add_generation_prompt=True, tokenize=False)
    assert rendered == [want]
    np.testing.assert_array_equal(ids, hf_chat_ids(hf_tok, CHATS[chat]))
    assert template.special_tokens["eos_token"] == "</s>"


def test_a_template_in_tokenizer_config_and_its_helpers(tmp_path):
    """The older place (tokenizer_config.json's chat_template), and the helpers a
    template may call: strftime_now, tojson (not HTML-escaped), namespace, loop controls."""
    source = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "[{{ ns.n }}] {{ m['content'] | tojson }}{% endfor %} {{ strftime_now('%Y') }}"
        "{% if add_generation_prompt %} <|assistant|>{% endif %}"
    )
    hf_tok = save_tokenizer(tmp_path, None)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = source
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [*CHATS["system"], {"role": "user", "content": "<a & b>"}]
    template = ChatTemplate.of_checkpoint(tmp_path)
    assert "tokenizer_config.json" in template.where
    want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert template.render(messages) == want and '"<a & b>"' in want
    ids, _ = encode_chat(template, text.load_tokenizer(tmp_path), messages)
    np.testing.assert_array_equal(ids, hf_chat_ids(hf_tok, messages))


def hf_greedy(model, ids, new_tokens):
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(ids),
            attention_mask=torch.ones(ids.shape, dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=model.config.eos_token_id,  # the checkpoint's, as einpage stops
            pad_token_id=model.config.eos_token_id,
        )
    return out.numpy()


@pytest.mark.parametrize("way", ["unrolled", "steps"])
@pytest.mark.parametrize("name", ["chatml", "zephyr"])
def test_the_generated_text_equals_transformers_generate(checkpoints, model, name, way):
    folder, hf_tok = checkpoints[name]
    messages = CHATS["system"]
    ids = hf_chat_ids(hf_tok, messages)
    want = hf_greedy(model, ids, 6)
    out = generate(folder, messages=messages, new_tokens=6, budget="100%", page_size=8,
                   plan=Planning(way=way))  # fmt: skip
    np.testing.assert_array_equal(out.ids, want)
    assert out.text == [hf_tok.decode(want[0], skip_special_tokens=True)]


def test_a_batch_of_conversations(checkpoints, model):
    """One conversation repeated (batch=2), and one per sequence (of the same length
    here; of different lengths below)."""
    folder, hf_tok = checkpoints["chatml"]
    first = [{"role": "user", "content": "What is a page?"}]
    second = [{"role": "user", "content": "What are pages?"}]
    ids = np.concatenate([hf_chat_ids(hf_tok, first), hf_chat_ids(hf_tok, second)])
    assert ids.shape[0] == 2
    out = generate(folder, messages=[first, second], new_tokens=4, budget="100%", page_size=8)
    np.testing.assert_array_equal(out.ids, hf_greedy(model, ids, 4))
    out = generate(folder, messages=first, new_tokens=4, budget="100%", page_size=8, batch=2)
    np.testing.assert_array_equal(out.ids, hf_greedy(model, ids[[0, 0]], 4))


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_conversations_of_different_lengths_are_a_ragged_batch(checkpoints, model, way):
    """Each conversation its own length: left padded (id 0, masked) as transformers'
    generate is given them with padding_side="left" and an attention mask, stopping at
    the checkpoint's eos as transformers does."""
    folder, hf_tok = checkpoints["chatml"]
    chats = [CHATS["user"], CHATS["turns"]]
    rows = [hf_chat_ids(hf_tok, c)[0] for c in chats]
    assert len(rows[0]) < len(rows[1])
    ids = np.zeros((2, len(rows[1])), np.int64)
    mask = np.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, ids.shape[1] - len(row) :], mask[b, ids.shape[1] - len(row) :] = row, 1
    eos = model.config.eos_token_id
    with torch.no_grad():
        want = model.generate(
            torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=5,
            do_sample=False, eos_token_id=eos, pad_token_id=eos,
        ).numpy()  # fmt: skip
    out = generate(folder, messages=chats, new_tokens=5, budget="100%", page_size=8,
                   plan=Planning(way=way))  # fmt: skip
    assert out.prompt_lengths == (len(rows[0]), len(rows[1]))
    np.testing.assert_array_equal(out.ids, want)
    for b, row in enumerate(rows):  # the text leaves the padding out
        kept = want[b, ids.shape[1] : ids.shape[1] + out.new_lengths[b]]
        whole = np.concatenate([row, kept])
        assert out.text[b] == hf_tok.decode(whole, skip_special_tokens=True)


def test_a_chat_with_quantized_weights_equals_the_reference_evaluator(checkpoints, model):
    import taskgraph
    from einpage.models import llama
    from einpage.program.quantize import Quantization
    from einpage.workloads.generation import GenerationSpec

    folder, hf_tok = checkpoints["chatml"]
    ids = hf_chat_ids(hf_tok, CHATS["system"])
    quant = Quantization(4, 16)
    cfg = llama.LlamaConfig.from_hf(model.config)
    spec = GenerationSpec(llama.FAMILY, cfg, 1, ids.shape[1], 5, page_size=8, quant=quant)
    weights = spec.program_weights(llama.weights_from_state_dict(cfg, model.state_dict()))
    inputs = {"tokens": ids, **llama.FAMILY.position_inputs(cfg, spec.positions, "float32")}
    free = taskgraph.evaluate(spec.generation_program().build(), {**inputs, **weights})["ids"]
    out = generate(folder, messages=CHATS["system"], new_tokens=5, budget="100%",
                   page_size=8, quant=quant, eos=(), logits=True)  # fmt: skip
    assert out.spec.quant == quant
    np.testing.assert_array_equal(out.ids, np.concatenate([ids, free], axis=1))
    floats = generate(folder, messages=CHATS["system"], new_tokens=5, budget="100%",
                      page_size=8, eos=(), logits=True)  # fmt: skip
    assert not np.allclose(out.logits, floats.logits, rtol=1e-4, atol=1e-4)  # int4 counted


def joined(out):
    """The first sequence's text as the command line printed it, without the ` | ` where
    the prompt ends or any space (which the mark may move)."""
    line = out.split("text (prompt | new)")[1].strip().splitlines()[0]
    return "".join(line.split(None, 1)[1].replace(" | ", "", 1).split())


def test_the_command_line_chat(checkpoints, model, tmp_path, capsys):
    folder, hf_tok = checkpoints["chatml"]
    messages = CHATS["turns"]
    want = hf_tok.decode(hf_greedy(model, hf_chat_ids(hf_tok, messages), 5)[0],
                         skip_special_tokens=True)  # fmt: skip
    file = tmp_path / "messages.json"
    file.write_text(json.dumps(messages))
    argv = ["generate", "--checkpoint", str(folder), "--budget", "100%", "--new-tokens", "5",
            "--page-size", "8", "--run", "--backend", "numpy"]  # fmt: skip
    assert main([*argv, "--messages", str(file)]) == EXIT_OK
    out = capsys.readouterr().out
    assert joined(out) == "".join(want.split())
    # --chat --prompt TEXT: the user's one message
    user = CHATS["user"][0]["content"]
    want = hf_tok.decode(hf_greedy(model, hf_chat_ids(hf_tok, CHATS["user"]), 5)[0],
                         skip_special_tokens=True)  # fmt: skip
    assert main([*argv, "--chat", "--prompt", user]) == EXIT_OK
    assert joined(capsys.readouterr().out) == "".join(want.split())


def test_the_command_line_chats_with_several_prompts(checkpoints, model, capsys):
    """Each --prompt with --chat is the user's message of its own chat; chats of
    different lengths are one ragged batch, each line its own chat's text."""
    folder, hf_tok = checkpoints["chatml"]
    users = ["Hello, how are you?", "What is a page? A page holds keys and values."]
    chats = [[{"role": "user", "content": u}] for u in users]
    out = generate(folder, messages=chats, new_tokens=4, budget="100%", page_size=8)
    assert out.prompt_lengths is not None  # ragged
    argv = ["generate", "--checkpoint", str(folder), "--budget", "100%", "--new-tokens", "4",
            "--page-size", "8", "--chat", "--prompt", users[0], "--prompt", users[1],
            "--run", "--backend", "numpy"]  # fmt: skip
    assert main(argv) == EXIT_OK
    printed = capsys.readouterr().out
    assert "left padded" in printed
    lines = printed.split("text (prompt | new)")[1].strip().splitlines()[:2]
    for line, want in zip(lines, out.text, strict=True):
        assert "".join(line.split(None, 1)[1].replace(" | ", "", 1).split()) == "".join(
            want.split()
        )


# -- errors ------------------------------------------------------------------------------


def test_a_checkpoint_without_a_template_says_where_it_looked(tmp_path, model, capsys):
    model.save_pretrained(tmp_path)
    save_tokenizer(tmp_path, None)
    with pytest.raises(ChatError) as caught:
        generate(tmp_path, messages=CHATS["user"], new_tokens=2, run=None)
    said = str(caught.value)
    assert str(tmp_path) in said
    assert "no chat_template.jinja, and no chat_template in tokenizer_config.json" in said
    code = main(["generate", "--checkpoint", str(tmp_path), "--budget", "100%", "--chat",
                 "--prompt", "Hello"])  # fmt: skip
    assert code == EXIT_BAD_INPUT and "no chat_template.jinja" in capsys.readouterr().err


def test_a_template_that_fails_to_render_gives_its_message(checkpoints):
    folder, _ = checkpoints["llama2"]
    not_alternating = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatError, match="failed to render: Conversation roles must alternate"):
        generate(folder, messages=not_alternating, new_tokens=2, run=None)


@pytest.mark.parametrize(
    "source, words",
    [
        ("{% for m in messages %}{{ m['content'] }}", "does not parse: Unexpected end of"),
        ("{{ messages[0]['content'] + 1 }}", "failed to render: TypeError"),
        ("{{ messages.append(1) }}", "failed to render: access to attribute 'append'"),
        ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "failed to render"),
    ],
)
def test_templates_that_break_or_reach_out_are_refused(source, words):
    with pytest.raises(ChatError, match=words):
        ChatTemplate(source, "a test").render(CHATS["user"])


@pytest.mark.parametrize(
    "messages, words",
    [
        ("Hello", "messages must be a non-empty list"),
        ([], "messages must be a non-empty list"),
        ([{"content": "Hi"}], "message 0 needs a 'role' string"),
        ([{"role": "user"}], "message 0 needs a 'content' string"),
        ([{"role": "user", "content": "Hi"}, 7], "message 1 must be a mapping"),
        ([[{"role": "user", "content": "Hi"}], []], "conversation 1 is empty"),
    ],
)
def test_malformed_messages_are_named(checkpoints, messages, words):
    folder, _ = checkpoints["chatml"]
    with pytest.raises(ChatError, match=words):
        generate(folder, messages=messages, new_tokens=2, run=None)


def test_prompt_and_messages_together_are_refused(checkpoints, tmp_path, capsys):
    folder, _ = checkpoints["chatml"]
    with pytest.raises(Exception, match="a prompt or messages, not both"):
        generate(folder, "Hello", messages=CHATS["user"], new_tokens=2, run=None)
    bad = tmp_path / "bad.json"
    bad.write_text("[{'role': 'user'}]")
    code = main(["generate", "--checkpoint", str(folder), "--budget", "100%",
                 "--messages", str(bad)])  # fmt: skip
    assert code == EXIT_BAD_INPUT and "is not valid JSON" in capsys.readouterr().err
