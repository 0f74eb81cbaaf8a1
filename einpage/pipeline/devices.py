"""`einpage.compile_devices(program, budget, devices)`: place, plan every device, verify.

The several-device counterpart of `einpage.compile`: the program is placed on `devices`
devices by a placement strategy (`memgraph.placement.STRATEGIES`, or "auto": each of
them tried and the fastest on the cost model kept), each device's graph is planned
under its own budget (`memgraph.multi.plan_devices`), and the whole is checked by
`memgraph.multi.verify_multi`. The result, `CompiledDevices`, keeps
the program, the graph placed, the `MultiPlan`, each device's budget as read, and runs,
simulates and saves the plan.

It is a function of its own, not `compile(..., devices=N)`: `Compiled.plan` is one
MemGraph and `Compiled.budget` one reading, which every caller of `compile` relies on;
a plan for several devices has one of each per device, and links. One function, one
result type.

Budgets: one for every device, or a sequence of one per device; each is bytes, a size
string, or a percentage read against *that device's* graph ("50%": half of that device's
resident peak). A budget below a device's smallest raises `memgraph.multi.DeviceBudgetError`
(an `InfeasibleBudgetError`: `.device`, `.needed`).

Tensor parallelism (`strategy="tensor"`) splits the program first
(`taskgraph.partition.tensor_split`: each device's heads and MLP columns, stated by the
models' `Shard` facts), and that split program is what is partitioned and placed:
`CompiledDevices.graph` is it, and a saved plan file holds it.

Partitioning composes as "partition the whole program first, then place": `partition`
is a block limit (bytes or a size string: the program is split at that limit, then the
blocks are placed), "off" (place the program as it is), or "auto" (the default): the
program is placed unsplit when every device's budget fits its tasks; when one does not,
the whole program is split at `DEFAULT_BUDGET_FRACTION` (a quarter) of the smallest
device budget (in bytes, as read against the unsplit devices' graphs, which are then the
budgets), placed again and planned. A tensor sent between devices is sent whole (a
device receives the base of the blocks it reads), so a device that reads a large
received tensor block by block may need room for it whole: then the error names the device,
its smallest budget and the block limit tried.

Links between devices are staged through host memory (`sends="host"`, the default: an
offload on the source, a reload on the target), or, with `sends="direct"`, sent straight
from device to device wherever `memgraph.peer.direct_sends` proves it cannot deadlock (a
`send` and a `recv`, one copy over NVLink or PCIe peer-to-peer; the rest stay staged and
`CompiledDevices.rows` says how many went direct and why the others did not). Each
device's budget and peak are the same either way: the regions are the planned ones.

`strategy="auto"` compiles the program with every strategy in `STRATEGIES` (those that
cannot place it, or whose devices' budgets are too small, are refused and say why),
simulates each plan on the planner's cost model (`memgraph.simulate_multi`, all devices
together) and keeps the one that finishes first (each compiled with the `sends` asked,
so the choice is made on the plans that will run); `CompiledDevices.choice` (a
`StrategyChoice`) has every candidate's time or refusal. Only the kept plan is verified.

>>> import einpage as ep
>>> prog = ep.Program("chain")
>>> x = prog.input("x", (8, 64))
>>> for i in range(4):
...     x = ep.tanh(x @ prog.input(f"w{i}", (64, 64), role="weight"))
>>> prog.output(x, "y")
>>> compiled = ep.compile_devices(prog, "24KiB", 2)
>>> compiled.devices, [reading.nbytes for reading in compiled.budgets]
(2, [24576, 24576])
>>> len(compiled.plan.links), compiled.report is not None
(1, True)
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from einpage.pipeline.compiler import Partitioning, _taskgraph, partition_mode
from einpage.pipeline.search import explicit_partition
from einpage.program.program import Program
from einpage_core.errors import BackendError, PlanError
from einpage_core.units import format_bytes, format_count
from memgraph.budgets import BudgetReading, read_budget
from memgraph.cost import get_cost_model
from memgraph.multi import (
    DeviceBudgetError,
    MultiPlan,
    MultiVerifyReport,
    plan_devices,
    verify_multi,
)
from memgraph.options import PlanOptions
from memgraph.peer import SENDS
from memgraph.placement import STRATEGIES, check_devices, place
from runtime.workspace import declare_workspaces
from taskgraph.graph import TaskGraph
from taskgraph.partition import DEFAULT_BUDGET_FRACTION, tensor_split
from taskgraph.partition.feasibility import BlockLimitError

__all__ = [
    "compile_devices",
    "CompiledDevices",
    "StrategyChoice",
    "NoStrategyError",
    "AUTO",
    "RUNNERS",
    "DEVICES_KEYWORDS",
    "device_rows",
    "budgets_line",
    "sends_line",
]

RUNNERS = ("local", "ray")
"""Where `CompiledDevices.run` runs a plan: "local" (`runtime.multi.run_devices`: a thread
and an arena per device, in this process) or "ray" (`runtime.ray_cluster.run_on_ray`: a
Ray actor per device; `pip install 'einpage[cluster]'`)."""

AUTO = "auto"
"""The `strategy` that tries every one of `STRATEGIES` and keeps the fastest."""

DEVICES_KEYWORDS = ("budget", "devices", "strategy", "sends", "partition", "verify")
"""`compile_devices`'s own keywords; the others are the planner's (`memgraph.PlanOptions`)."""


def budgets_line(readings: Sequence[BudgetReading]) -> str:
    """Each device's budget as read, on one line: "device 0: ...; device 1: ..."."""
    return "; ".join(f"device {d}: {b}" for d, b in enumerate(readings))


