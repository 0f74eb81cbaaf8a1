"""`einpage.compile(program, budget)`: partition when needed, plan, verify – and `Compiled`.

Each pass is a pure function of its IR (`taskgraph.partition(tg, limit)`,
`memgraph.plan(tg, budget)`, `memgraph.verify(mg)`); this module chains them and keeps
what a user wants to know beside the plan (`Compiled`): the TaskGraph given and the
one actually planned, how the budget was read, and how the block limit was chosen.

Partitioning (`partition=`):

* `"auto"` (the default): when some task cannot run even alone in the budget
  (`memgraph.min_budget` of the program above it), plan
  `taskgraph.partition_for_budget(tg, budget)` instead – the graph split into block
  tasks whose working sets fit a block limit of `DEFAULT_BUDGET_FRACTION` (a quarter)
  of the budget (room for the running block, the next one's prefetched operands and
  outputs waiting to leave), or the smallest limit the graph allows if that is more.
  Weights larger than a block are then read through slices, which sliced reloads
  stream. A program that fits is planned as it is: partitioning it would only add
  tasks. With `max_blocks`, a budget whose partition would have more tasks than that is
  refused with `TooManyBlocksError` (the CLI's guard, `MAX_AUTO_BLOCKS`): counted from
  the block sizes before any block is made when that count is already over, else by
  making them, stopping past the cap.
* `"off"`: never partition (an infeasible budget raises `memgraph.plan`'s error);
* a block limit (bytes or a size string, `"64MiB"`): partition at that limit.

Each graph planned carries its kernels' workspaces (`runtime.declare_workspaces`: the
device memory a GPU kernel needs besides its operands and output, as a task's
`workspace`), declared on the program and again on each partition – blocks are new tasks
– so that budgets, the smallest one and the plan all count them.

A split program output is rebuilt by Concats of kind "output", the one exception to
the block limit; it is assembled on the host when nothing else reads its blocks
(`memgraph.host_assembly`). Otherwise a Concat rebuilds it on the device, holding its
blocks and the whole output at once; if that cannot fit, `PartitionInfeasibleError`
says so and names the budget it needs (for LLM prefill, `logits="last"` keeps the
output small). It also reports, when no block limit can fit, the smallest budget that
could work and the smallest block limit, with the task that needs it.

The smallest budget an error names (`InfeasibleBudgetError.needed`) is one that compiles
with the same options and cap, found by trying what `compile` would do
(`einpage.pipeline.search.Budgets`; the messages are `einpage.pipeline.refusals`):
it compiles, and one byte less does not. Messages print it rounded up, with its bytes.

>>> import einpage as ep
>>> prog = ep.Program("smx")
>>> x = prog.input("x", (64, 256))
>>> w = prog.input("w", (256, 256), role="weight")
>>> prog.output(ep.softmax(x @ w), "y")
>>> compiled = ep.compile(prog, "200KiB")  # the matmul alone needs 384 KiB
>>> compiled.block_limit, len(compiled.program) < len(compiled.graph)
(51200, True)
>>> compiled.partitioning.how
'auto: 25% of the budget'
"""


from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import memgraph
from einpage.pipeline.refusals import (
    no_block_fits,
    partition_too_large,
    searched_note,
    too_many_blocks,
)
from einpage.pipeline.search import MAX_AUTO_BLOCKS, Budgets, explicit_partition
from einpage.program.program import Program
from einpage_core.errors import InputError, PlanError
from einpage_core.progress import ProgressCallback, ProgressReport
from einpage_core.units import BudgetFormatError, format_bytes, format_count, parse_bytes
from memgraph import MemGraph, NodeKind, PlanOptions, VerifyReport
from memgraph.budgets import BudgetReading, min_budget, read_budget
from memgraph.tiers import CheckpointPlace, place_host
from runtime.workspace import declare_workspaces
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input
from taskgraph.partition import DEFAULT_BUDGET_FRACTION

__all__ = [
    "compile",
    "Compiled",
    "Partitioning",
    "PARTITION_MODES",
    "COMPILE_KEYWORDS",
    "STAGE_SHARES",
    "partition_mode",
]

PARTITION_MODES = ("auto", "off")
"""`compile(..., partition=)` besides a block limit: split only what does not fit, or never."""

COMPILE_KEYWORDS = (
    "budget",
    "partition",
    "verify",
    "max_blocks",
    "progress",
    "host_budget",
    "checkpoint",
    "spill",
)
"""`compile`'s own keywords; the others are the planner's (`memgraph.PlanOptions`)."""

STAGE_SHARES = {
    "reading the budget": 1,
    "partitioning": 1,
    "planning": 6,
    "planning the host": 1,
    "verifying": 2,
}
"""The stages of `compile` in order, and the share of a progress bar each takes."""


