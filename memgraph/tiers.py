"""The host tier: host memory planned as a budget, disk below it (`place_host`).

A device plan (`memgraph.plan`) keeps every host storage in host memory for the whole run:
the weights, what it offloads, outputs assembled on the host. `place_host` plans that
memory too, the way the device planner plans the arena, one level down: an **arena of
`host_budget` bytes** holds each storage the tier takes (`memgraph.nodes.HostTier`) while
it is in host memory, and what does not fit lives on disk –

* a weight read from its checkpoint file where it already is (`CheckpointPlace`: the file
  and the offset of its bytes, as a safetensors header says), never copied to a spill
  file;
* anything the plan offloads (activations, KV pages) written to the spill file, in the
  spill folder the run is given, and read back before each reload.

Each storage's **occupancies** of the host arena (`Occupancy`) are planned in node order:

* a *kept* storage has one occupancy from its first use to its last: a weight read once,
  an offloaded tensor kept in host memory until its last reload (no disk traffic);
* a *streamed* storage has one occupancy per run of its reloads (reloads of it with no
  reload of another streamed storage between: the slices of one weight a partitioned
  matmul reloads one after another are one run): a `read` from disk into a slot, the
  reloads, a `release`; an offloaded tensor is first `write`n to the spill file from the
  slot its offload filled. Reads are prefetched: a streamed read is placed `depth` runs
  ahead of its own (double buffering by default), so the disk stream runs ahead of the
  reloads as far as slots are free;
* an output assembled on the host is kept to the end (the run returns it from there).

Every storage starts kept; where the host arena cannot place an occupancy (first fit, in
node order), a prefetch is given up first (the read placed just before its reload), and
then the kept storages alive there that save the fewest disk bytes per byte held become
streamed, as many as free the bytes missing; placement starts again. The nodes a slot's
reuse must wait for are added as the device planner adds them: whatever first fills a
slot waits for the release of every earlier occupancy it overlaps; a release waits for
every use of its occupancy; a reload waits for what filled its slot; a read of a spilled
tensor waits for its write.

The result is a new MemGraph with `tier` set; the device nodes, regions and budget are
unchanged (the device plan is not re-planned). `memgraph.verify` checks both budgets and
the order across tiers.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from einpage_core.errors import HostBudgetPlanError, PlanError
from einpage_core.units import format_bytes, parse_bytes
from memgraph.graph import MemGraph
from memgraph.nodes import DiskFile, DiskPlace, HostRegion, HostTier, MemNode, NodeKind
from taskgraph import dtypes

__all__ = [
    "CheckpointPlace",
    "Occupancy",
    "place_host",
    "host_reference",
    "SLOT_ALIGNMENT",
    "tier_storages",
]

SLOT_ALIGNMENT = 4096
"""Every slot of the host arena and every place in the spill file starts at a multiple of
this (a page: what O_DIRECT and GPUDirect Storage ask of buffers and offsets)."""


@dataclass(frozen=True, slots=True)
class CheckpointPlace:
    """Where a weight's bytes are in a checkpoint file: `offset` in the file at `path`,
    whose size is `file_nbytes` (a run checks the file still has it), and optionally the
    SHA-256 of its first `head` bytes (its header: a run checks it too). `transposed` =
    (rows, cols): the file holds the weight as a (rows, cols) matrix whose transpose, in C
    order, is the weight's bytes (`memgraph.nodes.DiskPlace`)."""

    path: str
    file_nbytes: int
    offset: int
    head: int = 0
    head_sha256: str = ""
    transposed: tuple[int, int] | None = None


