"""The files the CLI reads and writes: plans (JSON), TaskGraphs (JSON), arrays (.npz).

Plans and TaskGraphs are validated on load (`SerializationError` names the JSON path);
arrays go through `numpy`'s .npz format without pickles. Saving and loading a plan
report `einpage_core.progress.Progress` events to a `progress` callback, as
`einpage.compile` does: a 100 MB plan takes seconds each way.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from einpage.cli.presets import read_text
from einpage_core.dot import FORMATS as DOT_FORMATS
from einpage_core.errors import InputError, SerializationError
from einpage_core.progress import ProgressCallback, ProgressReport
from memgraph import MemGraph
from memgraph.multi_serialize import FORMAT as MULTI_FORMAT
from memgraph.multi_serialize import MultiPlanFile, multi_from_dict
from memgraph.plots import PLOT_FORMATS
from memgraph.serialize import FORMAT as PLAN_FORMAT
from memgraph.serialize import memgraph_from_dict, memgraph_from_json, write_memgraph_json
from taskgraph import TaskGraph
from taskgraph.serialize import FORMAT as GRAPH_FORMAT
from taskgraph.serialize import parse_json, taskgraph_from_dict

__all__ = [
    "INPUT_FORMATS",
    "save_plan",
    "load_plan",
    "load_plan_file",
    "load_inputs",
    "run_inputs",
    "save_arrays",
    "load_json_graph",
    "OUTPUT_KINDS",
    "check_output",
    "atomic_output",
]

OUTPUT_KINDS: dict[str, tuple[str, ...]] = {
    "JSON file": (".json",),
    "graph picture": tuple("." + f for f in DOT_FORMATS),
    "plot": tuple("." + f for f in PLOT_FORMATS),
    "file of arrays": (".npz",),
    "snapshot": (".pickle", ".pkl"),
}
"""The suffixes each kind of output the CLI writes accepts."""


def save_plan(
    mg: MemGraph, path: str | os.PathLike[str], progress: ProgressCallback | None = None
) -> None:
    """Write the plan to `path` as JSON, streamed (`memgraph.serialize.write_memgraph_json`:
    the text of `mg.to_json()`, byte for byte, without holding it all in memory),
    reporting `Progress` to `progress` ("writing tasks", "writing nodes", then "done").
    The CLI writes through `atomic_output`, so an error leaves no part of a file."""
    with open(path, "w", encoding="utf-8") as stream:
        write_memgraph_json(mg, stream, progress)


def load_plan(path: str | Path, progress: ProgressCallback | None = None) -> MemGraph:
    """The MemGraph in a plan file, validated (`SerializationError` names the JSON path);
    `progress` gets `Progress` events ("reading", "checking tasks", "checking nodes",
    then "done" at 1.0; `memgraph.serialize.memgraph_from_json`)."""

    text = read_text(path)
    try:
        return memgraph_from_json(text, progress)
    except SerializationError as err:
        raise SerializationError(f"{path}: not a valid plan{_kind_hint(text)}: {err}") from None


def load_plan_file(
    path: str | Path, progress: ProgressCallback | None = None
) -> MemGraph | MultiPlanFile:
    """The plan in a plan file, by its parsed top-level `format`: a MemGraph (one device,
    as `load_plan`) or a `MultiPlanFile` (several devices: `memgraph.multi_serialize`),
    validated (`SerializationError` names the file and the JSON path)."""
    text = read_text(path)
    try:
        data = parse_json(text)
    except SerializationError as err:
        raise SerializationError(f"{path}: not a valid plan{_kind_hint(text)}: {err}") from None
    kind = data.get("format") if isinstance(data, dict) else None
    try:
        if kind == MULTI_FORMAT:
            return multi_from_dict(data)
        return memgraph_from_dict(data, progress)
    except SerializationError as err:
        raise SerializationError(f"{path}: not a valid plan{_kind_hint(text)}: {err}") from None


def _kind_hint(text: str) -> str:
    """What the document is, by its parsed top level (a plan embeds a TaskGraph, so the
    text alone cannot tell): a note for the error, or "" when it is not JSON."""
    try:
        data = parse_json(text)
    except SerializationError:
        return " (the file is not complete JSON: truncated or corrupt)"
    kind = data.get("format") if isinstance(data, dict) else None
    if kind == GRAPH_FORMAT:
        return " (this is a TaskGraph: plan it with `einpage plan` first)"
    if kind in (PLAN_FORMAT, MULTI_FORMAT):
        return ""
    return f" (its top-level format is {kind!r}, not {PLAN_FORMAT!r} or {MULTI_FORMAT!r})"


INPUT_FORMATS = (".npz", ".safetensors")
"""What `--inputs` reads: NumPy's .npz archives (no pickles) and safetensors files."""


