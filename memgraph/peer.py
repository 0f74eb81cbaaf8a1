"""Direct sends between devices: a plan for several devices whose links are staged through
host memory, rewritten so that links go straight from device to device where that is safe.

`plan_devices` plans every device with its links staged through host memory: the source
offloads the tensor to a host storage (`output` node), the target's `input` starts on
the host and a `reload` brings it in. `direct_sends` turns such a link into one copy
between the two arenas (NVLink, or PCIe peer-to-peer): on the source the offload becomes
a `send` of the same region (the region stays held until the copy is done: the free
that waited for the offload waits for the send), on the target the reload becomes a
`recv` into the region the reload filled, and both host storages go. Each device's
budget is untouched: the regions, their allocs and frees are the planned ones.

A send and its receive are one copy, so it needs both ends at once: the source's region
is not freed, and whatever the source does after freeing it waits, until the target has
allocated its region. That can deadlock where staging through the host cannot (a target
whose alloc waits for a free that waits for something the source does after the send),
so a link goes direct only where it provably cannot. A copy is the send waiting, besides
for its own dependencies, for those of the receive (the target's alloc of the region):
the links are taken one by one (in the order of their sends) and each one's edges from
the target's waits to the source's send are added to the union of the host-staged plans
(`memgraph.multi.union_graph`) unless they close a cycle, the check kept cheap by a
topological order maintained as edges come (Pearce and Kelly's dynamic topological
sort, started from `memgraph.multi.union_order`). The direct plan's union is then
acyclic (`verify_multi` checks it again). An output sent to several devices counts as
one send for all (conservative: it may keep a safe link staged, never the reverse).

A link stays staged through the host where the rewrite does not apply: its target
reloads the tensor more than once (the host copy serves the later reloads) or in boxes
(a sliced reload), or its source reloads its own host copy, or making it direct would close a
cycle with the links made direct before it. `DirectReport` counts each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from einpage_core.errors import PlanError
from memgraph.graph import MemGraph
from memgraph.multi import DevicePlan, Link, MultiPlan, union_order
from memgraph.nodes import MemNode, NodeKind

__all__ = ["PATHS", "SENDS", "DirectReport", "direct_sends"]

PATHS = ("host", "peer")
"""How a link travels: staged through host memory (an offload, then a reload), or one
copy between the devices' arenas (a send and a receive)."""

SENDS = ("host", "direct")
"""How `plan_devices(sends=...)` sends links: every link staged through host memory, or
each link direct where `direct_sends` can make it so."""


@dataclass(frozen=True, slots=True)
class DirectReport:
    """What `direct_sends` did: `direct` links made device-to-device (and their bytes),
    and why each other link stays staged through the host (`reasons`: reason -> count)."""

    direct: int
    direct_bytes: int
    staged: int
    staged_bytes: int
    reasons: Mapping[str, int]

    def line(self) -> str:
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.reasons.items()))
        return (
            f"{self.direct} link(s) direct ({self.direct_bytes} B), {self.staged} staged "
            f"through the host ({self.staged_bytes} B)" + (f": {why}" if why else "")
        )


@dataclass
class _Ends:
    """The nodes of a host-staged link on its two devices."""

    offload: MemNode  # the source's offload of the sent tensor (into the output's storage)
    output: MemNode  # the source's output node of that storage
    input: MemNode  # the target's input node (on the host)
    reload: MemNode  # the target's one reload of it
    kept: bool  # whether the source's host copy is also a program output (then it stays)


