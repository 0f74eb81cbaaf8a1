"""MemGraph nodes: what a memory plan does, step by step, with explicit dependencies.

Node kinds (`NodeKind`), and the fields each one uses:

* `input`   – a program input's data appears. On the host: `storage` is the host
              storage it is copied into. On the device: `region` (allocated by an
              earlier `alloc`) receives it. `name` is the input's name.
* `alloc`   – `region` of the device arena is reserved for `tensor`.
* `apply`   – task `tensor` is computed: it reads `reads` (one device region per
              task operand, in the task's operand order; a view operand reads its
              base's region) and writes `region`.
* `offload` – `tensor`'s data is copied from device `region` to host `storage`. When
              `into` is set, it is a *sliced offload*: `storage` is the host array of
              task `into`, a program output that a tree of output Concats rebuilds from
              its blocks (`taskgraph.assembly`), and the copy fills just the box that
              `tensor` (one of its pieces) holds in it. Those Concats then never run:
              the output is assembled in host memory, each block leaving the device as
              soon as it is computed, and its `output` node (on the host) depends on
              the sliced offloads that fill it, which cover it exactly once.
* `reload`  – `tensor`'s data is copied from host `storage` to device `region`. When
              `tensor` is a Slice task whose operand is an input held in `storage`,
              the copy takes the slice's box of that input: a *sliced reload*, which
              produces the slice without the whole input on the device (how a
              partitioned program streams a weight larger than a block).
* `free`    – `region`, holding `tensor`, is released.
* `output`  – program output `name` is final: on the device in `region`, or on the
              host in `storage`. `tensor` is the task holding its bytes.

`tensor` is always a TaskGraph task id: the task whose bytes the node concerns (for
a view, its base task: views occupy no memory of their own). Every node lists in
`deps` the earlier nodes it must wait for; the dependencies alone make execution on
separate compute / host-to-device / device-to-host streams safe (see `verify`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from einpage_core.units import format_bytes

__all__ = ["NodeKind", "Region", "MemNode", "STREAM_OF"]


class NodeKind(str, enum.Enum):
    """The closed set of MemGraph node kinds (see the module docstring for their fields)."""

    INPUT = "input"  # an input's data appears on the host or the device
    ALLOC = "alloc"  # a device region is reserved for a tensor
    APPLY = "apply"  # a task computes: reads operand regions, writes its output region
    OFFLOAD = "offload"  # device region -> host storage (D2H)
    RELOAD = "reload"  # host storage -> device region (H2D)
    FREE = "free"  # a device region is released
    OUTPUT = "output"  # a program output is final (on the device or the host)

    def __str__(self) -> str:
        return self.value


STREAM_OF: dict[NodeKind, str] = {
    NodeKind.INPUT: "h2d",
    NodeKind.ALLOC: "none",
    NodeKind.APPLY: "compute",
    NodeKind.OFFLOAD: "d2h",
    NodeKind.RELOAD: "h2d",
    NodeKind.FREE: "none",
    NodeKind.OUTPUT: "none",
}
"""The stream each kind runs on: compute, h2d (host to device), d2h, or none (bookkeeping)."""


@dataclass(frozen=True, slots=True, order=True)
class Region:
    """The device bytes `[offset, offset + size)` of the arena."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size

    def overlaps(self, other: Region) -> bool:
        return self.offset < other.end and other.offset < self.end

    def __str__(self) -> str:
        return f"[{self.offset:#010x}, +{format_bytes(self.size)})"


@dataclass(frozen=True, slots=True)
class MemNode:
    """One step of a memory plan. Which fields are set depends on `kind` (module docstring).

    `id` equals the node's position in the MemGraph; `deps` are ids of earlier nodes.
    """

    id: int
    kind: NodeKind
    deps: tuple[int, ...] = ()
    tensor: int | None = None
    region: Region | None = None
    storage: int | None = None
    reads: tuple[Region, ...] = ()
    name: str = ""
    into: int | None = None  # a sliced offload: the output assembly `storage` belongs to

    @property
    def stream(self) -> str:
        return STREAM_OF[self.kind]

    def describe(self) -> str:
        """The node without id and dependencies: `reload %7 host#3 -> [0x0000a000, +1.0 KiB)`."""
        tensor = f"%{self.tensor}"
        host = f"host#{self.storage}"
        kind = self.kind
        if kind is NodeKind.INPUT:
            where = host if self.storage is not None else str(self.region)
            return f'input "{self.name}" {tensor} -> {where}'
        if kind is NodeKind.APPLY:
            reads = ", ".join(str(r) for r in self.reads)
            return f"apply {tensor} ({reads}) -> {self.region}"
        if kind is NodeKind.OFFLOAD:
            into = f" into %{self.into}" if self.into is not None else ""
            return f"offload {tensor} {self.region} -> {host}{into}"
        if kind is NodeKind.RELOAD:
            return f"reload {tensor} {host} -> {self.region}"
        if kind is NodeKind.OUTPUT:
            where = host if self.storage is not None else str(self.region)
            return f'output "{self.name}" {tensor} {where}'
        return f"{kind} {tensor} {self.region}"

    def line(self) -> str:
        """One readable line: `n15: reload %7 host#3 -> [0x0000a000, +1.0 KiB)  after n11, n14`."""
        after = f"  after {', '.join(f'n{d}' for d in self.deps)}" if self.deps else ""
        return f"n{self.id}: {self.describe()}{after}"

    def __repr__(self) -> str:
        return f"<MemNode {self.line()}>"
