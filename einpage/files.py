"""Plan, graph and array files (`save_plan`, `load_plan`): the public path of `einpage.cli.files`.

The code lives there; this module is kept so user code and notebooks stay stable and
defines nothing of its own.
"""

from einpage.cli.files import *  # noqa: F403
from einpage.cli.files import __all__  # noqa: F401
