"""benchmarks/transfer_schedule.py works end to end on tiny cells (--quick, a few
seconds): every cell planned both ways, verified and simulated."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "transfer_schedule.py"


def test_the_quick_run_measures_every_cell_both_ways(tmp_path):
    spec = importlib.util.spec_from_file_location("transfer_schedule_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["transfer_schedule_bench"] = module
    try:
        spec.loader.exec_module(module)
        out = tmp_path / "schedule.json"
        results = module.main(["--quick", "--json", str(out)])
    finally:
        sys.modules.pop("transfer_schedule_bench", None)
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert set(results) == {"generation", "training", "quality"}
    for rows in results.values():
        ways = {key.rsplit(", ", 1)[-1] for key in rows if key != "cell"}
        assert ways == {"scheduled", "unscheduled", "hidden reloads"}
        for key, row in rows.items():
            if key == "cell":
                continue
            assert row["makespan_s"] >= row["compute_s"] > 0
            assert row["stall_s"] == row["makespan_s"] - row["compute_s"]
            if key.endswith(("unscheduled", "hidden reloads")):
                assert row["prepared_ahead_evicting"] == 0
    for way in ("scheduled", "hidden reloads"):
        assert 0 < results["generation"][way]["of_bound"] <= 1.0 + 1e-9
    assert results["quality"]["unscheduled"]["vs_bound"] >= 1.0
