"""Pieces the LLaMA and GPT-2 programs share: causal attention, argument checks, HF configs.

Attention is written with explicit indices – batch `b`, head `h` (or kv-head `g` and
group `r` for grouped-query attention), query position `q`, key position `k`, head
feature `e` – so a partitioning pass can split it by batch, head and query block. The
key index `k` is reduced only by the softmax's max and sum and by the product with V,
never split by the layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from einpage import ops
from einpage.models.errors import ConfigError, ConfigMismatchError
from einpage.program import Program, Tensor
from einpage_core.errors import ProgramError
from taskgraph import dtypes

__all__ = [
    "LOGITS",
    "causal_attention",
    "last_position",
    "check_prefill_args",
    "hf_getter",
    "check_positive_int",
    "check_positive_float",
    "check_same_config",
    "scaled",
    "weight_input",
]

LOGITS = ("all", "last")
"""What `prefill_program(..., logits=...)` may return: every position's logits, or the last's."""


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """`softmax(q kᵀ + causal mask) v` per batch and head; `q` is already scaled by
    1/sqrt(head_dim).

    Multi-head: q, k, v are [b, h, s, e]; the specs are `bhqe,bhke->bhqk` and
    `bhqk,bhke->bhqe`. Grouped-query: q is [b, g, r, s, e] (kv-head g, group member r)
    and k, v are [b, g, s, e]; the specs are `bgrqe,bgke->bgrqk` and `bgrqk,bgke->bgrqe`,
    so K and V are shared by the r query heads of a group without being repeated.
    Returns the attention output with q's shape.
    """
    prog = q.program
    if q.ndim == 5:
        qh, kh = "bgr", "bg"
    elif q.ndim == 4:
        qh, kh = "bh", "bh"
    else:
        raise ProgramError(f"causal_attention: q must have rank 4 or 5, got shape {q.shape}")
    scores = prog.einsum(f"{qh}qe,{kh}ke->{qh}qk", q, k, label="scores")
    probs = ops.softmax(ops.causal_mask(scores), axis=-1)
    return prog.einsum(f"{qh}qk,{kh}ke->{qh}qe", probs, v, label="attn")


def last_position(x: Tensor) -> Tensor:
    """The hidden states of the last position: [b, s, d] -> [b, d] (a slice, then a view)."""
    prog = x.program
    batch, seq, width = x.shape
    if seq > 1:
        x = prog.slice(x, (0, seq - 1, 0), (batch, 1, width), label="last")
    return prog.view(x, (batch, width))


def check_prefill_args(batch: Any, seq: Any, dtype: Any, logits: Any) -> str:
    """Validate `prefill_program` arguments; returns the canonical dtype name."""
    for what, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ProgramError(f"prefill_program: {what} must be a positive int, got {value!r}")
    name = dtypes.canonical(dtype)
    if not dtypes.is_float(name):
        raise ProgramError(f"prefill_program: dtype must be a float type, got {name}")
    if logits not in LOGITS:
        raise ProgramError(f"prefill_program: logits must be one of {LOGITS}, got {logits!r}")
    return name


def hf_getter(config: Any) -> Callable[[str, Any], Any]:
    """`get(name, default)` over a transformers config object or a `config.json` dict."""
    if isinstance(config, Mapping):
        return lambda name, default: config.get(name, default)
    return lambda name, default: getattr(config, name, default)


def check_positive_int(owner: str, field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{owner}: {field} must be a positive int, got {value!r}")


def check_positive_float(owner: str, field: str, value: Any) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{owner}: {field} must be a positive finite number, got {value!r}")


def scaled(join: str, factor: float) -> str:
    """`join` multiplied by `factor` (left alone when the factor is 1)."""
    return join if factor == 1.0 else f"({join}) * {float(factor)!r}"


def weight_input(
    prog: Program, shapes: Mapping[str, tuple[int, ...]], dtype: str
) -> Callable[[str], Tensor]:
    """A function `weight(name)` declaring the weight input `name` with its shape."""

    def weight(name: str) -> Tensor:
        return prog.input(name, shapes[name], dtype, role="weight")

    return weight


def check_same_config(cfg: Any, on_disk: Any, path: Any) -> None:
    """Raise `ConfigMismatchError` listing every field where `cfg` differs from the config
    read from the checkpoint's `config.json` (`name` is ignored)."""
    diffs = [
        f"{f.name}={getattr(cfg, f.name)!r} (checkpoint: {getattr(on_disk, f.name)!r})"
        for f in fields(cfg)
        if f.compare and getattr(cfg, f.name) != getattr(on_disk, f.name)
    ]
    if diffs:
        raise ConfigMismatchError(
            f"the config does not describe the checkpoint {str(path)!r} (its config.json): "
            + ", ".join(diffs)
        )
