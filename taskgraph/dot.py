"""An alias of `einpage_core.dot`, where the drawing helpers both renderers share now live.

They moved to the leaf package so that `memgraph.render` draws without importing
taskgraph's rendering; `from taskgraph.dot import quote` keeps working. Patch
`einpage_core.dot` (not this alias) to change what the renderers call.
"""

from einpage_core.dot import *  # noqa: F403
from einpage_core.dot import __all__  # noqa: F401
