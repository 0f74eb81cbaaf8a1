"""Programs by name, for the command line: presets, TaskGraph JSON files, Python files.

A PROGRAM argument of the `einpage` command is one of

* a preset name: `mlp` (the demo MLP), `llama:7b`, `llama:tiny`, `gpt2:124m`, ...
  (`PRESETS`), shaped by `batch`, `seq` and `dtype`;
* a TaskGraph JSON file (`*.json`, as `TaskGraph.to_json` writes it), validated on load;
* a Python file (`*.py`) that defines `program` (a `Program` or a `TaskGraph`) or a
  function `build()` returning one. **Loading a Python file executes it**, as
  `python FILE` would (its directory first on `sys.path`; `__name__` is
  `"__einpage__"`, so an `if __name__ == "__main__":` block does not run). It is the
  user's own program: never pass a file you would not run. `batch=`, `seq=` and
  `dtype=` are passed to `build()` as keywords when given.

`random_inputs(tg, seed)` makes arrays for every input of any program: normal floats
scaled by the input's width, and integer ids within the rows of the table they index.

>>> tg = load_program("llama:tiny", seq=8)
>>> tg.name, tg[tg.outputs["logits"]].shape
('llama-tiny-prefill-b1-s8', (1, 8, 256))
>>> sorted(random_inputs(tg))[:3]
['embed', 'layers.0.attn.norm', 'layers.0.attn.wk']
"""

from __future__ import annotations

import inspect
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from einpage.program import ops
from einpage.program.program import Program
from einpage_core.errors import EinpageError, InputError, SerializationError
from einpage_core.host import available_memory
from einpage_core.units import format_bytes
from taskgraph import dtypes
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Gather

__all__ = [
    "Preset",
    "PRESETS",
    "ProgramSourceError",
    "load_program",
    "load_python_program",
    "mlp_program",
    "random_inputs",
]


class ProgramSourceError(EinpageError, ValueError):
    """A PROGRAM argument cannot be loaded: an unknown preset, a missing or unreadable
    file, or a Python file that fails or defines no program (the message says which)."""


# -- the demo MLP ----------------------------------------------------------------------


def mlp_program(
    batch: int = 4096,
    width: int = 256,
    hidden: int = 1024,
    layers: int = 4,
    classes: int = 256,
    dtype: str = "float32",
) -> Program:
    """An MLP of residual blocks, as in a transformer, then class probabilities.

    Each block is `h = h + gelu(h @ w_up + b_up) @ w_down` (the bias and the GELU are
    one generalized einsum, join `gelu(a + b)`); the head is `softmax(h @ w_out)`.
    Scopes are `layers.{i}` and `head`. The residual stream `h` stays live across each
    block, so a tight budget makes the planner offload it and reload it for the add.

    >>> tg = mlp_program(batch=8, width=4, hidden=16, layers=2, classes=3).build()
    >>> len(tg), list(tg.outputs), tg[tg.outputs["probs"]].shape
    (20, ['probs'], (8, 3))
    """
    prog = Program("mlp")
    h = prog.input("x", (batch, width), dtype)
    for i in range(layers):
        with prog.scope(f"layers.{i}"):
            w_up = prog.input(f"layers.{i}.w_up", (width, hidden), dtype, role="weight")
            b_up = prog.input(f"layers.{i}.b_up", (hidden,), dtype, role="weight")
            w_down = prog.input(f"layers.{i}.w_down", (hidden, width), dtype, role="weight")
            up = prog.einsum("bd,df->bf", h, w_up, label="up")
            act = prog.einsum("bf,f->bf", up, b_up, join="gelu(a + b)", label="act")
            h = h + ops.matmul(act, w_down)
    with prog.scope("head"):
        w_out = prog.input("head.w_out", (width, classes), dtype, role="weight")
        prog.output(ops.softmax(ops.matmul(h, w_out), axis=-1), "probs")
    return prog


