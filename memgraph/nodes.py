"""MemGraph nodes: what a memory plan does, step by step, with explicit dependencies.

Node kinds (`NodeKind`), and the fields each one uses:

* `input`   – a program input's data appears. On the host: `storage` is the host
              storage it is copied into. On the device: `region` (allocated by an
              earlier `alloc`) receives it. `name` is the input's name.
* `alloc`   – `region` of the device arena is reserved for `tensor`.
* `apply`   – task `tensor` is computed: it reads `reads` (one device region per
              task operand, in the task's operand order; a view operand reads its
              base's region) and writes `region`. When the task's kernel needs a
              workspace (`Task.workspace`), `workspace` is its region: *transient*,
              allocated for this apply only and released when it ends, so nothing
              else may hold those bytes while it runs, and whatever takes them later
              waits for the apply (as for the free of a tensor).
              With `recompute` set it is a *recompute*: the task was computed before,
              its output was dropped from the device with no copy out, and this apply
              computes it again from its operands (resident again, and unchanged:
              tensors are immutable) instead of a reload bringing it back. It prints
              as `recompute`, runs as any apply, and is counted apart (`PlanStats`).
* `offload` – `tensor`'s data is copied from device `region` to host `storage`. When
              `into` is set, it is a *sliced offload*: `storage` is the host array of
              task `into`, a program output that a tree of output Concats rebuilds from
              its blocks (`taskgraph.assembly`), and the copy fills just `box`, the box
              that `tensor` (one of its pieces) holds in it. Those Concats then never
              run: the output is assembled in host memory, each block leaving the
              device as soon as it is computed, and its `output` node (on the host)
              depends on the sliced offloads that fill it, which tile it exactly once.
* `reload`  – `tensor`'s data is copied from host `storage` to device `region`. When
              `box` is set, `tensor` is a Slice task whose operand is the input held in
              `storage`, and the copy takes just that box of it: a *sliced reload*,
              which produces the slice without the whole input on the device (how a
              partitioned program streams a weight larger than a block).
* `free`    – `region`, holding `tensor`, is released.
* `output`  – program output `name` is final: on the device in `region`, or on the
              host in `storage`. `tensor` is the task holding its bytes.
* `send`    – in a plan for several devices (`memgraph.multi`): output `name`, in
              device `region`, is copied straight to another device's arena (NVLink or
              PCIe peer-to-peer), as link `link` of the `MultiPlan` says. The region
              stays held until the copy is done: whatever frees it waits for the send.
* `recv`    – in a plan for several devices: input `name` arrives from another
              device into `region` (allocated by an earlier `alloc`), by link `link`.
              A send and its receive are one copy: it starts when both have their
              dependencies done, and both end when it ends.
* `read`    – in a plan with a host tier (`MemGraph.tier`, `memgraph.tiers`): host
              `storage` is copied from its place on disk (`HostStorage.disk`: a
              checkpoint file or the spill file) into host `slot`, bytes of the host
              arena of `HostTier.budget` bytes.
* `write`   – in a plan with a host tier: host `storage`, in `slot`, is copied to its
              place in the spill file.
* `release` – in a plan with a host tier: host `slot`, holding `storage`, is released
              (whatever takes its bytes later waits for it, as for a `free`).

In a plan with a host tier, every offload or reload of a host storage the tier holds,
and every output assembled on the host, names the `slot` of the host arena the storage
is in at that moment; copies of storages the tier does not hold (inputs the caller
passes) name none.

`tensor` is always a TaskGraph task id: the task whose bytes the node concerns (for
a view, its base task: views occupy no memory of their own). Every node lists in
`deps` the earlier nodes it must wait for; the dependencies alone make execution on
separate compute / host-to-device / device-to-host streams safe (see `verify`).

The fields each kind uses are declared once, in `NODE_FIELDS`; the JSON schema
(`memgraph.serialize`), `MemNode.describe` and the verifier's structural checks are
derived from it. A copy between host and device moves a whole host storage, or, when
the node carries a `HostBox`, just that box of it: the plan holds every fact a runtime
needs (each host storage's shape, dtype and size is in `MemGraph.storages`, a
`HostStorage` each), so a runtime copies boxes without reading the TaskGraph.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from einpage_core.units import format_bytes

__all__ = [
    "NodeKind",
    "Region",
    "HostBox",
    "HostStorage",
    "HostRegion",
    "STORAGE_KINDS",
    "DISK_FILE_KINDS",
    "DiskFile",
    "DiskPlace",
    "HostTier",
    "KindFields",
    "NODE_FIELDS",
    "FIELDS",
    "MemNode",
    "STREAM_OF",
]


class NodeKind(str, enum.Enum):
    """The closed set of MemGraph node kinds (see the module docstring for their fields)."""

    INPUT = "input"  # an input's data appears on the host or the device
    ALLOC = "alloc"  # a device region is reserved for a tensor
    APPLY = "apply"  # a task computes: reads operand regions, writes its output region
    OFFLOAD = "offload"  # device region -> host storage (D2H)
    RELOAD = "reload"  # host storage -> device region (H2D)
    FREE = "free"  # a device region is released
    OUTPUT = "output"  # a program output is final (on the device or the host)
    SEND = "send"  # device region -> another device's region (a link's output)
    RECV = "recv"  # another device's region -> device region (a link's input)
    READ = "read"  # disk -> host slot (a tier's storage arrives in host memory)
    WRITE = "write"  # host slot -> disk (a tier's storage is spilled)
    RELEASE = "release"  # a host slot is released

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
    NodeKind.SEND: "peer",
    NodeKind.RECV: "peer",
    NodeKind.READ: "disk_read",
    NodeKind.WRITE: "disk_write",
    NodeKind.RELEASE: "none",
}
"""The stream each kind runs on: compute, h2d (host to device), d2h, peer (device to
device: a send and its receive), disk_read and disk_write (between disk and host
memory), or none (bookkeeping)."""


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


@dataclass(frozen=True, slots=True, order=True)
class HostRegion(Region):
    """The bytes `[offset, offset + size)` of a plan's host arena (`HostTier`): where a
    host storage is while it is in host memory. A type of its own, printed `h[...]` and
    unequal to a `Region` of the same bytes, so that a host slot reads as one.

    >>> HostRegion(0, 4096) == Region(0, 4096), str(HostRegion(0, 4096))
    (False, 'h[0x00000000, +4.0 KiB)')
    """

    def __str__(self) -> str:
        return f"h[{self.offset:#010x}, +{format_bytes(self.size)})"


# -- host memory ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HostBox:
    """The part of a host storage a sliced copy moves: of the storage's C-contiguous
    array (`shape`, `dtype`), the elements `starts[k] <= i[k] < starts[k] + sizes[k]`.

    On the device the box is contiguous: `sizes` of `dtype`, `nbytes` bytes.

    >>> box = HostBox((64, 8), "float32", (16, 0), (8, 8))
    >>> str(box), box.nbytes, box.inside()
    ('[16:24, 0:8]', 256, True)
    >>> box.overlaps(HostBox((64, 8), "float32", (20, 4), (8, 4))), box.index
    (True, (slice(16, 24, None), slice(0, 8, None)))
    """

    shape: tuple[int, ...]
    dtype: str
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...], dtype: str) -> HostBox:
        """The box of all of an array."""
        return cls(tuple(shape), dtype, (0,) * len(shape), tuple(shape))

    @property
    def size(self) -> int:
        """Elements in the box."""
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @property
    def index(self) -> tuple[slice, ...]:
        """The NumPy index of the box in the storage's array."""
        return tuple(slice(s, s + n) for s, n in zip(self.starts, self.sizes, strict=True))

    def inside(self) -> bool:
        """Whether the box has one (start, size) per axis and lies inside the array."""
        return (
            len(self.starts) == len(self.sizes) == len(self.shape)
            and all(s >= 0 and n >= 1 for s, n in zip(self.starts, self.sizes, strict=True))
            and all(s + n <= d for s, n, d in zip(self.starts, self.sizes, self.shape, strict=True))
        )

    def overlaps(self, other: HostBox) -> bool:
        """Whether the two boxes (of arrays of one rank) share an element."""
        return all(
            a < b + m and b < a + n
            for a, n, b, m in zip(self.starts, self.sizes, other.starts, other.sizes, strict=True)
        )

    def __str__(self) -> str:
        pairs = zip(self.starts, self.sizes, strict=False)
        return "[" + ", ".join(f"{s}:{s + n}" for s, n in pairs) + "]"


