"""What the CLI writes: output paths checked before any work, files written whole
(`einpage.cli.files.atomic_output`), and `einpage plan`'s pictures and exports, each written
on its own so that one failure does not stop the others (`PicturesFailedError`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import memgraph
from einpage.cli.console import Console
from einpage.cli.files import atomic_output, check_output
from einpage_core.dot import DEFAULT_MAX_NODES
from einpage_core.errors import EinpageError
from memgraph import MemGraph
from memgraph.snapshot import write_memory_snapshot

__all__ = [
    "PLAN_OUTPUTS",
    "GENERATE_OUTPUTS",
    "PicturesFailedError",
    "check_outputs",
    "max_nodes",
    "plan_exports",
    "plan_pictures",
    "write_each",
    "wrote",
]


def wrote(console: Console, what: str, path: Path | str) -> None:
    console.print(f"wrote {what}: {path}")


def check_outputs(args: argparse.Namespace, *outputs: tuple[str, str, str]) -> None:
    """Every output path the command was given, checked before any work (`check_output`):
    (attribute, kind, option) triples."""
    for attribute, kind, option in outputs:
        value = getattr(args, attribute, None)
        if value:
            check_output(value, kind, option)


PLAN_OUTPUTS = (
    ("output", "JSON file", "-o"),
    ("render", "graph picture", "--render"),
    ("memory_map", "plot", "--memory-map"),
    ("timeline", "plot", "--timeline"),
    ("trace", "JSON file", "--trace"),
    ("memory_snapshot", "snapshot", "--memory-snapshot"),
)
"""`einpage plan`'s outputs: (attribute, kind, option)."""

GENERATE_OUTPUTS = (
    ("render", "graph picture", "--render"),
    ("memory_map", "plot", "--memory-map"),
)
"""`einpage generate`'s outputs (pictures of its largest plan)."""


class PicturesFailedError(EinpageError):
    """Some of the requested pictures or exports failed; the others were written."""

    def __init__(self, failed: list[tuple[str, EinpageError]]):
        lines = "; ".join(f"{what}: {err}" for what, err in failed)
        super().__init__(f"{len(failed)} output(s) not written ({lines})")
        self.failed = failed


def write_each(
    failed: list, console: Console, what: str, option: str, path: Any, write: Any
) -> None:
    """Write one picture or export with `write(temporary_path)`; an error is recorded in
    `failed` (the others still get written) and leaves nothing at `path`."""
    try:
        with atomic_output(path) as temporary:
            write(temporary)
    except (EinpageError, OSError) as err:
        failed.append((f"{option} {path}", err))
        return
    wrote(console, what, path)


def plan_pictures(args: argparse.Namespace, mg: MemGraph, console: Console) -> list:
    """The plan's pictures (`--render`, `--memory-map`, and `--timeline` where the command
    has it); returns the ones that failed as (what, error)."""
    failed: list = []
    if args.render:
        limit = max_nodes(getattr(args, "max_nodes", DEFAULT_MAX_NODES))
        with console.stage("drawing the plan"):
            write_each(failed, console, "plan picture", "--render", args.render,
                  lambda p: mg.render(p, collapse=True, max_nodes=limit))  # fmt: skip
    if args.memory_map:
        with console.stage("drawing the memory map"):
            write_each(
                failed, console, "memory map", "--memory-map", args.memory_map, mg.memory_map
            )
    if getattr(args, "timeline", None):
        with console.stage("simulating the streams"):
            sim = memgraph.simulate(mg, args.cost_model, timeline=True)
            write_each(failed, console, "stream timeline", "--timeline", args.timeline, sim.plot)
    return failed


def plan_exports(args: argparse.Namespace, mg: MemGraph, console: Console) -> list:
    """`--trace` and `--memory-snapshot`: the simulated schedule as a Chrome trace (the
    lanes and event names of `einpage run --trace`) and the device memory as a PyTorch
    memory snapshot; returns the ones that failed."""
    failed: list = []
    if args.trace:
        with console.stage("simulating the streams"):
            sim = memgraph.simulate(mg, args.cost_model, timeline=True)
            where = "simulated trace (open it in https://ui.perfetto.dev)"
            write_each(failed, console, where, "--trace", args.trace, sim.write_chrome_trace)
    if args.memory_snapshot:
        where = "memory snapshot (open it in https://pytorch.org/memory_viz)"
        write_each(failed, console, where, "--memory-snapshot", args.memory_snapshot,
              lambda p: write_memory_snapshot(mg, p))  # fmt: skip
    return failed


def max_nodes(value: int) -> int | None:
    return None if value == 0 else value
