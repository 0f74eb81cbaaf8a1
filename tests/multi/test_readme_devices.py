"""The README's "Several devices" example runs as written (a script in a scratch folder):
its outputs equal the reference evaluator's and the plan file it saves loads and verifies."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from memgraph.multi import verify_multi
from memgraph.multi_serialize import read_multi_json

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_several_devices_example_runs_and_equals_the_reference(tmp_path):
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Several devices") :]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(source, encoding="utf-8")
    root = str(README.parent)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"},
    )
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
