"""The `einpage` command line: show, plan, inspect, run and draw programs and plans.

    einpage show llama:tiny                       the TaskGraph and its memory needs
    einpage plan mlp --budget 50% -o plan.json    plan for a device of that many bytes
    einpage stats plan.json                       what the plan does, simulated and verified
    einpage run plan.json --check                 execute it; compare with the reference
    einpage plan mlp --devices 2 -b 50% -o two.json   a plan per device (--strategy tensor, auto)
    einpage run two.json --check [--ray]          every device, in this process or on Ray
    einpage render plan.json -o plan.svg --collapse   (layers folded; --scope layers.3)
    einpage demo                                  all of the above on the demo MLP
    einpage presets                               the programs known by name

A PROGRAM is a preset name, a TaskGraph JSON file or a Python file (executed: see
`einpage.cli.presets`). A budget is bytes (`1073741824`), a size (`8GiB`, `512MiB`,
`1.5GB`) or a percentage of one of the program's reference points (`einpage show` and
`einpage plan` print them; see `memgraph.budgets`): of its resident peak (`50%`, or
`50%resident`: all weights stay on the device, so `100%` moves nothing) or of its
streaming minimum (`150%streaming`: weights loaded just in time, nothing written back).
Plans are JSON files (`MemGraph.to_json`), validated on load.

`python -m einpage` is the same command. Errors word their advice in the command's own
flags (`--partition auto`, `--max-blocks`, `--backend numpy`): the library's messages
name Python keywords, and `cli_words` rewords them (`CLI_SPELLINGS`).

Exit codes (`EXIT_*`): 0 success; 1 a check failed (`run --check` found outputs that
differ from the reference evaluator, or a plan fails `memgraph.verify`); 2 bad input
(usage, a missing or invalid file, an unknown preset, a malformed budget, a program
that does not build, inputs that do not fit); 3 the budget is infeasible; 4 this
machine lacks something (Graphviz's `dot`, CuPy or a GPU); 130 interrupted. Errors
print one line (and a hint) on stderr, never a traceback for an `EinpageError`.

Progress bars (a step per stage, and how far the planner and the verifier are within
theirs: `einpage.compile(progress=)`) go to stderr when both stdout and stderr are
terminals, unless `--quiet`.

This module parses arguments and prints; what it runs lives in the library:
`einpage.pipeline` (`einpage.compile`: partition, plan, verify), `einpage.cli.checks`
(outputs against the reference), `einpage.cli.files` (plans, graphs and arrays on disk) and
`einpage.cli.console` (the console, tables and summaries).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

import memgraph
import runtime
import taskgraph
from einpage import pipeline
from einpage.cli.checks import (
    CHECK_TITLE,
    CheckFailedError,
    compare_outputs,
    raise_on_mismatch,
    summarize,
    tolerance_dtypes,
)
from einpage.cli.console import Console, format_table, plan_report, plan_title, program_rows
from einpage.cli.devices import device_to_render, plan_devices_command, run_multi, stats_multi
from einpage.cli.files import (
    atomic_output,
    load_json_graph,
    load_plan_file,
    run_inputs,
    save_arrays,
    save_plan,
)
from einpage.cli.generate import add_generate, positive_int
from einpage.cli.outputs import (
    PLAN_OUTPUTS,
    PicturesFailedError,
    check_outputs,
    max_nodes,
    plan_exports,
    plan_pictures,
    wrote,
)
from einpage.cli.presets import PRESETS, load_program, random_inputs
from einpage.pipeline import (
    AUTO,
    MAX_AUTO_BLOCKS,
    PARTITION_MODES,
    Compiled,
    TooManyBlocksError,
    explicit_partition,
)
from einpage.pipeline.weight_files import planned_weights
from einpage.version import __version__
from einpage_core.dot import Selection, select_ids
from einpage_core.errors import (
    BackendUnavailableError,
    EinpageError,
    GraphvizNotFoundError,
    InfeasibleBudgetError,
    InputError,
    MissingDependencyError,
    VerificationError,
)
from einpage_core.progress import ProgressReport
from einpage_core.units import BudgetFormatError, format_bytes, format_exact, parse_bytes
from memgraph import COST_MODELS, ORDERS, POLICIES, MemGraph, PlanOptions, budget_references
from memgraph.cost import DEFAULT_DISK, DISKS
from memgraph.multi import DeviceBudgetError
from memgraph.multi_serialize import MultiPlanFile
from memgraph.peer import SENDS
from memgraph.placement import STRATEGIES
from memgraph.render import memgraph_selection
from runtime.session import disk_stand_ins
from runtime.tiers import disk_inputs
from taskgraph import TaskGraph
from taskgraph.partition import BlockLimitError
from taskgraph.render import DEFAULT_MAX_NODES, render_taskgraph

__all__ = [
    "main",
    "build_parser",
    "Console",
    "format_table",
    "program_rows",
    "plan_report",
    "exit_code",
    "hint",
    "report_error",
    "cli_words",
    "CLI_SPELLINGS",
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
EXIT_STDOUT_CLOSED = 141
"""128 + SIGPIPE: the reader of stdout went away (`einpage plan ... | head`); files asked
for were still written, and nothing is printed about it, as Unix tools do."""


# -- subcommands -------------------------------------------------------------------------


def _program(args: argparse.Namespace) -> TaskGraph:
    return load_program(args.program, batch=args.batch, seq=args.seq, dtype=args.dtype)


def _cmd_show(args: argparse.Namespace, console: Console) -> int:
    check_outputs(args, ("output", "JSON file", "-o"), ("render", "graph picture", "--render"))
    with console.stages(2):
        with console.stage("building the program"):
            tg = _program(args)
            if args.partition is not None:
                tg = explicit_partition(tg, parse_block_size(args.partition))
        with console.stage("measuring"):
            rows = program_rows(tg)
    if not args.summary:
        console.print(str(tg))
        console.print()
    console.print(format_table(rows, f"program {tg.name!r}"))
    if args.output:
        with atomic_output(args.output) as temporary:
            temporary.write_text(tg.to_json(), encoding="utf-8")
        wrote(console, "TaskGraph", args.output)
    if args.render:
        path = render_taskgraph(tg, args.render, max_nodes=max_nodes(args.max_nodes))
        wrote(console, "picture", path)
    return EXIT_OK


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    check_outputs(args, *PLAN_OUTPUTS)
    partition_arg = parse_partition(args.partition)
    if args.sends != "host" and args.devices == 1:
        raise InputError(
            f"--sends {args.sends} sends tensors between devices: give --devices N (N > 1)"
        )
    tiered = [f for f in ("host_budget", "checkpoint", "spill") if getattr(args, f) is not None]
    if tiered and args.devices > 1:
        flags = ", ".join("--" + f.replace("_", "-") for f in tiered)
        raise InputError(f"{flags}: a host tier is planned for one device (not --devices N)")
    if args.devices > 1:
        with console.stages(3 + bool(args.output)):
            with console.stage("building the program"):
                tg = _program(args)
            return plan_devices_command(args, console, tg, partition_arg)
    pictures = sum(1 for p in (args.render, args.memory_map, args.timeline, args.trace) if p)
    with console.stages(4 + pictures + bool(args.output)):
        with console.stage("building the program"):
            tg = _program(args)
        with console.stage("compiling"):
            compiled = _compile(tg, args, partition_arg, console)
        mg = compiled.plan
        console.print(format_table(compiled.rows(), plan_title(mg)))
        console.print()
        with console.stage("measuring the reference points"):
            refs = budget_references(tg, PlanOptions(order=args.order, eviction=args.eviction))
        console.print(format_table(refs.rows(), "budget reference points"))
        console.print()
        with console.stage("simulating"):
            console.print(plan_report(mg, args.cost_model))
        if args.output:
            with console.stage("writing the plan"), atomic_output(args.output) as temporary:
                save_plan(mg, temporary, progress=console.report)
            wrote(console, "plan", args.output)
        failed = plan_pictures(args, mg, console) + plan_exports(args, mg, console)
    if failed:
        raise PicturesFailedError(failed)
    return EXIT_OK


def _compile(
    tg: TaskGraph, args: argparse.Namespace, partition_arg: str | int, console: Console
) -> Compiled:
    """`einpage.compile` with the command's options; `--partition auto` stops at
    `--max-blocks` blocks (`MAX_AUTO_BLOCKS` unless given)."""
    return pipeline.compile(
        tg,
        args.budget,
        partition=partition_arg,
        order=args.order,
        eviction=args.eviction,
        cost_model=args.cost_model,
        max_blocks=args.max_blocks,
        progress=console.report,
        host_budget=getattr(args, "host_budget", None),
        checkpoint=getattr(args, "checkpoint", None),
        spill=getattr(args, "spill", None),
    )


def _cmd_stats(args: argparse.Namespace, console: Console) -> int:
    with console.stages(3):
        with console.stage("loading the plan"):
            mg = load_plan_file(args.plan, progress=console.report)
        if isinstance(mg, MultiPlanFile):
            return stats_multi(args, console, mg)
        with console.stage("simulating"):
            machine = args.cost_model or mg.info.get("cost_model") or None
            sim = memgraph.simulate(mg, machine, disk=args.disk)
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
        console.print(f"{args.plan}: {plan_title(mg)}")
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
    check_outputs(args, ("output", "file of arrays", "-o"), ("trace", "JSON file", "--trace"))
    stages = 4 + 2 * bool(args.check)
    with console.stages(stages):
        with console.stage("loading the plan"):
            mg = load_plan_file(args.plan, progress=console.report)
        if isinstance(mg, MultiPlanFile):
            return run_multi(args, console, mg)
        if args.ray:
            raise InputError(
                f"--ray runs a plan for several devices; {args.plan} is a plan for one "
                f"(run it without --ray, or plan with --devices N)"
            )
        tg = mg.taskgraph
        on_disk = disk_inputs(mg)  # read by the plan from its checkpoint, not passed
        with console.stage("preparing inputs"):
            draw = partial(random_inputs, tg)
            arrays, source = run_inputs(args.inputs, args.random_inputs, draw)
            if args.inputs is None:
                arrays = {k: v for k, v in arrays.items() if k not in on_disk}
            tg.check_inputs({**arrays, **disk_stand_ins(mg)})
        with console.stage("staging"):  # the arena, host storage and staging slots
            debug = True if args.sync else None  # None: EINPAGE_SYNC decides
            session = runtime.Session(
                mg, args.backend, mode=args.mode, debug=debug, spill=args.spill,
                direct_io=args.direct_io,
            )  # fmt: skip
        with console.stage("running"), session:
            ran = ProgressReport(console.report, {"running": 1.0}).stage("running", len(mg))
            outputs = session.run(arrays, trace=bool(args.trace), progress=ran)
            last = session.last
            if args.trace:
                with atomic_output(args.trace) as temporary:
                    last.trace.write(temporary)
        comparisons = []
        if args.check:
            with console.stage("evaluating the reference"):
                reference = taskgraph.evaluate(tg, {**arrays, **planned_weights(mg)})
            with console.stage("comparing"):
                comparisons = compare_outputs(outputs, reference, tolerance_dtypes(tg))
    rows = [
        ("plan", f"{args.plan}: {tg.name!r}, {len(mg)} nodes, budget {format_bytes(mg.budget)}"),
        ("inputs", f"{len(arrays)} arrays, {source}"),
        ("backend", f"{last.backend} ({last.mode} mode)"),
        ("time", _stage_times(console.timings, last.seconds)),
    ]
    peak = last.memory.get("device_peak_bytes")
    if peak is not None:
        rows.append(("device memory", format_bytes(peak)))
    if mg.tier is not None:
        s = mg.stats
        rows.append(
            (
                "host tier",
                f"budget {format_bytes(mg.tier.budget)}, planned peak "
                f"{format_bytes(s.host_peak_bytes)}; {len(on_disk)} inputs read from their "
                f"checkpoint, {format_bytes(s.disk_read_bytes)} read and "
                f"{format_bytes(s.disk_write_bytes)} written{_direct_io(args, last)}",
            )
        )
    console.print(format_table(rows, "run"))
    console.print()
    console.print(format_table([_output_row(n, v) for n, v in outputs.items()], "outputs"))
    if comparisons:
        console.print()
        console.print(format_table([c.row() for c in comparisons], CHECK_TITLE))
    if args.trace:
        wrote(console, "trace (open it in https://ui.perfetto.dev)", args.trace)
    if args.output:
        with atomic_output(args.output) as temporary:
            save_arrays(temporary, outputs)
        wrote(console, "outputs", args.output)
    raise_on_mismatch(comparisons)
    return EXIT_OK


def _direct_io(args: argparse.Namespace, last: runtime.RunReport) -> str:
    """What --direct-io got: how many of the plan's disk files were direct (O_DIRECT);
    the others' file systems refused it. Nothing without the flag."""
    if not args.direct_io:
        return ""
    return f"; O_DIRECT for {sum(last.disk_direct)} of {len(last.disk_direct)} files"


