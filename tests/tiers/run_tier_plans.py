"""Small plans with a host tier, made by hand for the runtime's tests.

`tier_plan(mg, checkpoint)` rewrites a plan with host storages (`tests.plans.reference_plan`)
into one with a host tier, as obviously as it can: each weight in `checkpoint` is read
from its safetensors file into a slot just before each reload and released just after;
each offloaded tensor that is no output is offloaded into a slot, written to the spill
file and released, then read back into a slot before each reload and released after it;
outputs offloaded to the host keep a slot of their own to the end. Slots come from a pool
of `slots` slots used in turn; a read or an offload into a slot waits for the slot's last
release. `release_after_read` makes the mutant whose release does not wait for its
reload (only for the read).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from memgraph import MemGraph
from memgraph.nodes import DiskFile, DiskPlace, HostRegion, HostTier, MemNode, NodeKind

ALIGN = 256


def aligned(n: int) -> int:
    return -(-max(n, 1) // ALIGN) * ALIGN


def write_checkpoint(path: Path, arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """Save `arrays` as a safetensors file; return each tensor's byte offset in the file."""
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path))
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    return {k: 8 + size + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


@dataclasses.dataclass
class _Slot:
    region: HostRegion
    last_release: int | None = None


def tier_plan(
    mg: MemGraph,
    checkpoint: Path | None = None,
    offsets: dict[str, int] | None = None,
    spill: bool = True,
    slots: int = 2,
    release_after_read: bool = False,
    budget_extra: int = 0,
) -> MemGraph:
    """`mg` with a host tier (see the module docstring)."""
    offsets = offsets or {}
    storages = dict(mg.storages)
    outputs = {n.storage for n in mg.nodes if n.kind is NodeKind.OUTPUT and n.storage is not None}
    weights = {
        n.storage: n.name
        for n in mg.nodes
        if n.kind is NodeKind.INPUT and n.storage is not None and n.name in offsets
    }
    spilled = [
        sid for sid, s in storages.items() if s.kind == "offload" and sid not in outputs and spill
    ]
    pinned_ids = [sid for sid, s in storages.items() if s.kind in ("offload", "assembly")]
    pinned_ids = [sid for sid in pinned_ids if sid not in spilled]
    files: list[DiskFile] = []
    if weights:
        files.append(DiskFile("checkpoint", checkpoint.stat().st_size, str(checkpoint)))
        for sid, name in weights.items():
            storages[sid] = dataclasses.replace(storages[sid], disk=DiskPlace(0, offsets[name]))
    if spilled:
        top = 0
        for sid in spilled:
            storages[sid] = dataclasses.replace(storages[sid], disk=DiskPlace(len(files), top))
            top += aligned(storages[sid].nbytes)
        files.append(DiskFile("spill", top))
    pooled = [*weights, *spilled]
    size = max((aligned(storages[s].nbytes) for s in pooled), default=ALIGN)
    pool = [_Slot(HostRegion(k * size, size)) for k in range(slots if pooled else 0)]
    top = len(pool) * size
    pinned: dict[int, HostRegion] = {}
    for sid in pinned_ids:
        pinned[sid] = HostRegion(top, aligned(storages[sid].nbytes))
        top += pinned[sid].size

    out: list[MemNode] = []
    new: dict[int, int] = {}
    written: dict[int, int] = {}
    turn = [0]

    def emit(node: MemNode, deps) -> int:
        nid = len(out)
        out.append(dataclasses.replace(node, id=nid, deps=tuple(sorted(set(deps)))))
        return nid

    def take() -> _Slot:
        slot = pool[turn[0] % len(pool)]
        turn[0] += 1
        return slot

    def after(slot: _Slot) -> list[int]:
        return [] if slot.last_release is None else [slot.last_release]

    for node in mg.nodes:
        deps = [new[d] for d in node.deps]
        sid = node.storage
        if node.kind is NodeKind.OFFLOAD and sid in pinned:
            new[node.id] = emit(dataclasses.replace(node, slot=pinned[sid]), deps)
        elif node.kind is NodeKind.OFFLOAD and sid in spilled:
            slot = take()
            filled = dataclasses.replace(node, slot=slot.region)
            off = new[node.id] = emit(filled, deps + after(slot))
            tensor = node.tensor
            write = emit(
                MemNode(0, NodeKind.WRITE, (), tensor, storage=sid, slot=slot.region), [off]
            )
            written[sid] = write
            slot.last_release = emit(
                MemNode(0, NodeKind.RELEASE, (), tensor, storage=sid, slot=slot.region), [write]
            )
        elif node.kind is NodeKind.RELOAD and sid in pinned:
            new[node.id] = emit(dataclasses.replace(node, slot=pinned[sid]), deps)
        elif node.kind is NodeKind.RELOAD and (sid in weights or sid in spilled):
            slot = take()
            held = storages[sid].tensor
            source = [written[sid]] if sid in spilled else []
            read = emit(
                MemNode(0, NodeKind.READ, (), held, storage=sid, slot=slot.region),
                deps + source + after(slot),
            )
            reload = new[node.id] = emit(dataclasses.replace(node, slot=slot.region), deps + [read])
            slot.last_release = emit(
                MemNode(0, NodeKind.RELEASE, (), held, storage=sid, slot=slot.region),
                [read] if release_after_read else [reload],
            )
        elif node.kind is NodeKind.OUTPUT and sid in pinned:
            new[node.id] = emit(dataclasses.replace(node, slot=pinned[sid]), deps)
        else:
            new[node.id] = emit(node, deps)
    tier = HostTier(max(top, ALIGN) + budget_extra, tuple(files))
    return MemGraph(mg.taskgraph, tuple(out), mg.budget, mg.alignment, {}, storages, tier)
