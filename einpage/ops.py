"""The op library: the public path of `einpage.program.ops`.

The code lives there; this module is kept so user code and notebooks stay stable and
defines nothing of its own.
"""

from einpage.program.ops import *  # noqa: F403
from einpage.program.ops import __all__  # noqa: F401