@dataclass
class Occupancy:
    """One stay of storage `storage` (`nbytes`) in the host arena: from before original node `begin`
    (a read there) or at it (an offload that fills it) to after node `end` (its release;
    None: kept to the end of the run). `uses` are the original nodes reading or filling
    it; `read`: it begins with a read from disk; `write`: its offload is written to the
    spill file; `slot` is set by placement."""

    storage: int
    nbytes: int
    begin: int
    end: int | None
    uses: list[int]
    read: bool
    write: bool = False
    slot: HostRegion | None = None
    wanted: int = -1  # a streamed read: where it begins when not prefetched (its reload)

    @property
    def last(self) -> float:
        return float("inf") if self.end is None else self.end


@dataclass
class _Storage:
    """What the pass knows of one storage the tier holds."""

    id: int
    nbytes: int
    kind: str  # "weight" (from a checkpoint), "offload" or "assembly"
    fills: list[int] = field(default_factory=list)  # offloads into it, in order
    reads: list[int] = field(default_factory=list)  # reloads from it, in order
    outputs: list[int] = field(default_factory=list)  # output nodes returning it from the host

    @property
    def pinned(self) -> bool:
        """Whether it stays in host memory to the end: the run returns it from there."""
        return bool(self.outputs)

    @property
    def first(self) -> int:
        return min(self.fills + self.reads + self.outputs)

    @property
    def rank(self) -> tuple[float, int, int]:
        """How streaming it first is ranked: the fewest disk bytes saved per byte held, the
        larger first among equals (what frees most), then by id (deterministic)."""
        return (self.saved_per_byte(), -self.nbytes, self.id)

    def saved_per_byte(self) -> float:
        """Disk bytes saved by keeping it, per byte kept per node: what demotion ranks."""
        reads = len(self.reads) - 1 if self.kind == "weight" else len(self.reads) + 1
        span = max(1, max(self.reads + self.fills) - self.first)
        return reads / span


def tier_storages(mg: MemGraph, weights: Mapping[str, Any]) -> dict[int, str]:
    """The storages of `mg` a host tier holds, with what each is: "weight" (an input named
    in `weights`, read from its checkpoint), "offload", or "assembly"."""
    held: dict[int, str] = {}
    for node in mg.nodes:
        if node.kind is NodeKind.INPUT and node.storage is not None and node.name in weights:
            held[node.storage] = "weight"
    for sid, storage in mg.storages.items():
        if storage.kind in ("offload", "assembly"):
            held[sid] = storage.kind
    return held


def place_host(
    mg: MemGraph,
    host_budget: int | str,
    weights: Mapping[str, CheckpointPlace] | None = None,
    spill: bool = True,
    depth: int = 2,
) -> MemGraph:
    """`mg` with its host memory planned within `host_budget` (bytes, a size string, or a
    percentage of what the tier holds: `"50%"` is half the bytes of every storage it would
    keep, in their slots – `host_reference`; see the module docstring): weights named in
    `weights` read from their checkpoint files, offloaded tensors kept in host memory or,
    with `spill`, written to a spill file; `depth` streamed reads are in flight ahead of
    the reloads at most.

    Raises `HostBudgetPlanError` when the host budget cannot hold what must be in host
    memory at once (the message says how much), or when something must be spilled and
    `spill` is False.
    """
    if mg.tier is not None:
        raise PlanError("the plan already has a host tier; plan the host of a device plan")
    if not isinstance(depth, int) or depth < 1:
        raise PlanError(f"depth must be an integer >= 1, got {depth!r}")
    weights = dict(weights or {})
    storages = _storages(mg, weights)
    budget = read_host_budget(host_budget, storages)
    files, places = _checkpoint_table(mg, storages, weights)
    streamed = _first_guess(storages, budget, depth, len(mg.nodes))
    while True:
        occupancies = _occupancies(mg, storages, streamed, depth)
        blocked = _place(occupancies, budget)
        if blocked is None:
            break
        victims = _victims(blocked, occupancies, storages, streamed, budget)
        if not victims:
            raise _too_small(blocked, occupancies, budget, storages)
        streamed.update(victims)
    spilled = sorted(s for s in streamed if storages[s].kind == "offload")
    if spilled and not spill:
        total = sum(storages[s].nbytes for s in spilled)
        raise HostBudgetPlanError(
            f"host budget {format_bytes(budget)} cannot keep {len(spilled)} offloaded "
            f"tensor(s) ({format_bytes(total)}) in host memory: give a spill folder, or raise "
            f"the host budget"
        )
    if spilled:
        offset = 0
        for sid in spilled:
            places[sid] = DiskPlace(len(files), offset)
            offset += _aligned(storages[sid].nbytes)
        files.append(DiskFile("spill", offset))
    info = dict(mg.info)
    info["tier"] = {
        "depth": depth,
        "kept": len(storages) - len(streamed),
        "streamed_weights": sum(1 for s in streamed if storages[s].kind == "weight"),
        "spilled": len(spilled),
    }
    table = {
        sid: dataclasses.replace(entry, disk=places.get(sid))
        for sid, entry in mg.storages.items()
    }
    nodes = _rewrite(mg, occupancies, places, files)
    tier = HostTier(budget, tuple(files))
    return MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, info, table, tier)


