"""Schedules: which stream does each MemGraph node's work, and which events it waits for.

Execution modes (`MODES`):

* `sequential` – every node in insertion order on one stream (no events needed);
* `streams`    – nodes issued in insertion order onto three streams, `compute`
                 (applies), `h2d` (reloads, device inputs) and `d2h` (offloads,
                 device outputs); a node waits, through events, exactly for the
                 nodes on other streams that its MemGraph dependencies require
                 (work on one stream runs in issue order, so same-stream
                 dependencies need nothing). On the NumPy backend each stream is a
                 worker thread (so this mode is also called `threaded`).
* `random`     – a seeded random order honouring only the MemGraph dependencies,
                 each node finished before the next starts: a missing dependency
                 shows up as a wrong answer for some seed (see `random_order`).

A plan with a host tier (`runtime.tiers`) has two more streams in the modes `streams`
and `random`, `disk_read` (reads from disk into the host arena) and `disk_write`
(writes to the spill file; and, when poisoning, releases of host slots), so that
reads overlap compute (`memgraph.trace.DISK_STREAMS`).

Bookkeeping nodes (allocs, frees, host-side inputs and outputs) do no work; their
dependencies pass through them: a node that depends on a free waits for everything
the free depends on.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from einpage_core.errors import BackendError, VerificationError
from memgraph.graph import MemGraph
from memgraph.nodes import STREAM_OF, MemNode, NodeKind
from memgraph.trace import DISK_STREAMS, STREAMS  # the lane names, defined once

__all__ = [
    "MODES",
    "STREAMS",
    "DISK_STREAMS",
    "Schedule",
    "ReadyNodes",
    "node_stream",
    "random_order",
    "resolve_mode",
]

MODES = ("sequential", "streams", "random")
_ALIASES = {"threaded": "streams"}


def resolve_mode(mode: str | None, default: str) -> str:
    """The canonical mode name (`threaded` is `streams`); raises `BackendError` if unknown."""
    if mode is None:
        return default
    mode = _ALIASES.get(mode, mode) if isinstance(mode, str) else mode
    if mode not in MODES:
        valid = ", ".join(repr(m) for m in (*MODES, *_ALIASES))
        raise BackendError(f"unknown mode {mode!r}; valid: {valid}")
    return mode


def node_stream(node: MemNode, poison: bool = False) -> str | None:
    """The stream that does `node`'s work, or None when it is bookkeeping only.

    Unlike `memgraph.nodes.STREAM_OF` (where a plan's nodes belong), this is where
    the runtime has work to do: a host-side input does none (its data is placed in
    host storage before the run starts), a device-side output is a device-to-host
    copy, and a free poisons its region on the compute stream when asked to; a read
    from disk runs on `disk_read`, a write to the spill file on `disk_write`, and a
    release of a host slot poisons the slot there when asked to.
    """
    if node.kind is NodeKind.APPLY:
        return "compute"
    if node.kind in (NodeKind.READ, NodeKind.WRITE):
        return node.stream  # its disk lane
    if node.kind is NodeKind.RELEASE and poison:
        return STREAM_OF[NodeKind.WRITE]
    if node.copies is not None:  # a reload, an offload, an input put on the device
        return node.copies
    if node.kind is NodeKind.OUTPUT and node.region is not None:
        return "d2h"  # into the caller's array
    if node.kind is NodeKind.FREE and poison:
        return "compute"
    return None


@dataclass(frozen=True, slots=True)
class Schedule:
    """How a mode runs a MemGraph: per node, its stream (None: bookkeeping) and the nodes
    on other streams whose events it waits for; `recorded` are the nodes after which an
    event must be recorded (every node some other stream waits for)."""

    mode: str
    streams: tuple[str, ...]
    stream_of: tuple[str | None, ...]
    waits: tuple[tuple[int, ...], ...]
    recorded: frozenset[int]

    @classmethod
    def build(cls, mg: MemGraph, mode: str, poison: bool = False) -> Schedule:
        """The schedule of `mg` in `mode` (see the module docstring)."""
        check_dependencies(mg)
        own = [node_stream(node, poison) for node in mg.nodes]
        if mode == "sequential":
            stream_of = tuple(None if s is None else "compute" for s in own)
            return cls(mode, ("compute",), stream_of, ((),) * len(mg.nodes), frozenset())
        stream_of = tuple(own)
        disk = mg.tier is not None or any(s in DISK_STREAMS for s in own)
        streams = STREAMS + DISK_STREAMS if disk else STREAMS
        if mode == "random":
            return cls(mode, streams, stream_of, ((),) * len(mg.nodes), frozenset())
        waits = _event_waits(mg, stream_of)
        recorded = frozenset(i for w in waits for i in w)
        return cls(mode, streams, stream_of, waits, recorded)

    def __repr__(self) -> str:
        count = sum(len(w) for w in self.waits)
        return f"<Schedule {self.mode} nodes={len(self.stream_of)} waits={count}>"


def check_dependencies(mg: MemGraph) -> None:
    """Raise `VerificationError` unless every dependency names an earlier node.

    Checked even when verification is skipped: the schedules rely on it.
    """
    for node in mg.nodes:
        for dep in node.deps:
            if not 0 <= dep < node.id:
                raise VerificationError(
                    f"n{node.id} ({node.kind}): dependency n{dep} is not an earlier node", node.id
                )


def _merge(into: dict[str, int], other: dict[str, int]) -> None:
    for stream, position in other.items():
        if into.get(stream, -1) < position:
            into[stream] = position


def _event_waits(mg: MemGraph, stream_of: tuple[str | None, ...]) -> tuple[tuple[int, ...], ...]:
    """Per node, the events (node ids on other streams) it must wait for.

    `required[n]` is, per stream, the last node on it that must be done before n's
    dependents may run: n itself for a node with work, and what its dependencies
    require for a bookkeeping node. `guaranteed[s]` is, per stream, the last node
    known to be done before the next work issued on stream s starts (its own earlier
    work, and everything the events it waited on guarantee: `implied[i]`).
    """
    required: list[dict[str, int]] = []
    implied: dict[int, dict[str, int]] = {}
    guaranteed: dict[str, dict[str, int]] = {}
    waits: list[tuple[int, ...]] = []
    for node in mg.nodes:
        need: dict[str, int] = {}
        for dep in node.deps:
            _merge(need, required[dep])
        stream = stream_of[node.id]
        if stream is None:
            required.append(need)
            waits.append(())
            continue
        mine = guaranteed.setdefault(stream, {})
        mine_waits = []
        for other, position in sorted(need.items(), key=lambda item: -item[1]):
            if other != stream and mine.get(other, -1) < position:
                mine_waits.append(position)
                _merge(mine, implied[position])
        mine[stream] = node.id
        implied[node.id] = dict(mine)
        required.append({stream: node.id})
        waits.append(tuple(sorted(mine_waits)))
    return tuple(waits)


class ReadyNodes:
    """The nodes of `mg` whose dependencies are all done, smallest `keys[node id]` first
    (ties: the smaller id): `pop()` the next, `done(node)` once it has run (its users
    whose last dependency it was become ready), `push(node)` to put back one popped but
    not run (a node held until something outside the plan happens: a link's arrival,
    `runtime.multi`). Dependencies must point back (`check_dependencies`)."""

    def __init__(self, mg: MemGraph, keys: Sequence[Any]):
        nodes = mg.nodes
        self._keys = keys
        self._remaining = [len(set(node.deps)) for node in nodes]
        self._users: list[list[int]] = [[] for _ in nodes]
        for node in nodes:
            for dep in sorted(set(node.deps)):
                self._users[dep].append(node.id)
        self._heap = [(keys[n.id], n.id) for n in nodes if self._remaining[n.id] == 0]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __repr__(self) -> str:
        return f"<ReadyNodes ready={len(self._heap)}>"

    def pop(self) -> int:
        return heapq.heappop(self._heap)[1]

    def push(self, node_id: int) -> None:
        heapq.heappush(self._heap, (self._keys[node_id], node_id))

    def done(self, node_id: int) -> None:
        for user in self._users[node_id]:
            self._remaining[user] -= 1
            if self._remaining[user] == 0:
                self.push(user)


def random_order(mg: MemGraph, seed: int) -> list[int]:
    """A seeded random topological order of `mg` by its dependencies alone.

    Every node draws a random priority; at each step the ready node (all of its
    dependencies done) with the highest priority runs next. Unlike picking a ready
    node uniformly, this keeps a low-priority node waiting for as long as anything
    else can run, so a node that some other node should have waited for (a missing
    dependency) often runs after it, for some seed.
    """
    check_dependencies(mg)
    rng = random.Random(seed)
    ready = ReadyNodes(mg, [-rng.random() for _ in mg.nodes])
    order: list[int] = []
    while ready:
        current = ready.pop()
        order.append(current)
        ready.done(current)
    return order
