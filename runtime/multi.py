"""Running a plan for several devices (`memgraph.multi.MultiPlan`) in one process.

Each device gets a `DeviceRunner`: a `runtime.Session` over its MemGraph (its own arena,
host buffer and interpreter: nothing is shared between devices but the arrays that links
carry) that executes the plan *dependency-driven*. A node runs once its MemGraph
dependencies are done and, for the `input` node of a link's input, once that link has
arrived: the source device ran the link's `output` node and the host array it holds was
put in this device's `Inbox`, then bound as the input's host storage (`Session.stage`).
Among the nodes that can run, `order="ready"` runs a link's `output` node first (so
that a send never waits behind other work), then the lowest insertion order;
`order="random"` makes a seeded random choice (as `runtime.schedule.random_order` does,
with freed memory poisoned: a missing dependency, within a device or across a link,
shows up as a wrong answer; sends are delayed at random too). Each node is done before
the next starts. This cannot deadlock when the union of the plans' dependencies and the
links (source `output` node -> target `input` node) is acyclic (`verify_multi`).

`run_devices(mp, inputs)` runs every device on a thread of its own and gathers the
outputs; `LocalDevices` keeps the runners between runs, of one MultiPlan or of several
over the same devices (a generation's step plans: each runner a session over its
device's share of every plan, inputs staged once for all of them, `run(inputs,
plan=key)`); `runtime.ray_cluster` runs the same `DeviceRunner` in Ray actors. The
driver stages each original input on every device whose TaskGraph has an input of that
name.

A direct link (`Link.path == "peer"`: a `send` node on the source, a `recv` node on the
target, `memgraph.peer`) is one copy between the two arenas, a rendezvous as a GPU peer
copy is. The interpreter hands each send and recv to the runner's port (`PeerPort`, the
`Interpreter.peers` of a run), which passes them to the run's `PeerLinks`: in one
process (`InboxPeers`) the send *offers* its region's view – the source's arena bytes,
not a copy – through the target's inbox (keyed by the link's index, `offer_key`) and
is done only when the target has copied it (an acknowledgement through the source's
inbox, `copied_key`); the source's thread does not block on it: other ready nodes run,
and the send's dependents (the free of its region) wait, as a link's `input` node waits
for its arrival. A recv waits for the offer (ready nodes run meanwhile), copies the
view into its region (`Backend.copy_to_device`: on NumPy one `np.copyto` between the
arenas) and acknowledges. On Ray (`runtime.ray_cluster`) the send is buffered instead:
a copy goes through the object store and the send is done at once.

Waits are bounded: a device that waits more than `timeout` seconds for a link (an
arrival, an offer, or the acknowledgement of its send) raises `BackendError` naming the
device and the nodes it waits for; an error on one device cancels the others (their
inboxes: a waiting device wakes, a computing one stops before its next node), every
thread is joined, and the error is raised naming the device it happened on.

>>> out = run_devices(mp, {"x": xs, **weights})                       # doctest: +SKIP
>>> out = run_devices(mp, inputs, order="random", seed=3, timeout=5)  # doctest: +SKIP
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from einpage_core.errors import BackendError, EinpageError, InputError, VerificationError
from memgraph.graph import MemGraph
from memgraph.multi import Link, MultiPlan, verify_multi
from memgraph.nodes import MemNode, NodeKind
from runtime.backend import Backend, NodeFailure
from runtime.schedule import ReadyNodes, check_dependencies
from runtime.session import Session, _naming
from runtime.tiers import refuse_tier_plan

__all__ = [
    "ORDERS",
    "DEFAULT_TIMEOUT",
    "Inbox",
    "Cancelled",
    "DeviceRunner",
    "LocalDevices",
    "run_devices",
    "check_plans",
    "staging",
    "check_multi",
    "check_order",
    "check_timeout",
    "device_inputs",
    "gather",
    "on_device",
    "first_failure",
    "Send",
    "Key",
    "offer_key",
    "copied_key",
    "PeerLinks",
    "InboxPeers",
    "PeerPort",
]

ORDERS = ("ready", "random")
"""How a device picks among the nodes that can run: insertion order, or seeded random."""

DEFAULT_TIMEOUT = 60.0
"""Seconds a device waits for a link before it gives up (`run_devices(timeout=)`)."""

Send = Callable[[Link, np.ndarray], None]
"""Delivers a link's tensor (a host array) to the link's target device."""

Key = str | tuple[str, int]
"""What arrives in an `Inbox`: a host-staged link's input name, or for a direct link
(by its index in `MultiPlan.links`) its offer (`offer_key`) or the acknowledgement that
it was copied (`copied_key`)."""


def offer_key(index: int) -> tuple[str, int]:
    """The inbox key of direct link `index`'s offer (on the target: the source's view)."""
    return ("offer", index)


def copied_key(index: int) -> tuple[str, int]:
    """The inbox key of direct link `index`'s acknowledgement (on the source: copied)."""
    return ("copied", index)