# -- reading the partition argument ----------------------------------------------------


def partition_mode(partition: Any) -> str | int:
    """What `compile`'s `partition` asks for: "auto" (also True), "off" (also False and
    None) or a block limit in bytes (a positive int or a size string)."""
    if partition is True or partition == "auto":
        return "auto"
    if partition is False or partition is None or partition == "off":
        return "off"
    if isinstance(partition, int | str):
        try:
            limit = parse_bytes(partition)
        except BudgetFormatError:
            limit = -1
        if limit > 0:
            return limit
    raise PlanError(
        f"partition must be 'auto', 'off', True, False or a positive block limit (bytes or "
        f"a size string such as '64MiB'), got {partition!r}"
    )


# -- the record --------------------------------------------------------------------------


@dataclass(frozen=True)
class Partitioning:
    """How `compile` chose the graph it planned.

    `mode` is the `partition` argument read ("auto", "off" or "limit": an explicit block
    limit); `block_limit` the limit the program was split at (None: planned as given),
    and `how` says how it was chosen ("none", "explicit", or "auto: 25% of the budget" /
    "auto: the finest block" when that share was too small); `fraction` is the budget
    fraction of "auto"; `finest_block` the smallest block limit the program allows
    (when split); `program_min_budget` the program's `min_budget` unsplit.
    """

    mode: str
    block_limit: int | None = None
    how: str = "none"
    fraction: float | None = None
    finest_block: int | None = None
    program_min_budget: int = 0

    def describe(self) -> str:
        """`block limit 50.0 KiB (auto: 25% of the budget)`, or `not partitioned (...)`."""
        if self.block_limit is None:
            why = "partition off" if self.mode == "off" else "the program fits unsplit"
            return f"not partitioned ({why})"
        return f"block limit {format_bytes(self.block_limit)} ({self.how})"


