"""Running a README section's first Python block as written: a script in a scratch folder,
with only the repository on its import path (shared by the README example tests)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def run_section(heading: str, folder: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The first ```python block after `heading` in the README, run in `folder`."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = folder / "example.py"
    script.write_text(source, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PYTHONPATH": str(README.parent), "PATH": "/usr/bin:/bin"},
    )