def _stage_times(timings: Mapping[str, float], run_seconds: float) -> str:
    """Each stage of `einpage run` with its time, the plan's own run among them (the
    session's wall clock from placing the inputs to the outputs on the host)."""
    parts = [f"{name} {seconds:.2f} s" for name, seconds in timings.items()]
    return " · ".join([*parts, f"(of which the plan's run {run_seconds:.3f} s)"])


def _output_row(name: str, value: np.ndarray) -> tuple[str, str]:
    """An output's row: `checks.summarize` (its non-finite values first, if any)."""
    return name, summarize(value)


def _cmd_render(args: argparse.Namespace, console: Console) -> int:
    check_outputs(args, ("output", "graph picture", "-o"))
    with console.stages(2):
        with console.stage("loading"):
            if args.device is None:
                graph, links = load_json_graph(args.file, progress=console.report), []
            else:
                graph, links = device_to_render(args.file, args.device)
        options: dict[str, Any] = {"max_nodes": max_nodes(args.max_nodes), "scope": args.scope}
        if isinstance(graph, MemGraph):
            options["collapse"] = args.collapse
            options["fold_layers"] = False if args.unfold else None
            chosen = memgraph_selection(graph, **options)
        elif args.collapse or args.unfold:
            flag = "--collapse" if args.collapse else "--unfold"
            raise InputError(f"{flag} applies to plans; {args.file} is a TaskGraph")
        else:
            chosen = select_ids(
                len(graph), None, args.scope, lambda i: graph[i].scope, options["max_nodes"],
                "task",
            )  # fmt: skip
        with console.stage("drawing"):
            path = graph.render(args.output, **options)
    wrote(console, "picture", path)
    console.print(drawn(chosen, graph, args))
    for line in links:
        console.print(line)
    return EXIT_OK


