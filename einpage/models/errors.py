"""Errors of the model library: bad configs, missing or mis-shaped weights, broken checkpoints.

All derive from `ModelError` (itself an `EinpageError` and a `ValueError`), so a caller
can catch one family, or `EinpageError` for everything einpage raises on purpose. They
are defined in the frontend's leaf module `einpage.errors` (every room raises them).
"""

from einpage.errors import (
    CheckpointError,
    ConfigError,
    ConfigMismatchError,
    GenerationBudgetError,
    GenerationError,
    ModelError,
    UnsupportedConfigError,
    WeightError,
)

__all__ = [
    "ModelError",
    "ConfigError",
    "UnsupportedConfigError",
    "ConfigMismatchError",
    "WeightError",
    "CheckpointError",
    "GenerationError",
    "GenerationBudgetError",
]