def run_inputs(
    path: str | Path | None, seed: int | None, draw: Callable[[int], dict[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], str]:
    """The arrays `einpage run` feeds a plan, and where they came from: those in the file
    `path` (`--inputs`), else `draw(seed)` (`--random-inputs`, seed 0 by default)."""
    if path:
        return load_inputs(path), f"from {path}"
    seed = 0 if seed is None else seed
    return draw(seed), f"random (seed {seed})"


def load_inputs(path: str | Path) -> dict[str, np.ndarray]:
    """Arrays by input name from an .npz archive (`numpy.savez`; pickles refused) or a
    .safetensors file; `InputError` names the file and the formats accepted otherwise."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no such inputs file: {path}")
    accepted = " or ".join(INPUT_FORMATS)
    suffix = path.suffix.lower()
    if suffix not in INPUT_FORMATS:
        raise InputError(
            f"{path}: inputs are read from {accepted} files (named arrays), not "
            f"{suffix or 'a file without a suffix'!r}; for one .npy array, "
            "np.savez('in.npz', NAME=array)"
        )
    try:
        if suffix == ".safetensors":
            from safetensors.numpy import load_file

            return dict(load_file(str(path)))
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise InputError(
                f"{path}: holds one array, not an archive of named arrays; save inputs "
                "with np.savez('in.npz', NAME=array, ...)"
            )
        with data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as err:
        raise InputError(
            f"{path}: cannot read arrays from it ({type(err).__name__}: {err}); expected {accepted}"
        ) from None
    except Exception as err:  # safetensors' own errors (SafetensorError) and the like
        if type(err).__name__ == "SafetensorError":
            raise InputError(f"{path}: not a valid .safetensors file ({err})") from None
        raise


def save_arrays(path: str | Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write arrays by name to an .npz file at exactly `path` (what `load_inputs` reads).

    Unlike `numpy.savez`, any name works (even "file") and no suffix is added.
    """

    with zipfile.ZipFile(path, "w", allowZip64=True) as archive:
        for name, value in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as handle:
                np.lib.format.write_array(handle, np.asanyarray(value), allow_pickle=False)


def load_json_graph(
    path: str | Path, progress: ProgressCallback | None = None
) -> MemGraph | TaskGraph:
    """A plan or a TaskGraph, by the document's `format`; `progress` gets `Progress`
    events as for `load_plan` (a TaskGraph's: "checking tasks", then "done")."""

    text = read_text(path)
    try:
        data = parse_json(text)
    except SerializationError as err:
        raise SerializationError(f"{path}: {err}") from None
    kind = data.get("format") if isinstance(data, dict) else None
    try:
        if kind == PLAN_FORMAT:
            return memgraph_from_dict(data, progress)
        if kind == GRAPH_FORMAT:
            report = ProgressReport(progress, {"checking tasks": 1.0})
            tasks = data.get("tasks")
            tick = report.stage("checking tasks", len(tasks) if isinstance(tasks, list) else 0)
            graph = taskgraph_from_dict(data, tick=tick)
            report.finish()
            return graph
    except SerializationError as err:
        raise SerializationError(f"{path}: {err}") from None
    if kind == MULTI_FORMAT:
        raise SerializationError(
            f"{path}: a plan for several devices ({MULTI_FORMAT!r}); `einpage render "
            f"{path} --device D` draws device D's plan, and `einpage stats {path}` "
            f"describes them all"
        )
    raise SerializationError(
        f"{path}: $.format: expected {PLAN_FORMAT!r} (a plan) or {GRAPH_FORMAT!r} "
        f"(a TaskGraph), got {kind!r}"
    )


# -- writing outputs ---------------------------------------------------------------------


def check_output(path: str | os.PathLike[str], kind: str, option: str) -> Path:
    """`path` as an output of `kind` (see `OUTPUT_KINDS`), checked before any work: it is
    not a folder, its suffix is one that kind accepts, and its folder exists and takes a
    new file (tried: permissions alone miss read-only mounts, and root passes them all).
    `InputError` names the `option` and the problem."""
    path = Path(path)
    where = f"{option} {str(path)!r}"
    if path.is_dir():
        raise InputError(f"{where} is a folder; give a file name")
    suffixes = OUTPUT_KINDS[kind]
    if path.suffix.lower() not in suffixes:
        found = path.suffix.lower().lstrip(".")
        raise InputError(
            f"{where}: unknown format {found!r}; a {kind} is written as {' or '.join(suffixes)}"
        )
    folder = path.parent
    if not folder.is_dir():
        raise InputError(
            f"{where}: No such file or directory (the folder {str(folder)!r} does not exist)"
        )
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{path.stem}.einpage-check-"):
            pass
    except OSError as err:
        raise InputError(
            f"{where}: the folder {str(folder)!r} does not take new files ({err.strerror or err})"
        ) from None
    return path


@contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside `path` (same suffix) to write to; on success it replaces
    `path` at once, on failure it is removed: no partial file is ever left at `path`."""
    path = Path(path)
    temporary = path.with_name(f".{path.stem}.einpage-{os.getpid()}{path.suffix}")
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
