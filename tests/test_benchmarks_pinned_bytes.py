"""benchmarks/pinned_bytes.py (the README's before/after pinned memory of a step-plan
generation) stays runnable: on the tiny preset, its figures add up as it says."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "pinned_bytes.py"


def test_the_tiny_preset_adds_up(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("pinned_bytes", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "pinned.json"
    argv = ["--preset", "tiny", "--prompt", "8", "--new-tokens", "70", "--budget", "60%"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    each = result["before_per_session"]
    assert len(each) >= 3 and result["before_total"] == sum(each.values())
    assert result["after_promise"] == result["after_allocated"] + result["after_in_place"]
    assert result["after_in_place"] == 0  # the tiny weights are under 1 MiB: copied
    assert result["after_promise"] < result["before_total"]
    assert "after: one session" in capsys.readouterr().out
