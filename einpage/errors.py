"""The error hierarchy, as users import it: `from einpage.errors import SpecError`.

The classes live in the leaf package `einpage_core` (so taskgraph, memgraph and runtime
raise them without importing the frontend); these are the same objects.
"""

from einpage_core.errors import *  # noqa: F403
from einpage_core.errors import __all__  # noqa: F401
