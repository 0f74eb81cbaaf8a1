"""benchmarks/llama_plans.py runs end to end in its quick mode (so the script cannot rot),
and its LLaMA-7B plans respect the lower bounds it prints beside them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "llama_plans.py"


def test_llama_plans_quick(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("llama_plans", BENCH)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "llama_plans", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    out = tmp_path / "plans.json"
    result = bench.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    cells = result["cells"]
    assert len(cells) == 4 and {c["model"] for c in cells} == {"7b"}
    feasible = [c for c in cells if c["plan"] is not None]
    infeasible = [c for c in cells if c["plan"] is None]
    assert feasible and infeasible  # 8x1024 does not fit in 1 GiB without partitioning
    for cell in infeasible:
        assert "needs partitioning" in cell["plan_infeasible"]
    for cell in feasible:
        plan, bound = cell["plan"], cell["bound"]
        assert plan["peak_bytes"] <= cell["budget"]
        assert plan["reload_bytes"] >= bound["reload_bytes"]
        assert plan["offload_bytes"] >= bound["offload_bytes"]
        assert plan["makespan_s"] >= bound["makespan_s"] * (1 - 1e-9)
        if cell["stream"] is not None:
            assert cell["stream"]["makespan_s"] >= bound["makespan_s"] * (1 - 1e-9)
    assert "no plan (min > budget)" in capsys.readouterr().out