def direct_sends(mp: MultiPlan) -> tuple[MultiPlan, DirectReport]:
    """`mp` with every link that can safely go device to device made a direct send (see
    the module docstring), and the report of what went direct and why the rest did not.

    Raises `PlanError` when `mp` already has direct links (the rewrite starts from
    plans staged through host memory, as `plan_devices` makes them)."""
    if any(link.path != "host" for link in mp.links):
        raise PlanError("direct_sends: the plan already has direct links; give it host-staged")
    ends, reasons = _candidates(mp)
    union, position = union_order(mp)
    order = _Order(union.successors, position)
    base = union.offsets
    direct: set[int] = set()
    for index in sorted(
        ends, key=lambda i: position[base[mp.links[i].source] + ends[i].offload.id]
    ):
        end, link = ends[index], mp.links[index]
        send = base[link.source] + end.offload.id
        waits = [base[link.target] + d for d in end.reload.deps if d != end.input.id]
        if order.add_edges([(w, send) for w in waits]):
            direct.add(index)
        else:
            reasons["would wait in a cycle"] = reasons.get("would wait in a cycle", 0) + 1
    # An output sent to several devices keeps its offload while any of its links is staged,
    # and so does a tensor that is also a program output (its host copy is that output).
    by_output: dict[tuple[int, str], list[int]] = {}
    for index, link in enumerate(mp.links):
        by_output.setdefault((link.source, link.output), []).append(index)
    plans = []
    for plan in mp.plans:
        device = plan.device
        sends: dict[int, tuple[bool, list[int]]] = {}  # offload id -> (replaced, direct ones)
        outputs_gone: list[int] = []  # links whose output node goes (all of its links direct)
        for (source, _), indices in by_output.items():
            made = [i for i in indices if i in direct]
            if source == device and made:
                end = ends[made[0]]
                every = len(made) == len(indices)
                sends[end.offload.id] = (every and not end.kept, made)
                if every:
                    outputs_gone.append(made[0])
        receives = {ends[i].reload.id: i for i in direct if mp.links[i].target == device}
        plans.append(_rewrite(plan, mp.links, sends, receives, outputs_gone))
    links = tuple(
        replace(link, path="peer") if i in direct else link for i, link in enumerate(mp.links)
    )
    placed = replace(mp.placed, links=links)
    info = {**mp.info, "sends": "direct"}
    sent = sum(mp.links[i].nbytes for i in direct)
    staged = [link for i, link in enumerate(mp.links) if i not in direct]
    report = DirectReport(
        len(direct), sent, len(staged), sum(k.nbytes for k in staged), dict(reasons)
    )
    info["direct"] = {"links": report.direct, "bytes": report.direct_bytes, **report.reasons}
    return MultiPlan(placed, tuple(plans), info), report


def _candidates(mp: MultiPlan) -> tuple[dict[int, _Ends], dict[str, int]]:
    """The links the rewrite applies to, with their nodes; the others counted by reason."""
    found: dict[int, _Ends] = {}
    reasons: dict[str, int] = {}

    def skip(reason: str) -> None:
        reasons[reason] = reasons.get(reason, 0) + 1

    facts = [_Facts(plan.mg) for plan in mp.plans]
    for index, link in enumerate(mp.links):
        src, dst = facts[link.source], facts[link.target]
        output = src.outputs.get(link.output)
        offloads = src.offloads.get(output.storage, []) if output is not None else []
        if output is None or output.storage is None or len(offloads) != 1 or offloads[0].box:
            skip("sent from no single whole offload")
            continue
        if src.reloads.get(output.storage):
            skip("reloaded from its host copy on the source")
            continue
        node = dst.inputs.get(link.input)
        reloads = dst.reloads.get(node.storage, []) if node is not None else []
        if node is None or node.storage is None or not reloads:
            skip("never brought onto the target")
            continue
        if len(reloads) > 1 or reloads[0].box is not None:
            skip("reloaded more than once or in boxes on the target")
            continue
        if dst.others.get(node.storage) or dst.input_readers.get(node.id, 0) != 1:
            skip("read from the host on the target")
            continue
        kept = src.others.get(output.storage, 0) > 1  # another output node reads the storage
        found[index] = _Ends(offloads[0], output, node, reloads[0], kept)
    return found, reasons


class _Order:
    """A topological order of a growing DAG, kept as edges are added (Pearce and Kelly's
    dynamic topological sort): adding x -> y where y comes before x reorders just the
    nodes between them that must move, or finds that y reaches x (a cycle)."""

    def __init__(self, successors: list[list[int]], position: list[int]):
        self.successors = [list(after) for after in successors]
        self.predecessors: list[list[int]] = [[] for _ in successors]
        for g, after in enumerate(successors):
            for s in after:
                self.predecessors[s].append(g)
        self.position = list(position)

    def add_edges(self, edges: list[tuple[int, int]]) -> bool:
        """Add every edge, or none of them (False) when together they close a cycle."""
        added = []
        for x, y in edges:
            if not self._add(x, y):
                for a, b in reversed(added):  # removing edges keeps the order topological
                    self.successors[a].remove(b)
                    self.predecessors[b].remove(a)
                return False
            added.append((x, y))
        return True

    def _add(self, x: int, y: int) -> bool:
        position = self.position
        low, high = position[y], position[x]
        if low > high:
            self.successors[x].append(y)
            self.predecessors[y].append(x)
            return True
        forward = self._reach(y, self.successors, lambda g: position[g] <= high, x)
        if forward is None:
            return False  # y reaches x: x -> y closes a cycle
        backward = self._reach(x, self.predecessors, lambda g: position[g] >= low, None)
        moved = sorted(backward, key=position.__getitem__) + sorted(
            forward, key=position.__getitem__
        )
        for g, p in zip(moved, sorted(position[g] for g in moved), strict=True):
            position[g] = p
        self.successors[x].append(y)
        self.predecessors[y].append(x)
        return True

    @staticmethod
    def _reach(start: int, edges: list[list[int]], inside, stop: int | None) -> list[int] | None:
        """The nodes reachable from `start` through `edges` among those `inside` accepts
        (None if `stop` is among them)."""
        seen = {start}
        stack = [start]
        while stack:
            g = stack.pop()
            for n in edges[g]:
                if n == stop:
                    return None
                if n not in seen and inside(n):
                    seen.add(n)
                    stack.append(n)
        return list(seen)


