"""The README's "Several devices" example runs as written (a script in a scratch folder):
its outputs equal the reference evaluator's and the plan file it saves loads and verifies."""

from __future__ import annotations

from readme_blocks import run_section

from memgraph.multi import verify_multi
from memgraph.multi_serialize import read_multi_json


def test_the_several_devices_example_runs_and_equals_the_reference(tmp_path):
    result = run_section("## Several devices", tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("<CompiledDevices") and "pipeline on 2 devices" in lines[0]
    assert "makespan" in result.stdout
    assert float(lines[-2]) <= 1e-5  # the largest difference from taskgraph.evaluate
    assert float(lines[-1]) <= 1e-5  # the tensor-parallel plan's
    strategy, links, direct = lines[-3].split()
    assert strategy == "tensor" and int(links) > 0 and int(direct) == int(links)
    saved = read_multi_json((tmp_path / "two.json").read_text(encoding="utf-8"))
    assert saved.plan.devices == 2 and len(saved.plan.links) >= 1
    verify_multi(saved.plan)
