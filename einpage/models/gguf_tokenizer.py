"""The tokenizer a GGUF file describes, as a `tokenizers.Tokenizer`.

A GGUF has no `tokenizer.json`: it keeps the vocabulary (`tokenizer.ggml.tokens`), the
merges (`tokenizer.ggml.merges`), each token's type (3: control, a special token) and
the special ids under llama.cpp's keys. einpage builds two kinds from them:

* byte-level BPE (`tokenizer.ggml.model` "gpt2": GPT-2, Qwen2, Llama 3, SmolLM): the
  merges as they are, text split by the pre-tokenizer the file names
  (`tokenizer.ggml.pre`: Qwen2's and Llama 3's patterns; GPT-2's otherwise);
* sentencepiece BPE ("llama": Llama 2, Mistral, TinyLlama): spaces as "▁", a "▁" put
  before the text unless `tokenizer.ggml.add_space_prefix` is false, characters outside
  the vocabulary as their UTF-8 bytes (`<0xNN>` tokens), and – when the file lists no
  merges, as such files usually do – the merges its scores imply: every split of a
  token into two tokens, best-scored token first;

then control tokens (type 3) kept whole, user-defined ones (type 4) matched whole, and
the BOS token put first when `tokenizer.ggml.add_bos_token` says so (by default for
sentencepiece files, which llama.cpp treats so). Other tokenizer models ("t5", ...) are
refused by name. The ids are checked against transformers' tokenizer loaded from the
same file (`gguf_file=`) in the tests.
"""

from __future__ import annotations

from typing import Any

from einpage.models.errors import CheckpointError, UnsupportedConfigError

__all__ = ["tokenizer_from_gguf", "SPLITS", "MODELS"]

MODELS = ("gpt2", "llama")
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

CONTROL, USER_DEFINED = 3, 4
"""llama.cpp's token types of a control (special) token and of a user-defined one."""


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
    if not tokens:
        raise CheckpointError(f"{where}: tokenizer.ggml.tokens is empty")
    vocab = {token: i for i, token in enumerate(tokens)}
    listed = [tuple(str(m).split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    if kind == "gpt2":
        tokenizer = Tokenizer(models.BPE(vocab, listed, fuse_unk=False))
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
        add_bos = False
    else:
        scores = [float(x) for x in _field(reader, "tokenizer.ggml.scores", [0.0] * len(tokens))]
        merges = listed or implied_merges(vocab, dict(zip(tokens, scores, strict=False)))
        unk = _field(reader, "tokenizer.ggml.unknown_token_id")
        model = models.BPE(
            vocab, merges, unk_token=None if unk is None else tokens[int(unk)],
            fuse_unk=True, byte_fallback=True,
        )  # fmt: skip
        tokenizer = Tokenizer(model)
        prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False
        )
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tokenizer.decoder = decoders.Sequence(
            steps + ([decoders.Strip(content=" ", left=1)] if prefix else [])
        )
        add_bos = True
    types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type", []) or []]
    typed = list(zip(tokens, types, strict=False))
    control = [t for t, token_type in typed if token_type == CONTROL]
    if control:
        tokenizer.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t in control]
        )
    user = [t for t, token_type in typed if token_type == USER_DEFINED]
    if user:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None and bool(_field(reader, "tokenizer.ggml.add_bos_token", add_bos)):
        first = tokens[int(bos)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{first} $A", pair=f"{first} $A $B", special_tokens=[(first, int(bos))]
        )
    return tokenizer


def implied_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies: for every token, each way to cut
    it into two tokens of the vocabulary, ordered by the token's score (best first), then
    the longer left part, then the longer right part; the cuts of one token in the order
    of their parts' ids."""
    found = []
    for token, score in scores.items():
        cuts = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        found += sorted(cuts, key=lambda cut: (vocab[cut[0]], vocab[cut[1]]))
    found.sort(key=lambda cut: (cut[2], len(cut[0]), len(cut[1])), reverse=True)
    return [(left, right) for left, right, _ in found]
