"""The `einpage` command line (the demo is also CI's smoke test of the whole stack)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from einpage.cli import main


def test_demo_runs_and_checks_against_numpy(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "TaskGraph 'mlp'" in out
    assert 'einsum["ab,a,a->ab", join="exp(a - b) / c"]' in out
    assert "(OK)" in out


def test_console_script_is_installed():
    exe = shutil.which("einpage") or str(
        __import__("pathlib").Path(sys.executable).parent / "einpage"
    )
    result = subprocess.run([exe, "demo"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "max |einpage - numpy|" in result.stdout


def test_unknown_command_exits_with_usage_error():
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