def device_rows(mp: MultiPlan) -> list[tuple[str, ...]]:
    """A table of `mp`, a header first, then a row per device: its tasks, budget, peak,
    bytes moved through the host (offloaded + reloaded, each staged link's copies included;
    a direct link's copy is not), where any link goes direct the bytes it sends and
    receives device to device ("direct out/in"), and links in and out (with how many of
    them go device to device, if any)."""
    direct = any(k.path == "peer" for k in mp.links)
    header: tuple[str, ...] = ("device", "tasks", "budget", "peak", "moved")
    header += ("direct out/in",) if direct else ()
    rows: list[tuple[str, ...]] = [header + ("links in", "links out")]
    for plan in mp.plans:
        s = plan.mg.stats
        received = [k for k in mp.links if k.target == plan.device]
        sent = [k for k in mp.links if k.source == plan.device]
        row: tuple[str, ...] = (
            str(plan.device),
            f"{len(plan.mg.taskgraph):,}",
            format_bytes(plan.budget),
            format_bytes(s.peak_bytes),
            format_bytes(s.offload_bytes + s.reload_bytes),
        )
        if direct:
            row += (f"{_direct_bytes(sent)} / {_direct_bytes(received)}",)
        rows.append(row + (_links_cell(received), _links_cell(sent)))
    return rows


def _direct_bytes(links: Sequence[Any]) -> str:
    """The bytes of those of `links` that go device to device."""
    return format_bytes(sum(k.nbytes for k in links if k.path == "peer"))


def _links_cell(links: Sequence[Any]) -> str:
    """`device_rows`' cell for links in or out: count, bytes, and how many go direct."""
    direct = sum(1 for k in links if k.path == "peer")
    cell = f"{len(links)} ({format_bytes(sum(k.nbytes for k in links))})"
    return cell + (f", {direct} direct" if direct else "")


