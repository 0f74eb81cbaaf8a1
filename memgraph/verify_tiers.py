"""The verifier's host-tier rules: slots of the host arena, places on disk, and the order of
the reads, writes and releases that move storages between them.

A plan with a host tier (`MemGraph.tier`) keeps every host storage the tier *holds* (of
kind "offload" or "assembly", or an input with a place on disk: a checkpoint weight) in a
*slot* of the host arena while it is in host memory. `memgraph.verify` replays the plan
node by node and hands each node to `HostTierRules.see` after its device checks; the
checks here follow the shared spec of the tier (`RULES`, one sentence each):

* the tier's table, before any node: each place on disk lies inside its file, an input's
  in a checkpoint file and any other storage's in a spill file, a transposed place only
  in a checkpoint and its (rows, cols) matrix exactly the storage's bytes, and
  spill-file places of two storages do not overlap;
* each node naming a slot: the slot lies inside the host arena `[0, budget)`; copies
  (offload, reload, an output on the host) of a storage the tier holds name its slot, of
  any other storage none;
* occupancies: a storage occupies a slot from the node that fills it (a read, or the
  first offload into it) to its release; a slot holds its storage's bytes. A storage may
  occupy several slots at once (a streamed weight read ahead of its next reload while
  the last one is in flight): a node naming a storage and a slot names the storage's live
  occupancy of exactly that slot (an offload naming one that is not live fills a new
  one). Occupancies of overlapping slots are never live at once in node order, and the
  node beginning the later one comes after the release of the earlier (nothing
  overwritten while a copy from it may be in flight). The host bytes live at once stay
  within the budget;
* order ("comes after": through dependencies, `_Verifier.after`, the verifier's own
  happens-before): a reload, write, release or host output comes after every node that
  filled its occupancy; a release after every use of it; a read from the spill file
  after a write of its storage; a write goes only to the spill file;
* an output on the host keeps its slot (never released after its output node); an
  output assembled on the host loses no box (once released, its slot is filled again
  by a read, never by a sliced offload that would start it afresh).

A plan without a tier names no slot and no place on disk (`check_no_tier`; its read,
write and release nodes are refused by `memgraph.verify` itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Protocol

from einpage_core.errors import VerificationError
from memgraph.nodes import HostRegion, HostStorage, HostTier, MemNode, NodeKind
from memgraph.verify_ranges import LatestFrees, LiveRegions
from taskgraph import dtypes

__all__ = ["RULES", "rule", "HostTierRules", "check_no_tier"]

RULES: dict[str, str] = {
    "no tier": "a plan without a host tier names no host slot and no place on disk",
    "place": (
        "a storage read or written has a place on disk, inside its file: an input's in a "
        "checkpoint file, an offloaded or assembled storage's in a spill file; a transposed "
        "place is a checkpoint's, its matrix exactly the storage's bytes"
    ),
    "spill overlap": "the spill-file places of two storages do not overlap",
    "arena": "every slot lies inside the host arena",
    "held": "a copy of a storage the tier holds names its slot, of any other storage none",
    "tensor": "a read, write or release names the tensor its storage holds",
    "size": "a slot holds its storage's bytes",
    "current": "a node naming a slot names its storage's live occupancy of that slot",
    "overlap": "occupancies of overlapping slots are never live at once",
    "reuse": "an occupancy begins after the release of the earlier occupancies of its bytes",
    "filled": "a reload, write, release or host output comes after what filled its slot",
    "release": "a release comes after every use of its occupancy",
    "spilled": "a read from the spill file comes after a write of its storage",
    "checkpoint": "a write goes to the spill file: a checkpoint is never written",
    "kept": "an output on the host keeps its slot: it is never released",
    "boxes": "an output assembled on the host loses no box: a released one comes back by a read",
    "peak": "the host bytes live at once stay within the host budget",
}
"""The host tier's rules, by name; every refusal ends with the rule it breaks."""


