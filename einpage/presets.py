"""The programs a command line names: the public path of `einpage.cli.presets`.

The code lives there; this module is kept so user code and notebooks stay stable and
defines nothing of its own.
"""

from einpage.cli.presets import *  # noqa: F403
from einpage.cli.presets import __all__  # noqa: F401
