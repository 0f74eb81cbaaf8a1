"""The interpreter: issues each MemGraph node's work on a backend, one method per node kind.

Like torch.fx's `Interpreter`, `issue(node, stream)` dispatches in one place to the
method named after the node's kind (`input`, `alloc`, `apply`, `offload`, `reload`,
`free`, `output`, and between devices `send` and `recv`, handed to `peers`). The
methods only translate a node into backend primitives on the stream they are given;
which stream, in which order and after which events is the schedule's business
(`runtime.schedule`, `runtime.session`).

Host memory is one buffer laid out by `HostLayout` (`runtime.hostmem`): a slot per host
storage of the plan (`MemGraph.storages`: offloaded tensors, host-resident inputs,
outputs assembled on the host), and, on backends that stage transfers (pinned memory on
a GPU), a slot per device-side input and output; an input storage the layout calls
`aliased` is read from the array the session bound to it (`bind_host`).

An offload or reload copies what its node says and nothing else: its `box` of the
storage (a sliced copy), or else the whole storage, with the backend's one strided
copy primitive (`Backend.copy_box`), straight between the storage's place in host
memory and the arena. The interpreter reads no TaskGraph to find a box.

In a plan with a host tier (`runtime.tiers`), a copy that names a host `slot` copies
from or to that slot of the host arena (`tier_arena`), seen as its storage's shape and
dtype (`slot_view`), not a slot of the `HostLayout`; `read`, `write` and `release`
nodes go to `disk` (a `runtime.tiers.DiskPort`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from einpage_core.errors import BackendError
from memgraph.graph import MemGraph
from memgraph.nodes import HostBox, HostRegion, MemNode, NodeKind, Region
from runtime.backend import Backend, Stream
from runtime.hostmem import HOST_ALIGNMENT, HostLayout, HostSlot
from runtime.tiers import slot_bytes, tier_held

__all__ = ["HostSlot", "HostLayout", "Interpreter", "POISON_BYTE", "HOST_ALIGNMENT", "arena_bytes"]

POISON_BYTE = 0xFF
"""Freed (and never written) memory is filled with this byte when poisoning: every
float dtype reads it as NaN and every int dtype as -1."""


def arena_bytes(mg: MemGraph) -> int:
    """The device bytes a run of `mg` allocates for its arena: up to the end of the highest
    region the plan uses (`PlanStats.high_water`), never more than the budget – a plan
    at "60GiB" that uses 3 MiB allocates 3 MiB."""
    return min(mg.budget, max(1, mg.stats.high_water))


class Interpreter:
    """Issues MemGraph nodes on `backend` against `arena` and the `host` buffer.

    Per run, `sources` holds the host array each device-side input is copied from and
    `results` the host array each device-side output is copied into; `poison` fills
    freed regions with `POISON_BYTE`.
    """

    def __init__(
        self,
        mg: MemGraph,
        backend: Backend,
        arena: Any,
        host: np.ndarray,
        layout: HostLayout,
        poison: bool = False,
    ):
        self.mg = mg
        self.tg = mg.taskgraph
        self.backend = backend
        self.arena = arena
        self.arena_bytes = arena_bytes(mg)
        self.host = host
        self.layout = layout
        self.poison = poison
        self.sources: dict[str, np.ndarray] = {}
        self.results: dict[str, np.ndarray] = {}
        # What carries sends and receives, set for a run of a device's share of a plan for
        # several devices (`runtime.multi.PeerPort`); None: a send or recv is an error.
        self.peers: Any = None
        # What moves a host tier's storages between disk and the host arena, set for a run
        # of a plan with a host tier (`runtime.tiers`); None: a read, write or release is
        # an error.
        self.disk: Any = None
        # The host arena of a plan with a host tier (`runtime.tiers.host_arena_bytes`),
        # where the copies that name a slot copy from and to; None without a tier.
        self.tier_arena: np.ndarray | None = None
        self._views: dict[tuple[Any, ...], Any] = {}
        self._host_views: dict[int, np.ndarray] = {}
        self._slot_views: dict[tuple[int, int], np.ndarray] = {}
        # The class's functions, not bound methods: a dict of methods bound to `self` would
        # be a reference cycle, keeping the arena's views alive until a collection.
        self._handlers: dict[NodeKind, Callable[[Interpreter, MemNode, Stream | None], None]] = {
            kind: getattr(type(self), kind.value) for kind in NodeKind
        }

    def __repr__(self) -> str:
        return f"<Interpreter {self.tg.name!r} on {self.backend.name} nodes={len(self.mg)}>"

    # -- memory ------------------------------------------------------------------

    def device_view(self, region: Region, task_id: int) -> Any:
        """The arena bytes of `region` seen as task `task_id` (its shape and dtype)."""
        key = (region.offset, task_id)
        view = self._views.get(key)
        if view is None:
            task = self.tg[task_id]
            if region.offset < 0 or region.offset + task.nbytes > self.arena_bytes:
                raise BackendError(
                    f"%{task_id} ({task.nbytes} bytes) at offset {region.offset} does not fit "
                    f"in the arena of {self.arena_bytes} bytes"
                )
            view = self.backend.view(self.arena, region.offset, task.shape, task.dtype)
            self._views[key] = view
        return view

    def box_view(self, region: Region, box: HostBox) -> Any:
        """The arena bytes of `region` seen as the contiguous box `box` (its sizes and dtype)."""
        key = (region.offset, box.sizes, box.dtype)
        view = self._views.get(key)
        if view is None:
            if region.offset < 0 or region.offset + box.nbytes > self.arena_bytes:
                raise BackendError(
                    f"a copy of {box.nbytes} bytes at offset {region.offset} does not fit in "
                    f"the arena of {self.arena_bytes} bytes"
                )
            if box.nbytes > region.size:
                raise BackendError(f"a copy of {box.nbytes} bytes does not fit in {region}")
            view = self.backend.view(self.arena, region.offset, box.sizes, box.dtype)
            self._views[key] = view
        return view

    def byte_view(self, region: Region) -> Any:
        """The arena bytes of `region`."""
        size = max(0, min(region.size, self.arena_bytes - region.offset))
        return self.backend.view(self.arena, region.offset, (size,), "uint8")

    def host_view(self, storage: int) -> np.ndarray:
        """The host array of a storage: its slot of the host buffer, or the array bound to it."""
        view = self._host_views.get(storage)
        if view is None:
            if storage not in self.layout.storages:
                if self.mg.tier is not None and storage in tier_held(self.mg):
                    raise BackendError(
                        f"host#{storage} is held by the plan's host tier, so a node copying "
                        "it must name its slot of the host arena; this one names none"
                    )
                raise BackendError(f"host#{storage} holds no data: its input was never placed")
            view = self._host_views[storage] = self.layout.storages[storage].of(self.host)
        return view

    def slot_view(self, slot: HostRegion, storage: int) -> np.ndarray:
        """The host arena's bytes of `slot` seen as host storage `storage` (its shape and
        dtype, in the slot's first `nbytes` bytes)."""
        key = (slot.offset, storage)
        view = self._slot_views.get(key)
        if view is None:
            entry = self.mg.storages.get(storage)
            if entry is None:
                raise BackendError(f"host#{storage} is not in the plan's table of host storages")
            arena = self.tier_arena
            if arena is None:
                raise BackendError(
                    f"host#{storage} is in host slot {slot}, but this run has no host arena "
                    "(a plan with a host tier runs only in a session that allocated it)"
                )
            raw = slot_bytes(arena, slot, entry.nbytes, f"host#{storage}")
            view = self._slot_views[key] = raw.view(entry.dtype).reshape(entry.shape)
        return view

    def host_array(self, node: MemNode) -> np.ndarray:
        """The host array of the storage a node copies or outputs: its slot of the host
        arena when the node names one, else the storage's place."""
        if node.slot is not None:
            return self.slot_view(node.slot, node.storage)
        return self.host_view(node.storage)

    def bind_host(self, storage: int, array: np.ndarray) -> None:
        """Use `array` as host storage `storage` (an aliased input storage, only ever read)."""
        self._host_views[storage] = array

    # -- dispatch ----------------------------------------------------------------

    def issue(self, node: MemNode, stream: Stream | None) -> None:
        """Issue `node`'s work on `stream` (None for bookkeeping nodes)."""
        self._handlers[node.kind](self, node, stream)

    def input(self, node: MemNode, stream: Stream | None) -> None:
        """A device-side input is copied from its host array; a host-side input is already
        in its host storage (placed before the run starts)."""
        if node.region is not None:
            view = self.device_view(node.region, node.tensor)
            self.backend.copy_to_device(view, self.sources[node.name], stream)

    def alloc(self, node: MemNode, stream: Stream | None) -> None:
        """Nothing to do: the plan chose the region; dependencies order its reuse."""

    def apply(self, node: MemNode, stream: Stream | None) -> None:
        """The task's kernel, on its operands' regions into its own; with the workspace
        region of the apply, if it has one (poisoned first when poisoning: a kernel may
        expect nothing of it)."""
        task = self.tg[node.tensor]
        operands = [
            self.device_view(region, operand)
            for operand, region in zip(task.inputs, node.reads, strict=True)
        ]
        out = self.device_view(node.region, node.tensor)
        workspace = None
        if node.workspace is not None:
            workspace = self.byte_view(node.workspace)
            if self.poison:
                self.backend.fill_bytes(workspace, POISON_BYTE, stream)
        self.backend.compute(task, operands, out, stream, workspace)

    def offload(self, node: MemNode, stream: Stream | None) -> None:
        """Copy the region to the node's box of its storage (all of it when no box)."""
        host, box = self.host_box(node)
        self.backend.copy_box(host, box.starts, self.box_view(node.region, box), "d2h", stream)

    def reload(self, node: MemNode, stream: Stream | None) -> None:
        """Copy the node's box of its storage (all of it when no box) into the region."""
        host, box = self.host_box(node)
        self.backend.copy_box(host, box.starts, self.box_view(node.region, box), "h2d", stream)

    def host_box(self, node: MemNode) -> tuple[np.ndarray, HostBox]:
        """The host array of a copy's storage (in its slot of the host arena, when the
        node names one), and the box of it the copy moves."""
        storage = self.mg.storages.get(node.storage)
        if storage is None:
            raise BackendError(f"host#{node.storage} is not in the plan's table of host storages")
        return self.host_array(node), node.box if node.box is not None else storage.box

    def free(self, node: MemNode, stream: Stream | None) -> None:
        """Nothing to do, unless poisoning: then the region is filled with `POISON_BYTE`."""
        if self.poison:
            self.backend.fill_bytes(self.byte_view(node.region), POISON_BYTE, stream)

    def output(self, node: MemNode, stream: Stream | None) -> None:
        """A device-side output is copied to its host array; a host-side output is read
        from its host storage after the run (tensors are immutable, so it stays valid)."""
        if node.region is not None:
            view = self.device_view(node.region, self.tg.outputs[node.name])
            self.backend.copy_to_host(self.results[node.name], view, stream)

    def send(self, node: MemNode, stream: Stream | None) -> None:
        """Offer the region's tensor – its arena view, not a copy – to the link's target
        device (`peers.send`); the region stays held until the peers say it was copied."""
        self._peers(node).send(node, self.device_view(node.region, node.tensor), stream)

    def recv(self, node: MemNode, stream: Stream | None) -> None:
        """Copy the link's tensor from its source device into the region (`peers.recv`)."""
        self._peers(node).recv(node, self.device_view(node.region, node.tensor), stream)

    def read(self, node: MemNode, stream: Stream | None) -> None:
        """Copy the node's storage from its place on disk into its host slot."""
        self._disk(node).read(node, stream)

    def write(self, node: MemNode, stream: Stream | None) -> None:
        """Copy the node's storage from its host slot to its place in the spill file."""
        self._disk(node).write(node, stream)

    def release(self, node: MemNode, stream: Stream | None) -> None:
        """The slot's occupancy ends: nothing to do, unless poisoning (`disk.release`)."""
        self._disk(node).release(node, stream)

    def _disk(self, node: MemNode) -> Any:
        if self.disk is None:
            raise BackendError(
                f"n{node.id} ({node.describe()}) moves data between disk and host memory: a "
                f"plan with a host tier runs only in a session that opened its files"
            )
        return self.disk

    def _peers(self, node: MemNode) -> Any:
        if self.peers is None:
            raise BackendError(
                f"n{node.id} ({node.describe()}) copies between devices: a plan with direct "
                f"sends runs only with its other devices (runtime.run_devices, LocalDevices, "
                f"RayDevices)"
            )
        return self.peers
