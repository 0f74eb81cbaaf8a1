"""Stopping a generation: at an end-of-sequence token or a stop string, per sequence.

A sequence stops at the first new token that is one of `Stopping.eos_ids` (the
checkpoint's `eos_token_id`, from `generation_config.json` or `config.json`, an int or a
list: `checkpoint_stopping`) or whose text completes one of `Stopping.strings`. What it
keeps is its new tokens up to and including that one (as transformers' `generate`
keeps the end-of-sequence token); its later positions are *masked*: its ids there are
`Stopping.pad_id` (the checkpoint's `pad_token_id`, else its first end-of-sequence id,
as transformers pads), its logits NaN, and its text ends where the stop string begins
(the string is not part of the answer). The output is as wide as the longest kept
sequence, like transformers' output.

The two ways of planning stop differently: step plans end their loop once every
sequence has stopped (`StepPlans.run(..., until=...)`: no plan runs after that); an
unrolled plan runs whole (it is one plan) and its tokens after each stop are masked.
Either way the tokens counted – `Stopped.tokens`, the stats' tokens/s (`kept_stats`) –
are the tokens kept, and step plans' simulated time counts only the plans that ran.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from einpage.models.checkpoint import CONFIG_FILE
from einpage.models.errors import CheckpointError, GenerationError
from einpage.models.gguf import is_gguf, opened_gguf
from einpage.workloads.generation import GenerationStats, StepPlans, UnrolledPlan

__all__ = [
    "GENERATION_CONFIG_FILE",
    "Stopping",
    "StopWatch",
    "Stopped",
    "checkpoint_stopping",
    "run_stopping",
    "kept_stats",
]

GENERATION_CONFIG_FILE = "generation_config.json"
"""Where transformers keeps a checkpoint's generation defaults (its eos_token_id first)."""


def _ids(value: Any, what: str) -> tuple[int, ...]:
    """Token ids from an int or a list of ints (>= 0); `GenerationError` naming `what`."""
    values = [value] if isinstance(value, int | np.integer) else value
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
        raise GenerationError(f"{what} must be a token id or a list of them, got {value!r}")
    ids = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
            raise GenerationError(f"{what} must hold token ids (ints >= 0), got {v!r}")
        ids.append(int(v))
    return tuple(ids)


@dataclass(frozen=True)
class Stopping:
    """When sequences stop (module docstring): at a token of `eos_ids`, or at the token
    whose text completes one of `strings` (those need a tokenizer); after it, their ids
    are `pad_id`. Checked when made (`GenerationError` naming the field and value).

    >>> Stopping(eos_ids=2, strings=["\\n\\n"]).eos_ids
    (2,)
    """

    eos_ids: Any = ()
    strings: Any = ()
    pad_id: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_ids", _ids(self.eos_ids, "Stopping: eos_ids"))
        strings = (self.strings,) if isinstance(self.strings, str) else self.strings
        if not isinstance(strings, Sequence) or not all(
            isinstance(s, str) and s for s in strings
        ):
            raise GenerationError(
                f"Stopping: strings must be non-empty strings, got {self.strings!r}"
            )
        object.__setattr__(self, "strings", tuple(strings))
        if self.pad_id is not None:
            (pad,) = _ids(self.pad_id, "Stopping: pad_id")
            object.__setattr__(self, "pad_id", pad)

    @property
    def active(self) -> bool:
        """Whether anything can stop a sequence."""
        return bool(self.eos_ids or self.strings)

    @property
    def pad(self) -> int:
        """The id of masked positions: `pad_id`, else the first end-of-sequence id, else 0."""
        if self.pad_id is not None:
            return self.pad_id
        return self.eos_ids[0] if self.eos_ids else 0


def _config_ids(folder: Path, name: str) -> tuple[tuple[int, ...] | None, int | None]:
    """(eos ids, pad id) of one of a checkpoint's JSON files (None where it names none)."""
    file = folder / name
    if not file.is_file():
        return None, None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {str(file)!r}: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{str(file)!r}: expected a JSON object, got {type(data).__name__}")
    eos, pad = data.get("eos_token_id"), data.get("pad_token_id")
    try:
        eos_ids = None if eos is None else _ids(eos, "eos_token_id")
        (pad_id,) = (None,) if pad is None else _ids(pad, "pad_token_id")
    except GenerationError as err:
        raise CheckpointError(f"{str(file)!r}: {err}") from None
    return eos_ids, pad_id


