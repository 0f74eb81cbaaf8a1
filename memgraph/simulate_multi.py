"""The simulator for several devices: how long a `MultiPlan` takes, all devices together.

The model
---------
Each device runs its own MemGraph on its own three in-order streams (compute, h2d,
d2h), every node taking what it takes in `memgraph.simulate` (`NodeDurations`: the
same code), so a plan on one device simulates exactly as `simulate` times it. A node
starts when its dependencies have ended and its stream has finished the stream's
previous node. Two things tie the devices together:

* **links staged through the host** (`Link.path == "host"`): the `input` node of a
  link's input on the target device (a host-located input: it takes no time) starts no
  earlier than the end of the link's `output` node on the source, which the source's plan
  (made with `outputs="host"`) places after the offload of the tensor. So such a tensor
  costs A's device-to-host copy, then B's host-to-device reload. The copy that brings a
  received tensor onto the device (a node depending on a link's `input` node) is put on
  its stream when the tensor has arrived, as the devices' dependency-driven executor
  (`memgraph.multi`) issues it, not at its place in the stream's order: the copies queued
  behind it (the next layers' weights of a pipeline stage) do not wait for another
  device. Every other node keeps its stream's order.
* **direct links** (`Link.path == "peer"`, `memgraph.peer`): the source's `send` and the
  target's `recv` of a link are ONE copy (a rendezvous) on the devices' "peer" streams
  (`memgraph.trace.PEER_STREAM`). It starts when both ends are ready (their own
  dependencies ended; the send also its stream's previous node: a device's sends keep
  their order) and its lanes are free, and both nodes end together, `latency + bytes /
  bandwidth` later (`CostModel.transfer_latency_s`, the latency of every copy). A recv is
  the copy of a received tensor, so like the reload of a staged one it is put on its
  stream when its send is ready, holding up nothing queued behind it (the planner places
  it early, where it allocated the region, as it prefetches a reload). The lanes: with
  `Topology.peer_bytes_per_s` set (NVLink through NVSwitch), each device has a peer-out
  and a peer-in lane at that bandwidth, and a copy holds the source's out lane and the
  target's in lane (a device sends one tensor and receives another at once: the link is
  full duplex); with it None, a direct copy is PCIe peer-to-peer through the host links:
  it holds the source's host-link d2h lane and the target's host-link h2d lane (shared
  with the other devices on those links, as below), at the smaller of the two
  bandwidths.
* **shared host links** (`Topology.devices_per_host_link`): the devices on one host
  link share it by serialising their copies: each link has one lane per direction, and
  a copy holds its lane for its whole time (`CostModel.transfer_seconds`, at the full
  bandwidth). The lane serves copies in the order they become ready (first come, first
  served; ties by device, then node). Serialising at full bandwidth moves the same bytes
  in the same total time (latencies aside) as sharing the bandwidth fairly among the
  copies in flight; it only finishes some copies earlier. With one device per host link
  (the default), a lane is simply that device's h2d or d2h stream.

The whole is simulated as events in time order: nodes are started in the order they
become ready (their dependencies and link ended; ties by device, then node id), each at
the earliest time its stream and its host-link lane allow; a direct copy starts when
the later of its two ends becomes ready, at the earliest time all its lanes allow. With
no shared lanes and no direct links this gives every node the same times as a
sequential replay in any topological order; with shared lanes it is a first-come,
first-served list schedule.

In-order streams can still wait where the plans do not (a node queued behind an apply
that reads a received tensor, on a stream whose later nodes another device waits for):
the streams would deadlock though no dependency or link forms a cycle. The devices'
executor runs such a node anyway, so the simulator does too: when no node can start,
the first node (earliest ready, then by device and node id) that waits only for its
stream's previous node starts out of stream order; `MultiSimResult.reordered` counts
them. A plan whose dependencies and links form a cycle cannot run at all: the error
names, for each device, the first node that never became ready.

Reported (`MultiSimResult`): the makespan (when the last node of any device ends); per
device, a `SimResult` (its finish time as `makespan`, its compute time, stream busy
times and bytes, and its timeline when asked) and its stall (finish - compute: the time
before it finishes that it does not compute: waiting for copies or for another device);
the bytes and busy time of each host link per direction (PCIe peer-to-peer copies of
direct links included); each device's peer busy time and bytes per direction ("out",
"in"); the bytes each pair of devices sends (all its links) and of those the bytes sent
direct; and `scaling_efficiency(single_device_makespan)`.

>>> import einpage as ep, memgraph
>>> from memgraph.multi import DevicePart, DevicePlan, MultiPlan, PlacedGraph
>>> prog = ep.Program("one")
>>> x = prog.input("x", (256,), location="host")
>>> prog.output(ep.exp(x), "y")
>>> tg = prog.build()
>>> mg = memgraph.plan(tg, 4096, outputs="host")
>>> placed = PlacedGraph(1, (DevicePart(0, tg, (0, 1)),), (), {"y": (0, "y")})
>>> mp = MultiPlan(placed, (DevicePlan(0, mg, 4096),))
>>> simulate_multi(mp, "cpu").makespan == memgraph.simulate(mg, "cpu").makespan
True
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from einpage_core.errors import GraphError, PlanError, VerificationError, expect_graph
from einpage_core.units import format_bytes
from memgraph.cost import CostModel
from memgraph.graph import MemGraph
from memgraph.multi import Link, MultiPlan
from memgraph.nodes import NodeKind
from memgraph.simulate import NodeDurations, SimResult, resolve_cost_model
from memgraph.trace import PEER_STREAM, STREAMS, StreamEvent, node_event

__all__ = ["MultiSimResult", "simulate_multi"]

_COPIES = ("h2d", "d2h")
_DIRECTIONS = ("out", "in")  # of a device's direct copies: what it sends, what it receives
_PEER_KINDS = (NodeKind.SEND, NodeKind.RECV)


@dataclass(frozen=True, eq=False)
class MultiSimResult:
    """What `simulate_multi` found (seconds and bytes; the model is in the module docstring).

    `per_device[d]` is device d's `SimResult` (its `makespan` is the time its last node
    ends, on the clock all devices share; `events`/`node_times` with `timeline=True`).
    `host_link_bytes[k]` and `host_link_busy[k]` are, per direction ("h2d", "d2h"),
    what host link k moved and how long it was busy (a direct copy on a machine without
    a peer link, PCIe peer-to-peer, counts on the source's link as "d2h" and on the
    target's as "h2d"). `sent_bytes[(a, b)]` is what device a sends device b through all
    its links; `direct_bytes[(a, b)]` is the part of it sent direct (links with
    `path == "peer"`: one copy between the arenas), the rest is staged through the host.
    `peer_bytes[d]` and `peer_busy[d]` are, per direction ("out": sent, "in": received),
    what device d's direct copies moved and how long they took (its peer stream's busy
    time is their sum; `per_device[d].busy` has only the streams of `memgraph.simulate`).
    """

    makespan: float
    per_device: tuple[SimResult, ...]
    host_link_bytes: Mapping[int, Mapping[str, int]]
    host_link_busy: Mapping[int, Mapping[str, float]]
    sent_bytes: Mapping[tuple[int, int], int]
    cost_model: CostModel
    reordered: int = 0
    """How many nodes started out of their stream's order, to avoid a deadlock of the
    in-order streams that the plans' dependencies and links do not imply."""
    direct_bytes: Mapping[tuple[int, int], int] = field(default_factory=dict)
    peer_bytes: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    peer_busy: Mapping[int, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        freeze = MappingProxyType
        object.__setattr__(
            self,
            "host_link_bytes",
            freeze({k: freeze(dict(v)) for k, v in self.host_link_bytes.items()}),
        )
        object.__setattr__(
            self,
            "host_link_busy",
            freeze({k: freeze(dict(v)) for k, v in self.host_link_busy.items()}),
        )
        object.__setattr__(self, "sent_bytes", freeze(dict(self.sent_bytes)))
        object.__setattr__(self, "direct_bytes", freeze(dict(self.direct_bytes)))
        for name in ("peer_bytes", "peer_busy"):
            value = getattr(self, name)
            object.__setattr__(self, name, freeze({d: freeze(dict(v)) for d, v in value.items()}))

    @property
    def devices(self) -> int:
        return len(self.per_device)

    @property
    def compute_seconds(self) -> tuple[float, ...]:
        """Each device's compute busy time (the sum of its apply times)."""
        return tuple(r.compute_seconds for r in self.per_device)

    @property
    def finish_seconds(self) -> tuple[float, ...]:
        """When each device's last node ends."""
        return tuple(r.makespan for r in self.per_device)

    @property
    def stall_seconds(self) -> tuple[float, ...]:
        """Each device's stall: its finish time minus its compute time (waiting for its
        copies, or for a tensor another device sends)."""
        return tuple(r.stall_seconds for r in self.per_device)

    def speedup(self, single_device_makespan: float) -> float:
        """`single_device_makespan / makespan`: how many times faster than one device."""
        if not single_device_makespan > 0 or not self.makespan > 0:
            raise PlanError(
                f"speedup needs positive makespans, got single device "
                f"{single_device_makespan!r} s and {self.devices} devices {self.makespan!r} s"
            )
        return single_device_makespan / self.makespan

    def scaling_efficiency(self, single_device_makespan: float) -> float:
        """The speedup over one device divided by the number of devices: 1.0 is perfect
        scaling (N devices, N times faster); a pipeline that runs one batch through its
        stages in turn scores about 1/N.

        `single_device_makespan`: the same workload's makespan on one device (for
        example `memgraph.simulate` of its single-device plan, with offload)."""
        return self.speedup(single_device_makespan) / self.devices

    def rows(self) -> list[tuple[str, ...]]:
        """The table's rows, a header first: one per device, as human-readable strings."""

        def ms(seconds: float) -> str:
            return f"{seconds * 1e3:.4g}"

        span = self.makespan or 1.0
        topology = self.cost_model.topology
        direct = bool(self.direct_bytes)  # peer columns only where a link went direct
        header = ("device", "host link", "finish ms", "compute ms", "compute %", "stall ms",
                  "h2d ms", "d2h ms", "h2d bytes", "d2h bytes")  # fmt: skip
        if direct:
            header += ("peer out ms", "peer in ms", "peer out bytes", "peer in bytes")
        rows = [header]
        for d, r in enumerate(self.per_device):
            row = (
                str(d),
                str(topology.host_link(d)),
                ms(r.makespan),
                ms(r.compute_seconds),
                f"{100 * r.compute_seconds / span:.1f}",
                ms(r.stall_seconds),
                ms(r.busy["h2d"]),
                ms(r.busy["d2h"]),
                format_bytes(r.h2d_bytes),
                format_bytes(r.d2h_bytes),
            )
            if direct:
                busy, moved = self.peer_busy[d], self.peer_bytes[d]
                row += (
                    ms(busy["out"]),
                    ms(busy["in"]),
                    format_bytes(moved["out"]),
                    format_bytes(moved["in"]),
                )
            rows.append(row)
        return rows

    def table(self) -> str:
        """A plain-text table: the machine and the makespan, then a row per device, then
        each host link's bytes and busy time, then the bytes sent between devices."""
        rows = self.rows()
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = [
            f"{self.cost_model.name}: {self.cost_model.topology.describe()}",
            f"makespan {self.makespan * 1e3:.3f} ms on {self.devices} device(s)",
        ]
        for row in rows:
            lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        for k in sorted(self.host_link_bytes):
            moved, busy = self.host_link_bytes[k], self.host_link_busy[k]
            lines.append(
                f"host link {k}: h2d {format_bytes(moved['h2d'])} in {busy['h2d'] * 1e3:.3f} ms, "
                f"d2h {format_bytes(moved['d2h'])} in {busy['d2h'] * 1e3:.3f} ms"
            )
        peer = self.cost_model.topology.peer_bytes_per_s
        how = "over the peer link" if peer is not None else "PCIe peer-to-peer"
        for (a, b), nbytes in sorted(self.sent_bytes.items()):
            direct = self.direct_bytes.get((a, b), 0)
            parts = [f"{format_bytes(nbytes - direct)} through the host"] if nbytes > direct else []
            if direct:
                parts.append(f"{format_bytes(direct)} direct ({how})")
            lines.append(f"device {a} -> device {b}: {', '.join(parts)}")
        if self.reordered:
            lines.append(f"{self.reordered} node(s) started out of their stream's order")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        finish = ", ".join(f"{r.makespan * 1e3:.3f}" for r in self.per_device)
        sent = sum(self.sent_bytes.values())
        direct = sum(self.direct_bytes.values())
        return (
            f"<MultiSimResult {self.cost_model.name} devices={self.devices} "
            f"makespan={self.makespan * 1e3:.3f}ms finish=[{finish}]ms "
            f"sent={format_bytes(sent)}"
            + (f" direct={format_bytes(direct)}" if direct else "")
            + (f" reordered={self.reordered}" if self.reordered else "")
            + ">"
        )


def simulate_multi(
    mp: MultiPlan,
    cost_model: str | CostModel | None = None,
    *,
    timeline: bool = False,
) -> MultiSimResult:
    """Simulate all the devices of `mp` together (the model is in the module docstring).

    `cost_model`: a `memgraph.cost.PRESETS` name or a `CostModel` (default as
    `memgraph.simulate`'s); its rates are each device's and its `topology` says which
    devices share a host link. `timeline=True` also records each device's events and node
    times (`per_device[d].events`, `.node_times`).

    Raises `PlanError` when the plan uses more devices than the machine has, `GraphError`
    when a link names an output or input its device's plan lacks (or a device out of
    range, or a dependency on a later node), when a direct link has not exactly one send
    on its source and one receive on its target, or a send or receive names no direct
    link of its device, and `VerificationError` when the plans and links form a cycle
    (they would deadlock); `PlanError` for a device's plan with a host tier (its disk
    lanes are simulated for one device only: `memgraph.simulate`).
    """
    expect_graph(mp, MultiPlan, "memgraph.simulate_multi")
    for part in mp.plans:
        if part.mg.tier is not None:
            raise PlanError(
                f"memgraph.simulate_multi: device {part.device}'s plan of "
                f"{part.mg.taskgraph.name!r} has a host tier ({part.mg.tier}); plans for "
                f"several devices with host tiers are not simulated: memgraph.simulate "
                f"times one device's plan with its disk"
            )
    model = resolve_cost_model(cost_model)
    run = _MultiReplay(mp, model, timeline)
    run.run()
    return run.result()


class _MultiReplay:
    """The devices' streams and the host links' lanes, nodes started in the order they
    become ready; a direct link's send and receive started together, as one copy."""

    def __init__(self, mp: MultiPlan, model: CostModel, timeline: bool):
        topology = model.topology
        n_devices = mp.devices
        if topology.devices is not None and n_devices > topology.devices:
            raise PlanError(
                f"the plan uses {n_devices} devices; cost model {model.name!r} has "
                f"{topology.devices} ({topology.describe()})"
            )
        plans = sorted(mp.plans, key=lambda p: p.device)
        if [p.device for p in plans] != list(range(n_devices)):
            raise GraphError(
                f"a plan for {n_devices} devices needs one DevicePlan for each of devices "
                f"0..{n_devices - 1}; got devices {[p.device for p in mp.plans]}"
            )
        self.model = model
        self.timeline = timeline
        self.mgs: list[MemGraph] = [p.mg for p in plans]
        self.durations = [NodeDurations(mg, model) for mg in self.mgs]
        self.links = mp.links
        # Per device and node: (stream, seconds, bytes), then the bookkeeping of waits:
        # how many nodes each still waits for, when the last of them ended, who waits on it.
        # A send or receive's entry is its link's copy (`_ends`).
        self.cost = [
            [(None, 0.0, 0) if node.kind in _PEER_KINDS else durations(node)
             for node in mg.nodes]
            for durations, mg in zip(self.durations, self.mgs, strict=True)
        ]  # fmt: skip
        self.pending = [[0] * len(mg.nodes) for mg in self.mgs]
        self.ready = [[0.0] * len(mg.nodes) for mg in self.mgs]
        self.waiters: list[list[list[tuple[int, int]]]] = [
            [[] for _ in mg.nodes] for mg in self.mgs
        ]
        self.start = [[0.0] * len(mg.nodes) for mg in self.mgs]
        self.end = [[0.0] * len(mg.nodes) for mg in self.mgs]
        self.done = [[False] * len(mg.nodes) for mg in self.mgs]
        self.stream_pred: list[dict[int, int]] = [{} for _ in self.mgs]  # node -> previous
        self.reordered = 0
        self.named: dict[tuple[int, NodeKind, str], int] | None = None
        self.lane_free: dict[tuple[str, int], float] = {}
        self.link_busy: dict[int, dict[str, float]] = {}
        self.link_moved: dict[int, dict[str, int]] = {}
        # Direct links: link index -> its send and its receive, as (device, node); the end
        # of each copy that is ready while the other is not: link index -> its ready time.
        self.copy_of: list[dict[int, int]] = [{} for _ in self.mgs]  # node -> link index
        self.ends: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {}
        self.arrived: dict[int, float] = {}
        self.peer_busy = [dict.fromkeys(_DIRECTIONS, 0.0) for _ in self.mgs]
        self.peer_moved = [dict.fromkeys(_DIRECTIONS, 0) for _ in self.mgs]
        self._wire()

    # -- the graph of waits ---------------------------------------------------------

    def _wait(self, device: int, node: int, on_device: int, on_node: int) -> None:
        self.pending[device][node] += 1
        self.waiters[on_device][on_node].append((device, node))

    def _wire(self) -> None:
        received: list[set[int]] = [set() for _ in self.mgs]  # link inputs, by device
        direct = self._copies()
        for index, link in enumerate(self.links):
            if index in direct:
                continue
            source = self._link_node(link, link.source, NodeKind.OUTPUT, link.output)
            target = self._link_node(link, link.target, NodeKind.INPUT, link.input)
            self._wait(link.target, target, link.source, source)
            received[link.target].add(target)
        for d, mg in enumerate(self.mgs):
            last_on: dict[str, int] = {}
            for node in mg.nodes:
                i = node.id
                for dep in node.deps:
                    if dep >= i:
                        raise GraphError(
                            f"device {d} n{i} ({node.kind}): dependency n{dep} is not an "
                            f"earlier node"
                        )
                    self._wait(d, i, d, dep)
                stream = self.cost[d][i][0]
                if stream is None:
                    continue
                if received[d].intersection(node.deps) or node.kind is NodeKind.RECV:
                    # The copy of a received tensor (a reload of a link's input, or a
                    # direct link's recv): on its stream when the tensor has arrived (the
                    # recv: when its send is ready), holding up nothing queued behind it.
                    continue
                if stream in last_on:
                    self._wait(d, i, d, last_on[stream])
                    self.stream_pred[d][i] = last_on[stream]
                last_on[stream] = i

    def _copies(self) -> set[int]:
        """Index each direct link's send and receive (`copy_of`), give them their copy's
        cost (on the peer stream), and return the direct links' indices; a send or receive
        that names no direct link of its device, or a direct link without exactly one of
        each, is a `GraphError`."""
        found_ends: dict[int, dict[NodeKind, list[tuple[int, int]]]] = {}
        for d, mg in enumerate(self.mgs):
            for node in mg.nodes:
                if node.kind not in _PEER_KINDS:
                    continue
                k = node.link
                link = self.links[k] if isinstance(k, int) and 0 <= k < len(self.links) else None
                device = None if link is None else (
                    link.source if node.kind is NodeKind.SEND else link.target
                )  # fmt: skip
                if link is None or link.path != "peer" or device != d:
                    what = (
                        f"not one of the plan's {len(self.links)} links" if link is None
                        else f"{link.describe()}, path {link.path!r}"
                    )  # fmt: skip
                    raise GraphError(
                        f"device {d} n{node.id} ({node.describe()}) names link {k!r}: "
                        f"{what}; a {node.kind} names a direct link (path 'peer') whose "
                        f"{'source' if node.kind is NodeKind.SEND else 'target'} is its "
                        f"device"
                    )
                found_ends.setdefault(k, {}).setdefault(node.kind, []).append((d, node.id))
        direct = set()
        for index, link in enumerate(self.links):
            if link.path == "host":
                continue
            if link.path != "peer":
                raise GraphError(
                    f"link {index} ({link.describe()}): path {link.path!r} is not one of "
                    f"'host', 'peer'"
                )
            found = found_ends.get(index, {})
            sends, recvs = found.get(NodeKind.SEND, []), found.get(NodeKind.RECV, [])
            if len(sends) != 1 or len(recvs) != 1:
                raise GraphError(
                    f"direct link {index} ({link.describe()}) needs one send on device "
                    f"{link.source} and one recv on device {link.target}; found "
                    f"{len(sends)} send(s) and {len(recvs)} recv(s)"
                )
            seconds = self._copy_seconds(link.nbytes)
            for d, i in (*sends, *recvs):
                self.cost[d][i] = (PEER_STREAM, seconds, link.nbytes)
                self.copy_of[d][i] = index
            self.ends[index] = (sends[0], recvs[0])
            direct.add(index)
        return direct

    def _copy_seconds(self, nbytes: int) -> float:
        """A direct copy's time: the copy latency plus the bytes at the peer link's bandwidth,
        or, with none, at the slower of the host links' d2h and h2d (PCIe peer-to-peer)."""
        model = self.model
        rate = model.topology.peer_bytes_per_s
        if rate is None:
            rate = min(model.d2h_bytes_per_s, model.h2d_bytes_per_s)
        return model.transfer_latency_s + nbytes / rate

    def _link_node(self, link: Link, device: int, kind: NodeKind, name: str) -> int:
        if not 0 <= device < len(self.mgs):
            raise GraphError(
                f"link {link.describe()}: device {device} is not one of the plan's "
                f"{len(self.mgs)} devices"
            )
        if self.named is None:  # (device, kind, name) -> first such node, built once
            self.named = {}
            for d, mg in enumerate(self.mgs):
                for n in mg.nodes:
                    if n.kind in (NodeKind.INPUT, NodeKind.OUTPUT):
                        self.named.setdefault((d, n.kind, n.name), n.id)
        found = self.named.get((device, kind, name))
        if found is None:
            have = sorted({n.name for n in self.mgs[device].nodes if n.kind is kind})
            raise GraphError(
                f"link {link.describe()}: device {device}'s plan has no {kind} node named "
                f"{name!r}; its {kind}s: {', '.join(map(repr, have)) or 'none'}"
            )
        return found

    # -- running --------------------------------------------------------------------

    def _lane(self, device: int, stream: str) -> tuple[str, int]:
        """The lane a node on `stream` holds: the device's compute stream, or its host
        link's lane in a copy's direction."""
        if stream == "compute":
            return stream, device
        return stream, self.model.topology.host_link(device)

    def _copy_lanes(self, link: Link) -> tuple[tuple[str, int], tuple[str, int]]:
        """The lanes a direct copy holds: the source's peer-out and the target's peer-in
        lane (a peer link), or the source's host link's d2h and the target's host link's
        h2d lane (PCIe peer-to-peer)."""
        if self.model.topology.peer_bytes_per_s is not None:
            return ("peer-out", link.source), ("peer-in", link.target)
        return self._lane(link.source, "d2h"), self._lane(link.target, "h2d")

    def run(self) -> None:
        # Nodes start in the order they become ready (their dependencies and link ended),
        # ties by device then node: a node's ready time is at least the ready time of
        # every node started before it, so each lane serves its copies first come, first
        # served, and a lane's copies never overlap. A direct copy starts when the later
        # of its send and receive comes off the heap.
        heap: list[tuple[float, int, int]] = []  # (ready, device, node)
        for d, pending in enumerate(self.pending):
            for i, count in enumerate(pending):
                if count == 0:
                    heap.append((0.0, d, i))
        heapq.heapify(heap)
        while True:
            if not heap:
                out_of_order = self._out_of_order()
                if out_of_order is None:
                    break
                heap.append(out_of_order)
            ready, d, i = heapq.heappop(heap)
            link_index = self.copy_of[d].get(i)
            if link_index is not None:
                self._copy(link_index, ready, heap)
                continue
            stream, seconds, nbytes = self.cost[d][i]
            if stream is None:
                begin = ready
            else:
                lane = self._lane(d, stream)
                begin = max(ready, self.lane_free.get(lane, 0.0))
                self.lane_free[lane] = begin + seconds
                if stream != "compute":
                    self._on_host_link(d, stream, seconds, nbytes)
            self._finish(d, i, begin, begin + seconds, heap)
        self._check_all_ran()

    def _on_host_link(self, device: int, direction: str, seconds: float, nbytes: int) -> None:
        k = self.model.topology.host_link(device)
        busy = self.link_busy.setdefault(k, dict.fromkeys(_COPIES, 0.0))
        moved = self.link_moved.setdefault(k, dict.fromkeys(_COPIES, 0))
        busy[direction] += seconds
        moved[direction] += nbytes

    def _finish(self, d: int, i: int, begin: float, finish: float, heap: list) -> None:
        """Node i of device d ran from `begin` to `finish`: release what waits for it."""
        self.start[d][i] = begin
        self.end[d][i] = finish
        self.done[d][i] = True
        for wd, wi in self.waiters[d][i]:
            self.ready[wd][wi] = max(self.ready[wd][wi], finish)
            self.pending[wd][wi] -= 1
            if self.pending[wd][wi] == 0:
                heapq.heappush(heap, (self.ready[wd][wi], wd, wi))

    def _copy(self, index: int, ready: float, heap: list) -> None:
        """One end of direct link `index` is ready at `ready`: remember it, or, the other
        end having been ready already, run the copy (both ends end together)."""
        first = self.arrived.pop(index, None)
        if first is None:
            self.arrived[index] = ready
            return
        link = self.links[index]
        lanes = self._copy_lanes(link)
        (sd, si), (rd, ri) = self.ends[index]
        _, seconds, nbytes = self.cost[sd][si]
        begin = max(ready, first, *(self.lane_free.get(lane, 0.0) for lane in lanes))
        finish = begin + seconds
        for lane in lanes:
            self.lane_free[lane] = finish
        for device, direction in ((link.source, "out"), (link.target, "in")):
            self.peer_busy[device][direction] += seconds
            self.peer_moved[device][direction] += nbytes
        if self.model.topology.peer_bytes_per_s is None:  # through the host links
            self._on_host_link(link.source, "d2h", seconds, nbytes)
            self._on_host_link(link.target, "h2d", seconds, nbytes)
        self._finish(sd, si, begin, finish, heap)
        self._finish(rd, ri, begin, finish, heap)

    def _out_of_order(self) -> tuple[float, int, int] | None:
        """When no node can start: the first node (earliest ready, then device, node) that
        waits only for its stream's previous node, released from that wait; or None."""
        best: tuple[float, int, int] | None = None
        for d, preds in enumerate(self.stream_pred):
            done, pending = self.done[d], self.pending[d]
            for i, prev in preds.items():
                if not done[i] and pending[i] == 1 and not done[prev]:
                    entry = (self.ready[d][i], d, i)
                    if best is None or entry < best:
                        best = entry
        if best is not None:
            _, d, i = best
            self.waiters[d][self.stream_pred[d][i]].remove((d, i))
            self.pending[d][i] = 0
            self.reordered += 1
        return best

    def _check_all_ran(self) -> None:
        stuck = []
        for d, done in enumerate(self.done):
            if not all(done):
                i = done.index(False)
                node = self.mgs[d].nodes[i]
                stuck.append(f"device {d} n{i} ({node.describe()}), {done.count(False)} nodes")
        if stuck:
            raise VerificationError(
                "the plans and their links form a cycle: these devices wait forever "
                "(first node never ready, and how many never ran): " + "; ".join(stuck)
            )

    # -- the result -----------------------------------------------------------------

    def _device_result(self, d: int) -> SimResult:
        mg = self.mgs[d]
        busy = dict.fromkeys(STREAMS, 0.0)
        moved = dict.fromkeys(STREAMS, 0)
        events: list[StreamEvent] = []
        for node in mg.nodes:  # insertion order: sums as `simulate` adds them
            stream, seconds, nbytes = self.cost[d][node.id]
            if stream is None:
                continue
            if stream != PEER_STREAM:  # a direct copy's time is in `MultiSimResult.peer_busy`
                busy[stream] += seconds
                if stream != "compute":
                    moved[stream] += nbytes
            if self.timeline:
                begin = self.start[d][node.id]
                events.append(node_event(mg, node, stream, begin, begin + seconds))
        events.sort(key=lambda e: (e.start, e.node))
        times = tuple(zip(self.start[d], self.end[d], strict=True))
        return SimResult(
            makespan=max(self.end[d], default=0.0),
            compute_seconds=busy["compute"],
            busy=busy,
            bytes_moved=moved,
            cost_model=self.model,
            node_count=len(mg.nodes),
            events=tuple(events) if self.timeline else None,
            node_times=times if self.timeline else None,
            program=mg.taskgraph.name,
        )

    def result(self) -> MultiSimResult:
        per_device = tuple(self._device_result(d) for d in range(len(self.mgs)))
        sent: dict[tuple[int, int], int] = {}
        direct: dict[tuple[int, int], int] = {}
        for link in self.links:
            pair = (link.source, link.target)
            sent[pair] = sent.get(pair, 0) + link.nbytes
            if link.path == "peer":
                direct[pair] = direct.get(pair, 0) + link.nbytes
        links = range(self.model.topology.host_link(len(self.mgs) - 1) + 1) if self.mgs else ()
        return MultiSimResult(
            makespan=max((r.makespan for r in per_device), default=0.0),
            per_device=per_device,
            host_link_bytes={
                k: self.link_moved.get(k, dict.fromkeys(_COPIES, 0)) for k in links
            },
            host_link_busy={
                k: self.link_busy.get(k, dict.fromkeys(_COPIES, 0.0)) for k in links
            },
            sent_bytes=sent,
            cost_model=self.model,
            reordered=self.reordered,
            direct_bytes=direct,
            peer_bytes=dict(enumerate(self.peer_moved)),
            peer_busy=dict(enumerate(self.peer_busy)),
        )

