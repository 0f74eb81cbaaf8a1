"""The README's first Python example runs as written (as a script, in a scratch folder)
and checks something that could fail: random inputs through a plan that moves bytes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
CHECKS = """
assert mg.stats.offload_bytes + mg.stats.reload_bytes > 0, "the plan moves nothing"
assert len({float(v.std()) for v in inputs.values()}) == len(inputs), "constant inputs"
print("README example ran")
"""


def test_the_first_readme_example_runs(tmp_path):
    pytest.importorskip("matplotlib")
    from taskgraph.dot import find_dot

    source = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    if find_dot() is None:
        source = source.replace('mg.render("plan.svg"); ', "")
    script = tmp_path / "example.py"
    script.write_text(source + CHECKS)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "README example ran" in result.stdout and (tmp_path / "map.png").exists()
