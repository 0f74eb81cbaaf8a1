"""The error hierarchy: every error einpage raises on purpose derives from `EinpageError`.

This module is a leaf (it imports nothing of the project), so every package may use it;
`einpage.errors` re-exports it for users.
"""

from __future__ import annotations

__all__ = [
    "EinpageError",
    "ProgramError",
    "SpecError",
    "ShapeError",
    "JoinError",
    "DTypeError",
    "GraphError",
    "SerializationError",
    "InputError",
    "UnsupportedError",
    "PlanError",
    "InfeasibleBudgetError",
    "VerificationError",
    "AllocationError",
    "HostBudgetPlanError",
    "BackendError",
    "DiskError",
    "BackendUnavailableError",
    "RenderError",
    "GraphvizNotFoundError",
    "TraceError",
    "MissingDependencyError",
    "expect_graph",
]


class EinpageError(Exception):
    """Base class of every error einpage raises about its input or its environment."""


class ProgramError(EinpageError, ValueError):
    """A `Program` was used wrongly (unknown tensor, duplicate name, bad argument)."""


class SpecError(ProgramError):
    """An einsum spec is malformed or does not fit its operands."""


class ShapeError(ProgramError):
    """Shapes disagree: an index with two sizes, a non-positive dimension, a bad reshape."""


class JoinError(ProgramError):
    """A join expression cannot be parsed; the message gives the column."""

    def __init__(self, message: str, expression: str = "", column: int | None = None):
        self.expression = expression
        self.column = column
        if expression and column is not None:
            message = f"{message}\n  {expression}\n  {' ' * column}^"
        super().__init__(message)


class DTypeError(ProgramError, TypeError):
    """An unknown dtype, or operands of different dtypes without an explicit cast."""


class UnsupportedError(EinpageError, NotImplementedError):
    """Valid input that einpage deliberately does not handle (the message says what)."""


class GraphError(EinpageError, ValueError):
    """A TaskGraph or MemGraph is malformed (bad ids, cycles, inconsistent shapes)."""


class SerializationError(GraphError):
    """A JSON document is not a valid serialized graph; the message gives the JSON path."""


class InputError(EinpageError, ValueError):
    """Arrays given for a graph's inputs are missing, extra, or of the wrong shape or dtype."""


class PlanError(EinpageError):
    """The planner could not make a plan."""


class InfeasibleBudgetError(PlanError):
    """No plan fits the budget; `needed` is the smallest budget that could work.

    Attributes: `budget` (bytes asked for), `needed` (bytes, a lower bound on any
    feasible budget), `task` (the TaskGraph id of the task that needs it, or None).
    """

    def __init__(self, message: str, budget: int, needed: int, task: int | None = None):
        super().__init__(message)
        self.budget = budget
        self.needed = needed
        self.task = task


class VerificationError(EinpageError):
    """A MemGraph breaks one of its invariants; the message names the node."""

    def __init__(self, message: str, node: int | None = None):
        super().__init__(message)
        self.node = node


class AllocationError(PlanError):
    """The device arena cannot satisfy an allocation request."""


class HostBudgetPlanError(PlanError):
    """A host tier cannot be planned: the host budget cannot hold what must be in host
    memory at once (the message says how much that is), or no spill folder was given
    for what must leave it."""


class BackendError(EinpageError, RuntimeError):
    """A runtime backend failed (e.g. the arena could not be allocated)."""


class DiskError(BackendError):
    """A run's disk files failed: a spill folder that is missing, read-only or too small,
    a checkpoint file that is missing or changed size, or a read or write that failed."""


class BackendUnavailableError(BackendError):
    """The requested backend cannot run here (CuPy missing, no GPU); the message says how to fix."""


class RenderError(EinpageError, RuntimeError):
    """A picture could not be made: an unknown output format, or Graphviz failed."""


class GraphvizNotFoundError(RenderError):
    """Graphviz's `dot` program is not installed; `dot_path` is where the DOT source went."""

    def __init__(self, message: str, dot_path=None):
        super().__init__(message)
        self.dot_path = dot_path


class TraceError(EinpageError, ValueError):
    """A timeline trace (Chrome trace JSON) is malformed; the message says where."""


class MissingDependencyError(EinpageError, ImportError):
    """An optional package is not installed; the message names the einpage extra that
    installs it (`pip install 'einpage[viz]'`). Attributes: `package` (also `name`, as
    on any ImportError) and `extra`."""

    def __init__(self, message: str, package: str, extra: str):
        super().__init__(message, name=package)
        self.package = package
        self.extra = extra


def expect_graph(value: object, kind: type, where: str, hint: str = "") -> None:
    """Raise `GraphError` unless `value` is a `kind` (a TaskGraph or MemGraph): API misuse
    named with what `where` takes, not an AttributeError from inside."""
    if not isinstance(value, kind):
        raise GraphError(
            f"{where} takes a {kind.__module__.split('.')[0]}.{kind.__name__}, got "
            f"{type(value).__name__} {value!r:.60}{hint}"
        )