def checkpoint_stopping(
    checkpoint: str | os.PathLike[str] | None, eos: Any = None, strings: Any = ()
) -> Stopping:
    """How a generation stops: `eos` – None for the checkpoint's own end-of-sequence ids
    (`generation_config.json`'s `eos_token_id`, else `config.json`'s; none without a
    checkpoint), `()` for none, or ids –, the stop `strings`, and the checkpoint's
    `pad_token_id` for masked positions (the same files); a GGUF file's own eos and pad
    ids (`tokenizer.ggml.eos_token_id`, `padding_token_id`)."""
    pad = None
    if checkpoint is not None and is_gguf(checkpoint):
        opened = opened_gguf(checkpoint)
        own, pad = opened.eos_ids(), opened.pad_id()
    elif checkpoint is not None:
        path = Path(checkpoint)
        folder = path if path.is_dir() else path.parent
        found = [_config_ids(folder, n) for n in (GENERATION_CONFIG_FILE, CONFIG_FILE)]
        own = next((ids for ids, _ in found if ids is not None), ())
        pad = next((p for _, p in found if p is not None), None)
    else:
        own = ()
    return Stopping(own if eos is None else eos, strings, pad)


class StopWatch:
    """Which sequences have stopped, and where, as new ids come in (`update`): `kept[b]`
    is the new tokens sequence b keeps (-1 while it runs), `cut[b]` its new text's
    length up to a stop string (None when none stopped it). `prompts` are each
    sequence's prompt ids without padding (a ragged batch's left padding is not text):
    only new ids are looked at, never the prompt's."""

    def __init__(self, stopping: Stopping, prompts: Sequence[np.ndarray], tokenizer: Any = None):
        if stopping.strings and tokenizer is None:
            raise GenerationError(
                f"stop strings {list(stopping.strings)!r} need a tokenizer to read the text: "
                "give a text prompt with a tokenizer, or stop at token ids (eos)"
            )
        self.stopping = stopping
        self.prompts = [np.asarray(p) for p in prompts]
        self.tokenizer = tokenizer
        self.kept = np.full(len(self.prompts), -1, np.int64)
        self.cut: list[int | None] = [None] * len(self.prompts)
        self.seen = 0

    def update(self, new_ids: np.ndarray) -> bool:
        """Look at the new ids [batch, n] not looked at yet; True when every sequence has
        stopped."""
        new_ids = np.asarray(new_ids)
        eos = set(self.stopping.eos_ids)
        for t in range(self.seen, new_ids.shape[1]):
            for b in np.flatnonzero(self.kept < 0):
                if int(new_ids[b, t]) in eos:
                    self.kept[b] = t + 1
                elif self.stopping.strings:
                    at = self._string_at(self.prompts[b], new_ids[b, : t + 1])
                    if at is not None:
                        self.kept[b], self.cut[b] = t + 1, at
        self.seen = new_ids.shape[1]
        return bool(np.all(self.kept >= 0))

    def _string_at(self, prompt: np.ndarray, new: np.ndarray) -> int | None:
        """Where the first stop string begins in the new text, or None."""
        _, new_text = split_text(self.tokenizer, prompt, new)
        found = [i for i in (new_text.find(s) for s in self.stopping.strings) if i >= 0]
        return min(found) if found else None

    def lengths(self, made: int) -> np.ndarray:
        """New tokens kept per sequence, of `made` made: where it stopped, else all."""
        return np.where(self.kept >= 0, self.kept, made)


def split_text(tokenizer: Any, prompt: np.ndarray, new: np.ndarray) -> tuple[str, str]:
    """(the prompt's text, the new tokens' text): the whole decoded at once, cut after the
    prompt's text when that is its start (decoding the new tokens alone may lose a
    leading space), else the two parts decoded apart."""
    prompt_text = tokenizer.decode([int(i) for i in prompt])
    whole = tokenizer.decode([int(i) for i in np.concatenate([prompt, new])])
    if whole.startswith(prompt_text):
        return prompt_text, whole[len(prompt_text) :]
    return prompt_text, tokenizer.decode([int(i) for i in new])