STORAGE_KINDS = ("input", "offload", "assembly")
"""What fills a host storage: a program input placed there before the run ("input"), an
offload that copies a tensor there whole ("offload"), or sliced offloads that write the
boxes of a program output assembled on the host ("assembly")."""


@dataclass(frozen=True, slots=True)
class HostStorage:
    """Host storage `id` of a plan: a C-contiguous array of `shape` and `dtype` (`nbytes`
    bytes) that holds task `tensor` (an input, an offloaded tensor, or an output
    assembled on the host), filled as its `kind` says (`STORAGE_KINDS`)."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    tensor: int
    kind: str
    disk: DiskPlace | None = None

    @classmethod
    def of(cls, storage: int, shape: tuple[int, ...], dtype: str, tensor: int, kind: str):
        """A storage whose `nbytes` is that of `shape` and `dtype`."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        return cls(storage, tuple(shape), dtype, nbytes, tensor, kind)

    @property
    def box(self) -> HostBox:
        """The box of the whole storage."""
        return HostBox.whole(self.shape, self.dtype)

    @property
    def tiered(self) -> bool:
        """Whether a host tier holds it (keeps it in a slot of its arena), in a plan with
        one: an offloaded or assembled storage, or an input with a place on disk (a
        checkpoint weight). Any other input is the caller's array."""
        return self.kind != "input" or self.disk is not None

    def __str__(self) -> str:
        dims = ",".join(map(str, self.shape))
        size = format_bytes(self.nbytes)
        disk = f" on disk {self.disk}" if self.disk is not None else ""
        return f"host#{self.id}: {self.dtype}[{dims}] {size} {self.kind} %{self.tensor}{disk}"


