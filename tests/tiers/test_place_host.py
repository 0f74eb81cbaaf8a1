"""The host tier's pass (`memgraph.tiers.place_host`): on random programs, device budgets
and host budgets, the plan it makes keeps the device plan as it was, holds at most the
host budget in host memory, and orders every move across the tiers – checked by an oracle
written here that shares no code with the pass or `memgraph.verify` (a walk in node order
for the host arena, ancestor sets for happens-before); a budget too small is a typed
error naming the bytes, never a plan over it."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import einsum_programs

import memgraph
from einpage.models import llama
from einpage_core.errors import HostBudgetPlanError, PlanError
from memgraph import NodeKind
from memgraph.serialize import memgraph_from_json, memgraph_to_json
from memgraph.tiers import SLOT_ALIGNMENT, CheckpointPlace, place_host

TIER_KINDS = (NodeKind.READ, NodeKind.WRITE, NodeKind.RELEASE)


def checkpoint_of(mg, names=None, path="/data/model.safetensors"):
    """Made-up checkpoint places, back to back, for the host-side inputs of `mg` (those in
    `names`, or every one)."""
    places, offset = {}, 128
    for node in mg.nodes:
        host_side = node.kind is NodeKind.INPUT and node.storage is not None
        if host_side and (names is None or node.name in names):
            places[node.name] = offset
            offset += mg.storages[node.storage].nbytes
    return {name: CheckpointPlace(path, offset, at) for name, at in places.items()}


def ancestors(mg):
    """Each node's ancestors (transitive dependencies) as a bit set."""
    sets = []
    for node in mg.nodes:
        bits = 0
        for dep in node.deps:
            bits |= sets[dep] | (1 << dep)
        sets.append(bits)
    return sets


def check_tier(mg, original):
    """Every rule of a host tier, by a walk of its own (see the module docstring)."""
    tier = mg.tier
    assert tier is not None
    before = ancestors(mg)

    def after(later, earlier, what):
        assert before[later] >> earlier & 1, f"n{later} does not wait for n{earlier}: {what}"

    # the device plan is the original, node for node (slots and extra waits aside)
    device = [n for n in mg.nodes if n.kind not in TIER_KINDS]
    assert len(device) == len(original.nodes)
    position = {}
    for old, new in zip(original.nodes, device, strict=True):
        position[old.id] = new.id
        assert (old.kind, old.tensor, old.region, old.storage, old.box, old.reads) == (
            new.kind,
            new.tensor,
            new.region,
            new.storage,
            new.box,
            new.reads,
        )
        assert {position[d] for d in old.deps} <= set(new.deps)
    weights = {sid for sid, s in mg.storages.items() if s.disk is not None and s.kind == "input"}
    held = weights | {sid for sid, s in mg.storages.items() if s.kind in ("offload", "assembly")}
    spill = {k for k, f in enumerate(tier.files) if f.kind == "spill"}
    live = {}  # storage -> [slot, filled-by node, users]
    freed = []  # (slot, release node)
    written = {}
    peak = 0
    for node in mg.nodes:
        if node.slot is None:
            assert node.kind not in TIER_KINDS
            assert node.storage is None or node.storage not in held or node.kind is NodeKind.INPUT
            continue
        slot, sid = node.slot, node.storage
        assert slot.offset >= 0 and slot.end <= tier.budget
        assert slot.size >= mg.storages[sid].nbytes
        begins = node.kind is NodeKind.READ or (
            node.kind is NodeKind.OFFLOAD and sid not in live
        )
        if begins:
            assert sid not in live, f"n{node.id}: host#{sid} is in host memory twice"
            for other, _, _ in live.values():
                assert not other.overlaps(slot), f"n{node.id}: {slot} is taken"
            for region, release in freed:
                if region.overlaps(slot):
                    after(node.id, release, "a slot reused before its release")
            if node.kind is NodeKind.READ:
                place = mg.storages[sid].disk
                assert place is not None
                if place.file in spill:
                    after(node.id, written[sid], "read back before it was written")
            live[sid] = [slot, node.id, [node.id]]
            peak = max(peak, sum(s.size for s, _, _ in live.values()))
            continue
        assert sid in live and live[sid][0] == slot, f"n{node.id}: host#{sid} is not in {slot}"
        entry = live[sid]
        if node.kind in (NodeKind.RELOAD, NodeKind.OUTPUT):
            after(node.id, entry[1], "a copy from a slot before it was filled")
        elif node.kind is NodeKind.WRITE:
            assert tier.files[mg.storages[sid].disk.file].kind == "spill"
            after(node.id, entry[1], "written before it was offloaded")
            written[sid] = node.id
        elif node.kind is NodeKind.RELEASE:
            for user in entry[2]:
                after(node.id, user, "released while in use")
            freed.append((slot, node.id))
            del live[sid]
            continue
        entry[2].append(node.id)
    assert peak <= tier.budget
    assert mg.stats.host_peak_bytes == peak
    for sid, (_, _, users) in live.items():  # what stays to the end is an output's
        assert any(mg.nodes[u].kind is NodeKind.OUTPUT for u in users), f"host#{sid} leaks"


