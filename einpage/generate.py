"""`generate(...)`: the public path of `einpage.workloads.generate`.

The code lives there; this module is kept so user code and notebooks stay stable and
defines nothing of its own.
"""

from einpage.workloads.generate import *  # noqa: F403
from einpage.workloads.generate import __all__  # noqa: F401