# -- what the tier holds --------------------------------------------------------------

_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def host_reference(mg: MemGraph, weights: Mapping[str, Any] | None = None) -> int:
    """What a host budget's percentage is of: the bytes of every storage the tier would
    hold (`weights` read from a checkpoint, offloaded tensors, outputs assembled on the
    host), each in its page-aligned slot – at "100%" every one is kept, none streamed."""
    return sum(_aligned(s.nbytes) for s in _storages(mg, dict(weights or {})).values())


def read_host_budget(host_budget: int | str, storages: Mapping[int, _Storage]) -> int:
    """`host_budget` in bytes: a percentage of the storages' slots, or bytes."""
    match = _PERCENT.match(host_budget) if isinstance(host_budget, str) else None
    if match is None:
        return parse_bytes(host_budget, "host budget")
    reference = sum(_aligned(s.nbytes) for s in storages.values())
    return max(1, int(reference * float(match.group(1)) / 100))


def _storages(mg: MemGraph, weights: Mapping[str, CheckpointPlace]) -> dict[int, _Storage]:
    """Each storage the tier holds, with the nodes that fill, read and return it."""
    names = {n.name for n in mg.nodes if n.kind is NodeKind.INPUT}
    unknown = sorted(set(weights) - names)
    if unknown:
        raise PlanError(
            f"weights {unknown[:5]} are not inputs of the plan (inputs: {sorted(names)[:10]})"
        )
    for node in mg.nodes:
        if node.kind is NodeKind.INPUT and node.name in weights and node.storage is None:
            raise PlanError(
                f"input {node.name!r} is put on the device from the caller's array (n{node.id}),"
                f" not reloaded from host memory: it cannot be read from a checkpoint"
            )
    held = tier_storages(mg, weights)
    table = {sid: _Storage(sid, mg.storages[sid].nbytes, kind) for sid, kind in held.items()}
    for node in mg.nodes:
        entry = table.get(node.storage) if node.storage is not None else None
        if entry is None:
            continue
        if node.kind is NodeKind.OFFLOAD:
            entry.fills.append(node.id)
        elif node.kind is NodeKind.RELOAD:
            entry.reads.append(node.id)
        elif node.kind is NodeKind.OUTPUT:  # kept to the end (a weight: read, then kept)
            entry.outputs.append(node.id)
    for sid, entry in list(table.items()):
        if not (entry.fills or entry.reads or entry.outputs):
            del table[sid]  # never used: nothing to place
        elif entry.kind == "offload" and not entry.fills:
            raise PlanError(f"host#{sid} is an offload storage that nothing offloads into")
    return table


