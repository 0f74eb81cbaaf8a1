"""The notebooks run: every `notebooks/*.py` (jupytext percent format) is converted to a
notebook and executed, cell by cell, in a fresh kernel of this Python; a cell error,
a cell slower than `CELL_TIMEOUT` or a notebook slower than `NOTEBOOK_TIMEOUT` fails.

The kernel is this interpreter (`sys.executable`), with the repository first on its
path, whatever kernels Jupyter has installed. `make notebooks` runs this file as a
script to write the executed notebooks beside their sources (`notebooks/*.ipynb`,
not committed):

    python tests/test_notebooks.py [--out DIR] [NOTEBOOK.py ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))
KERNEL = "einpage-notebook-test"
CELL_TIMEOUT = 120
NOTEBOOK_TIMEOUT = 300  # seconds; each notebook takes well under a minute on 2 cores


def execute(source: Path, workdir: Path):
    """The notebook of `source` after running it in a fresh kernel (its kernel spec goes
    under `workdir`). The kernel's working directory is the notebook's folder, as in
    Jupyter."""
    import jupytext
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    kernels = workdir / "kernels"
    spec = kernels / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": f"Python ({sys.executable})",
                "language": "python",
                "env": {"PYTHONPATH": path},
            }
        )
    )
    notebook = jupytext.read(source)
    manager = AsyncKernelManager(
        kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)])
    )
    client = NotebookClient(
        notebook,
        km=manager,
        timeout=CELL_TIMEOUT,
        kernel_name=KERNEL,
        allow_errors=False,
        resources={"metadata": {"path": str(source.parent)}},
    )
    client.execute()
    return notebook


def figure_reprs(notebook) -> list[str]:
    """Outputs that show a matplotlib Figure as text instead of a picture."""
    found = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            text = output.get("data", {}).get("text/plain", "")
            pictures = {"image/png", "image/svg+xml"} & set(output.get("data", {}))
            if text.startswith("<Figure size") and not pictures:
                found.append(text)
    return found


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert "01_quickstart.py" in names and "02_budgets.py" in names


@pytest.mark.slow
@pytest.mark.timeout(NOTEBOOK_TIMEOUT)
@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(source, tmp_path):
    notebook = execute(source, tmp_path)
    assert not figure_reprs(notebook), "a figure was shown as text, not drawn"
    pictures = [
        o
        for cell in notebook.cells
        for o in cell.get("outputs", [])
        if {"image/png", "image/svg+xml"} & set(o.get("data", {}))
    ]
    assert pictures, "the notebook drew nothing"


def test_a_failing_cell_fails_and_the_writer_keeps_outputs(tmp_path):
    from nbclient.exceptions import CellExecutionError

    good = tmp_path / "good.py"
    good.write_text("# %% [markdown]\n# A note.\n\n# %%\nprint(6 * 7)\n")
    assert main([str(good), "--out", str(tmp_path / "built")]) == 0
    import nbformat

    built = nbformat.read(tmp_path / "built" / "good.ipynb", as_version=4)
    assert built.cells[1].outputs[0]["text"] == "42\n"

    bad = tmp_path / "bad.py"
    bad.write_text("# %%\nx = 1\n\n# %%\nraise ValueError('broken on purpose')\n")
    with pytest.raises(CellExecutionError, match="broken on purpose"):
        execute(bad, tmp_path)


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description="Execute notebooks/*.py into .ipynb files.")
    parser.add_argument("sources", nargs="*", type=Path, default=NOTEBOOKS)
    parser.add_argument("--out", type=Path, help="folder for the .ipynb files (default: beside)")
    args = parser.parse_args(argv)
    for source in args.sources:
        with tempfile.TemporaryDirectory() as workdir:
            notebook = execute(source.resolve(), Path(workdir))
        target = (args.out or source.parent) / (source.stem + ".ipynb")
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, target)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