@dataclass(frozen=True)
class Compiled:
    """A program and its plan, with how they were made.

    `program` is the TaskGraph given (built from a `Program`), `graph` the one planned
    (`program` partitioned when `block_limit` is set), `plan` its MemGraph, `budget` how
    the budget was read, `partitioning` how the block limit was chosen, `report` the
    verifier's (None with `verify=False`) and `timings` the seconds of each stage.
    """

    program: TaskGraph
    graph: TaskGraph
    plan: MemGraph
    budget: BudgetReading
    partitioning: Partitioning
    report: VerifyReport | None = None
    timings: Mapping[str, float] = field(default_factory=dict)
    spill: str | None = None

    @property
    def block_limit(self) -> int | None:
        return self.partitioning.block_limit

    @property
    def min_budget(self) -> int:
        """The program's `min_budget`, unsplit."""
        return self.partitioning.program_min_budget

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows for a table: program, budget, partition, plan, verify."""
        tg, mg = self.program, self.plan
        rows = [
            (
                "program",
                f"{tg.name!r}: {len(tg)} tasks, {format_count(tg.total_flops, 'FLOP')}, "
                f"{tg.main_dtype()}",
            ),
            ("budget", str(self.budget)),
        ]
        if self.block_limit is not None:
            rows.append(
                (
                    "partition",
                    f"{len(tg)} -> {len(self.graph)} tasks, block limit "
                    f"{format_bytes(self.block_limit)} (the program needs "
                    f"{format_bytes(self.min_budget)} unsplit)",
                )
            )
        s = mg.stats
        seconds = self.timings.get("planning", 0.0)
        rows.append(
            (
                "plan",
                f"{len(mg)} nodes in {seconds:.2f} s: {s.offload_count} offloads "
                f"({format_bytes(s.offload_bytes)}), {s.reload_count} reloads "
                f"({format_bytes(s.reload_bytes)}), {s.drop_count} drops" + _assembled_note(mg),
            )
        )
        if mg.tier is not None:
            rows.append(("host", _host_row(mg)))
        if self.report is not None:
            report = self.report
            rows.append(
                (
                    "verify",
                    f"ok: {report.nodes} nodes, {report.dependencies_checked} dependencies checked",
                )
            )
        return rows

    def __repr__(self) -> str:
        verified = "verified" if self.report is not None else "not verified"
        return (
            f"<Compiled {self.program.name!r}: {len(self.program)} tasks -> "
            f"{len(self.graph)}, budget {self.budget}, {self.partitioning.describe()}, "
            f"plan {len(self.plan)} nodes, {verified}>"
        )


def _host_row(mg: MemGraph) -> str:
    """`budget 1.0 GiB, peak 980.0 MiB; 2.9 GiB read from disk in 230, 0 B written ...`."""
    s, info = mg.stats, mg.info.get("tier", {})
    return (
        f"budget {format_bytes(mg.tier.budget)}, peak {format_bytes(s.host_peak_bytes)}; "
        f"{format_bytes(s.disk_read_bytes)} read from disk in {s.disk_read_count}, "
        f"{format_bytes(s.disk_write_bytes)} written in {s.disk_write_count}; "
        f"{info.get('kept', 0)} storages kept, {info.get('streamed_weights', 0)} weights "
        f"streamed, {info.get('spilled', 0)} tensors spilled"
    )


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


# -- the pipeline ------------------------------------------------------------------------


def compile(  # the name shadows the builtin here, as `torch.compile` does
    source: Program | TaskGraph,
    budget: int | str,
    *,
    partition: bool | int | str | None = "auto",
    verify: bool = True,
    max_blocks: int | None = MAX_AUTO_BLOCKS,
    progress: ProgressCallback | None = None,
    host_budget: int | str | None = None,
    checkpoint: str | os.PathLike[str] | Mapping[str, CheckpointPlace] | None = None,
    spill: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Compiled:
    """Partition `source` when needed, plan it within `budget`, verify; a `Compiled`.

    With `host_budget`, `checkpoint` or `spill`, host memory is planned too
    (`memgraph.tiers.place_host`): within `host_budget` (bytes, a size string, or a
    percentage of what the host would hold; default "100%": all kept), the weights the
    safetensors `checkpoint` holds under their input names read from it where they are
    (`einpage.weight_files`; or `checkpoint` is the places themselves, input name ->
    `memgraph.tiers.CheckpointPlace`, as `einpage.models.base.checkpoint_places` finds a
    Hugging Face checkpoint's), and, when `spill` names a folder, what does not fit the host
    written to a spill file there at run time (without it, a plan that would have to
    spill is a `HostBudgetPlanError`).

    `source` is a `Program` (built first) or a TaskGraph. `budget` is bytes, a size
    string (`"8GiB"`) or a percentage of the program's resident peak (`"50%"`; at
    `"100%"` nothing moves) or of its streaming minimum (`"150%streaming"`; see
    `memgraph.budgets`). `partition` is "auto", "off" or a block limit (see the
    module docstring); `max_blocks` (default `MAX_AUTO_BLOCKS`; None: no cap but the
    host's memory) refuses automatic partitioning into more tasks than that, or than
    the available host memory can plan (`task_cap`) – counted from the partition's
    arithmetic before any block is made (`taskgraph.partition.estimate_tasks`), and
    stopped while materializing past twice that – with a `TooManyBlocksError` that
    names the smallest budget that compiles under the cap. `verify` runs `memgraph.verify` on the
    plan (raising `VerificationError` if it fails). Other keywords are the planner's
    options (`memgraph.plan`: order, eviction, lookahead, cost_model, alignment, ...).
    `progress`, if given, is called with `einpage_core.progress.Progress` events: the
    stage running (as in `timings`), its items done (the planner's steps, the verifier's
    nodes) and the fraction of the whole call, never decreasing, 1.0 at the end.

    The MemGraph's `info` records the choice too: "partition", "block_limit" (None when
    not partitioned), "original_tasks", and when partitioned "original_min_budget" and
    "finest_block_limit". Raises `InfeasibleBudgetError` (a `PartitionInfeasibleError`
    when even partitioning cannot fit), `BudgetFormatError`, `PlanError`.
    """
    tg = _taskgraph(source)
    if "devices" in options or "strategy" in options:
        raise PlanError(
            "einpage.compile plans one device; for several, einpage.compile_devices(program, "
            "budget, devices, strategy='pipeline') places the program and plans each device"
        )
    declared = declare_workspaces(tg)
    opts = PlanOptions.from_keywords(options, "einpage.compile", COMPILE_KEYWORDS)
    mode = partition_mode(partition)
    if max_blocks is not None and (
        isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1
    ):
        raise PlanError(f"max_blocks must be a count >= 1 or None, got {max_blocks!r}")
    report = ProgressReport(progress, STAGE_SHARES)
    timings: dict[str, float] = {}
    with _timed(timings, "reading the budget"):
        report.stage("reading the budget", 1)
        reading = read_budget(declared, budget, opts)
        budgets = Budgets(declared, opts, max_blocks)
    with _timed(timings, "partitioning"):
        report.stage("partitioning", 1)
        graph, chosen = _choose_graph(budgets, reading, mode)
    with _timed(timings, "planning"):
        tick = report.stage("planning", len(graph))
        mg = memgraph.plan(graph, reading, progress=tick, **options)
    mg = replace(mg, info={**mg.info, **_info(tg, chosen)})
    tiered = host_budget is not None or checkpoint is not None or spill is not None
    if tiered:
        with _timed(timings, "planning the host"):
            report.stage("planning the host", 1)
            mg = _plan_host(mg, graph, host_budget, checkpoint, spill)
    verified = None
    if verify:
        with _timed(timings, "verifying"):
            verified = memgraph.verify(mg, report.stage("verifying", len(mg)))
    report.finish()
    folder = None if spill is None else os.fspath(spill)
    return Compiled(tg, graph, mg, reading, chosen, verified, MappingProxyType(timings), folder)


def _plan_host(
    mg: MemGraph, graph: TaskGraph, host_budget: Any, checkpoint: Any, spill: Any
) -> MemGraph:
    """`mg` with its host tier planned (see `compile`)."""
    from einpage.pipeline.weight_files import weight_places  # reads files: only when asked

    if spill is not None and not os.path.isdir(spill):
        raise InputError(f"spill folder {os.fspath(spill)!r} is not a folder")
    if isinstance(checkpoint, Mapping):
        weights = _given_places(checkpoint, graph)
    else:
        weights = weight_places(checkpoint, graph) if checkpoint is not None else {}
    budget = "100%" if host_budget is None else host_budget
    return place_host(mg, budget, weights, spill=spill is not None)


def _given_places(places: Mapping[Any, Any], graph: TaskGraph) -> dict[str, CheckpointPlace]:
    """`compile(checkpoint=)` given as places (input name -> `CheckpointPlace`, as
    `einpage.models.checkpoint_places` finds them), each checked to name an input."""
    inputs = {task.op.name for task in graph if isinstance(task.op, Input)}
    for name, place in places.items():
        if not isinstance(place, CheckpointPlace):
            raise PlanError(
                f"checkpoint= maps {name!r} to {type(place).__name__}; it takes a path or a "
                "mapping of input name to memgraph.tiers.CheckpointPlace"
            )
        if name not in inputs:
            raise PlanError(f"checkpoint= places {name!r}, which is not an input of the program")
    return dict(places)


def _taskgraph(source: Any) -> TaskGraph:
    if isinstance(source, TaskGraph):
        return source
    if isinstance(source, Program):
        return source.build()
    raise InputError(f"einpage.compile takes a Program or a TaskGraph, got {type(source).__name__}")


@contextmanager
def _timed(timings: dict[str, float], stage: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[stage] = time.perf_counter() - started


def _info(tg: TaskGraph, chosen: Partitioning) -> dict[str, Any]:
    """What the MemGraph's `info` records of the partitioning."""
    info: dict[str, Any] = {
        "partition": chosen.mode,
        "block_limit": chosen.block_limit,
        "original_tasks": len(tg),
    }
    if chosen.block_limit is not None:
        info["original_min_budget"] = chosen.program_min_budget
        info["finest_block_limit"] = chosen.finest_block
    return info


