"""Tier plans made by hand for the simulator's tests: the device plan of a tiny program
(`memgraph.plan`), rewritten with a host tier (reads, writes, releases, host slots) as
the tier spec says one is made."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import einpage as ep
import memgraph
from memgraph.graph import MemGraph
from memgraph.nodes import DiskFile, DiskPlace, HostRegion, HostTier, MemNode, NodeKind

KIB = 1024
CHECKPOINT = DiskFile("checkpoint", KIB, "/checkpoints/w.bin")
SPILL = DiskFile("spill", KIB)
SLOT_W = HostRegion(0, KIB)  # the weight w, read from the checkpoint
SLOT_H = HostRegion(KIB, KIB)  # %2 = exp(w): offloaded there (and maybe spilled)
SLOT_X = HostRegion(2 * KIB, KIB)  # x, when it too is read from a checkpoint
READ, WRITE, RELEASE = NodeKind.READ, NodeKind.WRITE, NodeKind.RELEASE


def program() -> ep.Program:
    """%0 w (a weight), %1 x (host), %2 exp(w), %3 exp(x), %4 %3 * x, %5 y = %2 * %4."""
    prog = ep.Program("tiny")
    w = prog.input("w", (256,), role="weight")
    x = prog.input("x", (256,), location="host")
    h = ep.exp(w)
    k = ep.exp(x) * x
    prog.output(h * k, "y")
    return prog


def device_plan() -> MemGraph:
    """The device plan in 3 KiB (no tier): %2 is offloaded (n11) while %3 and %4 are made,
    and reloaded (n18); the node ids the tier plans name are checked here."""
    mg = memgraph.plan(program().build(), 3 * KIB)
    kinds = {3: ("reload", 0), 8: ("reload", 1), 11: ("offload", 2), 18: ("reload", 2)}
    assert len(mg) == 24 and mg.tier is None
    for i, (kind, tensor) in kinds.items():
        assert (mg[i].kind.value, mg[i].tensor) == (kind, tensor), mg[i].line()
    return mg


@dataclass(frozen=True)
class New:
    """A node to insert: `name` (for later deps), its kind, host storage and slot, and its
    deps (ids of the device plan's nodes, or names of nodes inserted before it)."""

    name: str
    kind: NodeKind
    storage: int
    slot: HostRegion
    deps: Sequence[int | str] = ()


@dataclass
class Edits:
    """How a device plan becomes a tier plan: nodes inserted (`before[i]`: ahead of node
    i), slots set on copies, deps added, storages' places on disk."""

    before: dict[int, list[New]] = field(default_factory=dict)
    slots: dict[int, HostRegion] = field(default_factory=dict)
    more_deps: dict[int, list[int | str]] = field(default_factory=dict)
    disk: dict[int, DiskPlace] = field(default_factory=dict)

    def insert(self, at: int, *nodes: New) -> None:
        self.before.setdefault(at, []).extend(nodes)

    def copy_in(self, node: int, slot: HostRegion, *deps: int | str) -> None:
        self.slots[node] = slot
        self.more_deps.setdefault(node, []).extend(deps)


def rewrite(mg: MemGraph, edits: Edits, tier: HostTier) -> MemGraph:
    """`mg` with `edits` made and `tier` set; ids renumbered, deps mapped."""
    ids: dict[int | str, int] = {}
    nodes: list[MemNode] = []

    def add(node: MemNode, key: int | str, deps: Sequence[int | str]) -> None:
        ids[key] = len(nodes)
        mapped = tuple(sorted({ids[d] for d in deps}))
        nodes.append(dataclasses.replace(node, id=len(nodes), deps=mapped))

    for i in range(len(mg) + 1):
        for new in edits.before.get(i, ()):
            tensor = mg.storages[new.storage].tensor
            node = MemNode(0, new.kind, tensor=tensor, storage=new.storage, slot=new.slot)
            add(node, new.name, new.deps)
        if i < len(mg):
            node = mg[i]
            if i in edits.slots:
                node = dataclasses.replace(node, slot=edits.slots[i])
            add(node, i, (*node.deps, *edits.more_deps.get(i, ())))
    storages = {
        sid: dataclasses.replace(s, disk=edits.disk.get(sid, s.disk))
        for sid, s in mg.storages.items()
    }
    return MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, mg.info, storages, tier)


def read_w(edits: Edits) -> None:
    """w read from the checkpoint (file 0, offset 0) before its reload (n3), released after."""
    edits.insert(3, New("read w", READ, 0, SLOT_W, [0]))
    edits.copy_in(3, SLOT_W, "read w")
    edits.insert(4, New("release w", RELEASE, 0, SLOT_W, [3]))
    edits.disk[0] = DiskPlace(0, 0)


def keep_h(edits: Edits) -> None:
    """%2 offloaded into its slot (n11), kept there until its reload (n18), released."""
    edits.copy_in(11, SLOT_H)
    edits.copy_in(18, SLOT_H)
    edits.insert(19, New("release h", RELEASE, 2, SLOT_H, [18]))


def spill_h(edits: Edits, file: int) -> None:
    """%2 offloaded into its slot (n11), written to the spill file (`file`, offset 0) and
    released; read back into the slot before its reload (n18), released after it."""
    edits.copy_in(11, SLOT_H)
    edits.insert(
        12,
        New("write h", WRITE, 2, SLOT_H, [11]),
        New("release h", RELEASE, 2, SLOT_H, [11, "write h"]),
    )
    edits.insert(17, New("read h", READ, 2, SLOT_H, ["write h", "release h"]))
    edits.copy_in(18, SLOT_H, "read h")
    edits.insert(19, New("release h again", RELEASE, 2, SLOT_H, [18]))
    edits.disk[2] = DiskPlace(file, 0)


def checkpoint_plan() -> MemGraph:
    """w read from its checkpoint before its reload; %2 kept in host memory."""
    edits = Edits()
    read_w(edits)
    keep_h(edits)
    return rewrite(device_plan(), edits, HostTier(2 * KIB, (CHECKPOINT,)))


def spill_plan() -> MemGraph:
    """%2 through the spill file; w is the caller's array (no tier storage)."""
    edits = Edits()
    spill_h(edits, 0)
    return rewrite(device_plan(), edits, HostTier(2 * KIB, (SPILL,)))


def both_plan() -> MemGraph:
    """Both: w from the checkpoint (file 0), %2 through the spill file (file 1)."""
    edits = Edits()
    read_w(edits)
    spill_h(edits, 1)
    return rewrite(device_plan(), edits, HostTier(2 * KIB, (CHECKPOINT, SPILL)))


def two_reads_plan() -> MemGraph:
    """w and x both read from one checkpoint (x at offset 1 KiB), x's read first in node
    order: both are ready at 0, and the disk serves them in node order."""
    edits = Edits()
    edits.insert(3, New("read x", READ, 1, SLOT_X, [1]))
    read_w(edits)
    edits.copy_in(8, SLOT_X, "read x")
    edits.insert(9, New("release x", RELEASE, 1, SLOT_X, [8]))
    edits.disk[1] = DiskPlace(0, KIB)
    keep_h(edits)
    checkpoint = DiskFile("checkpoint", 2 * KIB, "/checkpoints/wx.bin")
    return rewrite(device_plan(), edits, HostTier(3 * KIB, (checkpoint,)))