def planned(tg, device_fraction, host_fraction, weights=True):
    low, high = memgraph.min_budget(tg)[0], memgraph.resident_peak(tg)
    mg = memgraph.plan(tg, low + int((high - low) * device_fraction))
    host = max(1, int(mg.host_bytes * host_fraction))
    places = checkpoint_of(mg) if weights else {}
    return mg, host, places


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    einsum_programs(max_tasks=16),
    st.floats(0, 1),
    st.floats(0.02, 1.5),
    st.booleans(),
    st.integers(1, 3),
)
def test_random_programs_fit_their_host_budget_and_order_every_move(
    tg, device, host, weights, depth
):
    mg, host_budget, places = planned(tg, device, host, weights)
    try:
        tiered = place_host(mg, host_budget, places, depth=depth)
    except HostBudgetPlanError as err:
        assert "too small" in str(err)
        # the error is honest: all the storages, each in page-aligned slots, would not fit
        pages = sum(-(-s.nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT for s in mg.storages.values())
        assert host_budget < pages
        return
    check_tier(tiered, mg)
    memgraph.verify(tiered)
    text = memgraph_to_json(tiered)
    assert memgraph_to_json(memgraph_from_json(text)) == text
    assert json.loads(text)["tier"]["budget"] == host_budget


def test_a_host_budget_that_holds_everything_reads_each_weight_once_and_spills_nothing():
    tg = llama.generation_program(llama.PRESETS["tiny"], 1, 8, 4, "float32").build()
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    places = checkpoint_of(mg)
    assert mg.stats.reload_count > len(places)  # weights are reloaded more than once
    tiered = place_host(mg, 2 * mg.host_bytes, places)
    check_tier(tiered, mg)
    weights = [s for s in mg.storages.values() if s.kind == "input"]
    assert tiered.stats.disk_read_count == len(weights)
    assert tiered.stats.disk_read_bytes == sum(s.nbytes for s in weights)
    assert tiered.stats.disk_write_count == 0
    assert [f.kind for f in tiered.tier.files] == ["checkpoint"]
    assert tiered.info["tier"] == {"depth": 2, "kept": len(weights), "streamed_weights": 0,
                                   "spilled": 0}


def test_a_smaller_host_budget_streams_weights_from_the_checkpoint_reading_more():
    tg = llama.generation_program(llama.PRESETS["tiny"], 1, 8, 4, "float32").build()
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    places = checkpoint_of(mg)
    reads = []
    for fraction in (1.0, 0.5, 0.3, 0.16):
        tiered = place_host(mg, int(mg.host_bytes * fraction), places)
        check_tier(tiered, mg)
        memgraph.verify(tiered)
        reads.append(tiered.stats.disk_read_bytes)
        assert tiered.stats.host_peak_bytes <= int(mg.host_bytes * fraction)
    assert reads == sorted(reads) and reads[-1] > reads[0]  # less memory, more reading


def test_offloaded_tensors_are_spilled_written_once_and_read_back_before_their_reloads():
    tg = llama.generation_program(llama.PRESETS["tiny"], 1, 16, 6, "float32").build()
    mg = memgraph.plan(tg, memgraph.min_budget(tg)[0])  # KV pages and activations offloaded
    offloaded = [s for s in mg.storages.values() if s.kind == "offload"]
    assert offloaded
    tiered = place_host(mg, mg.host_bytes // 7, checkpoint_of(mg))
    check_tier(tiered, mg)
    memgraph.verify(tiered)
    spill = tiered.tier.files[-1]
    assert spill.kind == "spill" and spill.path == ""
    spilled = [s for s in tiered.storages.values() if s.kind == "offload" and s.disk is not None]
    assert spilled and tiered.info["tier"]["spilled"] == len(spilled)
    assert tiered.stats.disk_write_count == len(spilled)
    assert spill.nbytes >= sum(s.nbytes for s in spilled)
    places = sorted((s.disk.offset, s.disk.offset + s.nbytes) for s in spilled)
    assert all(a[1] <= b[0] for a, b in zip(places, places[1:], strict=False))  # apart
    reloads = {
        s.id: sum(1 for n in mg.nodes if n.kind is NodeKind.RELOAD and n.storage == s.id)
        for s in spilled
    }
    reads = [n for n in tiered.nodes if n.kind is NodeKind.READ and n.storage in reloads]
    # one read per run of reloads (check_tier saw each reload find its tensor in its slot)
    assert len({n.storage for n in reads}) == sum(1 for count in reloads.values() if count)
    assert len(reads) <= sum(reloads.values())


def test_without_a_spill_folder_what_must_be_spilled_is_an_error_naming_the_bytes():
    tg = llama.generation_program(llama.PRESETS["tiny"], 1, 16, 6, "float32").build()
    mg = memgraph.plan(tg, memgraph.min_budget(tg)[0])
    with pytest.raises(HostBudgetPlanError, match="give a spill folder"):
        place_host(mg, mg.host_bytes // 7, checkpoint_of(mg), spill=False)
    place_host(mg, 2 * mg.host_bytes, checkpoint_of(mg), spill=False)  # all kept: fine


def test_a_budget_below_the_largest_storage_names_it():
    tg = llama.prefill_program(llama.PRESETS["tiny"], 1, 8, "float32").build()
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    largest = max(s.nbytes for s in mg.storages.values())
    with pytest.raises(HostBudgetPlanError, match=r"host budget .* is too small: at node n\d+"):
        place_host(mg, largest // 2, checkpoint_of(mg))


def transposed_places(mg, transposed):
    """`checkpoint_of(mg)`, every weight said to be stored `transposed`."""
    return {
        name: dataclasses.replace(place, transposed=transposed)
        for name, place in checkpoint_of(mg).items()
    }


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda mg: place_host(mg, "1MiB", {"nope": CheckpointPlace("/x", 10, 0)}), "not inputs"),
        (lambda mg: place_host(mg, "1MiB", depth=0), "depth"),
        (lambda mg: place_host(mg, "lots"), "host budget"),
        (
            lambda mg: place_host(
                mg, "1MiB", {n: CheckpointPlace("/x", 16, 8) for n in checkpoint_of(mg)}
            ),
            "is not inside",
        ),
        (lambda mg: place_host(place_host(mg, "1MiB"), "1MiB"), "already has a host tier"),
        (
            lambda mg: place_host(mg, "1MiB", transposed_places(mg, (1, 3))),
            r"but its transposed \(1, 3\) matrix is 12 bytes",
        ),
        (
            lambda mg: place_host(mg, "1MiB", transposed_places(mg, (3,))),
            r"transposed must be \(rows, cols\), got \(3,\)",
        ),
    ],
)
def test_bad_arguments_are_typed_errors(call, message):
    tg = llama.prefill_program(llama.PRESETS["tiny"], 1, 8, "float32").build()
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    with pytest.raises((PlanError, ValueError), match=message):
        call(mg)


def test_the_plan_prints_its_tier():
    tg = llama.prefill_program(llama.PRESETS["tiny"], 1, 8, "float32").build()
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    tiered = place_host(mg, "64KiB", checkpoint_of(mg))
    text = str(tiered)
    assert "host tier 64.0 KiB, file#0: checkpoint /data/model.safetensors" in text
    assert " read %" in text and "disk -> h[0x" in text and "release %" in text
    rows = dict(tiered.stats.rows())
    assert rows["host budget"] == "64.0 KiB"
    assert rows["read from disk"].endswith(f"in {tiered.stats.disk_read_count}")
