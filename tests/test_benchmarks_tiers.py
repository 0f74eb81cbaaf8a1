"""benchmarks/tiers.py runs end to end in its quick mode (so the script cannot rot): the
real run's every mode, and the generation from the same weights as a Hugging Face
folder, equals the reference, leaves no spill file and reports its memory;
the simulated rows' numbers hang together (tokens/s from the seconds, no plan faster than
its bound, a tier's plan reading from disk and none without one)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "tiers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tiers_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiers_bench"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["tiers_bench"]


def test_the_quick_real_run_equals_the_reference_in_every_mode(bench, tmp_path, capsys):
    out = tmp_path / "run.json"
    code = bench.main(["run", "--quick", "--folder", str(tmp_path / "work"), "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())["result"]
    assert set(result["runs"]) == set(bench.MODES)
    for run in result["runs"].values():
        assert run["equal"] and run["ids"] == result["reference_ids"]
        assert run["spill_left"] == []
        assert 0 < run["rss_before_run"] <= run["peak_rss"]
    assert result["host_peak"] <= result["host_budget"]
    assert result["disk_read_bytes"] >= result["weight_bytes"]  # every weight read at least once
    hf = result["hugging_face"]  # the same weights as a save_pretrained folder, in place
    assert hf["equal"] and hf["ids"] == result["reference_ids"] and hf["spill_left"] == []
    assert hf["host_peak"] <= hf["host_budget"] and hf["disk_read_bytes"] >= result["weight_bytes"]
    assert "reference ids" in capsys.readouterr().out


def test_the_quick_simulated_rows_hang_together(bench, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert bench.main(["simulate", "--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["result"]
    assert len(rows) == 3
    for row in rows:
        assert row["bound_s"] <= row["seconds"] * (1 + 1e-9)
        assert abs(row["of_bound"] - row["bound_s"] / row["seconds"]) < 1e-12
        assert (row["host"] is None) == (row["disk_read_bytes"] == 0)
    text = capsys.readouterr().out
    assert "| quick b2 |" in text and "DeepNVMe" in text


def test_the_quick_direct_run_equals_the_reference_both_ways(bench, tmp_path, capsys):
    out = tmp_path / "direct.json"
    code = bench.main(["direct", "--quick", "--folder", str(tmp_path / "work"), "--json", str(out)])
    assert code == 0
    runs = json.loads(out.read_text())["result"]["runs"]
    assert {run["direct_io"] for run in runs} == {False, True}
    for run in runs:
        assert run["equal"]
        assert run["direct_io"] or not any(run["files_direct"])  # buffered: no file direct
    assert "O_DIRECT" in capsys.readouterr().out
