"""Weight-only int8/int4 quantization: the public path of `einpage.program.quantize`.

The code lives there; this module is kept so user code and notebooks stay stable and
defines nothing of its own.
"""

from einpage.program.quantize import *  # noqa: F403
from einpage.program.quantize import __all__  # noqa: F401
