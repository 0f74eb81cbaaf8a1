"""The optimizers (SGD, AdamW) as einsums: the public path of `einpage.program.optim`.

The code lives there; this module is kept so user code and notebooks stay stable and
defines nothing of its own.
"""

from einpage.program.optim import *  # noqa: F403
from einpage.program.optim import __all__  # noqa: F401
