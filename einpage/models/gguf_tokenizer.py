"""The tokenizer a GGUF file describes, as a `tokenizers.Tokenizer`.

A GGUF has no `tokenizer.json`: it keeps the vocabulary (`tokenizer.ggml.tokens`), the
merges (`tokenizer.ggml.merges`), each token's type (3: control, a special token) and
the special ids under llama.cpp's keys. einpage builds byte-level BPE
(`tokenizer.ggml.model` "gpt2": GPT-2, Qwen2, Llama 3) from them: the merges as they
are, text split by the pre-tokenizer the file names (`tokenizer.ggml.pre`: Qwen2's and
Llama 3's patterns; GPT-2's otherwise), control tokens kept whole, and the BOS token
put first when `tokenizer.ggml.add_bos_token` says so. Other tokenizer models
(sentencepiece "llama", "t5", ...) are refused by name. The ids are checked against
transformers' tokenizer loaded from the same file (`gguf_file=`) in the tests.
"""

from __future__ import annotations

from typing import Any

from einpage.models.errors import CheckpointError, UnsupportedConfigError

__all__ = ["tokenizer_from_gguf", "SPLITS", "MODELS"]

MODELS = ("gpt2",)
"""The `tokenizer.ggml.model` values einpage builds."""

_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPLITS = {
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
}
"""`tokenizer.ggml.pre` -> the pattern text is split by before BPE (llama.cpp's)."""

CONTROL = 3
"""llama.cpp's token type of a control (special) token."""


def _field(reader: Any, key: str, default: Any = None) -> Any:
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def tokenizer_from_gguf(reader: Any, where: str) -> Any:
    """The `tokenizers.Tokenizer` of the GGUF opened as `reader` (a `gguf.GGUFReader`);
    `where` names the file in errors."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise CheckpointError(f"{where} has no tokenizer (no tokenizer.ggml.model)")
    if kind not in MODELS:
        raise UnsupportedConfigError(
            f"{where} has tokenizer model {kind!r}; einpage builds {', '.join(MODELS)} "
            "(byte-level BPE) from a GGUF file"
        )
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens", [])]
    merges = [tuple(str(m).split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    if not tokens:
        raise CheckpointError(f"{where}: tokenizer.ggml.tokens is empty")
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    split = SPLITS.get(_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    types = list(_field(reader, "tokenizer.ggml.token_type", []) or [])
    control = [t for t, kind in zip(tokens, types, strict=False) if int(kind) == CONTROL]
    if control:
        tokenizer.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t in control]
        )
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None and bool(_field(reader, "tokenizer.ggml.add_bos_token", False)):
        first = tokens[int(bos)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{first} $A", pair=f"{first} $A $B", special_tokens=[(first, int(bos))]
        )
    return tokenizer
