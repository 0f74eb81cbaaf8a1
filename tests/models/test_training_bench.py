"""benchmarks/training.py runs end to end in its quick mode (so the script cannot rot), and
what it reports holds together: plans within their budgets, reductions against the
resident step's peak, slowdowns against its compute time."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "training.py"


def test_training_bench_quick(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("training_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "training_bench", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    out = tmp_path / "training.json"
    result = bench.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    cells = result["cells"]
    assert {c["model"] for c in cells} == {"gpt2-tiny", "llama-tiny"}
    for cell in cells:
        # keeping states on the host until their update needs less than keeping them
        assert cell["host_peak"] < cell["resident_peak"]
        plans = [cell["spare"], cell["host"], cell["best"], *cell["fractions"].values()]
        for plan in filter(None, plans):
            assert plan["peak_bytes"] <= plan["budget"]
            assert plan["makespan_s"] >= cell["compute_s"] * (1 - 1e-9)
            assert abs(plan["makespan_s"] / cell["compute_s"] - 1 - plan["slowdown"]) < 1e-9
            # every plan moves the states in and their new values out at least once
            assert plan["reload_bytes"] >= cell["state_bytes"]
            assert plan["offload_bytes"] >= cell["state_bytes"] + cell["weight_bytes"]
    text = capsys.readouterr().out
    assert "anchor: PyTorch Inductor" in text and "llama-tiny" in text