def _checkpoint_table(
    mg: MemGraph, storages: Mapping[int, _Storage], weights: Mapping[str, CheckpointPlace]
) -> tuple[list[DiskFile], dict[int, DiskPlace]]:
    """The checkpoint files (one per path, in order of first use) and each weight's place."""
    files: list[DiskFile] = []
    index: dict[str, int] = {}
    places: dict[int, DiskPlace] = {}
    for node in mg.nodes:
        if node.kind is not NodeKind.INPUT or node.name not in weights:
            continue
        place = weights[node.name]
        entry = mg.storages[node.storage]
        if place.offset < 0 or place.offset + entry.nbytes > place.file_nbytes:
            raise PlanError(
                f"weight {node.name!r} ({entry.nbytes} bytes) at offset {place.offset} is not "
                f"inside {place.path!r} ({place.file_nbytes} bytes)"
            )
        transposed = None
        if place.transposed is not None:
            transposed = _transposed(node.name, place.transposed, entry.nbytes, entry.dtype)
        file = DiskFile("checkpoint", place.file_nbytes, place.path, place.head, place.head_sha256)
        if place.path not in index:
            index[place.path] = len(files)
            files.append(file)
        elif files[index[place.path]] != file:
            raise PlanError(f"{place.path!r} is given two sizes or headers")
        places[node.storage] = DiskPlace(  # used or not
            index[place.path], place.offset, transposed
        )
    return files, places


def _transposed(name: str, transposed: Any, nbytes: int, dtype: str) -> tuple[int, int]:
    """`transposed` as a (rows, cols) tuple; `PlanError` unless both are integers >= 1 and
    the matrix is exactly `nbytes` bytes of `dtype` (the whole weight, nothing more)."""
    if (
        not isinstance(transposed, (tuple, list))
        or len(transposed) != 2
        or not all(type(n) is int for n in transposed)
    ):
        raise PlanError(f"weight {name!r}: transposed must be (rows, cols), got {transposed!r}")
    rows, cols = transposed
    itemsize = dtypes.itemsize(dtype)
    if rows < 1 or cols < 1 or rows * cols * itemsize != nbytes:
        raise PlanError(
            f"weight {name!r} is {nbytes} bytes of {dtype}, but its transposed ({rows}, "
            f"{cols}) matrix is {rows * cols * itemsize} bytes: rows and cols must be >= 1 "
            f"and the matrix the whole weight"
        )
    return rows, cols


# -- occupancies and their placement ------------------------------------------------


def _occupancies(
    mg: MemGraph, storages: Mapping[int, _Storage], streamed: set[int], depth: int
) -> list[Occupancy]:
    """Every occupancy of the host arena, for the storages in `streamed` one per run of
    reloads (prefetched `depth` runs ahead), for the others one over all their uses."""
    result: list[Occupancy] = []
    stream_reads: list[tuple[int, int]] = []  # (reload node, storage) of streamed storages
    for sid, entry in storages.items():
        nbytes = entry.nbytes
        if sid not in streamed:
            uses = sorted(entry.fills + entry.reads)
            end = None if entry.pinned else max(uses)
            if entry.pinned:
                uses += entry.outputs
            read = entry.kind == "weight"
            result.append(Occupancy(sid, nbytes, entry.first, end, uses, read=read))
            continue
        if entry.kind == "offload":
            fill = entry.fills[0]
            result.append(
                Occupancy(sid, nbytes, fill, fill, list(entry.fills), read=False, write=True)
            )
        stream_reads.extend((reload, sid) for reload in entry.reads)
    stream_reads.sort()
    runs: list[list[tuple[int, int]]] = []  # reloads of one storage with no other between
    for reload, sid in stream_reads:
        if runs and runs[-1][-1][1] == sid:
            runs[-1].append((reload, sid))
        else:
            runs.append([(reload, sid)])
    for k, run in enumerate(runs):
        first, sid = run[0]
        earliest = runs[k - depth + 1][0][0] if k >= depth - 1 else 0
        entry = storages[sid]
        if entry.kind == "offload":
            earliest = max(earliest, entry.fills[0] + 1)  # after its write
        begin = min(first, earliest)
        uses = [reload for reload, _ in run]
        result.append(
            Occupancy(sid, entry.nbytes, begin, uses[-1], uses, read=True, wanted=first)
        )
    result.sort(key=lambda o: (o.begin, o.last, o.storage))
    return result


