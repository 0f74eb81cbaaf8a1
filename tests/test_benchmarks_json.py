"""benchmarks/json_bench.py --quick runs end to end: each plan is written, loaded and
written back byte for byte, by this tree and (`--before HEAD`) by a revision's tree
extracted with git, each timed in a process of its own."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "json_bench.py"


def in_git_checkout() -> bool:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, check=False
        )
    except OSError:
        return False
    return done.returncode == 0


@pytest.mark.skipif(not in_git_checkout(), reason="--before needs a git checkout")
def test_quick_run_measures_this_tree_and_a_revision(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("json_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "json.json"
    assert module.main(["--quick", "--repeat", "1", "--before", "HEAD", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [row["plan"] for row in data["rows"]] == ["mlp @ 4MiB", "llama:tiny @ 30%"]
    for row in data["rows"]:
        assert row["nodes"] > 1000 and row["bytes"] > 100_000
        for tree in ("now", "before"):
            assert row[tree]["same_bytes"] is True
            assert all(row[tree][key] > 0 for key in ("load_s", "save_s", "load_cpu_s"))
    table = capsys.readouterr().out
    assert "| before save s | before load s | same bytes |" in table
    assert "| mlp @ 4MiB | " in table and "| yes |" in table
