"""benchmarks/quantization.py --quick runs end to end: every variant is planned, int8
and int4 weights are fewer bytes than float16 and move fewer bytes, and the errors
are ordered (int4 worse than int8, both small for int8)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "quantization.py"


def test_quick_run_writes_ordered_bytes_and_errors(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("quantization_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "q.json"
    assert module.main(["--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    by = {row["weights"]: row for row in data["cells"]}
    assert set(by) == {"float16", "int8", "int4"}
    assert (
        by["int4"]["weights_bytes"] < by["int8"]["weights_bytes"] < by["float16"]["weights_bytes"]
    )
    assert by["int4"]["reload_bytes"] < by["float16"]["reload_bytes"]
    errors = data["errors"]
    assert errors["int8"]["matrix_rms"] < 0.01 < errors["int4"]["matrix_rms"] < 0.2
    assert errors["int8"]["logits"] < errors["int4"]["logits"]
    assert "| int4 |" in capsys.readouterr().out