def _choose_graph(
    budgets: Budgets, reading: BudgetReading, mode: str | int
) -> tuple[TaskGraph, Partitioning]:
    """The graph to plan (the program or its partition) and how it was chosen; raises
    when no partition can fit the budget (`memgraph.plan` raises for "off")."""
    tg, alignment, needed = budgets.tg, budgets.alignment, budgets.needed
    usable = reading.nbytes // alignment * alignment
    label = mode if isinstance(mode, str) else "limit"
    if mode == "off" or (mode == "auto" and (usable >= needed or budgets.task is None)):
        return tg, Partitioning(label, program_min_budget=needed)
    floor, _ = budgets.finest
    if isinstance(mode, int):
        graph = explicit_partition(tg, mode, alignment)
        part_needed, part_task = min_budget(graph, alignment, budgets.inputs)
        if usable < part_needed:  # the partition does not depend on the budget here
            raise partition_too_large(
                budgets, graph, reading, mode, part_needed, part_task, part_needed
            )
        return graph, Partitioning(label, mode, "explicit", None, floor, needed)
    if usable < floor:
        raise no_block_fits(budgets, reading)
    trial = budgets.trial(budgets.limit(usable))
    if trial.graph is None:
        raise too_many_blocks(budgets, reading, trial)
    if usable < trial.needed:
        raise partition_too_large(
            budgets, trial.graph, reading, trial.limit, trial.needed, trial.task,
            budgets.smallest(usable + alignment)[0], searched_note(budgets),
        )  # fmt: skip
    limit, fraction = trial.limit, DEFAULT_BUDGET_FRACTION
    how = "auto: the finest block" if limit == floor else f"auto: {fraction:.0%} of the budget"
    return trial.graph, Partitioning(label, limit, how, fraction, floor, needed)
