"""Training steps: the public path of `einpage.workloads.training`.

The code lives there; this module is kept so user code and notebooks stay stable and
defines nothing of its own.
"""

from einpage.workloads.training import *  # noqa: F403
from einpage.workloads.training import __all__  # noqa: F401
