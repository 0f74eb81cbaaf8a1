"""Tokenizers: the public path of `einpage.workloads.text`.

The code lives there; this module is kept so user code and notebooks stay stable and
defines nothing of its own.
"""

from einpage.workloads.text import *  # noqa: F403
from einpage.workloads.text import __all__  # noqa: F401