# -- presets ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A program by name: `make(batch, seq, dtype)` builds it; the other fields are the
    defaults (`seq` None: the program has no sequence length)."""

    name: str
    summary: str
    make: Callable[[int, int | None, str], Program]
    batch: int
    seq: int | None
    dtype: str = "float32"

    def build(
        self, batch: int | None = None, seq: int | None = None, dtype: str | None = None
    ) -> TaskGraph:
        """The TaskGraph, with the defaults for the options not given."""
        if seq is not None and self.seq is None:
            raise ProgramSourceError(f"preset {self.name!r} has no sequence length: drop --seq")
        for what, value in (("batch", batch), ("seq", seq)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ProgramSourceError(f"{what} must be a positive int, got {value!r}")
            if value is not None and value <= 0:
                raise ProgramSourceError(f"{what} must be a positive int, got {value}")
        dtype = dtypes.canonical(dtype or self.dtype)
        if not dtypes.is_float(dtype):
            raise ProgramSourceError(f"preset {self.name!r} needs a float dtype, got {dtype}")
        seq = self.seq if seq is None else seq
        return self.make(batch or self.batch, seq, dtype).build()

    def describe(self) -> str:
        seq = f", seq {self.seq}" if self.seq is not None else ""
        return f"{self.summary} (batch {self.batch}{seq}, {self.dtype})"


def _mlp(batch: int, seq: int | None, dtype: str) -> Program:
    return mlp_program(batch=batch, dtype=dtype)


def _model_presets() -> dict[str, Preset]:
    from einpage.models import FAMILIES

    seq_default = 128
    presets: dict[str, Preset] = {}
    for family in FAMILIES.values():
        for size, cfg in family.presets.items():

            def make(batch: int, seq: int | None, dtype: str, cfg=cfg, family=family) -> Program:
                return family.prefill_program(cfg, batch, seq, dtype)

            seq = min(seq_default, getattr(cfg, "max_positions", seq_default))
            summary = f"{cfg.name} prefill, {_count(cfg.num_parameters())} parameters"
            name = f"{family.name}:{size}"
            presets[name] = Preset(name, summary, make, 1, seq)
    return presets


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:,}"


PRESETS: dict[str, Preset] = {
    "mlp": Preset(
        "mlp",
        "the demo MLP: 4 residual blocks of width 256 (hidden 1024), 256 classes",
        _mlp,
        batch=4096,
        seq=None,
    ),
    **_model_presets(),
}
"""Program presets by name (`einpage presets` lists them)."""


def get_preset(name: str) -> Preset:
    """The preset called `name`; the error lists the valid names."""
    preset = PRESETS.get(name)
    if preset is None:
        raise ProgramSourceError(
            f"unknown program {name!r}: not a preset, and not a .py or .json file; "
            f"presets: {', '.join(PRESETS)}"
        )
    return preset


# -- loading ---------------------------------------------------------------------------


def load_program(
    source: str | os.PathLike[str],
    *,
    batch: int | None = None,
    seq: int | None = None,
    dtype: str | None = None,
) -> TaskGraph:
    """The TaskGraph a PROGRAM argument names (see the module docstring)."""
    text = os.fspath(source)
    options = {k: v for k, v in (("batch", batch), ("seq", seq), ("dtype", dtype)) if v is not None}
    suffix = Path(text).suffix.lower()
    if suffix == ".py":
        return load_python_program(text, **options)
    if suffix == ".json":
        if options:
            given = ", ".join(f"--{k}" for k in options)
            raise ProgramSourceError(f"{text}: a TaskGraph file has fixed shapes; drop {given}")
        return _load_taskgraph_json(Path(text))
    if text not in PRESETS and Path(text).exists():
        raise ProgramSourceError(
            f"{text}: cannot tell what this file holds; a program file ends in .py "
            "(Python) or .json (a TaskGraph)"
        )
    return get_preset(text).build(batch, seq, dtype)


def read_text(path: str | os.PathLike[str]) -> str:
    """A file's text, or a `ProgramSourceError` that says why it cannot be read."""
    path = Path(path)
    if not path.exists():
        raise ProgramSourceError(f"no such file: {path}")
    if path.is_dir():
        raise ProgramSourceError(f"{path} is a directory, not a file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ProgramSourceError(f"cannot read {path}: {err}") from None


def _load_taskgraph_json(path: Path) -> TaskGraph:
    text = read_text(path)
    try:
        return TaskGraph.from_json(text)
    except SerializationError as err:
        hint = ""
        if '"einpage.memgraph"' in text[:200]:
            hint = " (this is a plan: give it to `einpage run`, `stats` or `render`)"
        raise SerializationError(f"{path}: not a TaskGraph{hint}: {err}") from None


def load_python_program(path: str | os.PathLike[str], **options: Any) -> TaskGraph:
    """Execute the Python file `path` and return the TaskGraph of the program it defines.

    The file must define `program` (a `Program` or `TaskGraph`) or `build(**options)`
    returning one; `options` (batch, seq, dtype) go to `build`. Anything the file raises
    becomes a `ProgramSourceError` naming the file, line and exception.
    """
    path = Path(path)
    read_text(path)  # the clear error for a missing or unreadable file
    namespace = _run_user_file(path, lambda: runpy.run_path(str(path), run_name="__einpage__"))
    program = namespace.get("program")
    build = namespace.get("build")
    if program is None and build is None:
        raise ProgramSourceError(
            f"{path} defines neither `program` (an einpage.Program or TaskGraph) nor a "
            "function `build()` returning one"
        )
    if program is not None:
        if options:
            given = ", ".join(f"--{k}" for k in options)
            raise ProgramSourceError(
                f"{path} defines a fixed `program`; to use {given}, define "
                f"`build({', '.join(options)})` instead"
            )
        return _as_taskgraph(program, f"{path}: `program`")
    if not callable(build):
        raise ProgramSourceError(f"{path}: `build` is a {type(build).__name__}, not a function")
    try:
        inspect.signature(build).bind(**options)
    except TypeError:
        given = ", ".join(f"{k}=" for k in options)
        raise ProgramSourceError(f"{path}: build() does not accept {given}") from None
    result = _run_user_file(path, lambda: build(**options))
    return _as_taskgraph(result, f"{path}: build()")


def _as_taskgraph(value: Any, where: str) -> TaskGraph:
    if isinstance(value, Program):
        try:
            return value.build()
        except EinpageError as err:
            raise ProgramSourceError(f"{where}: {type(err).__name__}: {err}") from None
    if isinstance(value, TaskGraph):
        return value
    raise ProgramSourceError(
        f"{where} is a {type(value).__name__}, expected an einpage.Program or a TaskGraph"
    )


def _run_user_file(path: Path, call: Callable[[], Any]) -> Any:
    """`call()`, with `path`'s directory first on sys.path; errors name the file's line."""
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        return call()
    except SystemExit as err:
        raise ProgramSourceError(f"{path} called exit({err.code!r}) while loading") from None
    except Exception as err:  # the user's code: report where in it, not a traceback of ours
        raise ProgramSourceError(_describe_failure(path, err)) from None
    finally:
        if folder in sys.path:
            sys.path.remove(folder)


def _describe_failure(path: Path, err: BaseException) -> str:
    """`file:line: Type: message`, then the user's frames (most recent last)."""
    here = str(path.resolve())
    frames = [
        f for f in traceback.extract_tb(err.__traceback__) if os.path.abspath(f.filename) == here
    ]
    if isinstance(err, SyntaxError) and err.lineno is not None:
        return f"{path}:{err.lineno}: SyntaxError: {err.msg}"
    where = f"{path}:{frames[-1].lineno}" if frames else str(path)
    message = str(err).splitlines()[0] if str(err) else ""
    lines = [f"{where}: {type(err).__name__}: {message}".rstrip(": ")]
    lines += [f"  line {f.lineno}, in {f.name}: {(f.line or '').strip()}" for f in frames[-5:]]
    return "\n".join(lines)


# -- inputs ----------------------------------------------------------------------------


def random_inputs(
    tg: TaskGraph, seed: int = 0, available: int | None = None
) -> dict[str, np.ndarray]:
    """Random arrays for every input of `tg`, reproducible from `seed`.

    Checked first: the arrays (and the float64 draw of the largest) must fit in the
    host memory `available` (default: what the system has free now), else
    `InputError` with the numbers – not NumPy's out-of-memory error minutes later.

    Floats are standard normal, scaled by 1/sqrt(the larger of the last two dims) so
    that products stay of order one; integers (ids) lie in [0, rows) of every table a
    gather indexes with them (else in [0, 2)). Each input's stated domain
    (`taskgraph.nodes.DOMAINS`) holds: "nonnegative" takes the magnitude of that draw,
    "positive" its magnitude plus half the scale (integers: from 1), "fraction" is
    uniform in [0, 0.99) (below 1 after rounding to any float dtype).

    >>> x = random_inputs(load_program("llama:tiny", seq=4), seed=1)["tokens"]
    >>> x.dtype.name, x.shape, bool((x >= 0).all() and (x < 256).all())
    ('int64', (1, 4), True)
    """
    tasks = [tg[i] for i in tg.inputs.values()]
    needed = sum(t.nbytes for t in tasks) + max((8 * t.size for t in tasks), default=0)
    available = available_memory() if available is None else available
    if available is not None and needed > available:
        raise InputError(
            f"random inputs for {tg.name!r} need {format_bytes(needed)} ({needed} B) of host "
            f"memory ({len(tasks)} arrays, {format_bytes(sum(t.nbytes for t in tasks))}, "
            f"plus the float64 draw of the largest), more than the {format_bytes(available)} "
            "available: give --inputs, or a smaller batch/seq"
        )
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for name, task_id in tg.inputs.items():
        task = tg[task_id]
        domain = task.op.domain
        if dtypes.is_float(task.dtype):
            scale = 1.0 / np.sqrt(max(task.shape[-2:])) if len(task.shape) > 1 else 0.1
            if domain == "fraction":
                values = rng.uniform(0.0, 0.99, task.shape)
            else:
                values = rng.standard_normal(task.shape) * scale
            if domain in ("nonnegative", "positive"):
                values = np.abs(values) + (0.5 * scale if domain == "positive" else 0.0)
            arrays[name] = values.astype(task.dtype)
        else:
            low = 1 if domain == "positive" else 0
            high = max(_id_bound(tg, task_id), low + 1)
            arrays[name] = rng.integers(low, high, task.shape).astype(task.dtype)
    return arrays


def _id_bound(tg: TaskGraph, task_id: int) -> int:
    """The fewest rows among the tables `task_id` indexes (2 when it indexes none)."""
    rows = [
        tg[tg[user].inputs[0]].shape[0]
        for user in tg.consumers[task_id]
        if isinstance(tg[user].op, Gather) and tg[user].inputs[1] == task_id
    ]
    return min(rows, default=2)
