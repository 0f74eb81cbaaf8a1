"""Running a plan with a host tier (`MemGraph.tier`): its host arena, and the port to disk.

A plan with a host tier plans its host memory as it plans device memory: every host
storage the tier holds (`tier_held`: offloaded tensors, outputs assembled on the host,
weights read from a checkpoint) lives, while in host memory, in a `slot` of one host
arena of `host_arena_bytes(mg)` bytes – the plan's host high-water, never more than
`HostTier.budget` –, allocated once per session with the backend's `allocate_host`
(pinned on CuPy). The nodes that copy such a storage (offload, reload, output) name
its slot, and the interpreter copies from and to that slot (`Interpreter.slot_view`).

`DiskPort` is what the interpreter hands `read`, `write` and `release` nodes to
(`Interpreter.disk`): a read fills the slot's first `nbytes` bytes from the storage's
place on disk (`HostStorage.disk`; a matrix the checkpoint holds transposed is
transposed on the way, through a scratch of at most `runtime.diskio.TRANSPOSE_SCRATCH`
bytes allocated per read, outside the arena), a write copies them to the spill file, a
release does nothing – or, when poisoning, fills the slot with `POISON_BYTE`, so that a
copy from it that was not made to wait reads NaNs. The work runs on the node's stream
(`disk_read`, `disk_write`; in sequential mode the one stream): on the NumPy backend as
any other work of a stream (a worker thread in mode "streams"), on CuPy as a host
function in the CUDA stream's order (`launch_host_func`), whose failure the port keeps
and the session raises when the run is drained.

The caller does not pass the weights a plan reads from a checkpoint (`disk_inputs`): a
run refuses one given anyway (`InputError`), rather than silently ignoring it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from einpage_core.errors import BackendError, DiskError, InputError
from memgraph.graph import MemGraph
from memgraph.nodes import HostRegion, HostStorage, MemNode, NodeKind
from runtime.backend import NodeFailure, Stream
from runtime.diskio import DiskFiles
from taskgraph import dtypes

__all__ = [
    "DiskPort",
    "tier_held",
    "disk_inputs",
    "host_arena_bytes",
    "slot_bytes",
    "refuse_disk_inputs",
    "refuse_tier_plan",
]


def tier_held(mg: MemGraph) -> frozenset[int]:
    """The host storages `mg`'s tier holds (none without a tier): every offloaded tensor
    and output assembled on the host, and every input whose bytes are on disk."""
    if mg.tier is None:
        return frozenset()
    return frozenset(sid for sid, s in mg.storages.items() if s.tiered)


def disk_inputs(mg: MemGraph) -> dict[str, int]:
    """The inputs `mg` reads from disk (checkpoint weights), by name: their storage ids."""
    held = tier_held(mg)
    if not held:
        return {}  # no tier: nothing to walk
    return {
        n.name: n.storage
        for n in mg.nodes
        if n.kind is NodeKind.INPUT and n.storage is not None and n.storage in held
    }


def host_arena_bytes(mg: MemGraph) -> int:
    """The host arena a run of `mg` allocates: up to the end of its highest slot, never
    more than the tier's budget (0 without a tier)."""
    if mg.tier is None:
        return 0
    top = max((n.slot.end for n in mg.nodes if n.slot is not None), default=0)
    return min(mg.tier.budget, max(1, top))


def slot_bytes(arena: np.ndarray, slot: HostRegion, nbytes: int, who: str) -> np.ndarray:
    """The first `nbytes` bytes of `slot` of the host `arena`; `BackendError` (its message
    starting with `who`) when they are not inside the slot and the slot inside the arena."""
    if nbytes > slot.size or slot.offset < 0 or slot.end > arena.nbytes:
        raise BackendError(
            f"{who}: {nbytes} bytes in {slot} do not fit (in the host arena of "
            f"{arena.nbytes} bytes)"
        )
    return arena[slot.offset : slot.offset + nbytes]


def refuse_disk_inputs(mg: MemGraph, names: Any, key: Any = None) -> None:
    """`InputError` when `names` (inputs given by the caller) include one the plan reads
    from a checkpoint itself."""
    on_disk = disk_inputs(mg)
    given = [name for name in names if name in on_disk]
    if given:
        files = mg.tier.files  # type: ignore[union-attr]  (disk inputs imply a tier)
        where = "; ".join(
            f"{name!r} from {files[mg.storages[on_disk[name]].disk.file].path!r}"  # type: ignore[union-attr]
            for name in given
        )
        which = f"plan {key!r} " if key is not None else "the plan "
        raise InputError(
            f"{which}reads input(s) {where} itself, from its checkpoint: do not pass them "
            "(pass only the inputs that are not on disk)"
        )