def sends_line(mp: MultiPlan) -> str:
    """How `mp`'s links travel, on one line: all staged through the host, or how many go
    straight between devices (`Link.path` "peer") and why each other one stays staged
    (`mp.info["direct"]`, as `memgraph.peer.direct_sends` counted it)."""
    links = mp.links
    direct = [k for k in links if k.path == "peer"]
    staged = [k for k in links if k.path != "peer"]
    if mp.info.get("sends", "host") != "direct" and not direct:
        return f"host: all {len(links)} links staged through host memory"
    line = (
        f"direct: {len(direct)} of {len(links)} links device to device "
        f"({format_bytes(sum(k.nbytes for k in direct))}), {len(staged)} staged through the "
        f"host ({format_bytes(sum(k.nbytes for k in staged))})"
    )
    counted = mp.info.get("direct", {})
    reasons = sorted((why, n) for why, n in counted.items() if why not in ("links", "bytes"))
    return line + (": " + ", ".join(f"{n} {why}" for why, n in reasons) if reasons else "")


class NoStrategyError(PlanError):
    """`strategy="auto"` found no strategy that places and plans the program: `errors`
    holds each strategy's own error, by name."""

    def __init__(self, message: str, errors: Mapping[str, PlanError] | None = None):
        super().__init__(message)
        self.errors = MappingProxyType(dict(errors or {}))


@dataclass(frozen=True)
class StrategyChoice:
    """How `strategy="auto"` chose: each candidate strategy's simulated makespan on
    `cost_model` (`seconds`, by name), or the first line of why it was refused
    (`refused`); `chosen` is the fastest. `candidates` holds the compiled plans (the
    chosen one among them), for a caller that wants to compare them."""

    chosen: str
    cost_model: str
    seconds: Mapping[str, float]
    refused: Mapping[str, str]
    candidates: Mapping[str, CompiledDevices] = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        """One line: `auto: pipeline 0.954 s (chosen), tensor 1.21 s on 8xh100-sxm`."""
        parts = [
            f"{name} {seconds:.4g} s" + (" (chosen)" if name == self.chosen else "")
            for name, seconds in sorted(self.seconds.items(), key=lambda item: item[1])
        ]
        parts += [f"{name} refused: {why}" for name, why in self.refused.items()]
        return f"auto on {self.cost_model}: " + "; ".join(parts)