# -- disk ---------------------------------------------------------------------------

DISK_FILE_KINDS = ("checkpoint", "spill")
"""What a disk file of a plan is: a checkpoint file holding weights where they already
are (read only), or the spill file a run creates in its spill folder (read and written)."""


@dataclass(frozen=True, slots=True)
class DiskFile:
    """A file of a plan's host tier: `kind` (`DISK_FILE_KINDS`), `nbytes` its size (a
    checkpoint's size when planned, checked before and during a run; the size a run
    creates the spill file with), `path` a checkpoint's path ("" for the spill file: the
    run's spill folder decides where it goes). A checkpoint may state the SHA-256 of its
    first `head` bytes (`head_sha256`, hex: a safetensors file's header, which says where
    every tensor is), which a run checks before reading: a file replaced by another of
    the same size is then refused too."""

    kind: str
    nbytes: int
    path: str = ""
    head: int = 0
    head_sha256: str = ""

    def __str__(self) -> str:
        where = self.path or "in the spill folder"
        return f"{self.kind} {where} ({format_bytes(self.nbytes)})"


@dataclass(frozen=True, slots=True)
class DiskPlace:
    """Where a host storage's bytes are on disk: at `offset` of file `file` (an index in
    `HostTier.files`), `HostStorage.nbytes` of them, C-contiguous – or, with `transposed`
    = (rows, cols), as a C-contiguous (rows, cols) matrix whose transpose (cols, rows), in
    C order, is the storage's bytes (a Hugging Face checkpoint's `o_proj`, `down_proj`;
    only a checkpoint's place is transposed).

    >>> print(DiskPlace(0, 4096, (64, 128)))
    file#0@4096 T(64x128)
    """

    file: int
    offset: int
    transposed: tuple[int, int] | None = None

    def __str__(self) -> str:
        where = f"file#{self.file}@{self.offset}"
        if self.transposed is None:
            return where
        rows, cols = self.transposed
        return f"{where} T({rows}x{cols})"


