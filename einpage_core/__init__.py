"""einpage_core: the leaf every einpage package may import – errors and byte units.

It imports nothing of the project, so `import taskgraph` (or memgraph, runtime) never
loads the frontend. Users keep importing the errors from `einpage` (`ep.EinpageError`)
or `einpage.errors`; those names are these.
"""

from einpage_core import errors, units

__all__ = ["errors", "units"]
