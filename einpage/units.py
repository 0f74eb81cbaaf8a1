"""Byte sizes for humans, as users import them: `from einpage.units import parse_bytes`.

The functions live in the leaf package `einpage_core.units`; these are the same objects.
"""

from einpage_core.units import *  # noqa: F403
from einpage_core.units import __all__  # noqa: F401