def drawn(chosen: Selection, graph: MemGraph | TaskGraph, args: argparse.Namespace) -> str:
    """What a picture shows, for the terminal: how many nodes it draws of how many, what
    the node cap left out, and how to draw fewer.

    `drew 400 of the plan's 98,765 nodes; 98,365 more are left out (listed in a note):
    --max-nodes N draws N (0: all). Fewer: --scope layers.3 draws one layer; ...`"""
    plan = isinstance(graph, MemGraph)
    whose, what = ("plan's", "nodes") if plan else ("graph's", "tasks")
    text = f"drew {len(chosen.shown):,} of the {whose} {len(graph):,} {what}"
    if args.scope:
        text += f" (scope {args.scope!r})"
    elif plan and not args.unfold:
        text += " (a folded layer is one box)"
    if chosen.omitted:
        text += (
            f"; {len(chosen.omitted):,} more are left out (listed in a note): --max-nodes N "
            f"draws N (0: all)"
        )
    fewer = [] if args.scope else ["--scope layers.3 draws one layer"]
    if plan and not args.collapse:
        fewer.append("--collapse folds allocs and frees into their users")
    if fewer:
        text += f". Fewer: {'; '.join(fewer)}"
    return text


def _cmd_presets(args: argparse.Namespace, console: Console) -> int:
    console.print(format_table([(p.name, p.describe()) for p in PRESETS.values()], "presets"))
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from einpage.cli.demo import run_demo

    return run_demo(out_dir=args.out, backend=args.backend, budget=args.budget, console=console)


