"""benchmarks/workspaces.py --quick runs end to end: LLaMA tiny's q/k/v GEMMs need no
workspace (the old path's q temporary was its output), and only a gather declares one."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "workspaces.py"


def test_quick_run_counts_gemms_and_workspaces(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("workspaces_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "w.json"
    assert module.main(["--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    prefill = rows[0]
    assert prefill["gemm_tasks"] > 0 and prefill["in_place"] == prefill["gemm_tasks"]
    assert prefill["old_q_temporary"] > 0 and prefill["kinds_with_workspace"] == ["gather"]
    assert "| LLaMA tiny 2x16 prefill |" in capsys.readouterr().out