def _place(occupancies: Sequence[Occupancy], budget: int) -> Occupancy | None:
    """Give each occupancy a slot, first fit in order of beginning; the first one that
    finds no room even without its prefetch is returned (None: all placed)."""
    pending = [(o.begin, o.last, o.storage, k, o) for k, o in enumerate(occupancies)]
    heapq.heapify(pending)
    ending: list[tuple[float, int, Occupancy]] = []  # live occupancies by their last node
    free = _FreeList(budget)
    for occupancy in occupancies:
        occupancy.slot = None
    while pending:
        begin, _, _, k, occupancy = heapq.heappop(pending)
        while ending and ending[0][0] < begin:
            _, _, done = heapq.heappop(ending)
            free.give(done.slot.offset, done.slot.size)
        size = _aligned(occupancy.nbytes)
        offset = free.take(size, top=occupancy.end is None)
        if offset is None:
            if occupancy.read and occupancy.wanted > occupancy.begin:
                occupancy.begin = occupancy.wanted  # give up the prefetch: place it later
                heapq.heappush(pending, (occupancy.begin, occupancy.last, occupancy.storage, k,
                                         occupancy))  # fmt: skip
                continue
            return occupancy
        occupancy.slot = HostRegion(offset, size)
        heapq.heappush(ending, (occupancy.last, k, occupancy))
    return None


class _FreeList:
    """The free bytes of the host arena as sorted, coalesced gaps `[start, end)`."""

    def __init__(self, budget: int):
        self.starts = [0]
        self.ends = [budget]

    def take(self, size: int, top: bool = False) -> int | None:
        """The lowest offset of a gap of at least `size` bytes, now taken (None: no gap);
        with `top`, the highest bytes of the highest such gap: what stays to the end of the
        run goes to the top of the arena, so it does not split the free bytes below."""
        order = range(len(self.starts) - 1, -1, -1) if top else range(len(self.starts))
        for k in order:
            start, end = self.starts[k], self.ends[k]
            if end - start < size:
                continue
            if end - start == size:
                del self.starts[k], self.ends[k]
                return start
            if top:
                self.ends[k] = end - size
                return end - size
            self.starts[k] = start + size
            return start
        return None

    def give(self, offset: int, size: int) -> None:
        """Bytes `[offset, offset + size)` are free again (merged with the gaps beside)."""
        end = offset + size
        k = bisect.bisect_left(self.starts, offset)
        if k > 0 and self.ends[k - 1] == offset:  # joins the gap before
            k -= 1
            self.ends[k] = end
        else:
            self.starts.insert(k, offset)
            self.ends.insert(k, end)
        if k + 1 < len(self.starts) and self.starts[k + 1] == self.ends[k]:  # and the one after
            self.ends[k] = self.ends[k + 1]
            del self.starts[k + 1], self.ends[k + 1]


