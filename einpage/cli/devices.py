"""The command line for several devices: `einpage plan --devices N`, and `einpage stats`
and `einpage run` of a multi-device plan file (`memgraph.multi_serialize`).

    einpage plan llama:tiny --devices 2 -b 60% -o two.json   a plan per device, the links
    einpage stats two.json                                    each device, simulated, verified
    einpage run two.json --check [--ray]                      run every device; compare
    einpage render two.json --device 1 -o one.svg             draw one device's plan

`plan --devices N --trace SIM.json` writes the simulated timelines of all devices as one
Chrome trace (a process per device, its "peer" lane of direct copies, an arrow per direct
link). `plan` and `stats` list the links, each with its index (`link#3`, as the device
plans' sends and receives name it) and whether it goes direct (`--sends direct`).

`--budget` takes one budget for every device or one per device, comma-separated
(`-b 2GiB,3GiB`); a percentage is read against each device's own graph. `--devices 1`
is the single-device command as it was. A plan file for several devices holds the
program that was placed (the partitioned program with `--partition SIZE`), which
`run --check` evaluates with `taskgraph.evaluate`, as it evaluates a single plan's graph.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import Any

import numpy as np

import taskgraph
from einpage import pipeline
from einpage.cli.checks import (
    CHECK_TITLE,
    compare_outputs,
    raise_on_mismatch,
    summarize,
    tolerance_dtypes,
)
from einpage.cli.console import Console, format_table
from einpage.cli.files import atomic_output, run_inputs, save_arrays
from einpage.cli.outputs import wrote
from einpage.cli.presets import random_inputs
from einpage.pipeline.devices import device_rows, sends_line
from einpage_core.errors import InputError, VerificationError
from einpage_core.units import format_bytes
from memgraph.multi import MultiPlan, verify_multi
from memgraph.multi_serialize import MultiPlanFile
from memgraph.simulate_multi import simulate_multi
from memgraph.trace import devices_chrome_trace
from taskgraph import TaskGraph

__all__ = [
    "format_columns",
    "parse_budgets",
    "plan_devices_command",
    "stats_multi",
    "run_multi",
    "links_lines",
    "device_to_render",
    "PICTURES",
    "LINKS_SHOWN",
]

PICTURES = ("render", "memory_map", "timeline", "memory_snapshot")
"""`einpage plan`'s pictures and exports, drawn of one device's plan only (`--trace` is
written of all devices together)."""

LINKS_SHOWN = 24
"""The most links `links_lines` lists (`einpage stats --json` lists every one)."""


def links_lines(mp: MultiPlan, limit: int | None = LINKS_SHOWN) -> list[str]:
    """The links of `mp` for the terminal: a title saying how many go direct, then one
    line per link (at most `limit`; None: all), numbered as sends and receives name them.

    `links (2, 1 direct)`, `  link#0 %6 f32[64,64] 16.0 KiB: device 0 ... direct`."""
    direct = sum(1 for k in mp.links if k.path == "peer")
    shown = mp.links if limit is None else mp.links[:limit]
    lines = [f"links ({len(mp.links)}, {direct} direct)"]
    lines += [f"  link#{i} {link.describe()}" for i, link in enumerate(shown)]
    if len(shown) < len(mp.links):
        lines.append(
            f"  ... and {len(mp.links) - len(shown)} more (einpage stats --json lists all)"
        )
    return lines


def parse_budgets(text: str) -> str | list[str]:
    """`--budget` for several devices: one budget, or one per device comma-separated.

    >>> parse_budgets("50%"), parse_budgets("2GiB, 3GiB")
    ('50%', ['2GiB', '3GiB'])
    """
    parts = [part.strip() for part in text.split(",")]
    return parts[0] if len(parts) == 1 else parts


def format_columns(rows: list[tuple[str, ...]], title: str) -> str:
    """A header row and rows of cells as right-aligned columns, under `title`.

    >>> print(format_columns([("device", "peak"), ("0", "1.0 KiB")], "devices"))
    devices
      device     peak
           0  1.0 KiB
    """
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [title]
    lines += [
        "  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    ]
    return "\n".join(lines)


def _cost_model(mp: MultiPlan, asked: str | None) -> str | None:
    return asked or mp.info.get("plan_options", {}).get("cost_model") or None


def plan_devices_command(
    args: argparse.Namespace, console: Console, tg: TaskGraph, partition: str | int
) -> int:
    """`einpage plan PROGRAM --devices N`: compile for N devices, print a table per
    device and the simulated makespan, write the plan file with `-o`."""
    for attribute in PICTURES:
        if getattr(args, attribute, None):
            option = "--" + attribute.replace("_", "-")
            raise InputError(
                f"{option} draws the plan of one device; with --devices {args.devices}, "
                f"-o writes the plans and `einpage render PLAN.json --device D` draws device "
                f"D's (--trace writes all devices' simulated streams)"
            )
    with console.stage("compiling"):
        compiled = pipeline.compile_devices(
            tg,
            parse_budgets(args.budget),
            args.devices,
            strategy=args.strategy,
            sends=args.sends,
            partition=partition,
            order=args.order,
            eviction=args.eviction,
            cost_model=args.cost_model,
        )
    mp = compiled.plan
    console.print(format_table(compiled.rows(), f"plan for {args.devices} devices"))
    console.print()
    console.print(format_columns(device_rows(mp), "devices"))
    console.print()
    console.print("\n".join(links_lines(mp)))
    console.print()
    with console.stage("simulating"):
        sim = simulate_multi(mp, args.cost_model, timeline=bool(args.trace))
    console.print("simulated, all devices together")
    console.print(sim.table())
    if args.output:
        with console.stage("writing the plan"), atomic_output(args.output) as temporary:
            compiled.save(temporary)
        wrote(console, "plan for several devices", args.output)
    if args.trace:
        document = devices_chrome_trace(
            [r.events for r in sim.per_device],
            tg.name,
            {"cost_model": sim.cost_model.name, "makespan_s": sim.makespan},
        )
        with atomic_output(args.trace) as temporary:
            temporary.write_text(json.dumps(document), encoding="utf-8")
        wrote(console, "simulated trace of all devices (open it in https://ui.perfetto.dev)",
              args.trace)  # fmt: skip
    return 0


def stats_multi(args: argparse.Namespace, console: Console, loaded: MultiPlanFile) -> int:
    """`einpage stats` of a multi-device plan file: each device, the simulated time of all
    together, and `verify_multi` (raised at the end if it fails: exit code 1)."""
    mp = loaded.plan
    with console.stage("simulating"):
        sim = simulate_multi(mp, _cost_model(mp, args.cost_model))
    with console.stage("verifying"):
        try:
            report, failure = verify_multi(mp), None
        except VerificationError as err:
            report, failure = None, err
    if args.json:
        document = {
            "devices": mp.devices,
            "strategy": mp.placed.strategy,
            "program": None if loaded.program is None else loaded.program.name,
            "links": len(mp.links),
            "sent_bytes": sum(k.nbytes for k in mp.links),
            "direct_links": sum(1 for k in mp.links if k.path == "peer"),
            "direct_bytes": sum(k.nbytes for k in mp.links if k.path == "peer"),
            "link_list": [
                {
                    "link": index,
                    "task": k.task,
                    "source": k.source,
                    "target": k.target,
                    "bytes": k.nbytes,
                    "path": k.path,
                }
                for index, k in enumerate(mp.links)
            ],
            "per_device": [
                {
                    "device": p.device,
                    "tasks": len(p.mg.taskgraph),
                    "budget": p.budget,
                    "stats": p.mg.stats.as_dict(),
                    "direct_sent_bytes": sum(
                        k.nbytes for k in mp.links if k.path == "peer" and k.source == p.device
                    ),
                    "direct_received_bytes": sum(
                        k.nbytes for k in mp.links if k.path == "peer" and k.target == p.device
                    ),
                    "finish_s": sim.per_device[p.device].makespan,
                    "compute_s": sim.per_device[p.device].compute_seconds,
                }
                for p in mp.plans
            ],
            "simulated": {"cost_model": sim.cost_model.name, "makespan_s": sim.makespan},
            "verified": failure is None,
            "info": dict(mp.info),
        }
        console.print(json.dumps(document, indent=2))
    else:
        console.print(f"{args.plan}: {mp!r}")
        console.print()
        console.print(format_columns(device_rows(mp), "devices"))
        console.print()
        console.print(format_table([("sends", sends_line(mp))]))
        console.print("\n".join(links_lines(mp)))
        console.print()
        console.print("simulated, all devices together")
        console.print(sim.table())
        if report is not None:
            console.print()
            verdict = (
                f"ok: {report.devices} plans, {report.links} links, {report.nodes} nodes, "
                f"{report.edges} dependencies, acyclic"
            )
            console.print(format_table([("verify", verdict)]))
    if failure is not None:
        raise failure
    return 0


def device_to_render(path: str, device: int) -> tuple[Any, list[str]]:
    """`einpage render PLAN.json --device D`: device D's MemGraph of a plan file for several
    devices, and lines naming the links its sends and receives carry (its staged ones
    too), to print after the picture."""
    from einpage.cli.files import load_plan_file

    loaded = load_plan_file(path)
    if not isinstance(loaded, MultiPlanFile):
        raise InputError(
            f"--device picks one device of a plan for several devices; {path} is a plan for "
            f"one device: draw it without --device"
        )
    mp = loaded.plan
    if not 0 <= device < mp.devices:
        raise InputError(
            f"--device {device}: {path} is a plan for {mp.devices} devices, 0..{mp.devices - 1}"
        )
    mine = [(i, k) for i, k in enumerate(mp.links) if device in (k.source, k.target)]
    direct = sum(1 for _, k in mine if k.path == "peer")
    lines = [f"device {device}'s links ({len(mine)}, {direct} direct)"]
    lines += [f"  link#{i} {k.describe()}" for i, k in mine]
    return mp.plans[device].mg, lines


def _random_inputs(loaded: MultiPlanFile, seed: int) -> dict[str, np.ndarray]:
    """Random arrays for the driver's inputs: the program's (when the file holds it), else
    each input as the first device that reads it declares it."""
    if loaded.program is not None:
        return random_inputs(loaded.program, seed)
    mp = loaded.plan
    arrays: dict[str, np.ndarray] = {}
    for plan in mp.plans:
        drawn = random_inputs(plan.mg.taskgraph, seed)
        for name in mp.placed.inputs:
            if name in drawn and name not in arrays:
                arrays[name] = drawn[name]
    return arrays


def run_multi(args: argparse.Namespace, console: Console, loaded: MultiPlanFile) -> int:
    """`einpage run` of a multi-device plan file: every device on a thread of this process
    (the default) or on a local Ray instance (`--ray`); `--check` compares the outputs
    with `taskgraph.evaluate` of the program the file holds."""
    mp, program = loaded.plan, loaded.program
    for option, given in (("--trace", args.trace), ("--mode", args.mode)):
        if given:
            raise InputError(
                f"{option} applies to a plan for one device; {args.plan} is a plan for "
                f"{mp.devices} devices (each runs dependency-driven)"
            )
    if args.check and program is None:
        raise InputError(
            f"{args.plan} holds no program to check against (it was written without one); "
            f"run it without --check, or write it with `einpage plan ... --devices N -o`"
        )
    with console.stage("preparing inputs"):
        draw = partial(_random_inputs, loaded)
        arrays, source = run_inputs(args.inputs, args.random_inputs, draw)
        if program is not None:
            program.check_inputs(arrays)
    options: dict[str, Any] = {"backend": args.backend}
    if args.sync:
        options["debug"] = True
    runner = "ray" if args.ray else "local"
    with console.stage(f"running ({'a local Ray instance' if args.ray else 'in this process'})"):
        if args.ray:
            from runtime.ray_cluster import run_on_ray

            outputs = run_on_ray(mp, arrays, **options)
        else:
            from runtime.multi import run_devices

            outputs = run_devices(mp, arrays, **options)
    comparisons = []
    if args.check:
        with console.stage("evaluating the reference"):
            reference = taskgraph.evaluate(program, arrays)
        with console.stage("comparing"):
            comparisons = compare_outputs(outputs, reference, tolerance_dtypes(program))
    budgets = ", ".join(format_bytes(p.budget) for p in mp.plans)
    rows = [
        ("plan", f"{args.plan}: {mp.devices} devices, {len(mp.links)} links, budgets {budgets}"),
        ("inputs", f"{len(arrays)} arrays, {source}"),
        ("runner", f"{runner} ({args.backend} backend)"),
        ("time", " · ".join(f"{n} {s:.2f} s" for n, s in console.timings.items())),
    ]
    console.print(format_table(rows, "run"))
    console.print()
    console.print(format_table([_output_row(n, v) for n, v in outputs.items()], "outputs"))
    if comparisons:
        console.print()
        console.print(format_table([c.row() for c in comparisons], CHECK_TITLE))
    if args.output:
        with atomic_output(args.output) as temporary:
            save_arrays(temporary, outputs)
        wrote(console, "outputs", args.output)
    raise_on_mismatch(comparisons)
    return 0


def _output_row(name: str, value: Any) -> tuple[str, str]:
    return name, summarize(np.asarray(value))