@dataclass(frozen=True)
class CompiledDevices:
    """A program and its plan for several devices, with how they were made.

    `program` is the TaskGraph given, `graph` the one placed (`program` split for tensor
    parallelism with strategy "tensor", and partitioned when
    `partitioning.block_limit` is set), `plan` the `MultiPlan`, `budgets` each device's
    budget as read (against that device's graph), `report` the verifier's (None with
    `verify=False`), `timings` the seconds of each stage, `choice` how
    `strategy="auto"` chose (None for a strategy given by name).
    """

    program: TaskGraph
    graph: TaskGraph
    plan: MultiPlan
    budgets: tuple[BudgetReading, ...]
    partitioning: Partitioning
    report: MultiVerifyReport | None = None
    timings: Mapping[str, float] = field(default_factory=dict)
    choice: StrategyChoice | None = None

    @property
    def devices(self) -> int:
        return self.plan.devices

    @property
    def strategy(self) -> str:
        return self.plan.placed.strategy

    @property
    def sends(self) -> str:
        """How the plan's links were sent (`memgraph.peer.SENDS`): "host" or "direct"."""
        return self.plan.info.get("sends", "host")

    def sends_line(self) -> str:
        """How many links go device to device and how many are staged through the host
        (and why), e.g. `direct: 2 of 3 links device to device (32.0 KiB), 1 staged
        through the host (16.0 KiB): 1 reloaded more than once or in boxes on the target`."""
        return sends_line(self.plan)

    def simulate(self, cost_model: Any = None, *, timeline: bool = False) -> Any:
        """`memgraph.simulate_multi.simulate_multi` of the plan: all devices together on
        `cost_model` (a preset name or a `CostModel`; default: the one it was planned for)."""
        from memgraph.simulate_multi import simulate_multi

        if cost_model is None:
            cost_model = self.plan.info.get("plan_options", {}).get("cost_model")
        return simulate_multi(self.plan, cost_model, timeline=timeline)

    def run(
        self,
        inputs: Mapping[str, Any],
        *,
        runner: str = "local",
        order: str = "ready",
        **options: Any,
    ) -> dict[str, Any]:
        """Run the plan on `inputs` (original input name -> host array); the original
        outputs. `runner` is one of `RUNNERS`; `order` "ready" or "random" (with `seed=`);
        other keywords go to `runtime.multi.run_devices` or `runtime.ray_cluster.run_on_ray`
        (`timeout`, `backend`, ...)."""
        if runner == "local":
            from runtime.multi import run_devices

            return run_devices(self.plan, inputs, order=order, **options)
        if runner == "ray":
            from runtime.ray_cluster import run_on_ray

            return run_on_ray(self.plan, inputs, order=order, **options)
        raise BackendError(f"unknown runner {runner!r}; valid: {', '.join(map(repr, RUNNERS))}")

    def to_json(self) -> str:
        """The plan file's text (`memgraph.multi_serialize`), with the graph placed as its
        program (what `einpage run --check` evaluates)."""
        from memgraph.multi_serialize import multi_to_json

        return multi_to_json(self.plan, self.graph)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan file (`to_json`) to `path`, streamed."""
        from memgraph.multi_serialize import write_multi_json

        with open(path, "w", encoding="utf-8") as stream:
            write_multi_json(self.plan, stream, self.graph)

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows for a table: program, placement, partition, verify."""
        tg = self.program
        rows = [
            (
                "program",
                f"{tg.name!r}: {len(tg)} tasks, {format_count(tg.total_flops, 'FLOP')}, "
                f"{tg.main_dtype()}",
            ),
            (
                "placement",
                f"{self.strategy} on {self.devices} devices, {len(self.plan.links)} links "
                f"({format_bytes(sum(k.nbytes for k in self.plan.links))} sent)",
            ),
            ("budgets", budgets_line(self.budgets)),
            ("sends", self.sends_line()),
        ]
        if self.choice is not None:
            rows.append(("strategy", self.choice.describe()))
        if self.partitioning.block_limit is not None:
            rows.append(
                (
                    "partition",
                    f"{len(tg)} -> {len(self.graph)} tasks, {self.partitioning.describe()}",
                )
            )
        if self.report is not None:
            rows.append(
                (
                    "verify",
                    f"ok: {self.report.devices} plans, {self.report.links} links, "
                    f"{self.report.nodes} nodes, {self.report.edges} dependencies, acyclic",
                )
            )
        return rows

    def __repr__(self) -> str:
        verified = "verified" if self.report is not None else "not verified"
        return (
            f"<CompiledDevices {self.program.name!r}: {len(self.program)} tasks -> "
            f"{len(self.graph)}, {self.strategy} on {self.devices} devices, sends "
            f"{self.sends}, "
            f"{self.partitioning.describe()}, {self.plan!r}, {verified}>"
        )


