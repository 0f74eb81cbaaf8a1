"""Optional dependencies, imported on first use, with an error that names the extra to install.

einpage's core needs only NumPy, opt_einsum and tqdm. Plots of plans need the `viz`
extra (matplotlib); graph pictures need Graphviz's `dot` program, which pip cannot
install (`einpage_core.dot` says how when it is missing). A module that draws imports
its optional package where it is used, through `require`, so `import memgraph` works
without it and a missing one says how to install it:

>>> require("no_such_package_xyz", extra="viz")
Traceback (most recent call last):
...
einpage_core.errors.MissingDependencyError: no_such_package_xyz is not installed (needed \
for pictures); install it with `pip install 'einpage[viz]'`
"""

from __future__ import annotations

import importlib
from types import ModuleType

from einpage_core.errors import MissingDependencyError

__all__ = ["EXTRAS", "require"]

EXTRAS = {"viz": "pictures", "cluster": "running plans on Ray (runtime.ray_cluster)"}
"""The extras of `setup.cfg` that `require` may name, and what each is for."""


def require(module: str, extra: str) -> ModuleType:
    """Import `module` (e.g. `"matplotlib.figure"`) and return it.

    Raises `MissingDependencyError` (an `ImportError`) naming the top-level package and
    `pip install 'einpage[<extra>]'` when it cannot be imported. `extra` must be one of
    `EXTRAS` (a `ValueError` otherwise: that is a bug in the caller).
    """
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; valid: {', '.join(EXTRAS)}")
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".")[0]
        missing = (err.name or package).split(".")[0]
        what = (
            f"{package} is not installed"
            if missing == package
            else f"{package} cannot be imported: {missing} is missing"
        )
        raise MissingDependencyError(
            f"{what} (needed for {EXTRAS[extra]}); "
            f"install it with `pip install 'einpage[{extra}]'`",
            package=package,
            extra=extra,
        ) from err