class PeerLinks(Protocol):
    """How one run's direct links travel between devices (see the module docstring)."""

    def offer(self, index: int, link: Link, view: Any) -> bool:
        """Offer the source's `view` of direct link `index` to its target; True when the
        send is done at once (the transport took a copy), False when it is done only
        once the target acknowledges the copy."""
        ...

    def acknowledge(self, index: int, link: Link) -> None:
        """Tell the source of direct link `index` that the target has copied it."""
        ...


class Cancelled(BackendError):
    """A device's run was stopped because another device failed (never the error a
    driver reports when it knows the other one)."""


class Inbox:
    """What arrived on a device from the others, by `Key`: a host-staged link's array by
    its input name, a direct link's offer (the source's view) or acknowledgement by the
    link's index; filled by other devices (`put`, from any thread) and taken by the
    device's runner (`take`, `poll`, `arrived`). `cancel(reason)` wakes a waiting
    runner, which then raises `Cancelled`."""

    def __init__(self) -> None:
        self._arrived: dict[Key, Any] = {}
        self._cancelled: str | None = None
        self._changed = threading.Condition()

    def __repr__(self) -> str:
        keys = sorted(map(str, self._arrived))
        return f"<Inbox arrived={keys} cancelled={self._cancelled is not None}>"

    def put(self, name: Key, array: Any) -> None:
        with self._changed:
            self._arrived[name] = array
            self._changed.notify_all()

    def cancel(self, reason: str) -> None:
        with self._changed:
            if self._cancelled is None:
                self._cancelled = reason
            self._changed.notify_all()

    def poll(self, name: Key) -> Any:
        """What arrived under `name` (taken out), else None."""
        with self._changed:
            self._check_cancelled()
            return self._arrived.pop(name, None)

    def arrived(self, names: Sequence[Key]) -> dict[Key, Any]:
        """Every one of `names` that has arrived (taken out), without waiting."""
        with self._changed:
            self._check_cancelled()
            return {n: self._arrived.pop(n) for n in names if n in self._arrived}

    def take(self, names: Sequence[Key], timeout: float) -> dict[Key, Any] | None:
        """Every one of `names` that has arrived, waiting up to `timeout` seconds for at
        least one; None when none came in time. Raises `Cancelled` once cancelled."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                self._check_cancelled()
                got = {n: self._arrived.pop(n) for n in names if n in self._arrived}
                left = deadline - time.monotonic()
                if got or left <= 0:
                    return got or None
                self._changed.wait(left)

    def check(self) -> None:
        """Raise `Cancelled` if the run was cancelled (a runner asks between nodes, so a
        device that is computing stops too, not only one that waits)."""
        reason = self._cancelled  # one read of one attribute: no lock needed
        if reason is not None:
            raise Cancelled(reason)

    def _check_cancelled(self) -> None:
        if self._cancelled is not None:
            raise Cancelled(self._cancelled)


@dataclass(frozen=True)
class _Routes:
    """The links of one plan that concern one device: those it receives (by input name,
    direct ones too), those it sends staged through the host (by output name; an output
    may feed several devices), and its direct links (by index in the plan's links)."""

    receives: dict[str, Link]
    sends: dict[str, list[Link]]
    direct: dict[int, Link]

    @classmethod
    def of(cls, device: int, links: Sequence[Link]) -> _Routes:
        sends: dict[str, list[Link]] = {}
        for link in links:
            if link.source == device and link.path == "host":
                sends.setdefault(link.output, []).append(link)
        direct = {
            index: link
            for index, link in enumerate(links)
            if link.path == "peer" and device in (link.source, link.target)
        }
        return cls({link.input: link for link in links if link.target == device}, sends, direct)


class InboxPeers:
    """Direct links between the devices of one process (`PeerLinks`): an offer is the
    source's view put in the target's inbox, done only when the target acknowledges the
    copy through the source's inbox (a rendezvous: no copy is taken on the way)."""

    def __init__(self, inboxes: Sequence[Inbox]):
        self.inboxes = inboxes

    def __repr__(self) -> str:
        return f"<InboxPeers devices={len(self.inboxes)}>"

    def offer(self, index: int, link: Link, view: Any) -> bool:
        self.inboxes[link.target].put(offer_key(index), view)
        return False

    def acknowledge(self, index: int, link: Link) -> None:
        self.inboxes[link.source].put(copied_key(index), True)


class PeerPort:
    """A device's `Interpreter.peers` for one run: `send` passes the region's view to the
    run's `PeerLinks` (remembering the sends not done at once, `unacknowledged`), `recv`
    copies the offer its runner took from the inbox (`offers`, by link index) into the
    region, on `stream` when the node has none, then acknowledges it."""

    def __init__(
        self, device: int, links: Mapping[int, Link], transport: PeerLinks, backend: Backend,
        stream: Any,
    ):  # fmt: skip
        self.device = device
        self.links = links
        self.transport = transport
        self.backend = backend
        self.stream = stream
        self.offers: dict[int, Any] = {}
        self.unacknowledged: set[int] = set()

    def __repr__(self) -> str:
        return (
            f"<PeerPort device={self.device} offers={sorted(self.offers)} "
            f"unacknowledged={sorted(self.unacknowledged)}>"
        )

    def _link(self, node: MemNode, end: str) -> Link:
        link = self.links.get(node.link) if node.link is not None else None
        if link is None or getattr(link, end) != self.device:
            raise BackendError(
                f"device {self.device}: {_node_of(node)} names link#{node.link}, which is not "
                f"a direct link with this device as its {end}"
            )
        return link

    def send(self, node: MemNode, view: Any, stream: Any) -> None:
        """Offer `view` (the region's bytes) to the link's target."""
        link = self._link(node, "source")
        if not self.transport.offer(node.link, link, view):
            self.unacknowledged.add(node.link)

    def recv(self, node: MemNode, view: Any, stream: Any) -> None:
        """Copy the link's offer into `view` (the region), then acknowledge it."""
        link = self._link(node, "target")
        offered = self.offers.pop(node.link, None)
        if offered is None:
            raise BackendError(
                f"device {self.device}: {_node_of(node)} ran before device {link.source}'s "
                f"offer of link#{node.link} arrived"
            )
        if not isinstance(offered, np.ndarray):
            raise BackendError(
                f"device {self.device}: {_node_of(node)} would copy between two GPU arenas "
                f"({type(offered).__name__}): a peer-to-peer copy in one process is not built "
                f"(no GPU here to test it); run direct plans with the NumPy backend or on Ray"
            )
        stream = self.stream if stream is None else stream
        self.backend.copy_to_device(view, offered, stream)
        stream.synchronize()  # copied: the source may free its region
        self.transport.acknowledge(node.link, link)


def _node_of(node: MemNode) -> str:
    return f"n{node.id} ({node.describe()})"


class DeviceRunner(Session):
    """Device `device`'s share of a `MultiPlan` – or of several, run one at a time: a
    `Session` over its MemGraph `mg` (or its MemGraphs by key, as `Session` keys plans:
    one plan is key 0) that runs a plan dependency-driven, receiving the `links` whose
    target it is through an `Inbox` and sending those whose source it is (see the module
    docstring). With several plans `links` are by plan key (a sequence: the same links
    for every plan); inputs staged once (`stage`: weights) serve every plan that reads
    them, as in one `Session`.

    `order` is "ready" or "random" (ordered by `seed` and the device); `poison` (default:
    on in random order) fills freed and unwritten memory with 0xFF bytes. Other keywords
    go to `Session` (`unsafe_skip_verify`, `host_budget`, backend options).
    """

    def __init__(
        self,
        device: int,
        mg: MemGraph | Mapping[Any, MemGraph],
        links: Sequence[Link] | Mapping[Any, Sequence[Link]] = (),
        backend: str | Backend = "numpy",
        *,
        order: str = "ready",
        seed: int | None = None,
        poison: bool | None = None,
        **options: Any,
    ):
        check_order(order)
        self.device = device
        self.order = order
        self.seed = 0 if seed is None else seed
        poison = order == "random" if poison is None else poison
        # Mode "random": each node's work is done before the next one starts.
        super().__init__(mg, backend, mode="random", poison=poison, **options)
        self._routes = {
            key: _Routes.of(device, links[key] if isinstance(links, Mapping) else links)
            for key in self.plans
        }
        self.progress = (0, len(self.mg.nodes))  # nodes done in the current or last run, of all
        for key, plan in self.plans.items():
            try:
                self._check_links(plan, self._routes[key])
            except BaseException:
                self.close()
                raise

    carries_peers = True  # its runs hand sends and receives to the other devices

    def __repr__(self) -> str:
        plans = "" if len(self.plans) == 1 else f" plans={len(self.plans)}"
        direct = len(self._routes[self._current.key].direct)
        return (
            f"<DeviceRunner device={self.device} {self.tg.name!r}{plans} order={self.order} "
            f"receives={len(self.receives)} sends={sum(map(len, self.sends.values()))} "
            f"direct={direct}>"
        )

    @property
    def receives(self) -> dict[str, Link]:
        """The links this device receives in the current (or last) plan, by input name."""
        return self._routes[self._current.key].receives

    @property
    def sends(self) -> dict[str, list[Link]]:
        """The links this device sends staged through the host in the current (or last)
        plan, by output name (direct ones are sent by `send` nodes)."""
        return self._routes[self._current.key].sends

    def _check_links(self, mg: MemGraph, routes: _Routes) -> None:
        tg = mg.taskgraph
        for name, link in routes.receives.items():
            if name not in tg.inputs:
                raise VerificationError(
                    f"device {self.device}: {link.describe()} feeds input {name!r}, which its "
                    f"TaskGraph does not have; its inputs: {', '.join(map(repr, tg.inputs))}"
                )
        for name, links in routes.sends.items():
            if name not in tg.outputs:
                raise VerificationError(
                    f"device {self.device}: {links[0].describe()} reads output {name!r}, which "
                    f"its TaskGraph does not have; its outputs: {', '.join(map(repr, tg.outputs))}"
                )
        for node in mg.nodes:
            if node.kind not in (NodeKind.SEND, NodeKind.RECV):
                continue
            end = "source" if node.kind is NodeKind.SEND else "target"
            link = routes.direct.get(node.link) if node.link is not None else None
            if link is None or getattr(link, end) != self.device:
                raise VerificationError(
                    f"device {self.device}: {_node_of(node)} names link#{node.link}, which is "
                    f"not a direct link with this device as its {end}; its direct links: "
                    f"{sorted(routes.direct) or 'none'}",
                    node.id,
                )

    @property
    def driver_inputs(self) -> tuple[str, ...]:
        """The inputs the driver stages on this device for the current plan: those no
        link feeds."""
        return tuple(name for name in self.tg.inputs if name not in self.receives)

    @property
    def stageable(self) -> frozenset[str]:
        """The inputs the driver may stage on this device for any of its plans (`stage`):
        those no link of that plan feeds."""
        return frozenset(
            name
            for key, mg in self.plans.items()
            for name in mg.taskgraph.inputs
            if name not in self._routes[key].receives
        )

    # -- a run -------------------------------------------------------------------

    def run_linked(
        self,
        inputs: Mapping[str, Any],
        inbox: Inbox,
        send: Send,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        plan: Any = None,
        peers: PeerLinks | None = None,
    ) -> dict[str, np.ndarray]:
        """Run a plan once (`plan`: its key; default the first): `inputs` are the
        driver's (every input no link feeds, but those staged before with `stage`), the
        links' arrays come through `inbox`, and `send(link, array)` is called for each
        host-staged link whose source is this device as soon as its output node has run;
        direct links' sends and receives go through `peers` (their offers and
        acknowledgements arrive in `inbox` too). Returns every output of this device's
        TaskGraph that its plan produces (links' outputs staged through the host too;
        not those only sent direct), as host arrays."""
        self._check_open()
        self._current = self._plan(plan)
        direct = self._routes[self._current.key].direct
        if direct and peers is None:
            raise BackendError(
                f"device {self.device}: the plan has {len(direct)} direct link(s) "
                f"({', '.join(f'link#{i}' for i in sorted(direct))}) and the run was given no "
                "peers to carry them"
            )
        staged = set(self.staged)
        missing = [n for n in self.driver_inputs if n not in inputs and n not in staged]
        if missing:
            raise InputError(
                f"device {self.device} needs input(s) {', '.join(map(repr, missing))}, "
                "which were not given"
            )
        plan = self._current
        if inputs:
            self.stage(inputs)
        plan.interpreter.results = self._result_buffers(plan)
        port = None
        if direct:
            stream = self.streams[plan.schedule.streams[0]]
            port = PeerPort(self.device, direct, peers, self.backend, stream)
        plan.interpreter.peers = port
        failure: BaseException | None = None
        self._in_flight = []
        with self.backend.running():
            try:
                if self.poison:
                    self._poison_scratch(plan)
                    self._barrier(plan)
                self._issue_linked(plan, inbox, send, timeout)
            except BaseException as err:
                failure = err
            finally:
                plan.interpreter.peers = None  # nothing of the other devices outlives a run
            self._drain(failure)
        return self._collect(plan)

    def _collect(self, plan: Any) -> dict[str, np.ndarray]:
        """The outputs the plan produces (`Session._collect`), but for those only sent
        direct: a direct link's send replaces its output node."""
        sent = {link.output for link in self._routes[plan.key].direct.values()}
        produced = {n.name for n in plan.mg.nodes if n.kind is NodeKind.OUTPUT}
        return super()._collect(plan, skip=frozenset(sent - produced))

    def _priorities(self, nodes: Sequence[MemNode]) -> list[tuple[int, float, int]]:
        """Each node's place among ready ones (smallest first): in "ready" order links'
        outputs and direct sends first, then insertion order; in "random" order a seeded
        random draw (the seed and the device's id: each device draws its own)."""
        if self.order == "random":
            rng = random.Random(self.seed * 1_000_003 + self.device)
            return [(0, rng.random(), node.id) for node in nodes]
        sends = [
            node.kind is NodeKind.SEND
            or (node.kind is NodeKind.OUTPUT and node.name in self.sends)
            for node in nodes
        ]
        return [(0 if sends[node.id] else 1, 0.0, node.id) for node in nodes]

    def _issue_linked(self, plan: Any, inbox: Inbox, send: Send, timeout: float) -> None:
        """Run every node of `plan` once its dependencies are done (see the module
        docstring). Three kinds of node wait for another device, each held in `waiting`
        under the inbox key it waits for while other ready nodes run: a host-staged
        link's `input` node (its gate: the array's arrival), a `recv` (the source's
        offer) and a `send` that was offered but not yet copied (the acknowledgement:
        its dependents wait, the device does not)."""
        nodes = plan.mg.nodes
        port: PeerPort | None = plan.interpreter.peers
        check_dependencies(plan.mg)
        ready = ReadyNodes(plan.mg, self._priorities(nodes))
        gates: dict[int, Key] = {
            node.id: node.name
            for node in nodes
            if node.kind is NodeKind.INPUT and node.name in self.receives
        }
        gates.update(
            {node.id: offer_key(node.link) for node in nodes if node.kind is NodeKind.RECV}
        )
        waiting: dict[Key, int] = {}  # inbox key -> the node waiting for it
        done = 0
        self.progress = (done, len(nodes))

        def finish(node_id: int) -> None:
            nonlocal done
            done += 1
            self.progress = (done, len(nodes))
            ready.done(node_id)

        def arrive(key: Key, value: Any) -> None:
            """`value` arrived under `key`: release the node that waited for it."""
            node_id = waiting.pop(key)
            if isinstance(key, str):  # a host-staged link's array
                self.stage({key: value})
                ready.push(node_id)
            elif key[0] == "offer":  # the recv can copy now
                port.offers[key[1]] = value
                ready.push(node_id)
            else:  # the target copied what the send offered: the send is done
                port.unacknowledged.discard(key[1])
                finish(node_id)

        while done < len(nodes):
            if waiting:  # what came while this device ran releases its nodes at once
                for key, value in inbox.arrived(list(waiting)).items():
                    arrive(key, value)
            if not ready:
                if not waiting:  # cannot happen: dependencies point back (checked)
                    raise BackendError(f"device {self.device}: nothing can run")
                arrived = inbox.take(list(waiting), timeout)
                if arrived is None:
                    raise self._late(waiting, timeout)
                for key, value in arrived.items():
                    arrive(key, value)
                continue
            inbox.check()
            node_id = ready.pop()
            key = gates.pop(node_id, None)  # a gate is passed once: when its key has come
            if key is not None:
                value = inbox.poll(key)
                if value is None:
                    waiting[key] = node_id
                    continue
                waiting[key] = node_id
                arrive(key, value)
                continue  # pushed back: it runs when it is popped again
            node = nodes[node_id]
            self._run_node(plan, node)
            if node.kind is NodeKind.SEND and node.link in port.unacknowledged:
                waiting[copied_key(node.link)] = node_id  # done when the target has copied
                continue
            if node.kind is NodeKind.OUTPUT and node.name in self.sends:
                value = self._sent_value(plan, node)
                for link in self.sends[node.name]:
                    send(link, value)
            finish(node_id)

    def _run_node(self, plan: Any, node: MemNode) -> None:
        """Issue `node` and wait until its work is done; errors name the node."""
        name = plan.schedule.stream_of[node.id]
        try:
            if name is None:
                plan.interpreter.issue(node, None)
                return
            stream = self.streams[name]
            stream.context = node
            plan.interpreter.issue(node, stream)
            self._in_flight.append(node)
        except NodeFailure:
            raise
        except Exception as err:
            where = name or ("peer" if node.kind in (NodeKind.SEND, NodeKind.RECV) else "host")
            raise NodeFailure(err, node, where) from err
        self._settle(node, name, stream)

    def _sent_value(self, plan: Any, node: MemNode) -> np.ndarray:
        """A fresh host copy of the output `node` has just made available."""
        task = plan.tg[plan.tg.outputs[node.name]]
        if node.storage is not None:
            value = plan.interpreter.host_view(node.storage).reshape(task.shape)
        else:
            value = plan.interpreter.results[node.name]
        return np.array(value, copy=True)

    def _late(self, waiting: Mapping[Key, int], timeout: float) -> BackendError:
        """The error of a device that waited `timeout` seconds and got none of `waiting`
        (inbox key -> node), naming each node and what it waits for."""
        nodes = self._current.mg.nodes
        direct = self._routes[self._current.key].direct

        def what(key: Key) -> str:
            if isinstance(key, str):
                link = self.receives[key]
                return f"from device {link.source}'s output {link.output!r}"
            link = direct[key[1]]
            if key[0] == "offer":
                return f"for device {link.source}'s send of {link.output!r} (link#{key[1]})"
            return f"for device {link.target} to copy it (link#{key[1]}, {link.input!r})"

        listed = "; ".join(
            f"{_node_of(nodes[node_id])} {what(key)}"
            for key, node_id in sorted(waiting.items(), key=lambda item: item[1])
        )
        return BackendError(
            f"device {self.device} waited more than {timeout} s for {len(waiting)} link(s) "
            f"that did not arrive: {listed}"
        )


# -- checking and staging, shared by the drivers -----------------------------------------


def check_multi(mp: MultiPlan, unsafe_skip_verify: bool = False) -> None:
    """What a driver needs of `mp` before starting anything: one plan per device, in
    order, links between an output and an input of existing devices, and then the whole
    of `memgraph.multi.verify_multi` (each device plan, the links' sizes, every input fed
    once, the union of the plans and links acyclic: a run cannot deadlock; errors name
    the device). With `unsafe_skip_verify` only the structure and each plan's
    dependencies are checked, as `runtime.run` does. A device plan with a host tier is
    refused (`BackendError` naming the device): tiers run only in a plan's own session."""
    if not isinstance(mp, MultiPlan):
        raise BackendError(f"expected a memgraph.multi.MultiPlan, got {type(mp).__name__}")
    for plan in mp.plans:
        refuse_tier_plan(plan.mg, f"a plan for several devices (device {plan.device})")
    devices = [plan.device for plan in mp.plans]
    if devices != list(range(mp.devices)):
        raise VerificationError(
            f"a MultiPlan over {mp.devices} devices needs one plan per device in order, "
            f"got plans for devices {devices}"
        )
    for link in mp.links:
        for end in (link.source, link.target):
            if not 0 <= end < mp.devices:
                raise VerificationError(
                    f"{link.describe()}: device {end} is not one of the {mp.devices} devices"
                )
        source, target = mp.plans[link.source].mg.taskgraph, mp.plans[link.target].mg.taskgraph
        if link.output not in source.outputs:
            raise VerificationError(
                f"device {link.source}: {link.describe()} reads output {link.output!r}, which "
                f"its TaskGraph does not have; its outputs: {', '.join(map(repr, source.outputs))}"
            )
        if link.input not in target.inputs:
            raise VerificationError(
                f"device {link.target}: {link.describe()} feeds input {link.input!r}, which "
                f"its TaskGraph does not have; its inputs: {', '.join(map(repr, target.inputs))}"
            )
    for name, (device, output) in mp.outputs.items():
        tg = mp.plans[device].mg.taskgraph if 0 <= device < mp.devices else None
        if tg is None or output not in tg.outputs:
            raise VerificationError(
                f"output {name!r} is said to be device {device}'s output {output!r}, which "
                "that device's plan does not produce"
            )
    if not unsafe_skip_verify:
        verify_multi(mp)
        return
    for plan in mp.plans:
        try:
            check_dependencies(plan.mg)
        except VerificationError as err:
            raise VerificationError(f"device {plan.device}: {err}", err.node) from None


def device_inputs(
    mp: MultiPlan,
    inputs: Mapping[str, Any],
    staged: Sequence[frozenset[str] | set[str]] | None = None,
) -> list[dict[str, Any]]:
    """Per device, the arrays of `inputs` it reads (every input of its TaskGraph that no
    link feeds). `InputError` for an input no device reads, or one missing – neither
    given nor, when `staged` says per device what it holds already, staged there."""
    if not isinstance(inputs, Mapping):
        raise InputError(f"inputs must be a mapping of name to array, got {type(inputs).__name__}")
    linked = {(link.target, link.input) for link in mp.links}
    wanted: list[list[str]] = []
    for plan in mp.plans:
        names = plan.mg.taskgraph.inputs
        wanted.append([name for name in names if (plan.device, name) not in linked])
    known = {name for names in wanted for name in names}
    unknown = [name for name in inputs if name not in known]
    if unknown:
        raise InputError(
            f"unknown input(s) {', '.join(map(repr, unknown))}; the devices read "
            f"{', '.join(map(repr, sorted(known)))}"
        )
    held = [frozenset()] * mp.devices if staged is None else staged
    readers: dict[str, list[int]] = {}
    for device, names in enumerate(wanted):
        for name in names:
            if name not in inputs and name not in held[device]:
                readers.setdefault(name, []).append(device)
    if readers:
        said = ", ".join(f"{name!r} (device(s) {readers[name]})" for name in sorted(readers))
        raise InputError(f"missing input(s): {said}")
    return [{name: inputs[name] for name in names if name in inputs} for names in wanted]


def gather(mp: MultiPlan, results: Mapping[int, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The original outputs of `mp` from each device's outputs."""
    return {name: results[device][output] for name, (device, output) in mp.outputs.items()}


def on_device(error: BaseException, device: int) -> BaseException:
    """`error` naming `device`: an einpage error keeps its type, with a line saying where;
    anything else becomes a `BackendError`."""
    if isinstance(error, EinpageError):
        return _naming(error, f"on device {device}")
    return BackendError(f"device {device} failed: {type(error).__name__}: {error}")


def first_failure(failures: Sequence[tuple[int, BaseException]]) -> tuple[int, BaseException]:
    """The failure to report: the first that is not another device's cancellation."""
    for device, error in failures:
        if not isinstance(error, Cancelled):
            return device, error
    return failures[0]


# -- one process, a thread per device ------------------------------------------------


def _keyed_plans(plans: MultiPlan | Mapping[Any, MultiPlan]) -> dict[Any, MultiPlan]:
    """`plans` by key (one MultiPlan is key 0), every one over the same devices."""
    keyed = {0: plans} if isinstance(plans, MultiPlan) else dict(plans)
    if not keyed:
        raise BackendError("several devices' runs need at least one MultiPlan, got none")
    counts = {key: mp.devices for key, mp in keyed.items() if isinstance(mp, MultiPlan)}
    if len(set(counts.values())) > 1:
        raise BackendError(
            "the plans of one run of several devices must be for the same devices, got "
            + ", ".join(f"{key!r}: {n}" for key, n in counts.items())
        )
    return keyed


def check_plans(
    plans: MultiPlan | Mapping[Any, MultiPlan], unsafe_skip_verify: bool = False
) -> dict[Any, MultiPlan]:
    """`plans` by key (`_keyed_plans`), each checked by `check_multi`."""
    keyed = _keyed_plans(plans)
    for mp in keyed.values():
        check_multi(mp, unsafe_skip_verify)
    return keyed


def staging(keyed: Mapping[Any, MultiPlan], inputs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per device, the arrays of `inputs` that any of `keyed`'s plans reads there from
    the driver (not through a link): what `stage` places once for every run. `InputError`
    for an input no plan reads."""
    if not isinstance(inputs, Mapping):
        raise InputError(f"inputs must be a mapping of name to array, got {type(inputs).__name__}")
    devices = next(iter(keyed.values())).devices
    wanted: list[set[str]] = [set() for _ in range(devices)]
    for mp in keyed.values():
        linked = {(link.target, link.input) for link in mp.links}
        for plan in mp.plans:
            names = plan.mg.taskgraph.inputs
            wanted[plan.device] |= {n for n in names if (plan.device, n) not in linked}
    known = set().union(*wanted)
    unknown = [name for name in inputs if name not in known]
    if unknown:
        raise InputError(
            f"unknown input(s) {', '.join(map(repr, unknown))}; the devices read "
            f"{', '.join(map(repr, sorted(known)))}"
        )
    return [{n: v for n, v in inputs.items() if n in names} for names in wanted]


class LocalDevices:
    """The devices of one MultiPlan or several (by key, as `runtime.Session` keys plans;
    one MultiPlan is key 0), each a `DeviceRunner` over its share of every plan, in this
    process: `stage(inputs)` places inputs once on every device that reads them (the
    weights of a generation: each device gets those its graphs read), `run(inputs,
    plan=key)` runs one plan, a thread per device, and returns its original outputs.
    Keywords as `run_devices`; `close()` (or leaving its `with` block) closes every
    runner. `runtime.ray_cluster.RayDevices` is the same on Ray actors.

    >>> with LocalDevices({"prefill": a, "decode": b}) as devices:   # doctest: +SKIP
    ...     devices.stage(weights)
    ...     first = devices.run(prompt, plan="prefill")
    ...     step = devices.run(step_inputs, plan="decode")
    """

    def __init__(
        self,
        plans: MultiPlan | Mapping[Any, MultiPlan],
        *,
        backend: str | Backend = "numpy",
        order: str = "ready",
        seed: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        poison: bool | None = None,
        unsafe_skip_verify: bool = False,
        **options: Any,
    ):
        check_order(order)
        self.timeout = check_timeout(timeout)
        self.plans = check_plans(plans, unsafe_skip_verify)
        devices = next(iter(self.plans.values())).devices
        _check_backend(backend, devices)
        self.runners: list[DeviceRunner] = []
        self._staged: list[set[str]] = [set() for _ in range(devices)]
        try:
            for device in range(devices):
                self.runners.append(
                    DeviceRunner(
                        device,
                        {key: mp.plans[device].mg for key, mp in self.plans.items()},
                        {key: mp.links for key, mp in self.plans.items()},
                        backend,
                        order=order,
                        seed=seed,
                        poison=poison,
                        unsafe_skip_verify=True,  # checked above, for every device
                        **options,
                    )
                )
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        state = "closed" if not self.runners else f"runners={len(self.runners)}"
        return f"<LocalDevices plans={list(self.plans)} {state}>"

    def __enter__(self) -> LocalDevices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stage(self, inputs: Mapping[str, Any]) -> None:
        """Place `inputs` once on every device whose plans read them (from the driver);
        later runs use them unless given again."""
        for runner, mine in zip(self._open(), staging(self.plans, inputs), strict=True):
            if mine:
                runner.stage(mine)
                self._staged[runner.device] |= set(mine)

    def run(
        self, inputs: Mapping[str, Any], *, plan: Any = None, timeout: float | None = None
    ) -> dict[str, np.ndarray]:
        """Run plan `plan` (its key; default the first) on `inputs` and what is staged;
        return its original outputs. `timeout` (default: the one given when made) bounds
        each wait of a device for a link."""
        runners = self._open()
        key = next(iter(self.plans)) if plan is None else plan
        if key not in self.plans:
            known = ", ".join(map(repr, self.plans))
            raise InputError(f"these devices have no plan {key!r}; their plans: {known}")
        mp = self.plans[key]
        staged = device_inputs(mp, inputs, self._staged)
        wait = self.timeout if timeout is None else check_timeout(timeout)
        return gather(mp, _run_threads(runners, staged, wait, key))

    def _open(self) -> list[DeviceRunner]:
        if not self.runners:
            raise BackendError("these LocalDevices are closed")
        return self.runners

    def close(self) -> None:
        runners, self.runners = self.runners, []
        for runner in runners:
            runner.close()


def check_order(order: Any) -> str:
    """`order` if it is one of `ORDERS`, else a `BackendError` listing them."""
    if order not in ORDERS:
        raise BackendError(f"unknown order {order!r}; valid: {', '.join(map(repr, ORDERS))}")
    return order


def _check_backend(backend: Any, devices: int) -> None:
    """A backend object serves one device: several devices take it by name (each makes
    its own); `BackendError` otherwise."""
    if isinstance(backend, Backend) and devices > 1:
        raise BackendError(
            f"give the backend by name: each of the {devices} devices makes its own"
        )


def check_timeout(timeout: Any) -> float:
    """`timeout` as seconds if it is a positive number, else a `BackendError`."""
    if isinstance(timeout, bool) or not (isinstance(timeout, int | float) and timeout > 0):
        raise BackendError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def run_devices(
    mp: MultiPlan,
    inputs: Mapping[str, Any],
    *,
    backend: str | Backend = "numpy",
    order: str = "ready",
    seed: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    poison: bool | None = None,
    unsafe_skip_verify: bool = False,
    **options: Any,
) -> dict[str, np.ndarray]:
    """Run the MultiPlan `mp` on `inputs` (name -> host array), a thread and an arena
    per device; return the original outputs (`mp.outputs`).

    `backend` is each device's (a name: every device makes its own); `order` "ready" or
    "random" (with `seed`); `timeout` the most seconds a device waits for a link;
    `poison` as in `runtime.Session` (default: on in random order). Every device plan is
    verified first (`VerificationError` naming the device), unless `unsafe_skip_verify`.
    One run of a `LocalDevices`, made and closed here.
    """
    check_order(order)
    check_timeout(timeout)
    if isinstance(mp, MultiPlan):
        _check_backend(backend, mp.devices)
    check_multi(mp, unsafe_skip_verify)
    device_inputs(mp, inputs)  # before any arena is made
    with LocalDevices(
        mp, backend=backend, order=order, seed=seed, timeout=timeout, poison=poison,
        unsafe_skip_verify=True, **options,
    ) as devices:  # fmt: skip
        return devices.run(inputs)


def _run_threads(
    runners: Sequence[DeviceRunner],
    staged: Sequence[Mapping[str, Any]],
    timeout: float,
    plan: Any = None,
) -> dict[int, dict[str, np.ndarray]]:
    inboxes = [Inbox() for _ in runners]
    results: dict[int, dict[str, np.ndarray]] = {}
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    peers = InboxPeers(inboxes)

    def send(link: Link, value: np.ndarray) -> None:
        inboxes[link.target].put(link.input, value)

    def work(runner: DeviceRunner) -> None:
        try:
            out = runner.run_linked(staged[runner.device], inboxes[runner.device], send,
                                    timeout=timeout, plan=plan, peers=peers)  # fmt: skip
            with lock:
                results[runner.device] = out
        except BaseException as err:  # reported by the driver, never lost
            with lock:
                failures.append((runner.device, err))
            for inbox in inboxes:
                inbox.cancel(f"stopped: device {runner.device} failed")

    threads = [
        threading.Thread(target=work, args=(r,), name=f"einpage-device-{r.device}", daemon=True)
        for r in runners
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # every wait of a device is bounded by `timeout`
    if failures:
        device, error = first_failure(failures)
        public = on_device(error, device)
        if public is error:
            raise public
        raise public from error
    return results