def compile_devices(
    source: Program | TaskGraph,
    budget: Any,
    devices: int,
    *,
    strategy: str = "pipeline",
    sends: str = "host",
    partition: bool | int | str | None = "auto",
    verify: bool = True,
    **options: Any,
) -> CompiledDevices:
    """Place `source` on `devices` devices, plan each under its budget, verify the whole;
    a `CompiledDevices` (see the module docstring).

    `budget` is one budget for all devices or a sequence of one per device (bytes, size
    strings, percentages of that device's graph). `strategy` names a placement
    (`memgraph.placement.STRATEGIES`) or is "auto" (each tried, the fastest simulated on
    the `cost_model` option kept: the module docstring; when none fits, a
    `DeviceBudgetError` if one could place the program, else `NoStrategyError`, each
    naming every strategy's reason). `sends` is one of `memgraph.peer.SENDS`: "host"
    (every link staged through host memory) or "direct" (each link sent device to device
    where `memgraph.peer.direct_sends` can; with "auto", every candidate so). `partition`
    is "auto", "off" or a block limit. `verify` runs `verify_multi`. Other keywords are
    the planner's options (`memgraph.plan`: order, eviction, cost_model, ...; every device
    is planned with outputs="host"). Raises `DeviceBudgetError` for a device's budget
    below its smallest (naming the device and that budget), `PlanError` for a placement
    that cannot be made (more devices than weights for a pipeline, an unknown strategy), a
    wrong number of budgets, an option that is not one, or `sends` not one of `SENDS`.
    """
    devices = check_devices(devices, "einpage.compile_devices")
    if strategy not in STRATEGIES and strategy != AUTO:
        valid = ", ".join(map(repr, [*STRATEGIES, AUTO]))
        raise PlanError(f"unknown placement strategy {strategy!r}; valid: {valid}")
    if sends not in SENDS:
        raise PlanError(
            f"einpage.compile_devices: sends must be one of {', '.join(map(repr, SENDS))} "
            f"(links staged through host memory, or sent device to device where safe), got "
            f"{sends!r}"
        )
    if strategy == AUTO:
        return _auto_strategy(source, budget, devices, sends, partition, verify, options)
    tg = _taskgraph(source)
    started = time.perf_counter()
    if strategy == "tensor":  # split for tensor parallelism first, then for the budget
        declared = declare_workspaces(tensor_split(tg, devices))
    else:
        declared = declare_workspaces(tg)
    splitting = time.perf_counter() - started
    if options.get("outputs", "host") != "host":
        raise PlanError(
            f"einpage.compile_devices plans every device with outputs='host' (a link's tensor "
            f"leaves its device once computed); got outputs={options['outputs']!r}"
        )
    opts = PlanOptions.from_keywords(
        {**options, "outputs": "host"}, "einpage.compile_devices", DEVICES_KEYWORDS
    )
    mode = partition_mode(partition)
    timings: dict[str, float] = {"splitting": splitting} if strategy == "tensor" else {}
    started = time.perf_counter()
    if isinstance(mode, int):
        graph = explicit_partition(declared, mode, opts.alignment)
        chosen = Partitioning("limit", mode, "explicit")
    else:
        graph, chosen = declared, Partitioning(mode)
    timings["partitioning"] = time.perf_counter() - started
    started = time.perf_counter()
    placed = place(graph, devices, strategy)
    timings["placing"] = time.perf_counter() - started
    started = time.perf_counter()
    try:
        mp = plan_devices(placed, devices, budget, sends=sends, **options)
        readings = _readings(placed, budget, opts)
    except DeviceBudgetError as unsplit:
        if mode != "auto":
            raise
        readings = _readings(placed, budget, opts)
        try:
            graph, placed, mp, chosen = _auto_partition(declared, readings, devices, strategy,
                                                        sends, opts, options)  # fmt: skip
        except BlockLimitError as err:
            # No split reaches that block limit: the device's own error (its smallest
            # budget unsplit) says more than the partition's, so it is the one raised.
            raise DeviceBudgetError(
                f"{unsplit}; partition='auto' could not help: {err}",
                unsplit.budget,
                unsplit.needed,
                unsplit.task,
                unsplit.device,
            ) from None
    timings["planning"] = time.perf_counter() - started
    report = None
    if verify:
        started = time.perf_counter()
        report = verify_multi(mp)
        timings["verifying"] = time.perf_counter() - started
    return CompiledDevices(tg, graph, mp, readings, chosen, report, MappingProxyType(timings))


