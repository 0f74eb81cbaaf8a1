"""Generation plans: the public path of `einpage.workloads.generation`.

The code lives there; this module is kept so user code and notebooks stay stable and
defines nothing of its own.
"""

from einpage.workloads.generation import *  # noqa: F403
from einpage.workloads.generation import __all__  # noqa: F401
