"""`einpage demo` (and `make demo`): the whole pipeline on the demo MLP, with pictures.

It builds the MLP (`einpage.presets.mlp_program`) and plans it for a device with (by
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
from einpage.cli import (
    CHECK_TITLE,
    EXIT_OK,
    Console,
    compare_outputs,
    compile_program,
    format_table,
    plan_report,
    program_rows,
    raise_on_mismatch,
)
from einpage.presets import mlp_program, random_inputs
from einpage_core.errors import GraphvizNotFoundError
from einpage_core.units import format_bytes

__all__ = ["run_demo", "mlp_program", "random_inputs", "PICTURE_MAX_NODES"]

PICTURE_MAX_NODES = 120
"""Nodes drawn in the demo's plan picture (after folding allocs and frees)."""
PICTURE_NOTE = (
    f"allocs and frees folded; the first {PICTURE_MAX_NODES} nodes, a note lists the rest"
)
LAYER_NOTE = "the nodes of the first residual block, allocs and frees folded"


def run_demo(
    out_dir: str | Path = "out",
    backend: str = "auto",
    budget: str = "50%",
    console: Console | None = None,
    seed: int = 0,
) -> int:
    """Run the demo; returns a process exit code (0 when the outputs match the reference).

    Raises `einpage.cli.CheckFailedError` when they do not.
    """
    console = console or Console()
    say = console.print
    out = Path(out_dir) / "demo"
    with console.stages(11):
        with console.stage("building the program"):
            tg = mlp_program().build()
            rows = program_rows(tg)
        say(f"einpage demo: plan {tg.name!r} for a device smaller than it needs, run it, check it")
        say()
        say(format_table(rows, f"program {tg.name!r}"))

        compiled = compile_program(tg, budget, console=console)
        mg = compiled.plan
        with console.stage("verifying"):
            report = memgraph.verify(mg)
        s = mg.stats
        plan_rows = [("budget", compiled.budget_note)]
        if compiled.block_limit is not None:
            plan_rows.append(
                (
                    "partition",
                    f"{len(tg)} -> {len(compiled.graph)} tasks: tasks whose operands and "
                    f"output exceed {format_bytes(compiled.block_limit)} run in blocks",
                )
            )
        plan_rows += [
            ("plan", f"{len(mg)} nodes in {compiled.timings['planning']:.2f} s"),
            ("offloads", f"{s.offload_count} ({format_bytes(s.offload_bytes)} device -> host)"),
            ("reloads", f"{s.reload_count} ({format_bytes(s.reload_bytes)} host -> device)"),
            (
                "verify",
                f"ok: {report.nodes} nodes, {report.dependencies_checked} dependencies, "
                f"peak {format_bytes(report.peak_bytes)} <= budget {format_bytes(mg.budget)}",
            ),
        ]
        say()
        say(format_table(plan_rows, "plan"))

        with console.stage("making inputs"):
            arrays = random_inputs(tg, seed)
        with console.stage("running"), runtime.Session(mg, backend) as session:
            outputs = session.run(arrays)
            last = session.last
        with console.stage("evaluating the reference"):
            reference = taskgraph.evaluate(tg, arrays)
            comparisons = compare_outputs(outputs, reference)
        say()
        say(
            format_table(
                [
                    ("backend", f"{last.backend} ({last.mode} mode)"),
                    ("time", f"{last.seconds:.2f} s"),
                ],
                "run",
            )
        )
        say()
        say(format_table([c.row() for c in comparisons], CHECK_TITLE))
        say()
        say(plan_report(mg))

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
        say()
        say(format_table(pictures, "pictures"))

    raise_on_mismatch(comparisons)
    return EXIT_OK
