"""The `einpage` command line: show, plan, inspect, run and draw programs and plans.

    einpage show llama:tiny                       the TaskGraph and its memory needs
    einpage plan mlp --budget 50% -o plan.json    plan for a device of that many bytes
    einpage stats plan.json                       what the plan does, simulated and verified
    einpage run plan.json --check                 execute it; compare with the reference
    einpage render plan.json -o plan.svg --collapse
    einpage demo                                  all of the above on the demo MLP
    einpage presets                               the programs known by name

A PROGRAM is a preset name, a TaskGraph JSON file or a Python file (executed: see
`einpage.presets`). A budget is bytes (`1073741824`), a size (`8GiB`, `512MiB`,
`1.5GB`) or a percentage of the program's no-offload peak (`50%`, see
`memgraph.no_offload_peak`). Plans are JSON files (`MemGraph.to_json`), validated on
load.

Exit codes (`EXIT_*`): 0 success; 1 a check failed (`run --check` found outputs that
differ from the reference evaluator, or a plan fails `memgraph.verify`); 2 bad input
(usage, a missing or invalid file, an unknown preset, a malformed budget, a program
that does not build, inputs that do not fit); 3 the budget is infeasible; 4 this
machine lacks something (Graphviz's `dot`, CuPy or a GPU); 130 interrupted. Errors
print one line (and a hint) on stderr, never a traceback for an `EinpageError`.

Progress bars (one step per stage: the planner and the runtime have no finer hook)
go to stderr when both stdout and stderr are terminals, unless `--quiet`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import memgraph
import runtime
import taskgraph
from einpage import __version__
from einpage.presets import PRESETS, load_program, random_inputs, read_text
from einpage_core.errors import (
    BackendUnavailableError,
    EinpageError,
    GraphvizNotFoundError,
    InfeasibleBudgetError,
    InputError,
    SerializationError,
    VerificationError,
)
from einpage_core.units import BudgetFormatError, format_bytes, format_count, parse_bytes
from memgraph import COST_MODELS, ORDERS, MemGraph, NodeKind
from memgraph.eviction import POLICIES
from memgraph.serialize import FORMAT as PLAN_FORMAT
from memgraph.serialize import memgraph_from_dict
from taskgraph import TaskGraph
from taskgraph.nodes import Input
from taskgraph.partition import (
    DEFAULT_BUDGET_FRACTION,
    BlockLimitError,
    partition,
    working_set,
)
from taskgraph.render import DEFAULT_MAX_NODES, render_taskgraph
from taskgraph.serialize import FORMAT as GRAPH_FORMAT
from taskgraph.serialize import taskgraph_from_dict

__all__ = [
    "main",
    "build_parser",
    "Console",
    "Compiled",
    "compile_program",
    "resolve_budget_text",
    "Comparison",
    "compare_outputs",
    "load_plan",
    "load_inputs",
    "save_arrays",
    "format_table",
    "CHECK_TITLE",
    "CheckFailedError",
    "TooManyBlocksError",
    "estimated_blocks",
    "MAX_AUTO_BLOCKS",
    "raise_on_mismatch",
    "program_rows",
    "plan_report",
    "EXIT_OK",
    "EXIT_CHECK_FAILED",
    "EXIT_BAD_INPUT",
    "EXIT_INFEASIBLE",
    "EXIT_UNAVAILABLE",
    "EXIT_INTERRUPTED",
]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3
EXIT_UNAVAILABLE = 4
EXIT_INTERRUPTED = 130

PARTITION_MODES = ("auto", "off")
"""`--partition` values besides a block size: split only what does not fit, or never."""

TOLERANCES = {"float16": 1e-2, "float32": 1e-4, "float64": 1e-9}
"""Largest |output - reference| a check accepts, relative to the reference's largest
magnitude (at least 1), by dtype; integer outputs must be equal."""

_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


class CheckFailedError(EinpageError):
    """`run --check` (or the demo) found outputs that differ from the reference."""


# -- console ---------------------------------------------------------------------------


class Console:
    """Where the CLI writes: results to stdout (unless quiet), per-stage progress to stderr.

    `stage(name)` is a context manager; with progress on, a tqdm bar on stderr names the
    running stage and counts finished ones (the planner and runtime have no finer hook).
    """

    def __init__(self, quiet: bool = False, progress: bool | None = None, out=None, err=None):
        self.quiet = quiet
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        if progress is None:
            progress = not quiet and _is_tty(self.out) and _is_tty(self.err)
        self.progress = progress
        self._bar: Any = None
        self.timings: dict[str, float] = {}

    def print(self, text: str = "") -> None:
        if not self.quiet:
            self._clear_bar()
            print(text, file=self.out, flush=True)

    @contextmanager
    def stages(self, total: int) -> Iterator[None]:
        """A progress bar for `total` stages (none when progress is off)."""
        if self.progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total,
                file=self.err,
                leave=False,
                bar_format="{desc:<24} {bar:20} {n_fmt}/{total_fmt} stages [{elapsed}]",
            )
        try:
            yield
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage (in `timings`) and show it on the progress bar."""
        if self._bar is not None:
            self._bar.set_description_str(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = time.perf_counter() - started
            if self._bar is not None:
                self._bar.update(1)

    def _clear_bar(self) -> None:
        if self._bar is not None:
            self._bar.clear()


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def format_table(rows: Sequence[tuple[str, str]], title: str | None = None) -> str:
    """Rows of (label, value) as aligned text, under an optional title.

    >>> print(format_table([("budget", "4.0 MiB"), ("peak allocated", "3.5 MiB")], "plan"))
    plan
      budget          4.0 MiB
      peak allocated  3.5 MiB
    """
    width = max((len(label) for label, _ in rows), default=0)
    lines = [title] if title else []
    lines += [f"  {label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)


# -- budgets and compiling -------------------------------------------------------------


def resolve_budget_text(tg: TaskGraph, budget: str, order: str = "program") -> tuple[int, str]:
    """(bytes, how they were found) for a `--budget` value.

    A percentage is of `tg`'s no-offload peak under `order` (before any partitioning).

    >>> import einpage as ep
    >>> prog = ep.Program(); x = prog.input("x", (1024,)); prog.output(ep.exp(x), "y")
    >>> resolve_budget_text(prog.build(), "8KiB")
    (8192, '8.0 KiB')
    >>> resolve_budget_text(prog.build(), "50%")
    (4096, '50% of the no-offload peak 8.0 KiB = 4.0 KiB')
    """

    match = _PERCENT.match(budget)
    if match is None:
        if "%" in budget:
            raise BudgetFormatError(f"cannot parse budget {budget!r}: expected e.g. '50%'")
        nbytes = parse_bytes(budget)
        return nbytes, format_bytes(nbytes)
    percent = float(match.group(1))
    if percent <= 0:
        raise BudgetFormatError(f"budget {budget!r} must be a positive percentage")
    peak = memgraph.no_offload_peak(tg, order=order)
    nbytes = int(peak * percent / 100)
    return (
        nbytes,
        f"{percent:g}% of the no-offload peak {format_bytes(peak)} = {format_bytes(nbytes)}",
    )


def parse_block_size(value: str) -> int:
    """`show --partition`: a block size in bytes."""
    try:
        return parse_bytes(value)
    except BudgetFormatError:
        raise BudgetFormatError(
            f"--partition must be a block size such as 64MiB, got {value!r}"
        ) from None


def parse_partition(value: str) -> str | int:
    """`--partition`: "auto", "off", or a block size in bytes."""
    if value in PARTITION_MODES:
        return value
    try:
        return parse_bytes(value)
    except BudgetFormatError:
        raise BudgetFormatError(
            f"--partition must be auto, off or a block size such as 64MiB, got {value!r}"
        ) from None


@dataclass(frozen=True)
class Compiled:
    """A program and its plan: `graph` is what was planned (`program` partitioned when
    `block_limit` is set); `budget_note` says how the budget was read."""

    program: TaskGraph
    graph: TaskGraph
    plan: MemGraph
    budget: int
    budget_note: str
    min_budget: int
    block_limit: int | None = None
    timings: Mapping[str, float] = field(default_factory=dict)


def compile_program(
    tg: TaskGraph,
    budget: str,
    *,
    order: str = "program",
    eviction: str = "belady",
    partition_arg: str | int = "auto",
    cost_model: str = "h100-pcie5",
    console: Console | None = None,
) -> Compiled:
    """Plan `tg` within `budget` (partitioning it as `memgraph.plan(partition=)` does);
    returns a `Compiled`.

    `partition_arg`: "auto" splits large tasks only when the budget is below
    `memgraph.min_budget` of the program (refusing with `TooManyBlocksError` a budget
    that would make more than `MAX_AUTO_BLOCKS` blocks); "off" never does (an
    infeasible budget then raises); a byte count splits every task whose working set
    exceeds it. Raises `InfeasibleBudgetError` when no plan fits.
    """

    console = console or Console(quiet=True, progress=False)
    with console.stage("reading the budget"):
        nbytes, note = resolve_budget_text(tg, budget, order)
        needed, _ = memgraph.min_budget(tg)
    if partition_arg == "auto" and nbytes < needed:
        _check_block_count(tg, nbytes)
    with console.stage("planning"):
        mg = memgraph.plan(
            tg,
            nbytes,
            partition=partition_arg,
            order=order,
            eviction=eviction,
            cost_model=cost_model,
        )
    info = {**mg.info, "budget_request": budget}
    limit = info.get("block_limit")
    mg = memgraph.MemGraph(mg.taskgraph, mg.nodes, mg.budget, mg.alignment, info)
    return Compiled(tg, mg.taskgraph, mg, nbytes, note, needed, limit, dict(console.timings))


MAX_AUTO_BLOCKS = 100_000
"""`--partition auto` refuses budgets that would cut the program into more blocks than
this (estimated): such a graph takes minutes to build and plan, and is rarely meant."""


class TooManyBlocksError(InfeasibleBudgetError):
    """`--partition auto` would cut the program into more than `MAX_AUTO_BLOCKS` blocks;
    `needed` is about the smallest budget that stays under it."""


def estimated_blocks(tg: TaskGraph, limit: int) -> int:
    """About how many tasks partitioning `tg` to `limit` bytes makes: per compute task,
    its working set over the limit (rounded up). Assembly and combines come on top."""

    return sum(-(-working_set(tg, t.id) // limit) for t in tg if t.is_compute)


def _check_block_count(tg: TaskGraph, budget: int) -> None:
    """Raise `TooManyBlocksError` when `partition_for_budget(tg, budget)` would make more
    than `MAX_AUTO_BLOCKS` blocks (by `estimated_blocks`)."""

    def limit_of(nbytes: int) -> int:
        return max(256, int(nbytes * DEFAULT_BUDGET_FRACTION) // 256 * 256)

    count = estimated_blocks(tg, limit_of(budget))
    if count <= MAX_AUTO_BLOCKS:
        return
    low, high = budget, max(budget, 1) * 2
    while estimated_blocks(tg, limit_of(high)) > MAX_AUTO_BLOCKS:
        low, high = high, high * 2
    while high - low > max(256, high // 100):  # within 1%: it is an estimate anyway
        middle = (low + high) // 2
        if estimated_blocks(tg, limit_of(middle)) > MAX_AUTO_BLOCKS:
            low = middle
        else:
            high = middle
    raise TooManyBlocksError(
        f"budget {format_bytes(budget)} would cut {tg.name!r} into about {count:,} blocks of "
        f"at most {format_bytes(limit_of(budget))}; --partition auto stops at "
        f"{MAX_AUTO_BLOCKS:,} (about {format_bytes(high)} of budget). Give a larger budget, "
        "or split explicitly with --partition SIZE",
        budget,
        high,
    )


# -- checking ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """One output against the reference: `error` is max |output - reference| divided by
    `scale` (the reference's largest magnitude, at least 1); NaNs must coincide."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    error: float
    scale: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def row(self) -> tuple[str, str]:
        """(name, `dtype[shape]  error ... (tolerance ...)  ok`) for a table."""
        verdict = "ok" if self.ok else "MISMATCH"
        shape = "[" + ",".join(map(str, self.shape)) + "]"
        return (
            self.name,
            f"{self.dtype}{shape}  error {self.error:.2e} (tolerance {self.tolerance:.0e})  "
            f"{verdict}",
        )


CHECK_TITLE = "check against the reference evaluator (error: max |out - ref| / max(1, |ref|))"


def compare_outputs(
    outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]
) -> list[Comparison]:
    """Compare every reference output with the same-named output (see `Comparison`).

    >>> ref = {"y": np.array([1.0, 2.0], "float32")}
    >>> [c.ok for c in compare_outputs({"y": np.array([1.0, 2.00001], "float32")}, ref)]
    [True]
    >>> compare_outputs({"y": np.array([1.0, 2.5], "float32")}, ref)[0].error
    0.25
    """
    found = []
    for name, ref in reference.items():
        out = np.asarray(outputs[name])
        ref = np.asarray(ref)
        dtype = ref.dtype.name
        if out.shape != ref.shape:
            found.append(Comparison(name, ref.shape, dtype, float("inf"), 1.0, 0.0))
            continue
        tolerance = TOLERANCES.get(dtype, 0.0)
        wide_out, wide_ref = out.astype(np.float64), ref.astype(np.float64)
        nan_out, nan_ref = np.isnan(wide_out), np.isnan(wide_ref)
        finite = ~nan_ref
        scale = max(1.0, float(np.max(np.abs(wide_ref[finite]), initial=0.0)))
        if not np.array_equal(nan_out, nan_ref):
            error = float("inf")
        else:
            diff = np.abs(wide_out[finite] - wide_ref[finite])
            error = float(np.max(diff, initial=0.0)) / scale
            if np.isnan(error):  # infinities in different places
                error = float("inf")
        found.append(Comparison(name, ref.shape, dtype, error, scale, tolerance))
    return found


# -- files -----------------------------------------------------------------------------


def load_plan(path: str | Path) -> MemGraph:
    """The MemGraph in a plan file, validated (`SerializationError` names the JSON path)."""

    text = read_text(path)
    try:
        return MemGraph.from_json(text)
    except SerializationError as err:
        hint = ""
        if '"einpage.taskgraph"' in text[:200]:
            hint = " (this is a TaskGraph: plan it with `einpage plan` first)"
        raise SerializationError(f"{path}: not a valid plan{hint}: {err}") from None


def load_inputs(path: str | Path) -> dict[str, np.ndarray]:
    """Arrays by input name from an .npz file (`numpy.savez`); pickles are refused."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no such inputs file: {path}")
    try:
        with np.load(path, allow_pickle=False) as data:
            if not hasattr(data, "files"):
                raise InputError(f"{path}: expected an .npz archive of named arrays (np.savez)")
            return {name: data[name] for name in data.files}
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: cannot read arrays from it: {err}") from None


def save_arrays(path: str | Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write arrays by name to an .npz file at exactly `path` (what `load_inputs` reads).

    Unlike `numpy.savez`, any name works (even "file") and no suffix is added.
    """
    import zipfile

    with zipfile.ZipFile(path, "w", allowZip64=True) as archive:
        for name, value in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as handle:
                np.lib.format.write_array(handle, np.asanyarray(value), allow_pickle=False)


def _load_json_graph(path: str | Path) -> MemGraph | TaskGraph:
    """A plan or a TaskGraph, by the document's `format`."""

    text = read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise SerializationError(f"{path}: not valid JSON: {err}") from None
    kind = data.get("format") if isinstance(data, dict) else None
    try:
        if kind == PLAN_FORMAT:
            return memgraph_from_dict(data)
        if kind == GRAPH_FORMAT:
            return taskgraph_from_dict(data)
    except SerializationError as err:
        raise SerializationError(f"{path}: {err}") from None
    raise SerializationError(
        f"{path}: $.format: expected {PLAN_FORMAT!r} (a plan) or {GRAPH_FORMAT!r} "
        f"(a TaskGraph), got {kind!r}"
    )


def _wrote(console: Console, what: str, path: Path | str) -> None:
    console.print(f"wrote {what}: {path}")


# -- summaries ---------------------------------------------------------------------------


def program_rows(tg: TaskGraph) -> list[tuple[str, str]]:
    """Sizes of a TaskGraph and its memory needs, as table rows."""

    weights = sum(t.nbytes for t in tg if isinstance(t.op, Input) and t.op.location == "host")
    needed, task = memgraph.min_budget(tg)
    at = (
        f" (task %{task}{', ' + tg[task].scope if tg[task].scope else ''})"
        if task is not None
        else ""
    )
    return [
        (
            "tasks",
            f"{len(tg)} ({_plural(len(tg.inputs), 'input')}, {_plural(len(tg.outputs), 'output')})",
        ),
        ("compute", format_count(tg.total_flops, "FLOP")),
        ("inputs", f"{format_bytes(tg.input_bytes)} ({format_bytes(weights)} start on the host)"),
        ("no-offload peak", format_bytes(memgraph.no_offload_peak(tg))),
        ("smallest budget", f"{format_bytes(needed)}{at}, without partitioning"),
    ]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _plan_title(mg: MemGraph) -> str:
    info = mg.info
    words = {"order": "order", "eviction": "eviction", "cost_model": "cost model"}
    options = ", ".join(f"{word} {info[key]}" for key, word in words.items() if key in info)
    return f"plan of {mg.taskgraph.name!r}: {len(mg)} nodes, {len(mg.taskgraph)} tasks" + (
        f" ({options})" if options else ""
    )


def plan_report(mg: MemGraph, cost_model: str | None = None) -> str:
    """The PlanStats table and the simulator's summary of `mg`."""

    sim = memgraph.simulate(mg, cost_model or mg.info.get("cost_model") or None)
    return "\n\n".join(
        [
            format_table(mg.stats.rows(), "memory"),
            format_table(sim.rows(), f"simulated on {sim.cost_model.name}"),
        ]
    )


# -- subcommands -------------------------------------------------------------------------


def _program(args: argparse.Namespace) -> TaskGraph:
    return load_program(args.program, batch=args.batch, seq=args.seq, dtype=args.dtype)


def _cmd_show(args: argparse.Namespace, console: Console) -> int:
    with console.stages(2):
        with console.stage("building the program"):
            tg = _program(args)
            if args.partition is not None:
                tg = partition(tg, parse_block_size(args.partition), alignment=256)
        with console.stage("measuring"):
            rows = program_rows(tg)
    if not args.summary:
        console.print(str(tg))
        console.print()
    console.print(format_table(rows, f"program {tg.name!r}"))
    if args.output:
        Path(args.output).write_text(tg.to_json(), encoding="utf-8")
        _wrote(console, "TaskGraph", args.output)
    if args.render:
        path = render_taskgraph(tg, args.render, max_nodes=_max_nodes(args.max_nodes))
        _wrote(console, "picture", path)
    return EXIT_OK


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    partition_arg = parse_partition(args.partition)
    pictures = sum(1 for p in (args.render, args.memory_map, args.timeline) if p)
    with console.stages(5 + pictures):
        with console.stage("building the program"):
            tg = _program(args)
        compiled = compile_program(
            tg,
            args.budget,
            order=args.order,
            eviction=args.eviction,
            partition_arg=partition_arg,
            cost_model=args.cost_model,
            console=console,
        )
        mg = compiled.plan
        with console.stage("verifying"):
            report = memgraph.verify(mg)
        console.print(_compile_summary(compiled, report))
        console.print()
        console.print(plan_report(mg, args.cost_model))
        if args.output:
            Path(args.output).write_text(mg.to_json(), encoding="utf-8")
            _wrote(console, "plan", args.output)
        _pictures(args, mg, console)
    return EXIT_OK


def _compile_summary(compiled: Compiled, report: Any) -> str:
    mg, tg = compiled.plan, compiled.program
    s = mg.stats
    rows = [
        ("program", f"{tg.name!r}: {len(tg)} tasks, {format_count(tg.total_flops, 'FLOP')}"),
        ("budget", compiled.budget_note),
    ]
    if compiled.block_limit is not None:
        rows.append(
            (
                "partition",
                f"{len(tg)} -> {len(compiled.graph)} tasks, block limit "
                f"{format_bytes(compiled.block_limit)} (the program needs "
                f"{format_bytes(compiled.min_budget)} unsplit)",
            )
        )
    seconds = compiled.timings.get("planning", 0.0)
    rows += [
        (
            "plan",
            f"{len(mg)} nodes in {seconds:.2f} s: {s.offload_count} offloads "
            f"({format_bytes(s.offload_bytes)}), {s.reload_count} reloads "
            f"({format_bytes(s.reload_bytes)}), {s.drop_count} drops" + _assembled_note(mg),
        ),
        (
            "verify",
            f"ok: {report.nodes} nodes, {report.dependencies_checked} dependencies checked",
        ),
    ]
    return format_table(rows, _plan_title(mg))


def _assembled_note(mg: MemGraph) -> str:
    """`; outputs logits assembled on the host from 26 blocks`, or "" (no sliced offloads)."""
    roots = {n.into for n in mg.nodes if n.kind is NodeKind.OFFLOAD and n.into is not None}
    if not roots:
        return ""
    names = [n.name for n in mg.of_kind(NodeKind.OUTPUT) if n.tensor in roots]
    return (
        f"; outputs {', '.join(names)} assembled on the host from "
        f"{mg.stats.sliced_offload_count} blocks"
    )


def _pictures(args: argparse.Namespace, mg: MemGraph, console: Console) -> None:
    if args.render:
        with console.stage("drawing the plan"):
            path = mg.render(args.render, collapse=True, max_nodes=_max_nodes(args.max_nodes))
        _wrote(console, "plan picture", path)
    if args.memory_map:
        with console.stage("drawing the memory map"):
            mg.memory_map(args.memory_map)
        _wrote(console, "memory map", args.memory_map)
    if args.timeline:
        with console.stage("simulating the streams"):
            sim = memgraph.simulate(mg, args.cost_model, timeline=True)
            sim.plot(args.timeline)
        _wrote(console, "stream timeline", args.timeline)


def _max_nodes(value: int) -> int | None:
    return None if value == 0 else value


def _cmd_stats(args: argparse.Namespace, console: Console) -> int:
    with console.stages(3):
        with console.stage("loading the plan"):
            mg = load_plan(args.plan)
        with console.stage("simulating"):
            sim = memgraph.simulate(mg, args.cost_model or mg.info.get("cost_model") or None)
        with console.stage("verifying"):
            try:
                report, failure = memgraph.verify(mg), None
            except VerificationError as err:
                report, failure = None, err
    if args.json:
        document = {
            "name": mg.taskgraph.name,
            "tasks": len(mg.taskgraph),
            "stats": mg.stats.as_dict(),
            "simulated": {
                "cost_model": sim.cost_model.name,
                "makespan_s": sim.makespan,
                "compute_s": sim.compute_seconds,
                "stall_s": sim.stall_seconds,
                "busy_s": dict(sim.busy),
                "bytes_moved": dict(sim.bytes_moved),
            },
            "verified": failure is None,
            "info": dict(mg.info),
        }
        console.print(json.dumps(document, indent=2))
    else:
        console.print(f"{args.plan}: {_plan_title(mg)}")
        console.print()
        console.print(format_table(mg.stats.rows(), "memory"))
        console.print()
        console.print(format_table(sim.rows(), f"simulated on {sim.cost_model.name}"))
        if report is not None:
            console.print()
            verdict = f"ok: {report.nodes} nodes, {report.dependencies_checked} dependencies"
            console.print(format_table([("verify", verdict)]))
    if failure is not None:
        raise failure
    return EXIT_OK


def _cmd_run(args: argparse.Namespace, console: Console) -> int:
    stages = 3 + bool(args.check)
    with console.stages(stages):
        with console.stage("loading the plan"):
            mg = load_plan(args.plan)
        tg = mg.taskgraph
        with console.stage("preparing inputs"):
            if args.inputs:
                arrays = load_inputs(args.inputs)
                source = f"from {args.inputs}"
            else:
                seed = 0 if args.random_inputs is None else args.random_inputs
                arrays = random_inputs(tg, seed)
                source = f"random (seed {seed})"
            tg.check_inputs(arrays)
        with (
            console.stage("running"),
            runtime.Session(mg, args.backend, mode=args.mode) as session,
        ):
            outputs = session.run(arrays, trace=bool(args.trace))
            last = session.last
            if args.trace:
                last.trace.write(args.trace)
        comparisons = []
        if args.check:
            with console.stage("evaluating the reference"):
                comparisons = compare_outputs(outputs, taskgraph.evaluate(tg, arrays))
    rows = [
        ("plan", f"{args.plan}: {tg.name!r}, {len(mg)} nodes, budget {format_bytes(mg.budget)}"),
        ("inputs", f"{len(arrays)} arrays, {source}"),
        ("backend", f"{last.backend} ({last.mode} mode)"),
        ("time", f"{last.seconds:.3f} s"),
    ]
    peak = last.memory.get("device_peak_bytes")
    if peak is not None:
        rows.append(("device memory", format_bytes(peak)))
    console.print(format_table(rows, "run"))
    console.print()
    console.print(format_table([_output_row(n, v) for n, v in outputs.items()], "outputs"))
    if comparisons:
        console.print()
        console.print(format_table([c.row() for c in comparisons], CHECK_TITLE))
    if args.trace:
        _wrote(console, "trace (open it in https://ui.perfetto.dev)", args.trace)
    if args.output:
        save_arrays(args.output, outputs)
        _wrote(console, "outputs", args.output)
    raise_on_mismatch(comparisons)
    return EXIT_OK


def _output_row(name: str, value: np.ndarray) -> tuple[str, str]:
    shape = "[" + ",".join(map(str, value.shape)) + "]"
    if value.size and np.issubdtype(value.dtype, np.floating):
        wide = value.astype(np.float64)
        summary = f"mean {np.nanmean(wide):.4g}, max |x| {np.nanmax(np.abs(wide)):.4g}"
    elif value.size:
        summary = f"min {value.min()}, max {value.max()}"
    else:
        summary = "empty"
    return name, f"{value.dtype.name}{shape}  {summary}"


def raise_on_mismatch(comparisons: list[Comparison]) -> None:
    """Raise `CheckFailedError` naming the first output that differs from the reference."""
    bad = [c for c in comparisons if not c.ok]
    if bad:
        c = bad[0]
        raise CheckFailedError(
            f"check failed: output {c.name!r} differs from the reference evaluator: "
            f"max |out - ref| / {c.scale:.3g} = {c.error:.2e} > {c.tolerance:.0e}"
            + (f" ({len(bad) - 1} more output(s) differ)" if len(bad) > 1 else "")
        )


def _cmd_render(args: argparse.Namespace, console: Console) -> int:
    with console.stages(2):
        with console.stage("loading"):
            graph = _load_json_graph(args.file)
        options: dict[str, Any] = {"max_nodes": _max_nodes(args.max_nodes), "scope": args.scope}
        if isinstance(graph, MemGraph):
            options["collapse"] = args.collapse
        elif args.collapse:
            raise InputError(f"--collapse applies to plans; {args.file} is a TaskGraph")
        with console.stage("drawing"):
            path = graph.render(args.output, **options)
    _wrote(console, "picture", path)
    return EXIT_OK


def _cmd_presets(args: argparse.Namespace, console: Console) -> int:
    console.print(format_table([(p.name, p.describe()) for p in PRESETS.values()], "presets"))
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from einpage.demo import run_demo

    return run_demo(out_dir=args.out, backend=args.backend, budget=args.budget, console=console)


# -- the parser --------------------------------------------------------------------------

PROGRAM_HELP = (
    "a preset (see `einpage presets`: mlp, llama:7b, llama:tiny, gpt2:124m, ...), a "
    "TaskGraph .json file, or a Python .py file defining `program` or `build()`; a "
    "Python file is executed like `python FILE` (with __name__ == '__einpage__')"
)
BUDGET_HELP = (
    "device memory: bytes, a size (8GiB, 512MiB) or a percentage of the no-offload peak (50%%)"
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="einpage",
        description="Compile einsum tensor programs into memory plans for GPUs smaller "
        "than the program needs.",
        epilog="Exit codes: 0 ok, 1 a check failed, 2 bad input, 3 infeasible budget, "
        "4 missing tool (Graphviz, CuPy or a GPU).",
    )
    parser.add_argument("--version", action="version", version=f"einpage {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    program = argparse.ArgumentParser(add_help=False)
    program.add_argument("program", metavar="PROGRAM", help=PROGRAM_HELP)
    program.add_argument("--batch", type=_positive_int, help="batch size (presets, build())")
    program.add_argument("--seq", type=_positive_int, help="sequence length (model presets)")
    program.add_argument("--dtype", help="float16, float32 or float64 (presets, build())")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    show = commands.add_parser(
        "show",
        parents=[common, program],
        help="print a program's TaskGraph and its memory needs",
        description="Print the TaskGraph of PROGRAM (one line per task) and its sizes.",
    )
    show.add_argument("--summary", action="store_true", help="only the sizes, no listing")
    show.add_argument("--partition", metavar="SIZE", help="split tasks to this block size first")
    show.add_argument("-o", "--output", metavar="GRAPH.json", help="write the TaskGraph JSON")
    show.add_argument(
        "--render", metavar="FILE", help="draw the TaskGraph (.svg, .png, .pdf, .dot)"
    )
    show.add_argument(
        "--max-nodes", type=_count, default=DEFAULT_MAX_NODES, help="most tasks drawn (0: all)"
    )
    show.set_defaults(handler=_cmd_show)

    plan = commands.add_parser(
        "plan",
        parents=[common, program],
        help="plan a program for a device with BUDGET bytes",
        description="Plan PROGRAM to run in BUDGET bytes of device memory; print what the "
        "plan does and its simulated time.",
    )
    plan.add_argument("--budget", "-b", required=True, help=BUDGET_HELP)
    plan.add_argument("--order", choices=list(ORDERS), default="program", help="task order")
    plan.add_argument("--eviction", choices=list(POLICIES), default="belady", help="victim choice")
    plan.add_argument(
        "--partition",
        default="auto",
        metavar="auto|off|SIZE",
        help="split large tasks: auto (only when the budget needs it, the default), off, "
        "or every task whose working set exceeds SIZE",
    )
    plan.add_argument(
        "--cost-model",
        choices=list(COST_MODELS),
        default="h100-pcie5",
        help="machine for the prefetch lookahead and the simulator",
    )
    plan.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan")
    plan.add_argument("--render", metavar="FILE", help="draw the plan, collapsed (.svg, .png)")
    plan.add_argument(
        "--max-nodes", type=_count, default=DEFAULT_MAX_NODES, help="most nodes drawn (0: all)"
    )
    plan.add_argument("--memory-map", metavar="FILE", help="draw the memory map (.png, .svg)")
    plan.add_argument("--timeline", metavar="FILE", help="draw the simulated streams (.png)")
    plan.set_defaults(handler=_cmd_plan)

    stats = commands.add_parser(
        "stats",
        parents=[common],
        help="what a plan does: memory, transfers, simulated time, verification",
        description="Print what PLAN.json does (memory, transfers), its simulated time, "
        "and whether it passes memgraph.verify (exit code 1 if not).",
    )
    stats.add_argument("plan", metavar="PLAN.json")
    stats.add_argument(
        "--cost-model", choices=list(COST_MODELS), help="machine (default: the plan's)"
    )
    stats.add_argument("--json", action="store_true", help="print JSON instead of tables")
    stats.set_defaults(handler=_cmd_stats)

    run = commands.add_parser(
        "run",
        parents=[common],
        help="execute a plan; --check compares with the reference evaluator",
        description="Execute PLAN.json on random inputs or an .npz of named arrays; "
        "--check compares the outputs with taskgraph.evaluate (exit code 1 if they differ).",
    )
    run.add_argument("plan", metavar="PLAN.json")
    run.add_argument(
        "--backend",
        choices=list(runtime.BACKEND_NAMES),
        default="auto",
        help="auto (the default): CuPy when a GPU is usable, else NumPy",
    )
    run.add_argument(
        "--mode", choices=list(runtime.MODES), help="schedule (default: the backend's)"
    )
    source = run.add_mutually_exclusive_group()
    source.add_argument("--inputs", metavar="INPUTS.npz", help="arrays by input name")
    source.add_argument(
        "--random-inputs", type=_count, metavar="SEED", help="random inputs (default: seed 0)"
    )
    run.add_argument("--check", action="store_true", help="compare with taskgraph.evaluate")
    run.add_argument("--trace", metavar="TRACE.json", help="write a Chrome trace of the run")
    run.add_argument("-o", "--output", metavar="OUTPUTS.npz", help="write the outputs")
    run.set_defaults(handler=_cmd_run)

    render = commands.add_parser(
        "render",
        parents=[common],
        help="draw a plan or a TaskGraph with Graphviz",
        description="Draw a plan or a TaskGraph JSON file; the output's suffix picks the "
        "format (.dot needs no Graphviz).",
    )
    render.add_argument("file", metavar="PLAN.json|GRAPH.json")
    render.add_argument(
        "-o", "--output", required=True, metavar="FILE", help=".svg, .png, .pdf or .dot"
    )
    render.add_argument("--scope", help="only nodes in this scope, e.g. layers.3")
    render.add_argument(
        "--max-nodes", type=_count, default=DEFAULT_MAX_NODES, help="most nodes drawn (0: all)"
    )
    render.add_argument(
        "--collapse", action="store_true", help="fold allocs and frees into their users (plans)"
    )
    render.set_defaults(handler=_cmd_render)

    demo = commands.add_parser(
        "demo",
        parents=[common],
        help="plan, verify, run and check the demo MLP under a budget that forces offloads",
        description="The whole pipeline on the demo MLP: plan it for a smaller device, "
        "verify, run, check against the reference, print the numbers, draw pictures "
        "under DIR/demo.",
    )
    demo.add_argument("--out", default="out", metavar="DIR", help="where pictures go")
    demo.add_argument(
        "--backend",
        choices=list(runtime.BACKEND_NAMES),
        default="auto",
        help="auto (the default): CuPy when a GPU is usable, else NumPy",
    )
    demo.add_argument("--budget", default="50%", help=BUDGET_HELP)
    demo.set_defaults(handler=_cmd_demo)

    presets = commands.add_parser("presets", parents=[common], help="list the program presets")
    presets.set_defaults(handler=_cmd_presets)
    return parser


# -- errors and main ---------------------------------------------------------------------


def exit_code(err: EinpageError) -> int:
    """The exit code for an error (see the module docstring)."""
    if isinstance(err, InfeasibleBudgetError):
        return EXIT_INFEASIBLE
    if isinstance(err, CheckFailedError | VerificationError):
        return EXIT_CHECK_FAILED
    if isinstance(err, GraphvizNotFoundError | BackendUnavailableError):
        return EXIT_UNAVAILABLE
    return EXIT_BAD_INPUT


def hint(err: EinpageError, args: argparse.Namespace | None) -> str | None:
    """A line of advice for an error, where the CLI knows better than the library."""

    if isinstance(err, TooManyBlocksError):
        return None
    if isinstance(err, BlockLimitError):
        return f"the smallest block size that works is {format_bytes(err.needed)} ({err.needed} B)"
    if isinstance(err, InfeasibleBudgetError):
        text = f"the smallest budget that works is {format_bytes(err.needed)} ({err.needed} B)"
        if getattr(args, "partition", None) == "off":
            text += "; or let einpage split large tasks with --partition auto"
        return text
    if isinstance(err, BudgetFormatError):
        return (
            "sizes look like 8GiB, 512MiB, 1.5GB or 1073741824 (bytes); budgets may also "
            "be a percentage of the no-offload peak, like 50%"
        )
    if isinstance(err, VerificationError):
        return "the plan breaks an invariant of memgraph.verify; was the file edited?"
    return None


MAX_ERROR_LINE = 600
"""Error lines longer than this many characters lose their middle (a task reading fifty
operands would otherwise print a screenful)."""


def _shorten(line: str, limit: int = MAX_ERROR_LINE) -> str:
    """`line`, its middle replaced by ` … ` when longer than `limit`.

    >>> _shorten("a" * 10 + "b" * 10, 12)
    'aaaaaa … bbbbb'
    """
    if len(line) <= limit:
        return line
    head = limit // 2
    return f"{line[:head]} … {line[-(limit - head - 1) :]}"


def report_error(err: EinpageError, args: argparse.Namespace | None, stream: Any) -> None:
    """One line `einpage: error: ...` (continuation lines indented) and a hint."""
    lines = [_shorten(line) for line in str(err).splitlines()] or [type(err).__name__]
    print(f"einpage: error: {lines[0]}", file=stream)
    for line in lines[1:]:
        print(f"  {line}", file=stream)
    advice = hint(err, args)
    if advice:
        print(f"einpage: hint: {advice}", file=stream)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with `argv` (default: sys.argv[1:]); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a usage error (argparse printed it)
        return exit_.code if isinstance(exit_.code, int) else EXIT_BAD_INPUT
    console = Console(quiet=args.quiet)
    handler: Callable[[argparse.Namespace, Console], int] = args.handler
    try:
        return handler(args, console)
    except EinpageError as err:
        report_error(err, args, sys.stderr)
        return exit_code(err)
    except OSError as err:  # a file we were told to read or write
        where = f": {err.filename}" if err.filename else ""
        print(f"einpage: error: {err.strerror or err}{where}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("einpage: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