def _first_guess(
    storages: Mapping[int, _Storage], budget: int, depth: int, count: int
) -> set[int]:
    """The storages to stream before placing anything: where the kept storages alive at
    once would exceed the budget (less room for `depth` reads of the largest in flight),
    those that save the fewest disk bytes per byte held (`_cheapest`) – so
    that placement, which finds the rest, starts near the answer (every round of it
    places the whole plan again)."""
    movable = [e for e in storages.values() if not e.pinned]
    largest = max((_aligned(e.nbytes) for e in movable), default=0)
    target = budget - min(depth * largest, budget // 2)
    spans = {}
    curve = np.zeros(count + 1, dtype=np.int64)
    for entry in storages.values():
        last = count - 1 if entry.pinned else max(entry.fills + entry.reads)
        spans[entry.id] = (entry.first, last)
        curve[entry.first] += _aligned(entry.nbytes)
        curve[last + 1] -= _aligned(entry.nbytes)
    curve = np.cumsum(curve)
    if int(curve.max()) <= budget:
        return set()  # all kept fit: nothing is streamed, no room needed for reads
    kept = {e.id for e in movable}
    streamed: set[int] = set()
    while kept:
        at = int(np.argmax(curve))
        excess = int(curve[at]) - target
        alive = [s for s in kept if spans[s][0] <= at <= spans[s][1]]
        if excess <= 0 or not alive:
            break
        for sid in _cheapest(alive, storages, excess):
            first, last = spans[sid]
            curve[first : last + 1] -= _aligned(storages[sid].nbytes)
            kept.discard(sid)
            streamed.add(sid)
    return streamed


def _cheapest(
    candidates: Iterable[int], storages: Mapping[int, _Storage], lacking: int
) -> list[int]:
    """Of `candidates`, those that save the fewest disk bytes per byte held first (the
    larger first among equals), as many as free `lacking` bytes – at least one."""
    chosen: list[int] = []
    for sid in sorted(candidates, key=lambda s: storages[s].rank):
        chosen.append(sid)
        lacking -= _aligned(storages[sid].nbytes)
        if lacking <= 0:
            break
    return chosen


def _victims(
    blocked: Occupancy,
    occupancies: Sequence[Occupancy],
    storages: Mapping[int, _Storage],
    streamed: set[int],
    budget: int,
) -> list[int]:
    """Kept storages alive where `blocked` begins to stream from now on: those that save the
    fewest disk bytes per byte held first, as many as free the bytes `blocked` lacks (at
    least one; none: none can be streamed). Several at once, so that a budget far below
    what is kept is planned in a few rounds, not one round per storage."""
    alive = [
        o
        for o in occupancies
        if o.slot is not None and o.begin <= blocked.begin <= o.last
    ]
    lacking = _aligned(blocked.nbytes) - (budget - sum(o.slot.size for o in alive))
    candidates = {
        o.storage for o in alive if o.storage not in streamed and not storages[o.storage].pinned
    }
    if blocked.storage not in streamed and not storages[blocked.storage].pinned:
        candidates.add(blocked.storage)
    return _cheapest(candidates, storages, lacking) if candidates else []


def _too_small(
    blocked: Occupancy,
    occupancies: Sequence[Occupancy],
    budget: int,
    storages: Mapping[int, _Storage],
) -> HostBudgetPlanError:
    """The error for a host budget that cannot hold what must be there at once."""
    alive = [o for o in occupancies if o.slot is not None and o.begin <= blocked.begin <= o.last]
    need = sum(_aligned(o.nbytes) for o in alive) + _aligned(blocked.nbytes)
    why = (
        "outputs assembled on the host and the slots of copies in flight cannot go to disk"
        if need > budget
        else f"they fit in bytes, but not in slots of whole {SLOT_ALIGNMENT // 1024} KiB "
        f"pages placed first fit: the free bytes are split"
    )
    return HostBudgetPlanError(
        f"host budget {format_bytes(budget)} is too small: at node n{blocked.begin}, "
        f"host#{blocked.storage} ({format_bytes(storages[blocked.storage].nbytes)}) must be "
        f"in host memory with {len(alive)} other storage(s), {format_bytes(need)} in all "
        f"({why})"
    )


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


# -- the new nodes ----------------------------------------------------------------------


def _rewrite(
    mg: MemGraph,
    occupancies: Sequence[Occupancy],
    places: Mapping[int, DiskPlace],
    files: Sequence[DiskFile],
) -> list[MemNode]:
    """The plan's nodes with the tier's reads, writes and releases inserted, slots on the
    copies of the storages it holds, and the dependencies slot reuse needs."""
    before: dict[int, list[Occupancy]] = {}  # reads inserted before an original node
    after: dict[int, list[tuple[str, Occupancy]]] = {}  # writes, releases after one
    occupancy_of: dict[int, Occupancy] = {}  # an original node -> the occupancy it uses
    for o in occupancies:
        if o.read:
            before.setdefault(o.begin, []).append(o)
        if o.write:
            after.setdefault(o.begin, []).append(("write", o))
        if o.end is not None:
            after.setdefault(o.end, []).append(("release", o))
        for use in o.uses:  # with the output node of one kept to the end
            occupancy_of[use] = o
    for items in after.values():
        items.sort(key=lambda item: item[0] != "write")  # writes before releases
    nodes: list[MemNode] = []
    new_id: dict[int, int] = {}
    began: dict[int, int] = {}  # id(occupancy) -> the new node that filled its slot
    users: dict[int, list[int]] = {}  # id(occupancy) -> new nodes using it
    written: dict[int, int] = {}  # storage -> its write node
    released: list[tuple[HostRegion, int]] = []  # freed slots and their release nodes

    def add(kind: NodeKind, deps: Sequence[int], **fields: Any) -> int:
        node_id = len(nodes)
        nodes.append(MemNode(node_id, kind, tuple(sorted(set(deps))), **fields))
        return node_id

    def reuse(slot: HostRegion) -> list[int]:
        """The releases of earlier occupancies of `slot`'s bytes (dropping those it covers)."""
        deps = [rel for region, rel in released if region.overlaps(slot)]
        released[:] = [
            (region, rel)
            for region, rel in released
            if not (slot.offset <= region.offset and region.end <= slot.end)
        ]
        return deps

    tensor_of = {sid: s.tensor for sid, s in mg.storages.items()}
    for node in mg.nodes:
        for o in before.get(node.id, ()):
            deps = reuse(o.slot)
            if o.storage in written:
                deps.append(written[o.storage])
            read = add(
                NodeKind.READ, deps, tensor=tensor_of[o.storage], storage=o.storage, slot=o.slot
            )
            began[id(o)] = read
            users[id(o)] = [read]
        o = occupancy_of.get(node.id)
        deps = [new_id[d] for d in node.deps]
        if o is not None:
            if id(o) not in began:  # an offload that fills its slot first
                deps += reuse(o.slot)
            else:
                deps.append(began[id(o)])
            new = len(nodes)
            nodes.append(_renumbered(node, new, deps, o.slot))
            began.setdefault(id(o), new)
            users.setdefault(id(o), []).append(new)
        else:
            new = len(nodes)
            nodes.append(_renumbered(node, new, deps, node.slot))
        new_id[node.id] = new
        for what, o in after.get(node.id, ()):
            tensor = tensor_of[o.storage]
            if what == "write":
                written[o.storage] = add(
                    NodeKind.WRITE, [began[id(o)]], tensor=tensor, storage=o.storage, slot=o.slot
                )
                users[id(o)].append(written[o.storage])
            else:
                release = add(
                    NodeKind.RELEASE, users[id(o)], tensor=tensor, storage=o.storage, slot=o.slot
                )
                released.append((o.slot, release))
    return nodes


def _renumbered(node: MemNode, node_id: int, deps: list[int], slot: HostRegion | None) -> MemNode:
    """`node` as node `node_id` of the new plan, waiting for `deps`, naming `slot` (made
    field by field: a plan has millions of nodes, and `dataclasses.replace` is slow)."""
    return MemNode(
        node_id,
        node.kind,
        tuple(sorted(set(deps))) if len(deps) > 1 else tuple(deps),
        node.tensor,
        node.region,
        node.storage,
        node.reads,
        node.name,
        node.into,
        node.box,
        node.workspace,
        node.recompute,
        node.link,
        slot,
    )
