"""The examples in docstrings run, so they cannot go stale."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ["einpage_core", "einpage", "taskgraph", "memgraph", "runtime"]


def modules():
    names = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(module.__path__, prefix=f"{package}."):
            names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", modules())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
