"""`einpage demo` (and `make demo`): the whole pipeline on the demo MLP, with pictures.

It builds the MLP (`einpage.cli.presets.mlp_program`) and plans it for a device with (by
default) half the memory it needs without offloading, so that large tasks are
partitioned and activations offloaded. It verifies the plan, runs it on the best
backend here (CuPy on a GPU, else NumPy), checks the outputs against the reference
evaluator, prints what the plan does and its simulated time, and draws the plan
(SVG), its memory map and its simulated streams (PNG) under `out_dir/demo`. Every
number printed comes from this run.
"""

from __future__ import annotations

from pathlib import Path

import memgraph
import runtime
import taskgraph
from einpage.cli.checks import CHECK_TITLE, Comparison, compare_outputs, raise_on_mismatch
from einpage.cli.commands import EXIT_OK
from einpage.cli.console import Console, format_table, plan_report, program_rows
from einpage.cli.presets import mlp_program, random_inputs
from einpage.pipeline import Compiled, compile
from einpage_core.errors import GraphvizNotFoundError
from einpage_core.units import format_bytes
from memgraph import MemGraph

__all__ = ["run_demo", "mlp_program", "random_inputs", "PICTURE_MAX_NODES"]

PICTURE_MAX_NODES = 120
"""Nodes drawn in the demo's plan picture (after folding allocs and frees)."""
PICTURE_NOTE = "allocs and frees folded, each layer one box (open one: --scope layers.0)"
LAYER_NOTE = "the nodes of the first residual block, allocs and frees folded"


def run_demo(
    out_dir: str | Path = "out",
    backend: str = "auto",
    budget: str = "50%",
    console: Console | None = None,
    seed: int = 0,
) -> int:
    """Run the demo; returns a process exit code (0 when the outputs match the reference).

    Raises `einpage.cli.checks.CheckFailedError` when they do not.
    """
    console = console or Console()
    say = console.print
    with console.stages(8):
        with console.stage("building the program"):
            tg = mlp_program().build()
            rows = program_rows(tg)
        say(f"einpage demo: plan {tg.name!r} for a device smaller than it needs, run it, check it")
        say()
        say(format_table(rows, f"program {tg.name!r}"))
        with console.stage("compiling"):
            compiled = compile(tg, budget, progress=console.report)
        say()
        say(format_table(_plan_rows(compiled), "plan"))
        comparisons = _run_and_check(compiled, backend, seed, console)
        say()
        say(plan_report(compiled.plan))
        pictures = _draw(compiled.plan, Path(out_dir) / "demo", console)
        say()
        say(format_table(pictures, "pictures"))
    raise_on_mismatch(comparisons)
    return EXIT_OK


def _plan_rows(compiled: Compiled) -> list[tuple[str, str]]:
    """What the plan does: budget, partition, nodes, transfers, verification."""
    tg, mg, report = compiled.program, compiled.plan, compiled.report
    s = mg.stats
    rows = [("budget", str(compiled.budget))]
    if compiled.block_limit is not None:
        rows.append(
            (
                "partition",
                f"{len(tg)} -> {len(compiled.graph)} tasks: tasks whose operands and "
                f"output exceed {format_bytes(compiled.block_limit)} run in blocks",
            )
        )
    return rows + [
        ("plan", f"{len(mg)} nodes in {compiled.timings['planning']:.2f} s"),
        ("offloads", f"{s.offload_count} ({format_bytes(s.offload_bytes)} device -> host)"),
        ("reloads", f"{s.reload_count} ({format_bytes(s.reload_bytes)} host -> device)"),
        (
            "verify",
            f"ok: {report.nodes} nodes, {report.dependencies_checked} dependencies, "
            f"peak {format_bytes(report.peak_bytes)} <= budget {format_bytes(mg.budget)}",
        ),
    ]


def _run_and_check(
    compiled: Compiled, backend: str, seed: int, console: Console
) -> list[Comparison]:
    """Run the plan on random inputs, compare with the reference; print both."""
    tg, mg = compiled.program, compiled.plan
    with console.stage("making inputs"):
        arrays = random_inputs(tg, seed)
    with console.stage("running"), runtime.Session(mg, backend) as session:
        outputs = session.run(arrays)
        last = session.last
    with console.stage("evaluating the reference"):
        comparisons = compare_outputs(outputs, taskgraph.evaluate(tg, arrays))
    console.print()
    run_rows = [
        ("backend", f"{last.backend} ({last.mode} mode)"),
        ("time", f"{last.seconds:.2f} s"),
    ]
    console.print(format_table(run_rows, "run"))
    console.print()
    console.print(format_table([c.row() for c in comparisons], CHECK_TITLE))
    return comparisons


def _draw(mg: MemGraph, out: Path, console: Console) -> list[tuple[str, str]]:
    """Draw the plan, its memory map and its simulated streams under `out`; rows saying
    where each went (or why a drawing was skipped)."""
    out.mkdir(parents=True, exist_ok=True)
    pictures = []
    with console.stage("drawing the plan"):
        drawings = [
            ("plan", "plan.svg", {"max_nodes": PICTURE_MAX_NODES}, PICTURE_NOTE),
            ("one block", "plan_layers.0.svg", {"scope": "layers.0"}, LAYER_NOTE),
        ]
        for what, name, options, note in drawings:
            try:
                path = mg.render(out / name, collapse=True, **options)
                pictures.append((what, f"{path} ({note})"))
            except GraphvizNotFoundError as err:
                pictures.append((what, f"not drawn: {str(err).splitlines()[0]}"))
    with console.stage("drawing the memory map"):
        mg.memory_map(out / "memory_map.png")
        pictures.append(("memory map", str(out / "memory_map.png")))
    with console.stage("drawing the streams"):
        memgraph.simulate(mg, timeline=True).plot(out / "streams.png")
        pictures.append(("streams", f"{out / 'streams.png'} (simulated)"))
    return pictures
