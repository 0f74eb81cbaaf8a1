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


@pytest.mark.parametrize("package", ["taskgraph", "memgraph", "runtime"])
def test_lower_packages_do_not_load_the_frontend(package):
    """Data flows one way: importing a lower package loads no `einpage` module, only the leaf."""
    frontend = "m == 'einpage' or m.startswith('einpage.')"
    code = f"import sys; import {package}; print(*sorted(m for m in sys.modules if {frontend}))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [], f"import {package} loaded {result.stdout.strip()}"


def test_error_names_are_importable_where_users_import_them():
    import einpage as ep
    import einpage.errors
    import einpage.units
    import einpage_core

    for name in einpage_core.errors.__all__:
        assert getattr(ep, name) is getattr(einpage_core.errors, name)
        assert getattr(einpage.errors, name) is getattr(einpage_core.errors, name)
    assert ep.parse_bytes is einpage.units.parse_bytes is einpage_core.units.parse_bytes
    assert einpage.units.BudgetFormatError is einpage_core.units.BudgetFormatError
