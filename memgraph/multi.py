"""Plans for several devices: one TaskGraph and one MemGraph per device, and the links
that carry tensors between them.

A placement (`memgraph.placement`) gives every task of a TaskGraph a device; splitting
it makes one TaskGraph per device. A tensor computed on device A and read on device B
becomes a *link*: an output of A's TaskGraph (`Link.output`, offloaded to host memory as
soon as it is computed: devices are planned with `outputs="host"`) and an input of B's
TaskGraph (`Link.input`, an `Input` that starts on the host, reloaded when B needs it).
So a transfer between devices is staged through pinned host memory: a device-to-host
copy on A, then a host-to-device copy on B – the path of GPUs without peer-to-peer
access. `plan_devices(sends="direct")` then rewrites each link it safely can into one
copy between the two arenas (`memgraph.peer.direct_sends`; NVLink or PCIe peer-to-peer):
a `send` node on A (its region held until the copy is done) and a `recv` node on B
(into the region the reload would have filled), matched by the link's index; such a link
has `path="peer"`. A collective is such copies: the all-reduce of a tensor-parallel
placement is each device receiving the others' partial sums (no ring, no NCCL).

The link is the fact, typed: the names that `split` gives the outputs and inputs it
adds are labels for people, and nothing reads them back. Each device's MemGraph is an
ordinary plan (planned, verified, run and simulated like any other); what ties them
together is `MultiPlan.links`, which `verify_multi` checks: each link's output exists on
its source device and its input on its destination, with the same shape and dtype, on
the host; every input of a device plan is fed once, by the driver or by a link; and the
union of the plans' dependencies and the links has no cycle, so that executing every
node once its dependencies and its link have arrived cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from einpage_core.errors import InfeasibleBudgetError, PlanError, VerificationError
from einpage_core.units import format_bytes, format_exact
from memgraph.budgets import BudgetReading
from memgraph.graph import MemGraph
from memgraph.nodes import HostStorage, MemNode, NodeKind
from taskgraph import dtypes

__all__ = [
    "Link",
    "DevicePart",
    "PlacedGraph",
    "DevicePlan",
    "MultiPlan",
    "plan_devices",
    "verify_multi",
    "MultiVerifyReport",
    "DeviceBudgetError",
    "UnionGraph",
    "union_graph",
    "union_order",
]


@dataclass(frozen=True, slots=True)
class Link:
    """Tensor `task` of the original TaskGraph, computed on device `source` and read on
    device `target`: output `output` of the source's TaskGraph feeds input `input` of the
    target's. `shape`, `dtype` and `nbytes` are the tensor's."""

    task: int
    source: int
    target: int
    output: str
    input: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    path: str = "host"
    """How it travels (`memgraph.peer.PATHS`): "host" (an output offloaded to the host,
    an input reloaded from it) or "peer" (a `send` node on the source, a `recv` node on
    the target, one copy between the arenas; the nodes name the link by its index)."""

    def describe(self) -> str:
        """`%12 f32[2,64] 512 B: device 0 "send:%12" -> device 1 "recv:%12"` (and
        ` direct` for a link sent device to device)."""
        dims = ",".join(map(str, self.shape))
        return (
            f"%{self.task} {dtypes.short(self.dtype)}[{dims}] {format_bytes(self.nbytes)}: "
            f'device {self.source} "{self.output}" -> device {self.target} "{self.input}"'
            + (" direct" if self.path == "peer" else "")
        )


@dataclass(frozen=True)
class DevicePart:
    """Device `device`'s share of a placed TaskGraph: its own TaskGraph `tg`, and
    `origin`, for each of its task ids, the task of the original graph it stands for
    (a replicated input or fill stands for the same original task on every device; a
    link's input stands for the linked task)."""

    device: int
    tg: Any  # taskgraph.TaskGraph (memgraph reads TaskGraphs; it does not build them)
    origin: tuple[int, ...]

    def __repr__(self) -> str:
        return f"<DevicePart device={self.device} {self.tg!r}>"


@dataclass(frozen=True)
class PlacedGraph:
    """A TaskGraph split over `devices` devices: one `DevicePart` each, the links
    between them, and where each original output ends (`outputs`: output name ->
    (device, that device's output name))."""

    devices: int
    parts: tuple[DevicePart, ...]
    links: tuple[Link, ...]
    outputs: Mapping[str, tuple[int, str]]
    strategy: str = "pipeline"
    inputs: tuple[str, ...] = ()
    """The original program's input names: the driver stages each (from the one host
    array it is given) on every device whose graph has an input of that name; every
    other input of a device's graph is a link's (`verify_multi` checks it)."""
    graph: Any = field(default=None, compare=False, repr=False)
    """The TaskGraph placed (a `taskgraph.TaskGraph`, whose task ids `Link.task` and
    `DevicePart.origin` name): the program's graph, or it rewritten by the strategy
    (split for tensor parallelism); None where unknown (a plan read from a file)."""

    def __repr__(self) -> str:
        tasks = [len(part.tg) for part in self.parts]
        return (
            f"<PlacedGraph {self.strategy} devices={self.devices} tasks={tasks} "
            f"links={len(self.links)} sent={format_bytes(sum(k.nbytes for k in self.links))}>"
        )

    def lines(self) -> list[str]:
        """A header per device (its graph's summary), then one line per link and where
        each original output ends."""
        out = []
        for part in self.parts:
            out.append(f"device {part.device}: {part.tg!r}")
        out.extend(f"  link {link.describe()}" for link in self.links)
        out.extend(f'  output "{n}" on device {d} as "{m}"' for n, (d, m) in self.outputs.items())
        return out

    def __str__(self) -> str:
        return "\n".join([repr(self), *self.lines()])


@dataclass(frozen=True)
class DevicePlan:
    """Device `device`'s plan: its MemGraph `mg`, planned under `budget` bytes."""

    device: int
    mg: MemGraph
    budget: int

    def __repr__(self) -> str:
        return f"<DevicePlan device={self.device} {self.mg!r}>"


@dataclass(frozen=True)
class MultiPlan:
    """One plan for several devices: a MemGraph per device and the links between them.

    The driver stages each original input on every device whose TaskGraph has an input
    of that name (inputs are replicated, not linked: they start on the host), and reads
    each original output from `outputs` (output name -> (device, that device's output
    name)).
    """

    placed: PlacedGraph
    plans: tuple[DevicePlan, ...]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def devices(self) -> int:
        return self.placed.devices

    @property
    def links(self) -> tuple[Link, ...]:
        return self.placed.links

    @property
    def outputs(self) -> Mapping[str, tuple[int, str]]:
        return self.placed.outputs

    def __repr__(self) -> str:
        budgets = ", ".join(format_bytes(p.budget) for p in self.plans)
        peaks = ", ".join(format_bytes(p.mg.stats.peak_bytes) for p in self.plans)
        moved = sum(p.mg.stats.offload_bytes + p.mg.stats.reload_bytes for p in self.plans)
        direct = [k for k in self.links if k.path == "peer"]
        return (
            f"<MultiPlan {self.placed.strategy} devices={self.devices} links={len(self.links)} "
            f"sent={format_bytes(sum(k.nbytes for k in self.links))}"
            + (
                f" direct={len(direct)} ({format_bytes(sum(k.nbytes for k in direct))})"
                if direct
                else ""
            )
            + f" budgets=[{budgets}] peaks=[{peaks}] moved={format_bytes(moved)}>"
        )

    def lines(self, nodes: bool = True) -> list[str]:
        """A header per device (its plan's summary: nodes, budget, peak, bytes offloaded
        and reloaded – a direct link's copy is neither –, its links out and in, and of
        those the bytes sent and received direct), its plan's node lines (unless `nodes`
        is False), then one line per link (`link#i`, its index, as sends and receives name
        it) and where each original output ends."""
        out = []
        for plan in self.plans:
            s = plan.mg.stats
            sends = [k for k in self.links if k.source == plan.device]
            receives = [k for k in self.links if k.target == plan.device]
            out.append(
                f"device {plan.device}: {len(plan.mg)} nodes, budget {format_bytes(plan.budget)},"
                f" peak {format_bytes(s.peak_bytes)}, offloaded {format_bytes(s.offload_bytes)}"
                f" ({s.offload_count}), reloaded {format_bytes(s.reload_bytes)} "
                f"({s.reload_count}), sends {len(sends)}, receives {len(receives)}"
                + _direct_note(sends, receives)
            )
            if nodes:
                out.extend(f"  {line}" for line in plan.mg.lines())
        direct = sum(1 for k in self.links if k.path == "peer")
        out.append(f"links ({len(self.links)}" + (f", {direct} direct" if direct else "") + "):")
        out.extend(f"  link#{i} {link.describe()}" for i, link in enumerate(self.links))
        out.extend(f'output "{n}" on device {d} as "{m}"' for n, (d, m) in self.outputs.items())
        return out

    def __str__(self) -> str:
        return "\n".join([repr(self), *self.lines()])


def _direct_note(sends: Sequence[Link], receives: Sequence[Link]) -> str:
    """`MultiPlan.lines`' note of what a device sends and receives direct (nothing when
    none of its links is direct): `, direct: sent 16.0 KiB (1), received 0 B (0)`."""
    out = [k for k in sends if k.path == "peer"]
    into = [k for k in receives if k.path == "peer"]
    if not out and not into:
        return ""
    return (
        f", direct: sent {format_bytes(sum(k.nbytes for k in out))} ({len(out)}), "
        f"received {format_bytes(sum(k.nbytes for k in into))} ({len(into)})"
    )


# -- planning every device -----------------------------------------------------------


class DeviceBudgetError(InfeasibleBudgetError):
    """A device's budget is below the smallest its graph needs: `device` is the device,
    `budget` and `needed` its budget and smallest feasible budget (bytes), `task` the
    task of the program that needs it."""

    def __init__(self, message: str, budget: int, needed: int, task: int | None, device: int):
        super().__init__(message, budget, needed, task)
        self.device = device


def plan_devices(
    tg: Any,
    devices: int,
    budget: Any,
    *,
    strategy: str = "pipeline",
    sends: str = "host",
    **plan_options: Any,
) -> MultiPlan:
    """Place `tg` on `devices` devices and plan each device's graph; the `MultiPlan`.

    `tg` is a TaskGraph, placed by the strategy `strategy` names
    (`memgraph.placement.STRATEGIES`) and split, or a `PlacedGraph` already split over
    `devices` devices. `budget` is one budget for every device or a sequence of one per
    device: bytes, a size string, or a percentage read (as `memgraph.plan` reads it)
    against *that device's* graph ("50%": half of that device's resident peak). Every
    device is planned with `memgraph.plan(part, budget, outputs="host", **plan_options)`,
    so each tensor a link sends leaves its device as soon as it is computed.
    `sends="direct"` then makes every link it safely can a copy straight between the
    devices (`memgraph.peer.direct_sends`; `info["direct"]` counts them and why the rest
    stay staged through the host); "host" (the default) stages every link.

    Raises `DeviceBudgetError` (an `InfeasibleBudgetError`) for a budget below a device's
    `min_budget`, naming the device, its budget and its smallest feasible budget
    (`error.device` is the device, `error.task` the task of `tg` that needs it);
    `PlanError` for a wrong number of budgets, `outputs` other than "host", or a
    placement problem. The plans are not verified here: `verify_multi` does it.

    >>> import einpage as ep
    >>> prog = ep.Program("two")
    >>> x = prog.input("x", (64, 64))
    >>> for i in range(4):
    ...     x = ep.tanh(x @ prog.input(f"w{i}", (64, 64), role="weight"))
    >>> prog.output(x, "y")
    >>> mp = plan_devices(prog.build(), 2, "80%")
    >>> [len(mp.links), mp.outputs["y"]]
    [1, (1, 'y')]
    >>> verify_multi(mp).links
    1
    """
    from memgraph.budgets import infeasible_message, min_budget, read_budget
    from memgraph.options import PlanOptions
    from memgraph.peer import SENDS, direct_sends
    from memgraph.placement import check_devices, place
    from memgraph.planner import plan

    check_devices(devices, "plan_devices")
    if sends not in SENDS:
        raise PlanError(
            f"plan_devices: sends must be one of {', '.join(map(repr, SENDS))}, got {sends!r}"
        )
    if isinstance(tg, PlacedGraph):
        placed = tg
        if placed.devices != devices:
            raise PlanError(
                f"plan_devices: the placed graph is split over {placed.devices} devices, "
                f"not {devices}"
            )
    else:
        placed = place(tg, devices, strategy)
    if plan_options.get("outputs", "host") != "host":
        raise PlanError(
            f"plan_devices plans every device with outputs='host' (a link's tensor leaves "
            f"its device once computed); got outputs={plan_options['outputs']!r}"
        )
    options = {**plan_options, "outputs": "host"}
    opts = PlanOptions.from_keywords(options, "memgraph.plan_devices", ("budget", "strategy"))
    budgets = _budgets(budget, devices)
    plans = []
    for part, asked in zip(placed.parts, budgets, strict=True):
        reading = read_budget(part.tg, asked, opts)
        needed, task = min_budget(part.tg, opts.alignment, opts.inputs)
        if reading.nbytes // opts.alignment * opts.alignment < needed:
            why = infeasible_message(part.tg, reading, needed, task, opts.alignment)
            where = (
                ""
                if task is None
                else f" (device {part.device}'s %{task} is the program's %{part.origin[task]})"
            )
            raise DeviceBudgetError(
                f"device {part.device}: {why}{where}. Give device {part.device} at least "
                f"{format_exact(needed)}, or partition the graph so that its tasks fit "
                f"(taskgraph.partition_for_budget)",
                reading.nbytes,
                needed,
                None if task is None else part.origin[task],
                part.device,
            )
        mg = plan(part.tg, reading, **options)
        plans.append(DevicePlan(part.device, mg, mg.budget))
    info = {
        "strategy": placed.strategy,
        "budget_requests": [b if isinstance(b, int) else str(b) for b in budgets],
        "plan_options": opts.info(),
    }
    mp = MultiPlan(placed, tuple(plans), info)
    return direct_sends(mp)[0] if sends == "direct" else mp


def _budgets(budget: Any, devices: int) -> list[Any]:
    """One budget per device: `budget` repeated, or the sequence given, checked in length."""
    if isinstance(budget, str | int | BudgetReading) and not isinstance(budget, bool):
        return [budget] * devices
    if isinstance(budget, Sequence):
        if len(budget) != devices:
            raise PlanError(
                f"plan_devices: {len(budget)} budgets given for {devices} devices; give one "
                f"budget for all or one per device"
            )
        return list(budget)
    raise PlanError(
        f"plan_devices: a budget is bytes, a size string or a percentage (or a sequence of "
        f"one per device), got {budget!r}"
    )


# -- verifying the whole ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MultiVerifyReport:
    """What a successful `verify_multi` saw: each device plan's `VerifyReport`, the links,
    and the nodes and edges of the union graph it found acyclic."""

    devices: int
    links: int
    nodes: int
    edges: int
    plans: tuple[Any, ...]  # memgraph.verify.VerifyReport, one per device


def verify_multi(mp: MultiPlan) -> MultiVerifyReport:
    """Check a `MultiPlan`; raise `VerificationError` naming the first violation.

    * each device's plan passes `memgraph.verify` (the error says which device; run once
      per plan, `MemGraph.verified`, so a runner checking a compiled plan again does not
      verify its devices again), and the plans are those of devices 0, 1, ... in order,
      one per part;
    * each link goes between two devices of the plan, not from a device to itself; its
      output is an `output` node of the source plan that ends on the host (`storage`),
      and its input an `input` node of the target plan that starts on the host; both
      host storages (the plans' `storages` tables) have the link's shape, dtype and bytes;
    * every input of every device plan is fed exactly once: by the driver (an input of
      the original program, `PlacedGraph.inputs`) or by one link – not by nothing, not
      by both, not by two links;
    * every original output is an output of the device plan `MultiPlan.outputs` names;
    * the union of all plans' dependencies and one edge per link (the source's `output`
      node before the target's `input` node) is acyclic, so that executing each node
      once its dependencies are done and its link has arrived cannot deadlock (the
      error names a cycle: device and node line of each of its nodes). Linear time.
    """
    if not isinstance(mp, MultiPlan):
        raise VerificationError(f"verify_multi takes a MultiPlan, got {type(mp).__name__}")
    placed = mp.placed
    if len(mp.plans) != placed.devices or len(placed.parts) != placed.devices:
        raise VerificationError(
            f"the plan is over {placed.devices} devices but has {len(mp.plans)} device plans "
            f"and {len(placed.parts)} parts"
        )
    reports = []
    for index, device_plan in enumerate(mp.plans):
        if device_plan.device != index:
            raise VerificationError(f"device plan {index} says it is device {device_plan.device}")
        try:
            reports.append(device_plan.mg.verified())
        except VerificationError as error:
            raise VerificationError(f"device {index}: {error}", error.node) from None
    inputs = [_named(p.mg, NodeKind.INPUT) for p in mp.plans]
    outputs = [_named(p.mg, NodeKind.OUTPUT) for p in mp.plans]
    copies = [_copies(p.mg) for p in mp.plans]
    fed: dict[tuple[int, str], list[Link]] = {}
    for index, link in enumerate(mp.links):
        _check_link(mp, index, link, inputs, outputs, copies)
        fed.setdefault((link.target, link.input), []).append(link)
    for device, found in enumerate(copies):
        for (kind, index), node in found.items():
            link = mp.links[index] if 0 <= index < len(mp.links) else None
            end = None if link is None else (link.source if kind is NodeKind.SEND else link.target)
            if link is None or link.path != "peer" or end != device:
                way = "from" if kind is NodeKind.SEND else "to"
                raise VerificationError(
                    f"device {device}'s {node.line()} names link#{index}, which is no direct "
                    f"link {way} device {device}"
                )
    staged = set(placed.inputs)
    for device, named in enumerate(inputs):
        received = {
            node.name: node for (kind, _), node in copies[device].items() if kind is NodeKind.RECV
        }
        for name, node in {**named, **received}.items():
            feeders = fed.get((device, name), [])
            where = f'input "{name}" of device {device} (n{node.id})'
            if len(feeders) > 1:
                sources = ", ".join(k.describe() for k in feeders)
                raise VerificationError(f"{where} is fed by {len(feeders)} links: {sources}")
            if feeders and name in staged:
                raise VerificationError(
                    f"{where} is fed twice: the driver stages the program's input of that name, "
                    f"and link {feeders[0].describe()} ends there"
                )
            if not feeders and name not in staged:
                raise VerificationError(
                    f"{where} is fed by nothing: no link ends there and the program has no "
                    f"input of that name"
                )
    for name, (device, local) in mp.outputs.items():
        if not 0 <= device < placed.devices or local not in outputs[device]:
            raise VerificationError(
                f'output "{name}" is said to end on device {device} as "{local}", which is no '
                f"output of that device's plan"
            )
    nodes, edges = _check_acyclic(mp)
    return MultiVerifyReport(placed.devices, len(mp.links), nodes, edges, tuple(reports))


def _named(mg: MemGraph, kind: NodeKind) -> dict[str, MemNode]:
    """The plan's nodes of `kind` (inputs or outputs) by name."""
    return {node.name: node for node in mg.nodes if node.kind is kind}


def _copies(mg: MemGraph) -> dict[tuple[NodeKind, int], MemNode]:
    """The plan's sends and receives by (kind, link index) (`verify` checked that a plan
    uses each link index once)."""
    return {
        (node.kind, node.link): node
        for node in mg.nodes
        if node.kind in (NodeKind.SEND, NodeKind.RECV)
    }


def _check_link(
    mp: MultiPlan,
    index: int,
    link: Link,
    inputs: list[dict[str, MemNode]],
    outputs: list[dict[str, MemNode]],
    copies: list[dict[tuple[NodeKind, int], MemNode]],
) -> None:
    """The checks of one link (see `verify_multi`)."""
    from memgraph.peer import PATHS

    devices = mp.devices
    what = f"link#{index} {link.describe()}"
    for end, device in (("source", link.source), ("target", link.target)):
        if not 0 <= device < devices:
            raise VerificationError(
                f"{what}: its {end} device {device} is not one of 0..{devices - 1}"
            )
    if link.source == link.target:
        raise VerificationError(f"{what}: goes from device {link.source} to itself")
    if link.path not in PATHS:
        raise VerificationError(f"{what}: its path {link.path!r} is not one of {PATHS}")
    if link.path == "peer":
        for kind, device, name in (
            (NodeKind.SEND, link.source, link.output),
            (NodeKind.RECV, link.target, link.input),
        ):
            node = copies[device].get((kind, index))
            if node is None:
                raise VerificationError(f"{what}: device {device}'s plan has no {kind} of it")
            if node.name != name:
                raise VerificationError(
                    f'{what}: device {device}\'s {kind} n{node.id} is of "{node.name}", not '
                    f'"{name}"'
                )
            task = mp.plans[device].mg.taskgraph[node.tensor]
            _check_carried(what, link, f"device {device}'s {kind} n{node.id} copies", task)
        return
    ends = (
        ("output", link.source, outputs[link.source].get(link.output), link.output),
        ("input", link.target, inputs[link.target].get(link.input), link.input),
    )
    for kind, device, node, name in ends:
        if node is None:
            raise VerificationError(f'{what}: device {device}\'s plan has no {kind} "{name}"')
        if node.storage is None:
            raise VerificationError(
                f"{what}: device {device}'s {kind} n{node.id} is on the device "
                f"({node.region}), not the host: {node.line()}"
            )
        held = mp.plans[device].mg.storages[node.storage]
        _check_carried(what, link, f"device {device}'s {kind} n{node.id} holds", held)


def _check_carried(what: str, link: Link, subject: str, held: Any) -> None:
    """`held` (a task or a host storage: shape, dtype, nbytes) is what `link` carries."""
    if (held.shape, held.dtype, held.nbytes) != (link.shape, link.dtype, link.nbytes):
        name = f"%{held.id}" if not isinstance(held, HostStorage) else str(held)
        raise VerificationError(
            f"{what}: {subject} {name} ({held.dtype}{list(held.shape)}, {held.nbytes} B), "
            f"but the link carries {link.dtype}{list(link.shape)}, {link.nbytes} B"
        )


@dataclass
class UnionGraph:
    """The union of a MultiPlan's plans: node g of the whole is node `g - offsets[d]` of
    device d's plan; `successors`/`preds` over representatives (`rep[g]`: a direct link's
    receive stands for nothing of its own – it is its send's node); one edge per host
    link (the source's output before the target's input)."""

    offsets: list[int]
    rep: list[int]
    successors: list[list[int]]
    preds: list[int]
    edges: int

    def device_of(self, g: int) -> int:
        return max(d for d, base in enumerate(self.offsets) if base <= g)


def union_graph(mp: MultiPlan) -> UnionGraph:
    """The union of `mp`'s plans and links, which `verify_multi` checks for a cycle."""
    offsets, total = [], 0
    for plan in mp.plans:
        offsets.append(total)
        total += len(plan.mg.nodes)
    rep = list(range(total))
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for plan, base in zip(mp.plans, offsets, strict=True):
        for node in plan.mg.nodes:
            if node.kind is NodeKind.SEND:
                sent[node.link] = base + node.id
            elif node.kind is NodeKind.RECV:
                received[node.link] = base + node.id
    for index, g in received.items():
        rep[g] = sent[index]
    successors: list[list[int]] = [[] for _ in range(total)]
    preds = [0] * total
    edges = 0
    for plan, base in zip(mp.plans, offsets, strict=True):
        for node in plan.mg.nodes:
            target = rep[base + node.id]
            for dep in node.deps:
                successors[rep[base + dep]].append(target)
            preds[target] += len(node.deps)
            edges += len(node.deps)
    outputs = [_named(p.mg, NodeKind.OUTPUT) for p in mp.plans]
    inputs = [_named(p.mg, NodeKind.INPUT) for p in mp.plans]
    for link in mp.links:
        if link.path == "peer":
            continue
        source = offsets[link.source] + outputs[link.source][link.output].id
        target = offsets[link.target] + inputs[link.target][link.input].id
        successors[source].append(target)
        preds[target] += 1
        edges += 1
    return UnionGraph(offsets, rep, successors, preds, edges)


def union_order(mp: MultiPlan) -> tuple[UnionGraph, list[int]]:
    """The union of `mp`'s plans and links (`union_graph`) and a topological order of it,
    as each node's position (`position[g]`; a direct link's receive has its send's):
    Kahn's algorithm taking, among the nodes that can come next, anything but a `free`
    first, then the lowest device and id (frees last: a region stays held as long as
    anything else can proceed). Raises `VerificationError` naming a cycle."""
    import heapq

    union = union_graph(mp)
    kinds = [node.kind for plan in mp.plans for node in plan.mg.nodes]
    rep, waiting = union.rep, list(union.preds)
    heap = [
        (kinds[g] is NodeKind.FREE, g) for g in range(len(rep)) if rep[g] == g and not waiting[g]
    ]
    heapq.heapify(heap)
    position = [0] * len(rep)
    done = 0
    while heap:
        _, g = heapq.heappop(heap)
        position[g] = done
        done += 1
        for s in union.successors[g]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(heap, (kinds[s] is NodeKind.FREE, s))
    if done != sum(1 for g in range(len(rep)) if rep[g] == g):
        _check_acyclic(mp)  # raises, naming a cycle
    return union, [position[rep[g]] for g in range(len(rep))]


def _check_acyclic(mp: MultiPlan) -> tuple[int, int]:
    """Kahn's algorithm over the union of the plans' dependencies and the links; the
    number of nodes and edges, or a `VerificationError` naming a cycle."""
    union = union_graph(mp)
    successors, rep = union.successors, union.rep
    waiting = list(union.preds)
    nodes = [g for g in range(len(rep)) if rep[g] == g]
    ready = [g for g in nodes if waiting[g] == 0]
    done = 0
    while ready:
        g = ready.pop()
        done += 1
        for s in successors[g]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    if done == len(nodes):
        return len(nodes), union.edges
    offsets = union.offsets
    cycle = _a_cycle(successors, waiting)
    device_of = [union.device_of(g) for g in cycle]
    crossings = [k for k in range(len(cycle)) if device_of[k] != device_of[k - 1]]
    start = crossings[0] if crossings else 0  # begin where a link arrives
    cycle, device_of = cycle[start:] + cycle[:start], device_of[start:] + device_of[:start]
    runs: list[list[int]] = []  # the cycle's stretches on one device each, in order
    for k, g in enumerate(cycle):
        if not runs or device_of[k] != device_of[k - 1]:
            runs.append([])
        runs[-1].append(g)

    def line(g: int) -> str:
        device = union.device_of(g)
        return mp.plans[device].mg.nodes[g - offsets[device]].line()

    shown = []
    for run in runs:
        device = union.device_of(run[0])
        if len(run) == 1:
            shown.append(f"[device {device} {line(run[0])}]")
        else:
            shown.append(
                f"[device {device} {line(run[0])} ... through {len(run) - 2} more nodes to "
                f"{line(run[-1])}]"
            )
    raise VerificationError(
        f"the plans and their links wait for each other in a cycle of {len(cycle)} nodes "
        f"over {len(runs)} links (each stretch before the next, the last before the "
        f"first): {' -> '.join(shown)}"
    )


def _a_cycle(successors: list[list[int]], waiting: list[int]) -> list[int]:
    """A cycle among the nodes Kahn's algorithm left (`waiting[g] > 0`), in edge order.

    Every node left has a predecessor left; walking from one to a left predecessor
    repeats a node within as many steps as nodes are left: the walk from that node's
    first visit is a cycle (backwards)."""
    predecessor: dict[int, int] = {}
    for g, after in enumerate(successors):
        if waiting[g] > 0:
            for s in after:
                if waiting[s] > 0:
                    predecessor.setdefault(s, g)
    start = next(g for g in range(len(waiting)) if waiting[g] > 0)
    seen: dict[int, int] = {}
    walk = []
    g = start
    while g not in seen:
        seen[g] = len(walk)
        walk.append(g)
        g = predecessor[g]
    cycle = walk[seen[g] :]
    cycle.reverse()
    return cycle
