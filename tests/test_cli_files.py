"""Nothing half-written: every output path is checked before any work, files appear
whole or not at all, one failed picture does not stop the others, and a reader that
closes stdout early (`| head`) neither loses the files nor gets a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from einpage.cli import EXIT_BAD_INPUT, EXIT_STDOUT_CLOSED, main
from einpage.files import atomic_output, check_output
from einpage_core.errors import InputError

SMALL_MLP = ["mlp", "--batch", "256"]


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "option, name, needle",
    [
        ("-o", "missing/p.json", "does not exist"),
        ("-o", "plan.txt", "unknown format 'txt'"),
        ("--memory-map", "map.dot", "plot is written as"),
        ("--render", "plan.jpeg", "graph picture is written as"),
        ("--memory-snapshot", "snap.json", "snapshot is written as"),
    ],
)
def test_bad_output_paths_are_refused_before_any_work(capsys, tmp_path, option, name, needle):
    code, out, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "50%", option, tmp_path / name)
    assert code == EXIT_BAD_INPUT and needle in err and option in err
    assert out == ""  # nothing was planned or printed
    assert list(tmp_path.iterdir()) == []


def test_a_failing_picture_leaves_the_others_and_says_which(capsys, tmp_path, monkeypatch):
    import memgraph.graph

    def broken(self, path=None, **options):
        Path(path).write_text("partial")  # a writer dying halfway
        raise InputError("the memory map broke")

    monkeypatch.setattr(memgraph.graph.MemGraph, "memory_map", broken)
    plan, picture, timeline = tmp_path / "p.json", tmp_path / "map.png", tmp_path / "t.png"
    code, out, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "50%", "-o", plan,
                         "--memory-map", picture, "--timeline", timeline)  # fmt: skip
    assert code == EXIT_BAD_INPUT
    assert "--memory-map" in err and "the memory map broke" in err
    assert plan.exists() and timeline.exists() and not picture.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "t.png"]  # no temp left


def test_atomic_output_replaces_whole_or_not_at_all(tmp_path):
    target = tmp_path / "a.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_output(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("died")
    assert target.read_text() == "old" and sorted(tmp_path.iterdir()) == [target]
    with atomic_output(target) as temporary:
        temporary.write_text("new")
    assert target.read_text() == "new" and sorted(tmp_path.iterdir()) == [target]
    assert check_output(target, "json", "-o") == target
    (tmp_path / "d.json").mkdir()
    with pytest.raises(InputError, match="is a folder"):
        check_output(tmp_path / "d.json", "json", "-o")


@pytest.mark.skipif(os.name != "posix", reason="pipes as on Unix")
def test_a_closed_stdout_still_writes_the_plan_quietly(tmp_path):
    plan = tmp_path / "p.json"
    code = (
        "import sys; from einpage.cli import main; "
        f"sys.exit(main(['plan', 'mlp', '--batch', '256', '--budget', '50%', '-o', {str(plan)!r}]))"
    )
    producer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)  # fmt: skip
    producer.stdout.close()  # the reader goes away before the first line is printed
    err = producer.stderr.read().decode()
    assert producer.wait(timeout=120) == EXIT_STDOUT_CLOSED
    assert plan.exists() and plan.read_text().startswith("{")
    assert "Traceback" not in err and "Broken pipe" not in err and "BrokenPipe" not in err
