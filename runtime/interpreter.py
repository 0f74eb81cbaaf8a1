"""The interpreter: issues each MemGraph node's work on a backend, one method per node kind.

Like torch.fx's `Interpreter`, `issue(node, stream)` dispatches in one place to the
method named after the node's kind (`input`, `alloc`, `apply`, `offload`, `reload`,
`free`, `output`). The methods only translate a node into backend primitives on
the stream they are given; which stream, in which order and after which events is
the schedule's business (`runtime.schedule`, `runtime.session`).

Host memory is one buffer laid out by `HostLayout`: a slot per host storage of the
plan (offloaded tensors, host-resident inputs, and outputs assembled on the host by
sliced offloads), and, on backends that stage transfers (pinned memory on a GPU), a
slot per device-side input and output.

A sliced offload (`MemNode.into`) copies a block into its box of an output's host
array. Without staging (NumPy) the copy writes the box in place; with staging it goes
to a contiguous slot of its own (an asynchronous copy needs contiguous host memory),
and `Interpreter.assemble_on_host`, called once the run has synchronized, moves the
staged pieces into their boxes (nothing reads those storages during a run).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from einpage_core.errors import BackendError
from memgraph.graph import MemGraph
from memgraph.nodes import MemNode, NodeKind, Region
from runtime.backend import Backend, Stream
from taskgraph.assembly import AssemblyPiece, assembly_pieces, box_index
from taskgraph.nodes import Task

__all__ = ["HostSlot", "HostLayout", "Interpreter", "POISON_BYTE", "HOST_ALIGNMENT"]

POISON_BYTE = 0xFF
"""Freed (and never written) memory is filled with this byte when poisoning: every
float dtype reads it as NaN and every int dtype as -1."""

HOST_ALIGNMENT = 256


@dataclass(frozen=True, slots=True)
class HostSlot:
    """Bytes `[offset, offset + nbytes)` of the host buffer, holding `shape` of `dtype`."""

    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def of(self, buffer: np.ndarray) -> np.ndarray:
        """This slot of `buffer` as an array."""
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).reshape(self.shape)


@dataclass(frozen=True)
class HostLayout:
    """Where each host storage (and staging buffer) lives in the one host buffer.

    On backends without staging (NumPy), a host storage that only an input writes (no
    offload targets it) is not in the buffer: it is `aliased` to the input's array,
    which transfers only read.
    """

    storages: dict[int, HostSlot]
    inputs: dict[str, HostSlot]  # staging for device-side inputs (staging backends only)
    outputs: dict[str, HostSlot]  # staging for device-side outputs (staging backends only)
    nbytes: int
    aliased: frozenset[int] = frozenset()
    holders: dict[int, int] = field(default_factory=dict)  # storage -> the tensor it holds
    # Contiguous copies of the boxes that sliced reloads take from an input, by slice
    # task (staging backends only: an asynchronous copy needs contiguous host memory).
    boxes: dict[int, HostSlot] = field(default_factory=dict)
    # Sliced offloads, by node id: the piece they copy (its box in the storage's output),
    # and on staging backends the contiguous slot the copy lands in first.
    pieces: dict[int, AssemblyPiece] = field(default_factory=dict)
    staged_pieces: dict[int, HostSlot] = field(default_factory=dict)

    @classmethod
    def of(cls, mg: MemGraph, staging: bool) -> HostLayout:
        tg = mg.taskgraph
        top = 0
        aliased: set[int] = set()
        if not staging:
            offloaded = {n.storage for n in mg.nodes if n.kind is NodeKind.OFFLOAD}
            aliased = {
                n.storage for n in mg.nodes if n.kind is NodeKind.INPUT and n.storage is not None
            } - offloaded

        def place(task: Task) -> HostSlot:
            nonlocal top
            slot = HostSlot(top, task.shape, task.dtype)
            top += -(-max(slot.nbytes, 1) // HOST_ALIGNMENT) * HOST_ALIGNMENT
            return slot

        storages: dict[int, HostSlot] = {}
        inputs: dict[str, HostSlot] = {}
        outputs: dict[str, HostSlot] = {}
        holders: dict[int, int] = {}
        boxes: dict[int, HostSlot] = {}
        pieces: dict[int, AssemblyPiece] = {}
        staged_pieces: dict[int, HostSlot] = {}
        trees: dict[int, dict[int, AssemblyPiece]] = {}  # root -> its pieces by base
        for node in mg.nodes:
            if node.into is not None:  # a sliced offload: the storage holds `into`
                if node.into not in trees:
                    leaves = assembly_pieces(tg, node.into)[1]
                    trees[node.into] = {p.base: p for p in leaves}
                piece = trees[node.into].get(node.tensor)
                if piece is None:
                    raise BackendError(
                        f"n{node.id}: %{node.tensor} is not a piece of output assembly %{node.into}"
                    )
                pieces[node.id] = piece
                holders.setdefault(node.storage, node.into)
                if node.storage not in storages:
                    storages[node.storage] = place(tg[node.into])
                if staging:
                    staged_pieces[node.id] = place(tg[piece.task])
            elif node.storage is not None:
                holder = holders.setdefault(node.storage, node.tensor)
                if node.storage not in storages and node.storage not in aliased:
                    storages[node.storage] = place(tg[node.tensor])
                if staging and holder != node.tensor and node.tensor not in boxes:
                    boxes[node.tensor] = place(tg[node.tensor])  # a sliced reload's box
            elif staging and node.kind is NodeKind.INPUT:
                inputs[node.name] = place(tg[node.tensor])
            elif staging and node.kind is NodeKind.OUTPUT:
                outputs[node.name] = place(tg[tg.outputs[node.name]])
        return cls(
            storages,
            inputs,
            outputs,
            top,
            frozenset(aliased),
            holders,
            boxes,
            pieces,
            staged_pieces,
        )


def slice_box(task: Task) -> tuple[slice, ...]:
    """The index of the box a Slice task takes from its operand."""
    return tuple(slice(s, s + n) for s, n in zip(task.op.starts, task.shape, strict=True))


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
        self.host = host
        self.layout = layout
        self.poison = poison
        self.sources: dict[str, np.ndarray] = {}
        self.results: dict[str, np.ndarray] = {}
        self._views: dict[tuple[int, int], Any] = {}
        self._host_views: dict[int, np.ndarray] = {}
        self._handlers: dict[NodeKind, Callable[[MemNode, Stream | None], None]] = {
            kind: getattr(self, kind.value) for kind in NodeKind
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
            if region.offset < 0 or region.offset + task.nbytes > self.mg.budget:
                raise BackendError(
                    f"%{task_id} ({task.nbytes} bytes) at offset {region.offset} does not fit "
                    f"in the arena of {self.mg.budget} bytes"
                )
            view = self.backend.view(self.arena, region.offset, task.shape, task.dtype)
            self._views[key] = view
        return view

    def byte_view(self, region: Region) -> Any:
        """The arena bytes of `region`."""
        size = max(0, min(region.size, self.mg.budget - region.offset))
        return self.backend.view(self.arena, region.offset, (size,), "uint8")

    def host_view(self, storage: int) -> np.ndarray:
        """The host array of a storage: its slot of the host buffer, or the array bound to it."""
        view = self._host_views.get(storage)
        if view is None:
            if storage not in self.layout.storages:
                raise BackendError(f"host#{storage} holds no data: its input was never placed")
            view = self._host_views[storage] = self.layout.storages[storage].of(self.host)
        return view

    def bind_host(self, storage: int, array: np.ndarray) -> None:
        """Use `array` as host storage `storage` (an aliased input storage, only ever read)."""
        self._host_views[storage] = array

    # -- dispatch ----------------------------------------------------------------

    def issue(self, node: MemNode, stream: Stream | None) -> None:
        """Issue `node`'s work on `stream` (None for bookkeeping nodes)."""
        self._handlers[node.kind](node, stream)

    def input(self, node: MemNode, stream: Stream | None) -> None:
        """A device-side input is copied from its host array; a host-side input is already
        in its host storage (placed before the run starts)."""
        if node.region is not None:
            view = self.device_view(node.region, node.tensor)
            self.backend.copy_to_device(view, self.sources[node.name], stream)

    def alloc(self, node: MemNode, stream: Stream | None) -> None:
        """Nothing to do: the plan chose the region; dependencies order its reuse."""

    def apply(self, node: MemNode, stream: Stream | None) -> None:
        task = self.tg[node.tensor]
        operands = [
            self.device_view(region, operand)
            for operand, region in zip(task.inputs, node.reads, strict=True)
        ]
        out = self.device_view(node.region, node.tensor)
        self.backend.compute(task, operands, out, stream)

    def offload(self, node: MemNode, stream: Stream | None) -> None:
        piece = self.layout.pieces.get(node.id)
        if piece is None:
            view = self.device_view(node.region, node.tensor)
            self.backend.copy_to_host(self.host_view(node.storage), view, stream)
            return
        view = self.device_view(node.region, piece.task)  # the piece's own shape
        staged = self.layout.staged_pieces.get(node.id)
        if staged is not None:
            self.backend.copy_to_host(staged.of(self.host), view, stream)
        else:
            box = self.host_view(node.storage)[box_index(piece.box)]
            self.backend.copy_to_host(box, view, stream)

    def assemble_on_host(self) -> None:
        """Move the staged pieces of sliced offloads into their boxes (staging backends;
        call after the run has synchronized)."""
        for node_id, slot in self.layout.staged_pieces.items():
            node = self.mg.nodes[node_id]
            box = self.host_view(node.storage)[box_index(self.layout.pieces[node_id].box)]
            np.copyto(box, slot.of(self.host))

    def reload(self, node: MemNode, stream: Stream | None) -> None:
        view = self.device_view(node.region, node.tensor)
        self.backend.copy_to_device(view, self.reload_source(node), stream)

    def reload_source(self, node: MemNode) -> np.ndarray:
        """The host data a reload copies: its storage, or for a sliced reload (the tensor is
        a Slice of the input the storage holds) the slice's box of it."""
        if self.layout.holders.get(node.storage, node.tensor) == node.tensor:
            return self.host_view(node.storage)
        if node.tensor in self.layout.boxes:
            return self.layout.boxes[node.tensor].of(self.host)
        return self.host_view(node.storage)[slice_box(self.tg[node.tensor])]

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
