"""The runtime benchmark runs end to end on a tiny program (so the script cannot rot)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "runtime_bench.py"


def test_runtime_bench_quick(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("runtime_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "runtime_bench", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    result = bench.main(["--quick", "--repeat", "1", "--no-gpu", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    names = [row["name"] for row in result["rows"]]
    assert names[0] == "evaluate (reference)" and len(names) == 1 + 4 * 4 + 2
    assert result["planner"] == "memgraph" and set(result["overhead"]) == {
        "sequential session",
        "threaded session",
    }
    # The small budgets force offloads.
    assert any(row.get("offload_bytes") for row in result["rows"])
    assert all(row["median_s"] > 0 and row["ratio"] > 0 for row in result["rows"])
