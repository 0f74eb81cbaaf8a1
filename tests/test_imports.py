"""Every top-level package imports on its own, in a fresh interpreter, in any order."""

from __future__ import annotations

import subprocess
import sys

import pytest

PACKAGES = ["einpage", "taskgraph", "memgraph", "runtime"]


@pytest.mark.parametrize("first", PACKAGES)
def test_package_imports_first(first):
    order = [first] + [p for p in PACKAGES if p != first]
    code = "; ".join(f"import {p}" for p in order) + "; import einpage; einpage.Program"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_public_names_of_the_api_sketch():
    import einpage as ep
    import taskgraph

    assert issubclass(ep.SpecError, ep.EinpageError)
    assert callable(taskgraph.evaluate)
    assert ep.Program().build  # noqa: B018