def rule(name: str) -> str:
    """The tail of a refusal: `[host tier: <the rule>]`."""
    return f" [host tier: {RULES[name]}]"


class Verifier(Protocol):
    """What the rules use of `memgraph.verify`'s replay: its node, errors and "after"."""

    node: MemNode | None

    def fail(self, message: str, node: MemNode | None = None) -> VerificationError: ...

    def after(
        self, earlier: int | None, what: str, *args: object, via: Iterable[int] = ()
    ) -> None: ...

    def listed(self, storage: int) -> HostStorage: ...


def check_no_tier(storages: Mapping[int, HostStorage], verifier: Verifier) -> None:
    """A plan without a host tier: no storage has a place on disk."""
    for storage in storages.values():
        if storage.disk is not None:
            raise verifier.fail(
                f"{storage} has a place on disk, but the plan has no host tier" + rule("no tier")
            )


@dataclass
class _Occupancy:
    """Storage `storage` in `slot`, from node `begin` (a read or an offload) to its release:
    the nodes that filled it and those that used it since."""

    storage: int
    slot: HostRegion
    begin: int
    fillers: list[int]
    users: list[int] = field(default_factory=list)  # reloads, writes, host outputs
    output: int | None = None  # the host output naming it (then never released)


class HostTierRules:
    """The host tier's checks of one plan, fed its nodes in order by the verifier's replay."""

    def __init__(self, tier: HostTier, storages: Mapping[int, HostStorage], verifier: Verifier):
        self.tier = tier
        self.storages = storages
        self.v = verifier
        self.live_at: dict[int, _Occupancy] = {}  # slot offset -> the live occupancy there
        self.slots = LiveRegions()  # the live slots (disjoint), by storage
        self.released = LatestFrees()  # the latest release of each host byte
        self.written: dict[int, int] = {}  # storage -> its latest write to the spill file
        self.occupied: set[int] = set()  # storages that have had an occupancy
        self.live_bytes = 0  # host bytes of live occupancies
        self.peak = 0
        self.handlers = {
            NodeKind.OFFLOAD: self.on_offload,
            NodeKind.RELOAD: self.on_reload,
            NodeKind.OUTPUT: self.on_output,
            NodeKind.READ: self.on_read,
            NodeKind.WRITE: self.on_write,
            NodeKind.RELEASE: self.on_release,
        }

    def fail(self, message: str, name: str) -> VerificationError:
        return self.v.fail(message + rule(name))

    def after(self, earlier: int, name: str, what: str, *args: object) -> None:
        self.v.after(earlier, what + "{}", *args, rule(name))

    # -- the table, before any node ------------------------------------------------

    def check_table(self) -> None:
        """Each place on disk inside its file, of the file kind its storage reads (a
        transposed one in a checkpoint, of the storage's bytes); the spill-file places of
        two storages apart."""
        files = self.tier.files
        spilled: list[tuple[int, int, int, int]] = []  # (file, offset, end, storage)
        for storage in self.storages.values():
            place = storage.disk
            if place is None:
                continue
            if not 0 <= place.file < len(files):
                raise self.fail(
                    f"{storage} names file#{place.file}, but the tier has {len(files)} file(s)",
                    "place",
                )
            file = files[place.file]
            if place.offset < 0 or place.offset + storage.nbytes > file.nbytes:
                raise self.fail(
                    f"{storage}: bytes [{place.offset}, {place.offset + storage.nbytes}) are "
                    f"not inside file#{place.file}, {file}",
                    "place",
                )
            want = "checkpoint" if storage.kind == "input" else "spill"
            if file.kind != want:
                raise self.fail(
                    f"{storage} ({storage.kind}) is in file#{place.file}, a {file.kind} file",
                    "place",
                )
            if place.transposed is not None:
                self.check_transposed(storage, file.kind)
            if want == "spill" and storage.nbytes:
                spilled.append(
                    (place.file, place.offset, place.offset + storage.nbytes, storage.id)
                )
        spilled.sort()
        for (file, _, end, first), (other, offset, _, second) in pairwise(spilled):
            if file == other and offset < end:
                raise self.fail(
                    f"{self.storages[first]} and {self.storages[second]} overlap in file#{file}",
                    "spill overlap",
                )

    def check_transposed(self, storage: HostStorage, kind: str) -> None:
        """A transposed place is in a checkpoint (the runtime writes the spill file in C
        order), and its (rows, cols) matrix is exactly the storage's bytes."""
        rows, cols = storage.disk.transposed  # type: ignore[union-attr, misc]
        if kind != "checkpoint":
            raise self.fail(
                f"{storage} is transposed in a {kind} file: only a checkpoint holds a "
                "transposed matrix",
                "place",
            )
        matrix = rows * cols * dtypes.itemsize(storage.dtype)
        if rows < 1 or cols < 1 or matrix != storage.nbytes:
            raise self.fail(
                f"{storage}: its transposed ({rows}, {cols}) matrix is {matrix} bytes, the "
                f"storage {storage.nbytes}",
                "place",
            )

    # -- the replay ------------------------------------------------------------------

    def see(self, node: MemNode) -> None:
        """Check `node` (its device checks done) against the tier's rules."""
        if node.slot is not None:
            self.inside(node.slot)
        handler = self.handlers.get(node.kind)
        if handler is not None:
            handler(node)

    def inside(self, slot: HostRegion) -> None:
        budget = self.tier.budget
        if not isinstance(slot, HostRegion):
            raise self.fail(f"slot {slot} is a device region, not a HostRegion", "arena")
        if slot.offset < 0 or slot.size <= 0 or slot.end > budget:
            raise self.fail(f"slot {slot} is outside the host arena of {budget} bytes", "arena")

    def held(self, node: MemNode) -> HostStorage | None:
        """The storage a copy names, if the tier holds it (then the copy names a slot);
        None when it names none (then neither may the copy)."""
        if node.storage is None:
            if node.slot is not None:
                raise self.fail(f"an output on the device names host slot {node.slot}", "held")
            return None
        storage = self.v.listed(node.storage)
        if not storage.tiered:
            if node.slot is not None:
                raise self.fail(
                    f"names slot {node.slot}, but {storage} is the caller's input (no place "
                    f"on disk): the tier holds no slot for it",
                    "held",
                )
            return None
        if node.slot is None:
            raise self.fail(f"names no host slot, but the tier holds {storage}", "held")
        return storage

    def tier_storage(self, node: MemNode) -> HostStorage:
        """The storage a read, write or release names: listed, holding its tensor."""
        storage = self.v.listed(node.storage)
        if storage.tensor != node.tensor:
            raise self.fail(
                f"names %{node.tensor}, but {storage} holds %{storage.tensor}", "tensor"
            )
        if not storage.tiered:
            raise self.fail(
                f"{storage} is the caller's input (no place on disk): the tier does not hold it",
                "held",
            )
        return storage

    def live(self, node: MemNode) -> _Occupancy | None:
        """The live occupancy of the node's storage in the node's slot, if any."""
        occupancy = self.live_at.get(node.slot.offset)
        if occupancy is None or (occupancy.storage, occupancy.slot) != (node.storage, node.slot):
            return None
        return occupancy

    def occupancy(self, node: MemNode) -> _Occupancy:
        """The live occupancy of the node's storage in the node's slot, which must exist."""
        occupancy = self.live(node)
        if occupancy is None:
            live = self.live_at.values()
            held = [f"{o.slot} since n{o.begin}" for o in live if o.storage == node.storage]
            where = f"in {', '.join(held)}" if held else "in no slot"
            raise self.fail(
                f"host#{node.storage} is not in slot {node.slot} now: it is {where}", "current"
            )
        return occupancy

    def begin(self, node: MemNode, storage: HostStorage) -> None:
        """The node fills `storage` into its slot: a new occupancy."""
        slot = node.slot
        if slot.size < storage.nbytes:
            raise self.fail(f"slot {slot} is smaller than {storage}", "size")
        hit = self.slots.overlapping(slot)
        if hit is not None:
            other, at = hit
            since = self.live_at[at.offset].begin
            raise self.fail(
                f"slot {slot} overlaps slot {HostRegion(at.offset, at.size)} of host#{other}, "
                f"live since n{since}",
                "overlap",
            )
        for release in self.released.overlapping(slot):
            self.after(release, "reuse", "the release of bytes of its slot, at n{}", release)
        self.slots.add(slot, storage.id)
        self.live_at[slot.offset] = _Occupancy(storage.id, slot, node.id, [node.id])
        self.occupied.add(storage.id)
        self.live_bytes += slot.size
        self.peak = max(self.peak, self.live_bytes)
        if self.live_bytes > self.tier.budget:  # pragma: no cover (slots inside the arena, apart)
            raise self.fail(
                f"{self.live_bytes} host bytes live exceed the host budget of {self.tier.budget}",
                "peak",
            )

    def after_fillers(self, occupancy: _Occupancy) -> None:
        for filler in occupancy.fillers:
            self.after(
                filler, "filled", "n{}, which filled host#{} in its slot", filler, occupancy.storage
            )

    def on_offload(self, node: MemNode) -> None:
        storage = self.held(node)
        if storage is None:
            return
        occupancy = self.live(node)
        if occupancy is None:
            if storage.kind == "assembly" and storage.id in self.occupied:
                raise self.fail(
                    f"starts {storage} afresh in slot {node.slot}, losing the boxes its "
                    f"earlier slot holds or held",
                    "boxes",
                )
            self.begin(node, storage)
            return
        occupancy.fillers.append(node.id)

    def use(self, node: MemNode) -> _Occupancy:
        """The node reads its storage's slot: after everything that filled it, and one of
        its users (a release waits for them all)."""
        occupancy = self.occupancy(node)
        self.after_fillers(occupancy)
        occupancy.users.append(node.id)
        return occupancy

    def on_reload(self, node: MemNode) -> None:
        if self.held(node) is not None:
            self.use(node)

    def on_output(self, node: MemNode) -> None:
        if self.held(node) is not None:
            self.use(node).output = node.id

    def on_read(self, node: MemNode) -> None:
        storage = self.tier_storage(node)
        place = storage.disk
        if place is None:
            raise self.fail(f"{storage} has no place on disk to read it from", "place")
        if self.tier.files[place.file].kind == "spill":
            write = self.written.get(storage.id)
            if write is None:
                raise self.fail(
                    f"reads {storage} from the spill file, where nothing wrote it yet", "spilled"
                )
            self.after(write, "spilled", "n{}, which wrote host#{} there", write, storage.id)
        self.begin(node, storage)

    def on_write(self, node: MemNode) -> None:
        storage = self.tier_storage(node)
        place = storage.disk
        if place is None:
            raise self.fail(f"{storage} has no place on disk to write it to", "place")
        file = self.tier.files[place.file]
        if file.kind != "spill":
            raise self.fail(f"writes {storage} into file#{place.file}, {file}", "checkpoint")
        self.use(node)
        self.written[storage.id] = node.id

    def on_release(self, node: MemNode) -> None:
        self.tier_storage(node)
        occupancy = self.occupancy(node)
        if occupancy.output is not None:
            raise self.fail(
                f"releases host#{node.storage}, which output n{occupancy.output} keeps", "kept"
            )
        self.after_fillers(occupancy)
        for user in occupancy.users:
            self.after(user, "release", "n{}, which uses host#{} there", user, node.storage)
        self.slots.remove(occupancy.slot)
        self.released.record(occupancy.slot, node.id)
        del self.live_at[occupancy.slot.offset]
        self.live_bytes -= occupancy.slot.size
