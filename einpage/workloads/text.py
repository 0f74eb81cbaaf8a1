"""Text in and out of generation: a checkpoint's `tokenizer.json`, read with `tokenizers`.

The `tokenizers` library (the `text` extra: `pip install 'einpage[text]'`) loads the
`tokenizer.json` that Hugging Face checkpoints carry. `encode` makes one [batch,
prompt_len] array of prompts that encode to the same number of tokens; `encode_padded`
also takes prompts of different lengths, left padded to the longest as one ragged batch
(`einpage.models.generation.pad_prompts`: what `generate` does with them).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from einpage.models.errors import CheckpointError, GenerationError
from einpage.models.generation import check_tokens, pad_prompts
from einpage_core.errors import MissingDependencyError

__all__ = [
    "TOKENIZER_FILE",
    "find_tokenizer",
    "missing_tokenizer",
    "load_tokenizer",
    "encode_rows",
    "encode",
    "encode_padded",
    "padded",
    "decode",
]

TOKENIZER_FILE = "tokenizer.json"
"""The file name of a checkpoint's tokenizer."""


def missing_tokenizer(checkpoint: str | os.PathLike[str] | None, give: str) -> str:
    """Why a text prompt has no tokenizer, and what to `give` (how the caller takes one:
    "--tokenizer FILE", "tokenizer=..."): none given at all, or a checkpoint folder
    without a `tokenizer.json`."""
    if checkpoint is None:
        return (
            f"a text prompt needs a tokenizer: give {give} (a {TOKENIZER_FILE}), or a "
            "checkpoint folder with one"
        )
    path = Path(checkpoint)
    folder = path if path.is_dir() else path.parent
    return (
        f"a text prompt needs a tokenizer, and the checkpoint folder {str(folder)!r} has no "
        f"{TOKENIZER_FILE}: give {give}, or save the model's tokenizer into the folder "
        "(`tokenizer.save_pretrained(DIR)` in transformers writes it)"
    )


def find_tokenizer(checkpoint: str | os.PathLike[str]) -> Path | None:
    """The `tokenizer.json` of a checkpoint folder (or beside a weights file), or None."""
    path = Path(checkpoint)
    folder = path if path.is_dir() else path.parent
    candidate = folder / TOKENIZER_FILE
    return candidate if candidate.is_file() else None


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A `tokenizers.Tokenizer` from a `tokenizer.json` file or a checkpoint folder
    holding one; `CheckpointError` when there is none or it cannot be read."""
    try:
        import tokenizers
    except ImportError as err:
        raise MissingDependencyError(
            "tokenizers is not installed (needed for text in and out of generation); "
            "install it with `pip install 'einpage[text]'`",
            package="tokenizers",
            extra="text",
        ) from err
    file = Path(path)
    if file.is_dir():
        found = find_tokenizer(file)
        if found is None:
            raise CheckpointError(f"no {TOKENIZER_FILE} in {str(file)!r}")
        file = found
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # the library raises its own Exception types
        raise CheckpointError(f"cannot read the tokenizer {str(file)!r}: {err}") from None


def encode_rows(
    tokenizer: Any,
    texts: str | Sequence[str],
    batch: int | None = None,
    add_special_tokens: bool = True,
) -> list[list[int]]:
    """The token ids of each of `texts` (one string per sequence; a single string is
    repeated `batch` times), one list per sequence, of any lengths;
    `add_special_tokens=False` leaves out what the tokenizer adds around a text (a BOS: a
    chat template writes its own). `GenerationError` naming a text that encodes to no
    tokens."""
    if isinstance(texts, str):
        texts = [texts] * (batch or 1)
    texts = list(texts)
    if not texts:
        raise GenerationError("encode: no text given")
    rows = []
    for i, line in enumerate(texts):
        rows.append(list(tokenizer.encode(line, add_special_tokens=add_special_tokens).ids))
        if not rows[-1]:
            raise GenerationError(f"prompt {i} ({line!r}) encodes to no tokens")
    return rows


def encode(
    tokenizer: Any,
    texts: str | Sequence[str],
    batch: int | None = None,
    add_special_tokens: bool = True,
) -> np.ndarray:
    """The token ids of `texts` (as `encode_rows`) as int64 [batch, prompt_len].
    `GenerationError` when they encode to different lengths (`encode_padded` pads them)
    or to no tokens."""
    rows = encode_rows(tokenizer, texts, batch, add_special_tokens)
    lengths = sorted({len(row) for row in rows})
    if len(lengths) > 1:
        raise GenerationError(
            f"encode: the prompts encode to different lengths {lengths}; one [batch, "
            "prompt_len] array has one: encode_padded (or generate) left pads them"
        )
    return np.array(rows, dtype=np.int64)


def encode_padded(
    tokenizer: Any,
    texts: str | Sequence[str],
    vocab_size: int,
    batch: int | None = None,
    add_special_tokens: bool = True,
) -> tuple[np.ndarray, tuple[int, ...] | None]:
    """The token ids of `texts` (as `encode_rows`) as one batch int64 [batch,
    prompt_len] checked against `vocab_size`, and each prompt's length when they differ
    (None when they do not): then left padded to the longest (`pad_prompts`: padding id
    0, which a ragged generation never attends to)."""
    return padded(encode_rows(tokenizer, texts, batch, add_special_tokens), vocab_size)


def padded(rows: Sequence[Any], vocab_size: int) -> tuple[np.ndarray, tuple[int, ...] | None]:
    """Token id rows as one batch int64 [batch, prompt_len] and, when their lengths
    differ, each one's length (left padded to the longest: `pad_prompts`); `lengths`
    None when they are all as long."""
    if len({len(row) for row in rows}) == 1:
        return check_tokens(np.array(rows, dtype=np.int64), vocab_size), None
    return pad_prompts(rows, vocab_size)


def decode(tokenizer: Any, ids: Any) -> list[str]:
    """The text of each row of token ids [batch, n]."""
    return [tokenizer.decode([int(i) for i in row]) for row in np.asarray(ids)]
