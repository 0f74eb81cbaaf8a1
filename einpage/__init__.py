"""einpage: compile einsum tensor programs into memory plans for GPUs smaller than the program.

The user-facing API: `Program` to write programs, the op library (`einpage.program.ops`,
re-exported here), `compile` (the pipeline: partition when needed, plan, verify; see
`einpage.pipeline`), `compile_devices` (the same for several devices), and the error
hierarchy under `EinpageError`.
"""

from einpage import errors, units
from einpage.errors import *  # noqa: F403
from einpage.pipeline import (
    Compiled,
    CompiledDevices,
    PartitionInfeasibleError,
    TooManyBlocksError,
    compile,
    compile_devices,
)
from einpage.program import Program, Tensor, ops
from einpage.program.ops import *  # noqa: F403
from einpage.units import format_bytes, parse_bytes
from einpage.version import __version__  # noqa: F401

__all__ = [
    "Program",
    "Tensor",
    "compile",
    "Compiled",
    "compile_devices",
    "CompiledDevices",
    "PartitionInfeasibleError",
    "TooManyBlocksError",
    "ops",
    "errors",
    "units",
    "format_bytes",
    "parse_bytes",
    *errors.__all__,
    *ops.__all__,
]
