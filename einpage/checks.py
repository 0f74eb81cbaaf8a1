"""Outputs held to the reference evaluator (`TOLERANCES`): the public path of `einpage.cli.checks`.

The code lives there; this module is kept so user code and notebooks stay stable and
defines nothing of its own.
"""

from einpage.cli.checks import *  # noqa: F403
from einpage.cli.checks import __all__  # noqa: F401
