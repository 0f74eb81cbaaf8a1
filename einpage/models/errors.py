"""Errors of the model library: bad configs, missing or mis-shaped weights, broken checkpoints.

All derive from `ModelError` (itself an `EinpageError` and a `ValueError`), so a caller
can catch one family, or `EinpageError` for everything einpage raises on purpose.
"""

from __future__ import annotations

from einpage_core.errors import EinpageError, UnsupportedError

__all__ = [
    "ModelError",
    "ConfigError",
    "UnsupportedConfigError",
    "ConfigMismatchError",
    "WeightError",
    "CheckpointError",
]


class ModelError(EinpageError, ValueError):
    """Base class of the model library's errors."""


class ConfigError(ModelError):
    """A model config has an invalid value (the message names the field and the value)."""


class UnsupportedConfigError(ConfigError, UnsupportedError):
    """A valid Hugging Face config uses a feature these models do not implement (e.g. RoPE
    scaling or attention biases in LLaMA); the message names the setting."""


class ConfigMismatchError(ConfigError):
    """The config does not describe the checkpoint: wrong layer count, hidden size, heads ..."""


class WeightError(ModelError):
    """A weight is missing from a checkpoint or has the wrong shape.

    Attributes: `name` (the program input), `key` (the checkpoint key), `expected` and
    `got` (shapes; `got` is None when the weight is missing).
    """

    def __init__(
        self,
        message: str,
        name: str,
        key: str,
        expected: tuple[int, ...] | None = None,
        got: tuple[int, ...] | None = None,
    ):
        super().__init__(message)
        self.name = name
        self.key = key
        self.expected = expected
        self.got = got


class CheckpointError(ModelError):
    """A checkpoint on disk cannot be read: no weights file, a malformed index JSON, a
    shard that is missing or escapes the checkpoint directory, an unreadable header."""