# -- the parser --------------------------------------------------------------------------

PROGRAM_HELP = (
    "a preset (see `einpage presets`: mlp, llama:7b, llama:tiny, gpt2:124m, ...), a "
    "TaskGraph .json file, or a Python .py file defining `program` or `build()`; a "
    "Python file is executed like `python FILE` (with __name__ == '__einpage__')"
)
BUDGET_HELP = (
    "device memory: bytes, a size (8GiB, 512MiB), or a percentage of the resident peak "
    "(50%%: all weights stay, 100%% moves nothing) or of the streaming minimum "
    "(150%%streaming: weights loaded just in time); see `einpage --help`"
)
BUDGETS_EPILOG = """\
budgets (--budget):
  1073741824      bytes
  8GiB, 512MiB    a size: KiB, MiB, GiB, TiB are powers of 1024 (K, M, G, T too);
                  KB, MB, GB, TB powers of 1000
  50%             a percentage of the program's resident peak (also 50%resident):
                  everything stays on the device while needed and every weight stays
                  once loaded, so 100% moves nothing
  150%streaming   a percentage of the program's streaming minimum: weights loaded just
                  in time and dropped after use, nothing written back (about one
                  layer's working set for an LLM)
  `einpage show PROGRAM` and `einpage plan` print both reference points and the
  smallest budget that can work; a budget below it is refused (exit 3) naming the
  smallest one that compiles.

exit codes: 0 ok, 1 a check failed, 2 bad input, 3 infeasible budget, 4 missing tool
(Graphviz, CuPy or a GPU)."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written (line breaks kept), and after an option's help
    its default, unless the help already says it or there is none (argparse's
    `ArgumentDefaultsHelpFormatter` would print `(default: None)` and `(default: False)`)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or default == argparse.SUPPRESS
            or "default" in text
        ):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """The CLI's parsers (and its subcommands', which argparse makes of the same class):
    `HelpFormatter` unless told otherwise."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _max_blocks(text: str) -> int | None:
    """`--max-blocks`: a positive count, or `none` (no cap but the host's memory)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or 'none', got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="einpage",
        description="Compile einsum tensor programs into memory plans for GPUs smaller "
        "than the program needs.",
        epilog=BUDGETS_EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"einpage {__version__}")
    common = Parser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    program = Parser(add_help=False)
    program.add_argument("program", metavar="PROGRAM", help=PROGRAM_HELP)
    program.add_argument("--batch", type=positive_int, help="batch size (presets, build())")
    program.add_argument("--seq", type=positive_int, help="sequence length (model presets)")
    program.add_argument("--dtype", help="float16, bfloat16, float32 or float64 (presets, build())")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_show(commands, common, program)
    _add_plan(commands, common, program)
    _add_stats(commands, common)
    _add_run(commands, common)
    _add_render(commands, common)
    _add_demo(commands, common)
    _add_presets(commands, common)
    add_generate(commands, common)
    return parser


def _add_show(
    commands: Any, common: argparse.ArgumentParser, program: argparse.ArgumentParser
) -> None:
    """The `show` subcommand."""
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


def _add_plan(
    commands: Any, common: argparse.ArgumentParser, program: argparse.ArgumentParser
) -> None:
    """The `plan` subcommand."""
    plan = commands.add_parser(
        "plan",
        parents=[common, program],
        help="plan a program for a device with BUDGET bytes",
        description="Plan PROGRAM to run in BUDGET bytes of device memory; print what the "
        "plan does and its simulated time.",
        epilog=BUDGETS_EPILOG,
    )
    plan.add_argument("--budget", "-b", required=True, help=BUDGET_HELP)
    plan.add_argument(
        "--devices",
        type=positive_int,
        default=1,
        metavar="N",
        help="plan for N devices: the program placed on them (--strategy), a plan per "
        "device under its own budget (--budget B for all, or B0,B1,... one each; a "
        "percentage is of each device's own graph), -o writes them as one file",
    )
    plan.add_argument(
        "--strategy",
        choices=[*STRATEGIES, AUTO],
        default="pipeline",
        help="how --devices places the program: pipeline (consecutive layers per device, "
        "by weight bytes), tensor (each device its share of every layer's heads and MLP "
        "columns, partial sums added on every device), auto (each planned, the fastest "
        "on --cost-model kept)",
    )
    plan.add_argument(
        "--sends",
        choices=list(SENDS),
        default="host",
        help="how --devices sends tensors between devices: host (staged through host "
        "memory: an offload, then a reload) or direct (device to device, NVLink or PCIe "
        "peer-to-peer, wherever that cannot deadlock; the others stay staged and the table "
        "says why)",
    )
    plan.add_argument(
        "--host-budget",
        metavar="SIZE|PCT",
        help="plan host memory too, within SIZE (e.g. 16GiB) or a percentage of what the "
        "host would hold: what does not fit is read from --checkpoint where it is, or "
        "spilled to a file in --spill DIR at run time",
    )
    plan.add_argument(
        "--checkpoint",
        metavar="FILE.safetensors|DIR",
        help="read the program's weights from this safetensors file (or sharded folder), "
        "by input name, where they are (einpage.weight_files.save_weights writes one); "
        "implies a host tier (--host-budget, default 100%%)",
    )
    plan.add_argument(
        "--spill",
        metavar="DIR",
        help="what does not fit --host-budget goes to a spill file in DIR when the plan "
        "runs (einpage run PLAN --spill DIR); without it, a plan that must spill is refused",
    )
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
        "--max-blocks",
        type=_max_blocks,
        default=MAX_AUTO_BLOCKS,
        metavar="N|none",
        help=f"--partition auto refuses budgets that would make more tasks than this "
        f"(default {MAX_AUTO_BLOCKS:,}; none: only the host's memory limits it)",
    )
    plan.add_argument(
        "--cost-model",
        choices=list(COST_MODELS),
        default="h100-pcie5",
        help="the machine's cost model (FLOP rate, transfer bandwidths): it sets how far "
        "the planner prefetches and what the simulator times",
    )
    plan.add_argument("-o", "--output", metavar="PLAN.json", help="write the plan")
    plan.add_argument("--render", metavar="FILE", help="draw the plan, collapsed (.svg, .png)")
    plan.add_argument(
        "--max-nodes", type=_count, default=DEFAULT_MAX_NODES, help="most nodes drawn (0: all)"
    )
    plan.add_argument("--memory-map", metavar="FILE", help="draw the memory map (.png, .svg)")
    plan.add_argument("--timeline", metavar="FILE", help="draw the simulated streams (.png)")
    plan.add_argument(
        "--trace", metavar="SIM.json", help="write the simulated streams as a Chrome trace"
    )
    plan.add_argument(
        "--memory-snapshot",
        metavar="SNAP.pickle",
        help="write the device memory as a PyTorch memory snapshot (pytorch.org/memory_viz)",
    )
    plan.set_defaults(handler=_cmd_plan)


def _add_stats(commands: Any, common: argparse.ArgumentParser) -> None:
    """The `stats` subcommand."""
    stats = commands.add_parser(
        "stats",
        parents=[common],
        help="what a plan does: memory, transfers, simulated time, verification",
        description="Print what PLAN.json does (memory, transfers), its simulated time, "
        "and whether it passes memgraph.verify (exit code 1 if not). A plan with a host "
        "tier also prints what it needs of host memory and disk, and its disk's reads and "
        "writes in the simulated time. A plan for several "
        "devices (einpage plan --devices N) prints each device, the simulated time of all "
        "together, and memgraph.multi.verify_multi.",
    )
    stats.add_argument("plan", metavar="PLAN.json")
    stats.add_argument(
        "--cost-model",
        choices=list(COST_MODELS),
        help="the machine's cost model the simulator times the plan on (default: the plan's)",
    )
    stats.add_argument(
        "--disk",
        choices=list(DISKS),
        help="the drive below a plan's host tier, for its reads and writes (default: the "
        f"cost model's, else {DEFAULT_DISK})",
    )
    stats.add_argument("--json", action="store_true", help="print JSON instead of tables")
    stats.set_defaults(handler=_cmd_stats)


def _add_run(commands: Any, common: argparse.ArgumentParser) -> None:
    """The `run` subcommand."""
    run = commands.add_parser(
        "run",
        parents=[common],
        help="execute a plan; --check compares with the reference evaluator",
        description="Execute PLAN.json on random inputs or an .npz of named arrays; "
        "--check compares the outputs with taskgraph.evaluate (exit code 1 if they differ). "
        "A plan for several devices (einpage plan --devices N) runs each device on a "
        "thread of this process, or with --ray on a local Ray instance.",
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
    run.add_argument(
        "--ray",
        action="store_true",
        help="a plan for several devices: run each device in a Ray actor of a local Ray "
        "instance (pip install 'einpage[cluster]')",
    )
    run.add_argument(
        "--sync",
        action="store_true",
        help="synchronize after each node, so that a failure names the node that failed "
        "(slower; EINPAGE_SYNC=1 does the same)",
    )
    run.add_argument("--trace", metavar="TRACE.json", help="write a Chrome trace of the run")
    run.add_argument(
        "--spill",
        metavar="DIR",
        help="a plan with a host tier that spills: the folder its spill file is made in "
        "(removed when the run ends); its weights are read from the checkpoint it names",
    )
    run.add_argument(
        "--direct-io",
        action="store_true",
        help="a plan with a host tier: read and write its disk files with O_DIRECT where "
        "the file system allows, keeping the page cache out of the run's memory (default: "
        "through the page cache, faster for a re-read checkpoint with free memory)",
    )
    run.add_argument("-o", "--output", metavar="OUTPUTS.npz", help="write the outputs")
    run.set_defaults(handler=_cmd_run)


def _add_render(commands: Any, common: argparse.ArgumentParser) -> None:
    """The `render` subcommand."""
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
    render.add_argument(
        "--unfold",
        action="store_true",
        help="draw every node of a whole layered plan (by default each layer is one box)",
    )
    render.add_argument(
        "--device",
        type=_count,
        metavar="D",
        help="a plan for several devices (einpage plan --devices N): draw device D's plan "
        "(its sends and receives name their links, listed after drawing)",
    )
    render.set_defaults(handler=_cmd_render)


def _add_demo(commands: Any, common: argparse.ArgumentParser) -> None:
    """The `demo` subcommand."""
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


def _add_presets(commands: Any, common: argparse.ArgumentParser) -> None:
    """The `presets` subcommand."""
    presets = commands.add_parser("presets", parents=[common], help="list the program presets")
    presets.set_defaults(handler=_cmd_presets)


# -- errors and main ---------------------------------------------------------------------


def exit_code(err: EinpageError) -> int:
    """The exit code for an error (see the module docstring)."""
    if isinstance(err, PicturesFailedError):  # that of the first output that failed
        first = err.failed[0][1]
        return exit_code(first) if isinstance(first, EinpageError) else EXIT_BAD_INPUT
    if isinstance(err, InfeasibleBudgetError):
        return EXIT_INFEASIBLE
    if isinstance(err, CheckFailedError | VerificationError):
        return EXIT_CHECK_FAILED
    if isinstance(err, GraphvizNotFoundError | BackendUnavailableError | MissingDependencyError):
        return EXIT_UNAVAILABLE
    return EXIT_BAD_INPUT


def hint(err: EinpageError, args: argparse.Namespace | None) -> str | None:
    """A line of advice for an error, where the CLI knows better than the library."""

    if isinstance(err, TooManyBlocksError):
        return None
    if isinstance(err, BlockLimitError):
        return f"the smallest block size that works is {format_exact(err.needed)}"
    if isinstance(err, DeviceBudgetError):
        return (
            f"the smallest budget that works on device {err.device} is "
            f"{format_exact(err.needed)} (--budget takes one per device: B0,B1,...)"
        )
    if isinstance(err, InfeasibleBudgetError):
        return f"the smallest budget that works is {format_exact(err.needed)}"
    if isinstance(err, BudgetFormatError):
        return (
            "sizes look like 8GiB, 512MiB, 1.5GB or 1073741824 (bytes); budgets may also "
            "be a percentage of the resident peak (50%) or of the streaming minimum "
            "(150%streaming)"
        )
    if isinstance(err, VerificationError):
        return "the plan breaks an invariant of memgraph.verify; was the file edited?"
    return None


CLI_SPELLINGS = (
    # several devices (`memgraph.multi.plan_devices`, `einpage.compile_devices`)
    (
        "or partition the graph so that its tasks fit (taskgraph.partition_for_budget)",
        "or split its tasks (--partition SIZE)",
    ),
    ("a block limit of your own (partition=SIZE)", "a block size of your own (--partition SIZE)"),
    # memgraph.plan's way out of a task too large (`memgraph.budgets.WAY_OUT`)
    (
        "einpage.compile(program, budget) does it when needed, or plan "
        "taskgraph.partition_for_budget(tg, budget).graph",
        "--partition auto (the default) does it when needed, or --partition SIZE splits "
        "every task larger than SIZE",
    ),
    # the block cap (`einpage.pipeline.TooManyBlocksError`)
    ("partition='auto'", "--partition auto"),
    ("a block limit (partition=SIZE)", "a block limit (--partition SIZE)"),
    ("(max_blocks=)", "(--max-blocks)"),
    ("with no cap, max_blocks=None,", "with --max-blocks none"),
    # a split output rebuilt on the device (`einpage.pipeline`)
    (
        "(LLM prefill: logits='last')",
        "(LLM prefill: a program file of your own whose logits are the last position's)",
    ),
    # backends (`runtime.cupy_backend`)
    (
        "or use backend='numpy' (or 'auto', which picks CuPy only when a GPU is usable)",
        "or use --backend numpy (or --backend auto, which picks CuPy only when a GPU is usable)",
    ),
    ("use backend='numpy' or 'auto'", "use --backend numpy or --backend auto"),
    # a lost device context (`runtime.session.ContextLostError`)
    ("with debug=True (EINPAGE_SYNC=1, or einpage run --sync)", "with --sync (or EINPAGE_SYNC=1)"),
    (
        "run it with backend='numpy', or build the program in float16 (load the checkpoint "
        "with dtype='float16')",
        "run it with --backend numpy, or build the program in float16 (--dtype float16)",
    ),
    # pictures (`einpage_core.dot`)
    (
        "show fewer nodes (max_nodes=, select=, scope=, collapse=True)",
        "show fewer nodes (--max-nodes N, --scope, --collapse)",
    ),
)
"""(how a library message words its advice for Python callers, how the command line
says it): `cli_words` rewrites the first into the second in every error the CLI prints,
so that it names its own flags. Each pair is a whole phrase of a library message (a test
raises each error and checks that no Python spelling reaches the terminal)."""


def cli_words(text: str) -> str:
    """`text` with the Python advice of `CLI_SPELLINGS` in the command line's words.

    >>> cli_words("Give a larger budget, raise the cap (max_blocks=), or ...")
    'Give a larger budget, raise the cap (--max-blocks), or ...'
    """
    for python, cli in CLI_SPELLINGS:
        text = text.replace(python, cli)
    return text


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
    lines = [_shorten(line) for line in cli_words(str(err)).splitlines()]
    lines = lines or [type(err).__name__]
    print(f"einpage: error: {lines[0]}", file=stream)
    for line in lines[1:]:
        print(f"  {line}", file=stream)
    advice = hint(err, args)
    if advice:
        print(f"einpage: hint: {advice}", file=stream)


# -- reading arguments ------------------------------------------------------------


def parse_partition(value: str) -> str | int:
    """The CLI's `--partition`: "auto", "off", or a block size in bytes."""
    if value in PARTITION_MODES:
        return value
    try:
        return parse_bytes(value)
    except BudgetFormatError:
        raise BudgetFormatError(
            f"--partition must be auto, off or a block size such as 64MiB, got {value!r}"
        ) from None


def parse_block_size(value: str) -> int:
    """The CLI's `show --partition`: a block size in bytes."""
    try:
        return parse_bytes(value)
    except BudgetFormatError:
        raise BudgetFormatError(
            f"--partition must be a block size such as 64MiB, got {value!r}"
        ) from None


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
        code = handler(args, console)
        return EXIT_STDOUT_CLOSED if console.out_closed and code == EXIT_OK else code
    except EinpageError as err:
        report_error(err, args, sys.stderr)
        return exit_code(err)
    except OSError as err:  # a file we were told to read or write
        where = f": {err.filename}" if err.filename else ""
        print(f"einpage: error: {err.strerror or err}{where}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemoryError as err:  # a size no check foresaw: say so, not a traceback
        detail = f" ({err})" if str(err) else ""
        print(
            f"einpage: error: out of host memory{detail}: the program, its partition or its "
            "plan is larger than this machine can hold",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("einpage: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
