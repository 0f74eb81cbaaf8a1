"""The verifier's host-tier rules (`memgraph.verify_tiers`): tier plans made by hand from
device plans pass, and a mutant of each rule is refused, naming the node and the rule.

The hand-made plans: a weight read from a checkpoint into a slot and released around its
reload; an offloaded tensor spilled (offload -> write -> release) and read back (read ->
reload -> release), in the same slot; an output assembled on the host in its slot, spilled
and read back half-way. The oracle watch (`conftest.py`) judges each plan too, so the
independent oracle's rule P6 (`tests/oracle.py`) must name the same node.

Then plans of the pass (`memgraph.tiers.place_host`), random programs at several host
budgets: they verify, and their mutants – a dependency the tier needs dropped, a slot
shifted, an occupancy moved onto a live one – are refused where a walk written here (not
the verifier's code) says the violation is.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import oracle
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from plans import hand_assembled
from strategies import einsum_programs

import einpage as ep
import memgraph
from einpage.errors import HostBudgetPlanError, VerificationError
from einpage.models import llama
from einpage.weight_files import save_weights
from memgraph import MemGraph, NodeKind, plan, verify
from memgraph.nodes import DiskFile, DiskPlace, HostRegion, HostStorage, HostTier, MemNode
from memgraph.tiers import SLOT_ALIGNMENT, CheckpointPlace, host_reference, place_host
from memgraph.verify_tiers import RULES

SLOT = HostRegion(0, 256)
OTHER = HostRegion(256, 256)
CHECKPOINT = DiskFile("checkpoint", 512, "/models/w.safetensors")
SPILL = DiskFile("spill", 256)


class Draft:
    """A device plan being rewritten by hand: nodes by key (an original node's id, or the
    name of an added one), their deps given as keys; `build` numbers them in order."""

    def __init__(self, mg: MemGraph):
        self.mg = mg
        self.order: list[int | str] = [n.id for n in mg.nodes]
        self.nodes: dict[int | str, MemNode] = {n.id: n for n in mg.nodes}
        self.storages = dict(mg.storages)
        self.index: dict[int | str, int] = {}

    def add(self, key: str, node: MemNode, *, after: int | str) -> None:
        self.order.insert(self.order.index(after) + 1, key)
        self.nodes[key] = node

    def change(self, key: int | str, **fields) -> None:
        self.nodes[key] = dataclasses.replace(self.nodes[key], **fields)

    def wait(self, key: int | str, *deps: int | str) -> None:
        """Node `key` also waits for `deps`."""
        self.change(key, deps=(*self.nodes[key].deps, *deps))

    def drop(self, key: int | str) -> None:
        self.order.remove(key)
        del self.nodes[key]

    def place(self, storage: int, file: int, offset: int) -> None:
        self.storages[storage] = dataclasses.replace(
            self.storages[storage], disk=DiskPlace(file, offset)
        )

    def build(self, tier: HostTier | None) -> MemGraph:
        self.index = {key: i for i, key in enumerate(self.order)}
        nodes = tuple(
            dataclasses.replace(
                self.nodes[key],
                id=i,
                deps=tuple(
                    sorted({self.index[d] for d in self.nodes[key].deps if d in self.index})
                ),
            )
            for i, key in enumerate(self.order)
        )
        mg = self.mg
        return MemGraph(mg.taskgraph, nodes, mg.budget, mg.alignment, {}, self.storages, tier)


def tier_node(kind: NodeKind, storage: HostStorage, slot: HostRegion, *deps) -> MemNode:
    return MemNode(0, kind, tuple(deps), storage.tensor, storage=storage.id, slot=slot)


def first(mg: MemGraph, kind: NodeKind, tensor: int) -> int:
    return next(n.id for n in mg.nodes if n.kind is kind and n.tensor == tensor)


# -- the plans ------------------------------------------------------------------------


def device_plan() -> MemGraph:
    """w (a weight, host#0) reloaded once; %3 offloaded (host#1) and reloaded."""
    prog = ep.Program("tiers")
    w = prog.input("w", (64,), role="weight")
    x = prog.input("x", (64,))
    a = ep.exp(x * w)
    b = ep.exp(a)
    c = ep.exp(b)
    prog.output(b * c + a, "y")
    mg = plan(prog.build(), 768)
    kinds = [(s.kind, s.tensor) for s in mg.storages.values()]
    assert kinds == [("input", 0), ("offload", 3)]
    assert [n.tensor for n in mg.nodes if n.kind is NodeKind.RELOAD] == [0, 3]
    return mg


def spill_draft() -> Draft:
    """The device plan with a host tier of one 256-byte slot: w read from the checkpoint,
    reloaded, released; %3 offloaded, written to the spill file, released, read back,
    reloaded, released. Every occupancy takes the same slot, after the last one's
    release."""
    mg = device_plan()
    d = Draft(mg)
    d.place(0, 0, 128)
    d.place(1, 1, 0)
    w, s3 = d.storages[0], d.storages[1]
    w_reload = first(mg, NodeKind.RELOAD, 0)
    offload = first(mg, NodeKind.OFFLOAD, 3)
    reload = first(mg, NodeKind.RELOAD, 3)
    d.add("read w", tier_node(NodeKind.READ, w, SLOT, 0), after=w_reload - 1)
    d.change(w_reload, slot=SLOT)
    d.wait(w_reload, "read w")
    d.add("release w", tier_node(NodeKind.RELEASE, w, SLOT, w_reload), after=w_reload)
    d.change(offload, slot=SLOT)
    d.wait(offload, "release w")
    d.add("write", tier_node(NodeKind.WRITE, s3, SLOT, offload), after=offload)
    d.add("release", tier_node(NodeKind.RELEASE, s3, SLOT, offload, "write"), after="write")
    d.add("read", tier_node(NodeKind.READ, s3, SLOT, "write", "release"), after=reload - 1)
    d.change(reload, slot=SLOT)
    d.wait(reload, "read")
    d.add("release again", tier_node(NodeKind.RELEASE, s3, SLOT, reload), after=reload)
    return d


def spill_tier(budget: int = 256, files=(CHECKPOINT, SPILL)) -> HostTier:
    return HostTier(budget, tuple(files))


ASSEMBLY_SLOT = HostRegion(0, 768)


def assembly_draft() -> Draft:
    """An output assembled on the host (host#0, three sliced offloads) in its slot: after
    the second box it is written to the spill file, released and read back, then the
    third box and the output name the slot."""
    mg = memgraph_plan_assembled()
    d = Draft(mg)
    d.place(0, 0, 0)
    out = d.storages[0]
    sliced = [n.id for n in mg.nodes if n.kind is NodeKind.OFFLOAD]
    output = next(n.id for n in mg.nodes if n.kind is NodeKind.OUTPUT)
    for node in (*sliced, output):
        d.change(node, slot=ASSEMBLY_SLOT)
    d.add("write", tier_node(NodeKind.WRITE, out, ASSEMBLY_SLOT, *sliced[:2]), after=sliced[1])
    d.add(
        "release",
        tier_node(NodeKind.RELEASE, out, ASSEMBLY_SLOT, *sliced[:2], "write"),
        after="write",
    )
    d.add("read", tier_node(NodeKind.READ, out, ASSEMBLY_SLOT, "write", "release"), after="release")
    d.wait(sliced[2], "read")
    d.wait(output, "read")
    return d


def memgraph_plan_assembled() -> MemGraph:
    mg = plan(hand_assembled(), 4096)
    assert [s.kind for s in mg.storages.values()] == ["assembly"]
    assert sum(n.kind is NodeKind.OFFLOAD for n in mg.nodes) == 3
    return mg


ASSEMBLY_TIER = HostTier(768, (DiskFile("spill", 768),))


# -- plans that pass ----------------------------------------------------------------------


def test_a_weight_from_a_checkpoint_and_a_spilled_tensor_verify():
    d = spill_draft()
    mg = d.build(spill_tier())
    report = verify(mg)
    assert report.host_peak_bytes == mg.stats.host_peak_bytes == 256
    assert report.peak_bytes == mg.stats.peak_bytes
    assert mg.stats.disk_read_count == 2 and mg.stats.disk_write_count == 1
    assert oracle.judge(mg.to_json()).accepted
    again = MemGraph.from_json(mg.to_json())
    assert again.tier == mg.tier and verify(again) == report


def test_slots_apart_need_no_order_between_occupancies():
    """In slots that do not overlap, the spilled tensor's occupancy need not wait for the
    weight's release, which comes last: both are live at once."""
    d = spill_draft()
    offload = first(d.mg, NodeKind.OFFLOAD, 3)
    d.change(offload, deps=tuple(x for x in d.nodes[offload].deps if x != "release w"))
    release_w = d.nodes["release w"]
    d.drop("release w")
    d.add("release w", release_w, after=d.order[-1])
    for key in (
        offload,
        "write",
        "release",
        "read",
        first(d.mg, NodeKind.RELOAD, 3),
        "release again",
    ):
        d.change(key, slot=OTHER)
    mg = d.build(spill_tier(512))
    assert verify(mg).host_peak_bytes == mg.stats.host_peak_bytes == 512
    assert oracle.judge(mg.to_json()).accepted


def test_an_output_assembled_on_the_host_spilled_half_way_verifies():
    mg = assembly_draft().build(ASSEMBLY_TIER)
    assert verify(mg).host_peak_bytes == 768
    assert oracle.judge(mg.to_json()).accepted


def test_a_plan_without_a_tier_still_verifies():
    mg = device_plan()
    assert verify(mg).host_peak_bytes == 0


# -- one mutant per rule -------------------------------------------------------------------


def refused(mg: MemGraph, node: int | None, rule: str) -> VerificationError:
    """`mg` is refused at `node` (None: the plan as a whole) for `rule`, which the message
    states; the oracle refuses it at the same node."""
    with pytest.raises(VerificationError) as caught:
        verify(mg)
    err = caught.value
    assert err.node == node, str(err)
    assert f"[host tier: {RULES[rule]}]" in str(err), str(err)
    if node is not None:
        assert str(err).startswith(f"n{node} (")
    verdict = oracle.judge(mg.to_json())
    assert not verdict.accepted and verdict.node == node and verdict.rule == "P6", verdict
    return err


def spill_mutant(change, budget: int = 256, files=(CHECKPOINT, SPILL)) -> tuple[MemGraph, Draft]:
    d = spill_draft()
    change(d)
    return d.build(spill_tier(budget, files)), d


def test_no_tier_a_slot_or_a_place_on_disk():
    mg = device_plan()
    d = Draft(mg)
    reload = first(mg, NodeKind.RELOAD, 0)
    d.change(reload, slot=SLOT)
    refused(d.build(None), reload, "no tier")
    d = Draft(mg)
    d.place(0, 0, 0)
    mg = d.build(None)
    with pytest.raises(VerificationError, match=r"has a place on disk, but the plan has no host"):
        verify(mg)


def test_a_read_in_a_plan_without_a_tier():
    d = spill_draft()
    d.storages = dict(d.mg.storages)  # no places on disk
    mg = d.build(None)
    with pytest.raises(VerificationError, match="a read node in a plan without a host tier"):
        verify(mg)
    assert not oracle.judge(mg.to_json()).accepted


@pytest.mark.parametrize(
    "storage, file, offset, message",
    [
        (0, 0, 300, "are not inside file#0"),  # 300 + 256 > 512
        (0, 2, 0, "names file#2, but the tier has 2 file"),
        (0, 1, 0, "(input) is in file#1, a spill file"),
        (1, 0, 0, "(offload) is in file#0, a checkpoint file"),
    ],
)
def test_places_on_disk(storage, file, offset, message):
    mg, _ = spill_mutant(lambda d: d.place(storage, file, offset))
    assert message in str(refused(mg, None, "place"))


def transpose(storage: int, rows: int, cols: int):
    """A change to the spill draft: storage `storage`'s place said to be transposed."""

    def change(d: Draft) -> None:
        entry = d.storages[storage]
        place = dataclasses.replace(entry.disk, transposed=(rows, cols))
        d.storages[storage] = dataclasses.replace(entry, disk=place)

    return change


def test_a_transposed_checkpoint_place_of_the_storages_bytes_verifies():
    mg, _ = spill_mutant(transpose(0, 8, 8))  # w: 64 float32, 256 bytes
    verify(mg)
    assert oracle.judge(mg.to_json()).accepted


@pytest.mark.parametrize(
    "storage, rows, cols, message",
    [
        (0, 3, 7, "its transposed (3, 7) matrix is 84 bytes, the storage 256"),
        (0, 16, 8, "its transposed (16, 8) matrix is 512 bytes, the storage 256"),
        (1, 8, 8, "is transposed in a spill file: only a checkpoint holds"),
    ],
)
def test_a_transposed_place_of_other_bytes_or_in_a_spill_file(storage, rows, cols, message):
    mg, _ = spill_mutant(transpose(storage, rows, cols))
    assert message in str(refused(mg, None, "place"))


def test_spill_places_do_not_overlap():
    def change(d: Draft) -> None:
        d.storages[2] = HostStorage(2, (64,), "float32", 256, 5, "offload", DiskPlace(1, 128))

    mg, _ = spill_mutant(change, files=(CHECKPOINT, DiskFile("spill", 512)))
    assert "overlap in file#1" in str(refused(mg, None, "spill overlap"))


def test_a_slot_outside_the_host_arena():
    mg, d = spill_mutant(lambda d: None, budget=255)
    refused(mg, d.index["read w"], "arena")


def test_copies_of_held_storages_name_a_slot_and_others_none():
    reload = first(device_plan(), NodeKind.RELOAD, 0)
    mg, d = spill_mutant(lambda d: d.change(reload, slot=None))
    assert "names no host slot" in str(refused(mg, d.index[reload], "held"))

    def callers(d: Draft) -> None:  # w without a place on disk: the caller's array
        d.storages[0] = dataclasses.replace(d.storages[0], disk=None)
        d.drop("read w")
        d.drop("release w")

    mg, d = spill_mutant(callers)
    assert "caller's input" in str(refused(mg, d.index[reload], "held"))


def test_a_device_output_names_no_slot():
    output = next(n.id for n in device_plan().nodes if n.kind is NodeKind.OUTPUT)
    mg, d = spill_mutant(lambda d: d.change(output, slot=OTHER), budget=512)
    assert "an output on the device" in str(refused(mg, d.index[output], "held"))


def test_a_tier_node_names_its_storage_tensor():
    mg, d = spill_mutant(lambda d: d.change("read w", tensor=2))
    refused(mg, d.index["read w"], "tensor")


def test_a_slot_smaller_than_its_storage():
    small = HostRegion(0, 128)
    reload = first(device_plan(), NodeKind.RELOAD, 0)

    def change(d: Draft) -> None:
        for key in ("read w", reload, "release w"):
            d.change(key, slot=small)

    mg, d = spill_mutant(change)
    refused(mg, d.index["read w"], "size")


def test_a_storage_in_two_slots_at_once():
    """A weight read again, into another slot, while its first occupancy is live (a read
    ahead of the next reload): allowed. Into the same slot: the occupancies overlap."""

    def twice(slot: HostRegion):
        def change(d: Draft) -> None:
            read = tier_node(NodeKind.READ, d.storages[0], slot, 0)
            d.add("read w twice", read, after="read w")

        return change

    mg, d = spill_mutant(twice(OTHER), budget=512)
    assert verify(mg).host_peak_bytes == 512
    assert oracle.judge(mg.to_json()).accepted
    mg, d = spill_mutant(twice(SLOT), budget=512)
    refused(mg, d.index["read w twice"], "overlap")


def test_a_read_without_a_slot():
    """The verifier remembers the field problems of each kind of node by the fields set:
    the slot is one of them (a read without one, after a read with one, is refused)."""
    mg, d = spill_mutant(lambda d: d.change("read", slot=None))
    with pytest.raises(VerificationError, match="has no host slot") as caught:
        verify(mg)
    assert caught.value.node == d.index["read"]


def test_a_copy_names_another_slot_than_its_storage_is_in():
    reload = first(device_plan(), NodeKind.RELOAD, 0)
    mg, d = spill_mutant(lambda d: d.change(reload, slot=OTHER), budget=512)
    refused(mg, d.index[reload], "current")


def test_a_copy_of_a_storage_in_no_slot():
    reload = first(device_plan(), NodeKind.RELOAD, 3)
    mg, d = spill_mutant(lambda d: d.drop("read"))
    assert "now: it is in no slot" in str(refused(mg, d.index[reload], "current"))


def test_overlapping_occupancies_live_at_once():
    offload = first(device_plan(), NodeKind.OFFLOAD, 3)
    mg, d = spill_mutant(lambda d: d.drop("release w"))
    refused(mg, d.index[offload], "overlap")


def test_an_occupancy_begins_after_the_release_of_its_bytes():
    offload = first(device_plan(), NodeKind.OFFLOAD, 3)

    def change(d: Draft) -> None:
        d.change(offload, deps=tuple(x for x in d.nodes[offload].deps if x != "release w"))

    mg, d = spill_mutant(change)
    err = refused(mg, d.index[offload], "reuse")
    assert f"missing dependency on n{d.index['release w']}" in str(err)


def test_a_reload_comes_after_the_read_that_filled_its_slot():
    reload = first(device_plan(), NodeKind.RELOAD, 0)
    mg, d = spill_mutant(lambda d: d.change(reload, deps=(reload - 1, 0)))
    err = refused(mg, d.index[reload], "filled")
    assert f"missing dependency on n{d.index['read w']}" in str(err)


def test_a_write_comes_after_the_offload_that_filled_its_slot():
    mg, d = spill_mutant(lambda d: d.change("write", deps=()))
    refused(mg, d.index["write"], "filled")


def test_a_release_comes_after_every_use():
    mg, d = spill_mutant(lambda d: d.change("release w", deps=("read w",)))
    reload = first(d.mg, NodeKind.RELOAD, 0)
    err = refused(mg, d.index["release w"], "release")
    assert f"missing dependency on n{d.index[reload]}" in str(err)


def test_a_read_from_the_spill_file_comes_after_a_write():
    mg, d = spill_mutant(lambda d: d.drop("write"))
    assert "nothing wrote it yet" in str(refused(mg, d.index["read"], "spilled"))

    def elsewhere(d: Draft) -> None:  # read back into another slot, not waiting for the write
        reload = first(d.mg, NodeKind.RELOAD, 3)
        for key in ("read", reload, "release again"):
            d.change(key, slot=OTHER)
        d.change("read", deps=())

    mg, d = spill_mutant(elsewhere, budget=512)
    err = refused(mg, d.index["read"], "spilled")
    assert f"missing dependency on n{d.index['write']}" in str(err)


def test_a_checkpoint_is_never_written():
    def change(d: Draft) -> None:
        d.add("write w", tier_node(NodeKind.WRITE, d.storages[0], SLOT, "read w"), after="read w")

    mg, d = spill_mutant(change)
    refused(mg, d.index["write w"], "checkpoint")


def test_an_output_on_the_host_keeps_its_slot():
    d = assembly_draft()
    output = next(n.id for n in d.mg.nodes if n.kind is NodeKind.OUTPUT)
    release = tier_node(NodeKind.RELEASE, d.storages[0], ASSEMBLY_SLOT, output)
    d.add("release output", release, after=output)
    mg = d.build(ASSEMBLY_TIER)
    refused(mg, d.index["release output"], "kept")


def test_an_assembly_loses_no_box():
    d = assembly_draft()
    third = [n.id for n in d.mg.nodes if n.kind is NodeKind.OFFLOAD][2]
    d.drop("read")
    d.drop("write")
    mg = d.build(ASSEMBLY_TIER)
    refused(mg, d.index[third], "boxes")


# -- plans made by the pass (`memgraph.tiers.place_host`) ------------------------------------

HOST_FRACTIONS = (2.0, 0.6, 0.25, 0.08)
TIER_KINDS = (NodeKind.READ, NodeKind.WRITE, NodeKind.RELEASE)


def checkpoint(mg: MemGraph) -> dict[str, CheckpointPlace]:
    """Made-up places in one checkpoint file for every host-side input of `mg`."""
    inputs = [n for n in mg.nodes if n.kind is NodeKind.INPUT and n.storage is not None]
    offsets, end = {}, 64
    for node in inputs:
        offsets[node.name] = end
        end += mg.storages[node.storage].nbytes
    return {
        name: CheckpointPlace("/models/ckpt.safetensors", end, at) for name, at in offsets.items()
    }


def tier_plans(tg, device: float, weights: bool) -> list[MemGraph]:
    """`tg` planned on the device, then its host at each of `HOST_FRACTIONS` of what the
    tier would hold (budgets too small for the pass are left out)."""
    low, high = memgraph.min_budget(tg)[0], memgraph.resident_peak(tg)
    mg = plan(tg, low + int((high - low) * device))
    places = checkpoint(mg) if weights else {}
    reference = max(1, host_reference(mg, places))
    plans = []
    for fraction in HOST_FRACTIONS:
        try:
            plans.append(place_host(mg, max(1, int(reference * fraction)), places))
        except HostBudgetPlanError:
            continue
    return plans


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(einsum_programs(max_tasks=14), st.floats(0, 1), st.booleans())
def test_plans_of_the_pass_verify_at_every_host_budget(tg, device, weights):
    for mg in tier_plans(tg, device, weights):
        report = verify(mg)
        assert report.host_peak_bytes == mg.stats.host_peak_bytes <= mg.tier.budget
        assert oracle.judge(mg.to_json()).accepted


def test_a_weight_output_twice_on_the_host_verifies():
    """Both host outputs of a checkpoint weight (an input and a view of it) name its slot,
    after its read (place_host once gave a slot to the last one only)."""
    prog = ep.Program("twice")
    a = prog.input("a", (1,), role="weight", location="device")
    w = prog.input("w", (1,), role="weight", location="host")
    prog.output(prog.view(w, (1,)), "out")
    prog.output(a, "a")
    prog.output(w, "w")
    tg = prog.build()
    mg = plan(tg, memgraph.min_budget(tg)[0])
    assert [n.storage for n in mg.nodes if n.kind is NodeKind.OUTPUT and n.storage is not None] == [
        0,
        0,
    ]
    verify(place_host(mg, "1MiB", checkpoint(mg)))


def test_the_pass_streams_spills_and_reads_ahead_and_verifies(tmp_path):
    """A model compiled with a checkpoint at small host budgets: weights streamed from the
    checkpoint, read ahead of their reloads, offloaded tensors spilled and read back;
    every plan verifies."""
    prog = llama.generation_program(llama.PRESETS["tiny"], 1, 8, 4, "float32")
    tg = prog.build()
    rng = np.random.default_rng(0)
    weights = {
        name: rng.standard_normal(tg[t].shape).astype(tg[t].dtype)
        for name, t in tg.inputs.items()
        if tg[t].op.role == "weight"
    }
    path = save_weights(weights, tmp_path / "m.safetensors")
    budget = memgraph.min_budget(tg)[0]
    kinds = set()
    for host_budget in ("50%", "30%", "20%", "14%"):
        mg = ep.compile(prog, budget, host_budget=host_budget, checkpoint=path, spill=tmp_path).plan
        report = verify(mg)
        assert report.host_peak_bytes == mg.stats.host_peak_bytes <= mg.tier.budget
        kinds |= {n.kind for n in mg.nodes}
    assert set(TIER_KINDS) <= kinds


class Walk:
    """A walk of a tier plan in node order, independent of the verifier: for each node,
    the nodes the spec says it must come after (`required`), where the storages are
    (`live_before`: (storage, slot) pairs) before it, and the occupancy it names
    (`occupancy_of`: (node that began it, storage, slot)). A read, or an offload naming a
    slot its storage does not occupy, begins an occupancy; a release ends it."""

    def __init__(self, mg: MemGraph):
        self.required: dict[int, set[int]] = {}
        self.live_before: list[set[tuple[int, HostRegion]]] = []
        self.occupancy_of: dict[int, tuple[int, int, HostRegion]] = {}
        live: dict[tuple[int, HostRegion], tuple[int, list[int], list[int]]] = {}
        released: list[tuple[HostRegion, int]] = []
        written: dict[int, int] = {}
        spill = {k for k, f in enumerate(mg.tier.files) if f.kind == "spill"}
        for node in mg.nodes:
            self.live_before.append(set(live))
            if node.slot is None:
                continue
            key = (node.storage, node.slot)
            need = self.required.setdefault(node.id, set())
            if node.kind is NodeKind.READ or key not in live:
                need.update(r for slot, r in released if slot.overlaps(node.slot))
                if node.kind is NodeKind.READ and mg.storages[node.storage].disk.file in spill:
                    need.add(written[node.storage])
                live[key] = (node.id, [node.id], [])
            elif node.kind is NodeKind.OFFLOAD:
                live[key][1].append(node.id)
            else:
                _, fills, uses = live[key]
                need.update(fills)
                uses.append(node.id)
                if node.kind is NodeKind.WRITE:
                    written[node.storage] = node.id
                if node.kind is NodeKind.RELEASE:
                    need.update(uses[:-1])
                    released.append((node.slot, node.id))
            self.occupancy_of[node.id] = (live[key][0], *key)
            if node.kind is NodeKind.RELEASE:
                del live[key]


def verified(plans: list[MemGraph]) -> list[MemGraph]:
    """The plans that verify (the mutants are made of those; that every plan of the pass
    verifies is `test_plans_of_the_pass_verify_at_every_host_budget`'s question)."""
    good = []
    for mg in plans:
        try:
            verify(mg)
        except VerificationError:
            continue
        good.append(mg)
    return good


def ancestors(nodes) -> list[int]:
    """Each node's transitive dependencies, as a bit set."""
    sets: list[int] = []
    for node in nodes:
        bits = 0
        for dep in node.deps:
            bits |= sets[dep] | 1 << dep
        sets.append(bits)
    return sets


def with_nodes(mg: MemGraph, changed: dict[int, MemNode]) -> MemGraph:
    nodes = tuple(changed.get(n.id, n) for n in mg.nodes)
    return MemGraph(mg.taskgraph, nodes, mg.budget, mg.alignment, {}, dict(mg.storages), mg.tier)


MUTATED = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
"""Programs without a storage the tier holds (no host-side input, nothing offloaded) have
no tier node to break: many are filtered out."""


@MUTATED
@given(einsum_programs(max_tasks=14), st.floats(0, 0.6), st.randoms(use_true_random=False))
def test_a_dependency_the_tier_needs_dropped_is_refused_at_its_node(tg, device, rng):
    """Drop, from a read, offload, reload, write or release, a direct dependency the spec
    requires of it (the release of bytes its slot reuses, the write it reads back, what
    filled its slot, a use of the slot it releases) that it does not come after by another
    path: the plan is refused at that node, naming the missing dependency."""
    candidates = []
    for mg in verified(tier_plans(tg, device, weights=True)):
        walk, before = Walk(mg), ancestors(mg.nodes)
        for node in mg.nodes:
            for dep in walk.required.get(node.id, ()):
                rest = [d for d in node.deps if d != dep]
                if dep in node.deps and not any(d == dep or before[d] >> dep & 1 for d in rest):
                    candidates.append((mg, node, dep, rest))
    assume(candidates)
    mg, node, dep, rest = rng.choice(candidates)
    mutant = with_nodes(mg, {node.id: dataclasses.replace(node, deps=tuple(rest))})
    with pytest.raises(VerificationError, match=rf"missing dependency on n{dep} ") as caught:
        verify(mutant)
    assert caught.value.node == node.id


@MUTATED
@given(einsum_programs(max_tasks=14), st.floats(0, 0.6), st.randoms(use_true_random=False))
def test_a_shifted_slot_is_refused(tg, device, rng):
    """Shift the slot of one reload, write, release or host output to bytes where its
    storage is not (by the walk): refused at that node. Or move a whole occupancy onto the
    slot of another storage's occupancy live where it begins: refused where it begins."""
    mutants = []  # (plan, the nodes changed, the node to be named)
    using = (NodeKind.RELOAD, NodeKind.WRITE, NodeKind.RELEASE, NodeKind.OUTPUT)
    for mg in verified(tier_plans(tg, device, weights=True)):
        walk = Walk(mg)
        members: dict[tuple, list[MemNode]] = {}
        for node in mg.nodes:
            if node.id in walk.occupancy_of:
                members.setdefault(walk.occupancy_of[node.id], []).append(node)
            if node.slot is None or node.kind not in using:
                continue
            for k in (-2, -1, 1, 2):
                slot = HostRegion(node.slot.offset + k * SLOT_ALIGNMENT, node.slot.size)
                if slot.offset >= 0 and (node.storage, slot) not in walk.live_before[node.id]:
                    mutants.append((mg, {node.id: dataclasses.replace(node, slot=slot)}, node.id))
        for (begin, storage, slot), nodes in members.items():
            for other, there in walk.live_before[begin]:
                if other != storage:
                    moved = HostRegion(there.offset, slot.size)
                    changed = {n.id: dataclasses.replace(n, slot=moved) for n in nodes}
                    mutants.append((mg, changed, begin))
    assume(mutants)
    mg, changed, named = rng.choice(mutants)
    with pytest.raises(VerificationError) as caught:
        verify(with_nodes(mg, changed))
    assert caught.value.node == named
