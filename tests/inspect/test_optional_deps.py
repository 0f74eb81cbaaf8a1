"""Optional packages: a missing one raises a typed error naming the extra that installs it."""

from __future__ import annotations

import configparser
import doctest
import subprocess
import sys
from pathlib import Path

import pytest
from inspect_fixtures import mlp_plan

import einpage as ep
import einpage_core.optional
from einpage_core.errors import EinpageError, MissingDependencyError
from einpage_core.optional import EXTRAS, require

MATPLOTLIB_MODULES = [
    "matplotlib",
    "matplotlib.figure",
    "matplotlib.lines",
    "matplotlib.patches",
    "matplotlib.collections",
]


@pytest.fixture
def no_matplotlib(monkeypatch):
    """matplotlib as if it were not installed: `None` in `sys.modules` makes every import
    of it raise ImportError, also when an earlier test imported it."""
    for name in MATPLOTLIB_MODULES:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("plot", ["memory_map", "live_bytes_timeline"])
def test_a_plot_without_matplotlib_names_the_viz_extra(no_matplotlib, plot):
    from memgraph import plots

    with pytest.raises(MissingDependencyError) as info:
        getattr(plots, plot)(mlp_plan())
    err = info.value
    assert str(err) == (
        "matplotlib is not installed (needed for pictures); "
        "install it with `pip install 'einpage[viz]'`"
    )
    assert (err.package, err.extra, err.name) == ("matplotlib", "viz", "matplotlib")
    assert isinstance(err, EinpageError) and isinstance(err, ImportError)
    assert ep.MissingDependencyError is MissingDependencyError


def test_stream_timeline_without_matplotlib_names_the_viz_extra(no_matplotlib):
    from memgraph.plots import StreamEvent, stream_timeline

    events = [StreamEvent("compute", 0.0, 1.0, "apply")]
    with pytest.raises(MissingDependencyError, match=r"pip install 'einpage\[viz\]'"):
        stream_timeline(events)


def test_require_returns_the_module_and_names_what_is_missing(tmp_path, monkeypatch):
    assert require("json.decoder", extra="viz") is sys.modules["json.decoder"]
    # A package that is installed but cannot import one of its own dependencies.
    (tmp_path / "half_installed_xyz").mkdir()
    (tmp_path / "half_installed_xyz" / "__init__.py").write_text("import lost_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingDependencyError) as info:
        require("half_installed_xyz", extra="viz")
    assert str(info.value) == (
        "half_installed_xyz cannot be imported: lost_dependency_xyz is missing "
        "(needed for pictures); install it with `pip install 'einpage[viz]'`"
    )
    assert info.value.package == "half_installed_xyz"
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_require_rejects_an_unknown_extra():
    with pytest.raises(ValueError, match="unknown extra 'plots'; valid: viz, cluster"):
        require("json", extra="plots")
    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    declared = set(setup["options.extras_require"])
    assert set(EXTRAS) == {"viz", "cluster"} and set(EXTRAS) <= declared


def test_packages_import_without_matplotlib():
    code = (
        "import sys\n"
        "for name in ('matplotlib', 'graphviz'):\n"
        "    sys.modules[name] = None\n"
        "import einpage, taskgraph, memgraph, runtime, memgraph.plots, memgraph.render\n"
        "import einpage.cli\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_docstring_example_runs():
    assert doctest.testmod(einpage_core.optional, optionflags=doctest.ELLIPSIS).failed == 0