@dataclass(frozen=True, slots=True)
class HostTier:
    """A plan's host memory, planned as its device memory is: an arena of `budget` bytes
    that every host storage the tier holds is in while in host memory (`read`, `write`,
    `release` nodes move storages between it and `files`), and the disk files below it."""

    budget: int
    files: tuple[DiskFile, ...]

    @property
    def spill_bytes(self) -> int:
        """The size of the spill file a run creates (0 without one)."""
        return sum(f.nbytes for f in self.files if f.kind == "spill")

    def __str__(self) -> str:
        files = "; ".join(f"file#{i}: {f}" for i, f in enumerate(self.files))
        return f"host tier {format_bytes(self.budget)}" + (f", {files}" if files else "")


# -- which fields each kind uses ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class KindFields:
    """The fields a node kind uses besides `id`, `kind`, `deps` and `tensor` (which every
    node has): `required` ones, `optional` ones, and `one_of`, of which exactly one is set.
    `template` is how `MemNode.describe` prints the kind (`{field}` placeholders)."""

    required: tuple[str, ...]
    template: str
    optional: tuple[str, ...] = ()
    one_of: tuple[str, ...] = ()

    @property
    def allowed(self) -> frozenset[str]:
        return frozenset(self.required + self.optional + self.one_of)


FIELDS: dict[str, str] = {
    "region": "a device region",
    "storage": "host storage",
    "reads": "operand regions",
    "name": "a name",
    "into": "an output assembly",
    "box": "a host box",
    "workspace": "a workspace region",
    "recompute": "a recompute mark",
    "link": "a link between devices",
    "slot": "a host slot",
}
"""The optional fields of a `MemNode`, each with what it is (for messages)."""

_USE = {
    "region": "use a device region ('region')",
    "storage": "use host storage ('storage')",
    "reads": "read operand regions ('reads')",
    "name": "name a program input or output ('name')",
    "into": "fill an output assembly ('into')",
    "box": "copy a box of host storage ('box')",
    "workspace": "hold a kernel's workspace ('workspace')",
    "recompute": "compute a task again ('recompute')",
    "link": "copy between devices ('link')",
    "slot": "use a slot of the host arena ('slot')",
}

_ONE_PLACE = ("storage", "region")  # an input or output is on the host or on the device
_SLOT_KINDS = ("read", "write", "release")  # kinds whose template prints the slot itself

NODE_FIELDS: dict[NodeKind, KindFields] = {
    NodeKind.INPUT: KindFields(
        required=("name",), one_of=_ONE_PLACE, template='input "{name}" {tensor} -> {where}'
    ),
    NodeKind.ALLOC: KindFields(required=("region",), template="alloc {tensor} {region}"),
    NodeKind.APPLY: KindFields(
        required=("region", "reads"),
        optional=("workspace", "recompute"),
        template="{verb} {tensor} ({reads}) -> {region}{workspace}",
    ),
    NodeKind.OFFLOAD: KindFields(
        required=("region", "storage"),
        optional=("into", "box", "slot"),
        template="offload {tensor} {region} -> {host}{into}",
    ),
    NodeKind.RELOAD: KindFields(
        required=("region", "storage"),
        optional=("box", "slot"),
        template="reload {tensor} {host} -> {region}",
    ),
    NodeKind.FREE: KindFields(required=("region",), template="free {tensor} {region}"),
    NodeKind.OUTPUT: KindFields(
        required=("name",),
        one_of=_ONE_PLACE,
        optional=("slot",),
        template='output "{name}" {tensor} {where}',
    ),
    NodeKind.SEND: KindFields(
        required=("name", "region", "link"), template='send "{name}" {tensor} {region} -> {link}'
    ),
    NodeKind.RECV: KindFields(
        required=("name", "region", "link"), template='recv "{name}" {tensor} {link} -> {region}'
    ),
    NodeKind.READ: KindFields(
        required=("storage", "slot"), template="read {tensor} {host} disk -> {slot}"
    ),
    NodeKind.WRITE: KindFields(
        required=("storage", "slot"), template="write {tensor} {host} {slot} -> disk"
    ),
    NodeKind.RELEASE: KindFields(
        required=("storage", "slot"), template="release {tensor} {host} {slot}"
    ),
}
"""The fields of each node kind, declared once: serialization, `MemNode.describe` and the
verifier's structural checks read them from here."""


