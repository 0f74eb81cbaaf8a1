"""Chat prompts: a checkpoint's chat template applied to messages, as transformers does.

Instruct models expect their conversation written the way they were trained on, which
their checkpoint says with a Jinja2 *chat template*: a `chat_template.jinja` file (what
transformers 4.43+ writes) or the `chat_template` entry of `tokenizer_config.json` (a
string, or a list of named templates of which "default" is used). `ChatTemplate`
renders it as transformers' `apply_chat_template(messages, add_generation_prompt=True)`
does:

* in Jinja2's `ImmutableSandboxedEnvironment` (a template comes from a file: it is
  never evaluated as Python, and cannot change the values it is given), with
  `trim_blocks`, `lstrip_blocks` and the `loopcontrols` extension;
* with the helpers transformers gives templates: `raise_exception(message)`,
  `strftime_now(format)`, a `tojson` filter that does not escape HTML, and the
  tokenizer's special tokens (`bos_token`, `eos_token`, ...: from
  `tokenizer_config.json`, or `special_tokens_map.json`);
* `messages` and `add_generation_prompt=True` (the prompt then ends where the
  assistant's answer begins).

The rendered text is encoded without adding special tokens (the template writes them),
as transformers does (`encode_chat`).

>>> template = ChatTemplate(
...     "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\\n{% endfor %}"
...     "{% if add_generation_prompt %}<|assistant|>{% endif %}", "an example")
>>> template.render([{"role": "user", "content": "Hi"}])
'<|user|>Hi\\n<|assistant|>'
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from einpage.models.errors import CheckpointError, GenerationError
from einpage.models.gguf import is_gguf, opened_gguf
from einpage_core.errors import MissingDependencyError

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "TOKENIZER_CONFIG_FILE",
    "SPECIAL_TOKENS_FILE",
    "SPECIAL_TOKENS",
    "ChatError",
    "ChatTemplate",
    "check_messages",
    "chat_rows",
    "encode_chat",
]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""A checkpoint's chat template as a file of its own (read first)."""
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
"""Holds the chat template as `chat_template` in older checkpoints, and the special tokens."""
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
"""The special tokens, in checkpoints whose tokenizer_config.json does not name them."""
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The special tokens a template is given by name (transformers' `special_tokens_map`)."""


class ChatError(GenerationError):
    """A chat prompt cannot be made: no template where one was looked for, a template that
    does not parse or fails to render (with the template's own message), or malformed
    messages."""


def _jinja() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as err:
        raise MissingDependencyError(
            "jinja2 is not installed (needed to apply a chat template); install it with "
            "`pip install 'einpage[text]'`",
            package="jinja2",
            extra="text",
        ) from err
    return jinja2


def _raise_exception(message: str) -> None:
    """What a template calls to refuse its input (transformers' helper)."""
    raise _jinja().exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """Jinja's `tojson` as transformers overrides it: plain JSON, no HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """The current local time in `format` (templates that print today's date)."""
    return datetime.now().strftime(format)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template: its Jinja2 `source`, `where` it came from (for messages), and the
    `special_tokens` it is given (name -> text, such as `{"bos_token": "<s>"}`). The
    template is parsed when made: `ChatError` with the line and Jinja's message when it
    does not parse."""

    source: str
    where: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    _compiled: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        jinja2 = _jinja()
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            compiled = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatError(
                f"the chat template of {self.where} does not parse: {err.message} (line "
                f"{err.lineno}: {_line(self.source, err.lineno)!r})"
            ) from None
        object.__setattr__(self, "_compiled", compiled)

    @classmethod
    def of_checkpoint(cls, folder: str | os.PathLike[str]) -> ChatTemplate:
        """The chat template of a checkpoint folder (or of the folder of a file in it):
        `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`, with the
        special tokens of `tokenizer_config.json` (or `special_tokens_map.json`); for a
        GGUF file, its own (`of_gguf`). `ChatError` naming both places when neither has
        one."""
        path = Path(folder)
        if is_gguf(path):
            return cls.of_gguf(path)
        folder = path if path.is_dir() else path.parent
        config = _json_object(folder / TOKENIZER_CONFIG_FILE) or {}
        special = _special_tokens(_json_object(folder / SPECIAL_TOKENS_FILE) or {})
        special.update(_special_tokens(config))
        file = folder / CHAT_TEMPLATE_FILE
        if file.is_file():
            try:
                source = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise CheckpointError(f"cannot read {str(file)!r}: {err}") from None
            return cls(source, repr(str(file)), special)
        where = f"{str(folder / TOKENIZER_CONFIG_FILE)!r}"
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise ChatError(
                    f"{where} has chat templates named {sorted(map(str, named))} but none "
                    "named 'default', the one a chat prompt uses"
                )
            template = named["default"]
        if template is None:
            raise ChatError(
                f"a chat prompt needs the checkpoint's chat template, and {str(folder)!r} "
                f"has none: no {CHAT_TEMPLATE_FILE}, and no chat_template in "
                f"{TOKENIZER_CONFIG_FILE}; save an instruct model's tokenizer into the "
                "folder (`tokenizer.save_pretrained(DIR)` writes its template), or give "
                "the prompt as plain text"
            )
        if not isinstance(template, str):
            raise ChatError(
                f"{where}: chat_template must be a string, got {type(template).__name__}"
            )
        return cls(template, where, special)

    @classmethod
    def of_gguf(cls, path: str | os.PathLike[str]) -> ChatTemplate:
        """The chat template of a GGUF file (`tokenizer.chat_template`) with the special
        tokens it names by id (`GGUFModel.special_tokens`: its bos and eos tokens' text),
        as transformers reads a template from the file. `ChatError` when it has none."""
        opened = opened_gguf(path)
        source = opened.chat_template()
        if source is None:
            raise ChatError(
                f"a chat prompt needs the checkpoint's chat template, and the "
                f"{opened.where} has none (no tokenizer.chat_template in its metadata); "
                "give chat_template=ChatTemplate(source, where), or the prompt as plain text"
            )
        return cls(source, f"{opened.where} (tokenizer.chat_template)", opened.special_tokens())

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The text of one conversation (`check_messages` checks it first), ending with the
        generation prompt unless `add_generation_prompt` is False. `ChatError` with the
        template's own message when it fails to render (its `raise_exception`, or any
        error inside it)."""
        (conversation,) = check_messages(messages)
        jinja2 = _jinja()
        try:
            return self._compiled.render(
                **self.special_tokens,
                messages=conversation,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as err:
            raise ChatError(f"the chat template of {self.where} failed to render: {err}") from None
        except Exception as err:  # an error inside the template's expressions
            raise ChatError(
                f"the chat template of {self.where} failed to render: {type(err).__name__}: {err}"
            ) from None


def check_messages(messages: Any) -> list[list[dict[str, Any]]]:
    """Conversations from `messages`: one conversation (a list of messages) or one per
    sequence (a list of such lists). A message is a mapping with a string `role` and a
    `content` (a string, or a list of parts as multimodal templates take). `ChatError`
    naming the conversation, the message and what was wrong."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ChatError(
            "messages must be a non-empty list of messages such as [{'role': 'user', "
            f"'content': 'Hello'}}] (or one such list per sequence), got {messages!r:.80}"
        )
    batched = all(isinstance(m, Sequence) and not isinstance(m, str | bytes) for m in messages)
    conversations = list(messages) if batched else [messages]
    checked = []
    for c, conversation in enumerate(conversations):
        where = f"conversation {c}, " if batched else ""
        if not conversation:
            raise ChatError(f"messages: {where.rstrip(', ') or 'the conversation'} is empty")
        rows = []
        for m, message in enumerate(conversation):
            at = f"messages: {where}message {m}"
            if not isinstance(message, Mapping):
                raise ChatError(
                    f"{at} must be a mapping with 'role' and 'content', got {message!r:.60}"
                )
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not role:
                raise ChatError(
                    f"{at} needs a 'role' string (user, assistant, system), got {role!r}"
                )
            if not isinstance(content, str | list):
                raise ChatError(f"{at} needs a 'content' string, got {content!r:.60}")
            rows.append(dict(message))
        checked.append(rows)
    return checked


def chat_rows(
    template: ChatTemplate, tokenizer: Any, messages: Any, batch: int | None = None
) -> tuple[list[list[int]], list[str]]:
    """The token ids of each conversation of `messages` rendered by `template` with the
    generation prompt, encoded by `tokenizer` (a `tokenizers.Tokenizer`) without adding
    special tokens, as transformers' `apply_chat_template(...,
    add_generation_prompt=True)` – one list per sequence, of any lengths (conversations
    of different lengths are a ragged batch: `generate` left pads them) –, and the
    rendered texts. One conversation is repeated `batch` times; several must number
    `batch` when it is given."""
    from einpage.workloads import text

    conversations = check_messages(messages)
    if batch is not None and len(conversations) not in (1, batch):
        raise ChatError(f"batch={batch} but messages has {len(conversations)} conversations")
    rendered = [template.render(c) for c in conversations]
    if len(rendered) == 1 and batch is not None:
        rendered = rendered * batch
    return text.encode_rows(tokenizer, rendered, add_special_tokens=False), rendered


def encode_chat(
    template: ChatTemplate, tokenizer: Any, messages: Any, batch: int | None = None
) -> tuple[np.ndarray, list[str]]:
    """The token ids [batch, prompt_len] of the conversations of `messages` (as
    `chat_rows`), and the rendered texts. `ChatError` when they encode to different
    lengths: `chat_rows` gives those as lists, which `generate` left pads."""
    rows, rendered = chat_rows(template, tokenizer, messages, batch)
    lengths = sorted({len(row) for row in rows})
    if len(lengths) > 1:
        raise ChatError(
            f"the conversations encode to different lengths {lengths}: one [batch, "
            "prompt_len] array has one (chat_rows gives them as lists; generate pads them)"
        )
    return np.array(rows, dtype=np.int64), rendered


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a tokenizer config: a string, or an added token's
    record (`{"content": "<s>", ...}`)."""
    found = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def _json_object(file: Path) -> dict[str, Any] | None:
    """A JSON object file's content, or None when there is no such file."""
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {str(file)!r}: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(file)!r}: expected a JSON object, got {type(data).__name__}")
    return data


def _line(source: str, number: int | None) -> str:
    """Line `number` (1-based) of `source`, or "" when there is none."""
    lines = source.splitlines()
    return lines[number - 1] if number and 0 < number <= len(lines) else ""
