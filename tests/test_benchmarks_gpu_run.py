"""benchmarks/gpu_run.py stays runnable without a GPU: its dry run measures the same
rows on the NumPy backend – prefill in float16 and bfloat16 at every budget, and a
generation both ways – and without --dry-run it refuses cleanly where no GPU is."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import runtime

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_run.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_run", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_measures_every_budget_dtype_and_way(bench, tmp_path, capsys):
    out = tmp_path / "gpu.json"
    argv = ["--dry-run", "--repeats", "1", "--batch", "1", "--seq", "16", "--json", str(out)]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] is True
    rows = data["rows"]
    assert [(r["dtype"], r["fraction"]) for r in rows] == [
        (dtype, fraction) for dtype in bench.DTYPES for fraction in bench.FRACTIONS
    ]
    assert "bfloat16" in bench.DTYPES
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["predicted_seconds"] > 0
        assert row["device_peak_bytes"] >= row["budget_bytes"]
        assert row["pinned_bytes"] <= row["promised_pinned_bytes"]
    float16 = [r for r in rows if r["dtype"] == "float16"]
    assert float16[0]["moved_bytes"] >= float16[-1]["moved_bytes"]
    generation = data["generation"]
    assert [r["way"] for r in generation] == ["unrolled", "steps"]
    for row in generation:
        assert row["ids_equal"] is True and row["tokens_per_s"] > 0
        assert row["device_peak_bytes"] <= row["budget_bytes"]
        assert row["arena_allocated_bytes"] <= row["budget_bytes"]
        assert row["pinned_bytes"] <= row["promised_pinned_bytes"]
    assert generation[1]["plans"] >= 3  # a prefill and decode plans, in one session
    printed = capsys.readouterr().out
    assert "dry run: not GPU timings" in printed and "LLaMA generation" in printed


@pytest.mark.skipif(runtime.cupy_usable(), reason="a GPU is usable here")
def test_without_a_gpu_it_asks_for_the_dry_run(bench, capsys):
    assert bench.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err