def _users(field: str) -> str:
    """`an offload`, `an input or an output`, ...: the kinds that use `field`."""
    kinds = [k.value for k, spec in NODE_FIELDS.items() if field in spec.allowed]
    named = [f"an {k}" if k[0] in "aeiou" else f"a {k}" for k in kinds]
    return named[0] if len(named) == 1 else ", ".join(named[:-1]) + " or " + named[-1]


# -- the node ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemNode:
    """One step of a memory plan. Which fields are set depends on `kind` (`NODE_FIELDS`).

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
    box: HostBox | None = None  # a sliced offload or reload: the box of `storage` it copies
    workspace: Region | None = None  # an apply: its kernel's transient workspace region
    recompute: bool = False  # an apply that computes its task again (see the module docstring)
    link: int | None = None  # a send or receive: the index of its link in `MultiPlan.links`
    slot: HostRegion | None = None  # with a host tier: where in the host arena the storage is

    @property
    def stream(self) -> str:
        return STREAM_OF[self.kind]

    @property
    def copies(self) -> str | None:
        """The host<->device copy this node makes in the plan: "h2d" (a reload, an input put
        on the device), "d2h" (an offload), or None (no copy)."""
        if self.kind is NodeKind.RELOAD or (
            self.kind is NodeKind.INPUT and self.region is not None
        ):
            return "h2d"
        return "d2h" if self.kind is NodeKind.OFFLOAD else None

    def fields_set(self) -> frozenset[str]:
        """The optional fields this node sets (`FIELDS`; empty `reads` and `name` are unset)."""
        values = {
            "region": self.region,
            "storage": self.storage,
            "reads": self.reads or None,
            "name": self.name or None,
            "into": self.into,
            "box": self.box,
            "workspace": self.workspace,
            "recompute": True if self.recompute else None,
            "link": self.link,
            "slot": self.slot,
        }
        return frozenset(f for f, value in values.items() if value is not None)

    def field_problem(self) -> str | None:
        """What is wrong with the fields this node sets for its kind (`NODE_FIELDS`), or None."""
        spec = NODE_FIELDS[self.kind]
        have = self.fields_set()
        for f in spec.required:
            if f not in have and f not in ("reads", "name"):  # may be legitimately empty
                return f"has no {FIELDS[f].removeprefix('a ').removeprefix('an ')}"
        for f in sorted(have - spec.allowed):
            return f"sets '{f}', but only {_users(f)} can {_USE[f]}"
        if spec.one_of and len(have & set(spec.one_of)) != 1:
            choices = " and ".join(FIELDS[f] for f in spec.one_of)
            return f"an {self.kind} is in exactly one of {choices}"
        return None

    def describe(self) -> str:
        """The node without id and dependencies: `reload %7 host#3 -> [0x0000a000, +1.0 KiB)`."""
        host = f"host#{self.storage}" + (str(self.box) if self.box is not None else "")
        if self.slot is not None and self.kind not in _SLOT_KINDS:
            host += f" {self.slot}"
        parts = {
            "tensor": f"%{self.tensor}",
            "name": self.name,
            "region": str(self.region),
            "host": host,
            "where": host if self.storage is not None else str(self.region),
            "reads": ", ".join(str(r) for r in self.reads),
            "into": f" into %{self.into}" if self.into is not None else "",
            "workspace": f" + workspace {self.workspace}" if self.workspace is not None else "",
            "verb": "recompute" if self.recompute else "apply",
            "link": f"link#{self.link}",
            "slot": str(self.slot),
        }
        return NODE_FIELDS[self.kind].template.format(**parts)

    def line(self) -> str:
        """One readable line: `n15: reload %7 host#3 -> [0x0000a000, +1.0 KiB)  after n11, n14`."""
        after = f"  after {', '.join(f'n{d}' for d in self.deps)}" if self.deps else ""
        return f"n{self.id}: {self.describe()}{after}"

    def __repr__(self) -> str:
        return f"<MemNode {self.line()}>"