class _Facts:
    """A device plan's nodes by what the rewrite asks of them."""

    def __init__(self, mg: MemGraph):
        self.outputs = {n.name: n for n in mg.nodes if n.kind is NodeKind.OUTPUT}
        self.inputs = {n.name: n for n in mg.nodes if n.kind is NodeKind.INPUT}
        self.offloads: dict[int, list[MemNode]] = {}
        self.reloads: dict[int, list[MemNode]] = {}
        self.others: dict[int, int] = {}  # storage -> outputs reading it on the host
        self.input_readers: dict[int, int] = {}  # input node -> nodes waiting for it
        for node in mg.nodes:
            if node.kind is NodeKind.OFFLOAD:
                self.offloads.setdefault(node.storage, []).append(node)
            elif node.kind is NodeKind.RELOAD:
                self.reloads.setdefault(node.storage, []).append(node)
            elif node.kind is NodeKind.OUTPUT and node.storage is not None:
                self.others[node.storage] = self.others.get(node.storage, 0) + 1
            for dep in node.deps:
                self.input_readers[dep] = self.input_readers.get(dep, 0) + 1


def _dependents(mg: MemGraph) -> list[list[int]]:
    """For each node of `mg`, the nodes that list it in their dependencies."""
    out: list[list[int]] = [[] for _ in mg.nodes]
    for node in mg.nodes:
        for dep in node.deps:
            out[dep].append(node.id)
    return out


def _rewrite(
    plan: DevicePlan,
    links: tuple[Link, ...],
    sends: Mapping[int, tuple[bool, list[int]]],
    receives: Mapping[int, int],
    outputs_gone: Sequence[int] = (),
) -> DevicePlan:
    """Device `plan` with its direct links' nodes rewritten: each offload in `sends`
    (offload id -> (whether all its links are direct, the direct ones)) followed, or
    replaced, by a send per direct link (replaced where no program output is that host
    copy); the output nodes of the links in `outputs_gone` (every link of their output
    direct) dropped; each
    reload in `receives` (reload id -> link) made a receive, its input node dropped.
    Ids are renumbered; a node that waited for a replaced node waits for what replaced it."""
    mg = plan.mg
    dropped_storages: set[int] = set()
    gone: set[int] = set()  # old ids of nodes that disappear without replacement
    sent_only = {links[i].output for i in outputs_gone}
    gone.update(n.id for n in mg.nodes if n.kind is NodeKind.OUTPUT and n.name in sent_only)
    for offload_id, (whole, direct) in sends.items():
        if whole and direct:
            dropped_storages.add(mg.nodes[offload_id].storage)
    input_of = {
        n.storage: n.id for n in mg.nodes if n.kind is NodeKind.INPUT and n.storage is not None
    }
    for reload_id in receives:
        storage = mg.nodes[reload_id].storage
        dropped_storages.add(storage)
        gone.add(input_of[storage])
    if not sends and not receives and not gone:
        return plan
    new_ids: list[tuple[int, ...]] = []  # old id -> the new ids standing for it
    nodes: list[MemNode] = []

    def deps_of(node: MemNode) -> tuple[int, ...]:
        return tuple(sorted({new for d in node.deps for new in new_ids[d]}))

    for node in mg.nodes:
        if node.id in gone:
            new_ids.append(())
            continue
        deps = deps_of(node)
        made: list[int] = []
        whole, direct = sends.get(node.id, (False, []))
        if not (whole and direct):
            made.append(len(nodes))
            if node.id in receives:
                link = receives[node.id]
                nodes.append(_copy(NodeKind.RECV, len(nodes), deps, node, links[link].input, link))
            else:
                nodes.append(replace(node, id=len(nodes), deps=deps))
        for link in direct:
            made.append(len(nodes))
            nodes.append(_copy(NodeKind.SEND, len(nodes), deps, node, links[link].output, link))
        new_ids.append(tuple(made))
    storages = {sid: s for sid, s in mg.storages.items() if sid not in dropped_storages}
    info = dict(mg.info)
    new = MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, info, storages)
    return DevicePlan(plan.device, new, plan.budget)


def _copy(
    kind: NodeKind, node_id: int, deps: tuple[int, ...], moved: MemNode, name: str, link: int
) -> MemNode:
    """The send or receive of link `link` (input or output `name`) that stands for the
    offload or reload `moved`: its tensor and region."""
    return MemNode(node_id, kind, deps, moved.tensor, moved.region, name=name, link=link)
