"""benchmarks/generation.py runs end to end in its quick mode (so the script cannot rot),
and its numbers hang together."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "generation.py"


def test_generation_benchmark_quick(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("generation_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "generation_bench", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    out = tmp_path / "generation.json"
    result = bench.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    cells = result["cells"]
    assert len(cells) == 2 and {c["model"] for c in cells} == {"7b"}
    for cell in cells:
        u, h, s = cell["unrolled"], cell["hidden"], cell["steps"]
        assert u is not None and h is not None and s is not None
        tokens = cell["batch"] * cell["new_tokens"]
        for way in (u, h):  # the default unrolled plan and the one with hide_reloads
            assert abs(way["tokens_per_s"] * way["seconds"] - tokens) < 1e-6 * tokens
        # 8 GiB holds part of the 12.6 GiB of weights: every plan streams some each step
        assert u["weight_bytes_per_token"] > 0 and s["weight_bytes_per_token"] > 0
        assert 0 < cell["kv_host_resident_fraction"] < 1
        assert cell["bound_tokens_per_s"] > 0 and cell["stream_tokens_per_s"] > 0
        # FlexGen's searched policy: a policy that fits, and no faster than the bound
        policy = cell["flexgen_policy"]
        shares = (policy["weights_gpu"], policy["cache_gpu"], policy["activations_gpu"])
        assert all(0 <= share <= 1 for share in shares) and min(shares) < 1
        assert policy["gpu_batches"] * policy["gpu_batch_size"] == cell["batch"]
        assert 0 < policy["gpu_peak"] <= cell["budget"]
        assert 0 < cell["flexgen_tokens_per_s"] <= cell["bound_tokens_per_s"] * (1 + 1e-9)
    out = capsys.readouterr().out
    assert "within 10% of the bound" in out and "at least FlexGen's searched policy" in out
    assert "hidden: within 10% of the bound" in out