@dataclass(frozen=True)
class Stopped:
    """A run with its stops applied: `new_ids` [batch, n] (n: the longest kept; masked
    positions are the pad id), `new_lengths` [batch] (new tokens each keeps), each step's
    `logits` [batch, n, vocab] when asked for (NaN where masked), the run `reports`,
    `text` (prompt, without padding, and kept text per sequence, cut before a stop string; with a
    tokenizer), and `made`, the new tokens per sequence the plans computed."""

    new_ids: np.ndarray
    new_lengths: np.ndarray
    made: int
    logits: np.ndarray | None = None
    reports: tuple[Any, ...] = field(default=(), repr=False)
    text: list[str] | None = None

    @property
    def tokens(self) -> int:
        """Tokens kept, in all sequences (what tokens/s counts)."""
        return int(self.new_lengths.sum())


def run_stopping(
    plan: UnrolledPlan | StepPlans,
    weights: Any,
    prompt: np.ndarray,
    stopping: Stopping,
    tokenizer: Any = None,
    backend: Any = "numpy",
    mode: str | None = None,
    direct_io: bool = False,
) -> Stopped:
    """Run `plan` on `prompt` [batch, prompt_len] with `stopping` applied (module
    docstring): step plans end once every sequence has stopped; an unrolled plan runs
    whole, then its tokens after each stop are masked. In a ragged batch (the plan's
    `spec.pads`) each sequence's left padding is left out of its text and its stop
    strings' search. `direct_io`: an unrolled plan with a host tier moves its disk bytes
    with O_DIRECT (`UnrolledPlan.run`)."""
    prompt = np.asarray(prompt)
    pads = plan.spec.pads or (0,) * prompt.shape[0]
    prompts = [row[pad:] for row, pad in zip(prompt, pads, strict=True)]
    watch = StopWatch(stopping, prompts, tokenizer)
    if isinstance(plan, StepPlans) and stopping.active:
        out = plan.run(weights, prompt, backend=backend, mode=mode, until=watch.update)
    elif direct_io:  # only a plan with a host tier, unrolled, has disk files
        out = plan.run(weights, prompt, backend=backend, mode=mode, direct_io=True)
    else:
        out = plan.run(weights, prompt, backend=backend, mode=mode)
    made = out.ids.shape[1]
    watch.update(out.ids)
    lengths = watch.lengths(made)
    width = int(lengths.max())
    new_ids = out.ids[:, :width].copy()
    logits = None if out.logits is None else out.logits[:, :width].copy()
    for b, kept in enumerate(lengths):
        new_ids[b, kept:] = stopping.pad
        if logits is not None:
            logits[b, kept:] = np.nan
    texts = None
    if tokenizer is not None:
        texts = []
        for b, kept in enumerate(lengths):
            if watch.cut[b] is None:
                whole = np.concatenate([prompts[b], out.ids[b, :kept]])
                texts.append(tokenizer.decode([int(i) for i in whole]))
            else:
                prompt_text, new_text = split_text(tokenizer, prompts[b], out.ids[b, :kept])
                texts.append(prompt_text + new_text[: watch.cut[b]])
    return Stopped(new_ids, lengths, made, logits, out.reports, texts)


def kept_stats(
    plan: UnrolledPlan | StepPlans, stats: GenerationStats, stopped: Stopped
) -> GenerationStats:
    """`stats` of the run that made `stopped`: the tokens kept (so tokens/s counts those);
    for step plans that ended early, the simulated time and transfers of the plans that
    ran (the prefill and the chunks up to the last token made)."""
    if isinstance(plan, StepPlans) and stopped.made < plan.spec.new_tokens:
        ran = [c for c in plan.chunks if c.first < stopped.made]
        stats = plan.serving(ran).stats(stats.cost_model)
    return replace(stats, tokens=stopped.tokens)
