"""benchmarks/plan_bench.py, section 3: verification time against plan size, and its targets
(on tiny sizes; the full run takes minutes)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("plan_bench_verify", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_bench_verify"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("plan_bench_verify", None)


def test_verify_scaling_rows_and_targets(bench, monkeypatch, capsys):
    monkeypatch.setattr(bench, "VERIFY_SIZES", {"llama": ([64, 96], []), "chain": ([50, 200], [])})
    rows = bench.verify_scaling(quick=True)
    assert [r["family"] for r in rows] == ["llama", "llama", "chain", "chain"]
    for row in rows:
        assert row["nodes"] > 0 and row["plan_seconds"] > 0 and row["verify_seconds"] > 0
        assert row["verify_over_plan"] == row["verify_seconds"] / row["plan_seconds"]
    assert rows[0]["slope"] is None and rows[1]["slope"] is not None
    timing = [{"graph": "chain-500", "seconds": 2.0, "verify_seconds": 1.0}]
    targets = bench.verify_targets(timing, rows)
    json.dumps({"rows": rows, "targets": targets})  # the JSON output
    assert [t["met"] for t in targets][1] is None  # no 500k-node plan in this run
    worst = max([0.5] + [r["verify_over_plan"] for r in rows])
    assert targets[0]["met"] == (worst <= 1.0)
    out = capsys.readouterr().out
    assert "log-log slope of verify seconds against nodes" in out and "verification targets" in out
