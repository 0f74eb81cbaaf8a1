"""The error hierarchy, as users import it: `from einpage.errors import SpecError`.

The classes of the lower layers live in the leaf package `einpage_core` (so taskgraph,
memgraph and runtime raise them without importing the frontend); these are the same
objects. Below them, the frontend's own errors (models, checkpoints, generation), here
in the frontend's leaf module so that every room of the package may raise them
(`einpage.models.errors` names them too).
"""

from einpage_core.errors import *  # noqa: F403
from einpage_core.errors import EinpageError, InfeasibleBudgetError, UnsupportedError
from einpage_core.errors import __all__ as _CORE

__all__ = [
    *_CORE,
    "ModelError",
    "ConfigError",
    "UnsupportedConfigError",
    "ConfigMismatchError",
    "WeightError",
    "CheckpointError",
    "GenerationError",
    "GenerationBudgetError",
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


class GenerationError(ModelError):
    """Bad arguments of a generation: `new_tokens` <= 0, a prompt longer than the model's
    positions, a token id outside the vocabulary, a page size that is not positive, a
    sampling setting out of range (the message names the value and what is valid)."""


class GenerationBudgetError(InfeasibleBudgetError):
    """The budget is below what a generation plan needs. Besides `budget` and `needed`
    (bytes) and `task` (a task id of the planned program, or None), `step` names the part
    of the generation that needs it: "prefill" or "step {t}" (decode step t, 1-based
    after the prefill's token), and `plan` the plan ("unrolled", "prefill", or
    "decode (pages P)"). Its message is two lines: where (the plan, the step, the task),
    then the planner's own message, whole."""

    def __init__(
        self,
        message: str,
        budget: int,
        needed: int,
        task: int | None,
        step: str,
        plan: str,
    ):
        super().__init__(message, budget, needed, task)
        self.step = step
        self.plan = plan