def refuse_tier_plan(mg: MemGraph, where: str) -> None:
    """`BackendError` when `mg` has a host tier and `where` cannot run one."""
    if mg.tier is not None:
        raise BackendError(
            f"{where} cannot run {mg.taskgraph.name!r}: it has a host tier ({mg.tier}); "
            "a plan with a host tier runs alone, in runtime.run or a runtime.Session of it"
        )


def submit_host(
    stream: Stream, work: Callable[[], None], failed: Callable[[BaseException], None]
) -> None:
    """Run `work` on the host in `stream`'s order: a NumPy stream's own work, or a CUDA
    stream's host function (its failure handed to `failed`: nothing can raise there)."""
    submit = getattr(stream, "submit", None)
    if submit is not None:
        submit(work)
        return
    cuda = getattr(stream, "cuda", None)
    if cuda is None or not hasattr(cuda, "launch_host_func"):
        raise BackendError(f"stream {stream.name!r} cannot run host work (disk transfers)")

    def callback(_: object) -> None:
        try:
            work()
        except BaseException as err:  # noqa: BLE001 (kept; the session raises it)
            failed(err)

    cuda.launch_host_func(callback, None)


class DiskPort:
    """Moves the tier's storages between `files` and the host `arena` (see the module
    docstring); `poison` is the byte a release fills its slot with (None: none);
    `failure` is the first failure of host work run as a CUDA host
    function (None on NumPy, whose streams raise their own)."""

    def __init__(
        self, mg: MemGraph, files: DiskFiles, arena: np.ndarray, poison: int | None = None
    ):
        self.mg = mg
        self.files = files
        self.arena = arena
        self.poison = poison
        self.failure: NodeFailure | None = None

    def __repr__(self) -> str:
        return f"<DiskPort {len(self.files.fds)} file(s) arena={self.arena.nbytes}>"

    def slot_bytes(self, node: MemNode, nbytes: int) -> np.ndarray:
        """The first `nbytes` bytes of the node's slot of the arena."""
        if node.slot is None:
            raise BackendError(f"n{node.id} ({node.describe()}) names no host slot")
        return slot_bytes(self.arena, node.slot, nbytes, f"n{node.id}")

    def _storage(self, node: MemNode) -> HostStorage:
        storage = self.mg.storages.get(node.storage)
        if storage is None or storage.disk is None:
            raise DiskError(
                f"n{node.id} ({node.describe()}): host#{node.storage} has no place on disk"
            )
        return storage

    def read(self, node: MemNode, stream: Stream | None) -> None:
        """Storage from its place on disk into the slot's first `nbytes` bytes; a place
        the checkpoint holds transposed is transposed on the way (`read_transposed`: a
        read then holds at most `TRANSPOSE_SCRATCH` bytes besides the arena, its scratch,
        allocated per read)."""
        storage = self._storage(node)
        place = storage.disk
        into = self.slot_bytes(node, storage.nbytes)
        if place.transposed is None:
            work = partial(self.files.read, place.file, place.offset, into)
        else:
            rows, cols = place.transposed
            itemsize = dtypes.itemsize(storage.dtype)
            work = partial(
                self.files.read_transposed, place.file, place.offset, rows, cols, itemsize, into
            )
        self._submit(node, stream, work)

    def write(self, node: MemNode, stream: Stream | None) -> None:
        """The slot's first `nbytes` bytes to the storage's place in the spill file."""
        storage = self._storage(node)
        place = storage.disk
        if place.transposed is not None:
            raise DiskError(
                f"n{node.id} ({node.describe()}): host#{storage.id} is transposed on disk "
                "(a checkpoint's place): only spill places, in C order, are written"
            )
        data = self.slot_bytes(node, storage.nbytes)
        self._submit(node, stream, lambda: self.files.write(place.file, place.offset, data))

    def release(self, node: MemNode, stream: Stream | None) -> None:
        """Nothing, unless poisoning: then the whole slot is filled with the poison byte."""
        byte = self.poison
        if byte is None:
            return
        whole = self.slot_bytes(node, node.slot.size if node.slot is not None else 0)
        self._submit(node, stream, lambda: whole.fill(byte))

    def _submit(self, node: MemNode, stream: Stream | None, work: Callable[[], None]) -> None:
        if stream is None:
            work()
            return

        def failed(err: BaseException) -> None:
            if self.failure is None:
                self.failure = NodeFailure(err, node, stream.name)

        def guarded() -> None:
            if self.failure is None:
                work()

        submit_host(stream, guarded, failed)

    def take_failure(self) -> NodeFailure | None:
        """The first failure of host work since the last call (then forgotten)."""
        failure, self.failure = self.failure, None
        return failure