def _auto_strategy(
    source: Program | TaskGraph,
    budget: Any,
    devices: int,
    sends: str,
    partition: bool | int | str | None,
    verify: bool,
    options: dict[str, Any],
) -> CompiledDevices:
    """`compile_devices(strategy="auto")`: every strategy compiled unverified (with
    `sends`: the plans compared are those that would run), each plan
    simulated on the options' cost model, the fastest verified and returned with the
    `StrategyChoice`. When no strategy fits: a `DeviceBudgetError` (the fields of the
    first strategy whose device budget was too small, the message naming every
    strategy's reason) if any strategy could place the program, else `NoStrategyError`."""
    from memgraph.simulate_multi import simulate_multi

    started = time.perf_counter()
    cost = get_cost_model(
        PlanOptions.from_keywords(
            {**options, "outputs": "host"}, "einpage.compile_devices", DEVICES_KEYWORDS
        ).cost_model
    )
    candidates: dict[str, CompiledDevices] = {}
    seconds: dict[str, float] = {}
    errors: dict[str, PlanError] = {}
    for name in STRATEGIES:
        try:
            compiled = compile_devices(
                source, budget, devices, strategy=name, sends=sends, partition=partition,
                verify=False, **options,
            )  # fmt: skip
        except PlanError as err:
            errors[name] = err
            continue
        candidates[name] = compiled
        seconds[name] = simulate_multi(compiled.plan, cost).makespan
    if not candidates:
        listed = "; ".join(f"{name}: {err}" for name, err in errors.items())
        message = f"strategy='auto': no placement strategy fits this program ({listed})"
        budgets = [err for err in errors.values() if isinstance(err, DeviceBudgetError)]
        if budgets:  # a strategy that could place the program needs larger budgets
            first = budgets[0]
            raise DeviceBudgetError(message, first.budget, first.needed, first.task, first.device)
        raise NoStrategyError(message, errors)
    chosen = min(seconds, key=lambda name: (seconds[name], name != "pipeline"))
    refused = {name: str(err).splitlines()[0] for name, err in errors.items()}
    choice = StrategyChoice(chosen, cost.name, seconds, refused, candidates)
    best = candidates[chosen]
    timings = dict(best.timings)
    timings["choosing"] = time.perf_counter() - started
    report = None
    if verify:
        verifying = time.perf_counter()
        report = verify_multi(best.plan)
        timings["verifying"] = time.perf_counter() - verifying
    return replace(best, report=report, timings=MappingProxyType(timings), choice=choice)


def _readings(placed: Any, budget: Any, opts: PlanOptions) -> tuple[BudgetReading, ...]:
    """Each device's budget as read against its graph (`plan_devices` has checked the
    count)."""
    asked = _asked(budget, placed.devices)
    return tuple(read_budget(part.tg, b, opts) for part, b in zip(placed.parts, asked, strict=True))


def _auto_partition(
    declared: TaskGraph,
    readings: tuple[BudgetReading, ...],
    devices: int,
    strategy: str,
    sends: str,
    opts: PlanOptions,
    options: dict[str, Any],
) -> tuple[TaskGraph, Any, MultiPlan, Partitioning]:
    """`partition="auto"` when a device's budget is below what one of its tasks needs: the
    whole program split at `DEFAULT_BUDGET_FRACTION` of the smallest device budget (bytes,
    as read against the unsplit devices' graphs), placed again and planned under those
    bytes. Raises the device's `DeviceBudgetError` (saying what was tried) if even that
    does not fit, or the partition's `BlockLimitError` when no block is that small."""
    alignment = opts.alignment
    smallest = min(reading.nbytes for reading in readings)
    limit = max(alignment, int(smallest * DEFAULT_BUDGET_FRACTION) // alignment * alignment)
    graph = explicit_partition(declared, limit, alignment)
    placed = place(graph, devices, strategy)
    how = f"auto: {DEFAULT_BUDGET_FRACTION:.0%} of the smallest device budget"
    chosen = Partitioning("auto", limit, how, DEFAULT_BUDGET_FRACTION)
    try:
        mp = plan_devices(placed, devices, [r.nbytes for r in readings], sends=sends, **options)
    except DeviceBudgetError as err:
        raise DeviceBudgetError(
            f"{err}; that is after partition='auto' split the program at a block limit of "
            f"{format_bytes(limit)} ({how}): a block limit of your own (partition=SIZE) "
            f"or a larger budget for device {err.device}",
            err.budget,
            err.needed,
            err.task,
            err.device,
        ) from None
    return graph, placed, mp, chosen


def _asked(budget: Any, devices: int) -> list[Any]:
    """The budget asked of each device (`plan_devices` has checked the count)."""
    if isinstance(budget, Sequence) and not isinstance(budget, str):
        return list(budget)
    return [budget] * devices
