"""The disk of a host tier in the cost model, the simulator, traces and `einpage stats`:
reads and writes on lanes of their own, timed by hand on tier plans made by hand (and one
made by `memgraph.tiers.place_host`); plans without a tier simulate as they did."""

from __future__ import annotations

import dataclasses
import doctest
import json
import math

import pytest
from cli_runner import cli
from hypothesis import given, settings
from hypothesis import strategies as st
from tier_plans import (
    KIB,
    SLOT_H,
    both_plan,
    checkpoint_plan,
    device_plan,
    spill_plan,
    two_reads_plan,
)

import memgraph
import memgraph.cost as cost_module
import memgraph.graph as graph_module
from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK
from einpage_core.errors import EinpageError, PlanError
from memgraph.cost import DEFAULT_DISK, DISKS, PRESETS, CostModel, Disk, get_cost_model
from memgraph.multi import DevicePart, DevicePlan, MultiPlan, PlacedGraph
from memgraph.nodes import MemNode, NodeKind
from memgraph.simulate_multi import simulate_multi
from memgraph.tiers import CheckpointPlace, place_host
from memgraph.trace import DISK_STREAMS, STREAMS, read_chrome_trace

# Round numbers: a task (256 FLOP) takes 1 s, a 1 KiB copy 1 s each way between host and
# device, a 1 KiB read from disk 2 s, a 1 KiB write 4 s; no latencies, no memory roofline.
TOY = CostModel(
    "toy", flops_per_s=256.0, device_bytes_per_s=math.inf, h2d_bytes_per_s=1024.0,
    d2h_bytes_per_s=1024.0, disk_read_bytes_per_s=512.0, disk_write_bytes_per_s=256.0,
)  # fmt: skip
NO_DISK = dataclasses.replace(TOY, name="toy0", disk_read_bytes_per_s=None,
                              disk_write_bytes_per_s=None)  # fmt: skip
LANES = (*STREAMS, *DISK_STREAMS)


def test_module_doctests():
    for module in (cost_module, graph_module):
        assert doctest.testmod(module).failed == 0


def times(mg, result, kind, tensor):
    """(start, end) of each node of `kind` for `tensor`, in node order."""
    return [
        result.node_times[n.id] for n in mg.nodes if n.kind is kind and n.tensor == tensor
    ]


# -- the cost model --------------------------------------------------------------------


def test_existing_presets_state_no_disk_and_keep_their_rates():
    assert PRESETS["h100-pcie5"] == CostModel("h100-pcie5", 400e12, 2.0e12, 50e9, 50e9, 5e-6, 10e-6)
    assert PRESETS["cpu"] == CostModel("cpu", 200e9, 20e9, 10e9, 10e9, 0.0, 0.0)
    for model in PRESETS.values():
        assert not model.has_disk and model.disk_read_bytes_per_s is None


def test_a_disk_goes_under_any_machine_and_its_name_finds_it_again():
    for machine in ("h100-pcie5", "cpu", "8xh100-sxm"):
        model = get_cost_model(machine, disk="nvme-pcie4")
        assert model.name == f"{machine}+nvme-pcie4"
        assert (model.disk_read_bytes_per_s, model.disk_write_bytes_per_s) == (7e9, 5e9)
        without = dataclasses.replace(model, name=machine, disk_read_bytes_per_s=None,
                                      disk_write_bytes_per_s=None)  # fmt: skip
        assert without == PRESETS[machine]
        assert get_cost_model(model.name) == model
        assert model.disk_seconds(5 * 10**9, "write") == 1.0
    faster = Disk("fast", 14e9, 12e9)
    again = get_cost_model("cpu+nvme-pcie4", disk=faster)  # a new drive replaces the old
    assert again.name == "cpu+fast" and again.disk_read_bytes_per_s == 14e9
    assert DEFAULT_DISK in DISKS


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: get_cost_model("cpu", disk="floppy"), "unknown disk 'floppy'; disks: nvme-pcie4"),
        (lambda: get_cost_model("cpu+floppy"), "unknown disk 'floppy' in cost model"),
        (lambda: get_cost_model("abacus+nvme-pcie4"), r"unknown cost model 'abacus\+nvme-pcie4'"),
        (lambda: dataclasses.replace(TOY, disk_write_bytes_per_s=None), "together"),
        (lambda: dataclasses.replace(TOY, disk_read_bytes_per_s=0.0), "must be positive"),
        (lambda: Disk("bad", 1e9, -1.0), "bandwidths must be positive"),
        (lambda: NO_DISK.disk_seconds(KIB, "read"), "states no disk"),
        (lambda: TOY.disk_seconds(KIB, "sideways"), "'read' or 'write'"),
    ],
)
def test_disk_errors_name_what_is_wrong(make, message):
    with pytest.raises(EinpageError, match=message):
        make()


# -- hand-computed times -----------------------------------------------------------------


def test_the_device_plan_by_hand():
    """reload w [0,1], exp(w) [1,2], offload %2 [2,3] while x comes [2,3] and %3 [3,4],
    %4 [4,5], %2 back [5,6], y [6,7]."""
    result = memgraph.simulate(device_plan(), TOY)
    assert result.makespan == 7.0
    assert dict(result.busy) == {"compute": 4.0, "h2d": 3.0, "d2h": 1.0}
    assert result.lanes == STREAMS


def test_a_weight_read_from_its_checkpoint_comes_before_its_reload():
    """The read takes 2 s (1 KiB at 512 B/s): everything after moves by 2 s."""
    mg = checkpoint_plan()
    result = memgraph.simulate(mg, TOY, timeline=True)
    assert times(mg, result, NodeKind.READ, 0) == [(0.0, 2.0)]
    assert times(mg, result, NodeKind.RELOAD, 0) == [(2.0, 3.0)]
    assert result.makespan == 9.0
    assert dict(result.busy) == {"compute": 4.0, "h2d": 3.0, "d2h": 1.0,
                                 "disk_read": 2.0, "disk_write": 0.0}  # fmt: skip
    assert dict(result.bytes_moved) == {"compute": 0, "h2d": 3 * KIB, "d2h": KIB,
                                        "disk_read": KIB, "disk_write": 0}  # fmt: skip


def test_an_offloaded_tensor_is_written_and_read_back_before_its_reload():
    """offload [2,3]; write [3,7] (4 s); read back [7,9], after the write and the release;
    reload [9,10] (its device region was free at 5); y [10,11]."""
    mg = spill_plan()
    result = memgraph.simulate(mg, TOY, timeline=True)
    assert times(mg, result, NodeKind.OFFLOAD, 2) == [(2.0, 3.0)]
    assert times(mg, result, NodeKind.WRITE, 2) == [(3.0, 7.0)]
    assert times(mg, result, NodeKind.READ, 2) == [(7.0, 9.0)]
    assert times(mg, result, NodeKind.RELOAD, 2) == [(9.0, 10.0)]
    assert result.makespan == 11.0
    assert (result.busy["disk_read"], result.busy["disk_write"]) == (2.0, 4.0)
    assert (result.disk_read_bytes, result.disk_write_bytes) == (KIB, KIB)


def test_both_disks_lanes_at_once():
    """read w [0,2], reload w [2,3], exp(w) [3,4], offload [4,5], write [5,9], read back
    [9,11] (the read lane idle since 2), reload [11,12], y [12,13]."""
    mg = both_plan()
    result = memgraph.simulate(mg, TOY, timeline=True)
    assert times(mg, result, NodeKind.READ, 0) + times(mg, result, NodeKind.READ, 2) == [
        (0.0, 2.0), (9.0, 11.0),
    ]  # fmt: skip
    assert times(mg, result, NodeKind.WRITE, 2) == [(5.0, 9.0)]
    assert times(mg, result, NodeKind.RELOAD, 2) == [(11.0, 12.0)]
    assert result.makespan == 13.0
    assert result.compute_seconds == 4.0 and result.stall_seconds == 9.0
    assert (result.busy["disk_read"], result.busy["disk_write"]) == (4.0, 4.0)
    assert (result.disk_read_bytes, result.disk_write_bytes) == (2 * KIB, KIB)


def test_the_disk_serves_reads_in_node_order():
    """x's read comes first in node order: w's read, ready at 0 too, waits for it [2,4];
    the reload of w then [4,5]; x's reload waits for its device region (free at 6)."""
    mg = two_reads_plan()
    result = memgraph.simulate(mg, TOY, timeline=True)
    assert times(mg, result, NodeKind.READ, 1) == [(0.0, 2.0)]
    assert times(mg, result, NodeKind.READ, 0) == [(2.0, 4.0)]
    assert times(mg, result, NodeKind.RELOAD, 0) == [(4.0, 5.0)]
    assert times(mg, result, NodeKind.RELOAD, 1) == [(6.0, 7.0)]
    assert result.makespan == 11.0


def test_releases_are_bookkeeping():
    mg = both_plan()
    result = memgraph.simulate(mg, TOY, timeline=True)
    releases = mg.of_kind(NodeKind.RELEASE)
    assert len(releases) == 3
    for node in releases:
        start, end = result.node_times[node.id]
        assert start == end == max(result.node_times[d][1] for d in node.deps)
    assert not any(e.kind == "release" for e in result.events)


def test_a_machine_without_a_disk_is_taken_over_the_default_drive():
    mg = both_plan()
    assumed = memgraph.simulate(mg, NO_DISK)
    assert assumed.cost_model.name == "toy0+nvme-pcie4"
    drive = DISKS[DEFAULT_DISK]
    assert assumed.busy["disk_read"] == pytest.approx(2 * KIB / drive.read_bytes_per_s)
    assert assumed.busy["disk_write"] == pytest.approx(KIB / drive.write_bytes_per_s)
    slow = Disk("slow", 256.0, 128.0)
    given_drive = memgraph.simulate(mg, TOY, disk=slow)  # replaces the model's own drive
    assert given_drive.cost_model.name == "toy+slow"
    assert (given_drive.busy["disk_read"], given_drive.busy["disk_write"]) == (8.0, 8.0)
    assert memgraph.simulate(mg, "cpu").cost_model.name == "cpu+nvme-pcie4"


def test_a_read_in_a_plan_without_a_tier_is_refused_by_name():
    mg = both_plan()
    untiered = dataclasses.replace(mg, tier=None)
    with pytest.raises(PlanError, match=r"n3 \(read %0 host#0 disk -> h\[.*no host tier"):
        memgraph.simulate(untiered, TOY)


# -- plans without a tier ----------------------------------------------------------------


def plans_without_a_tier():
    yield device_plan()
    tg = memgraph.plan(device_plan().taskgraph, 4 * KIB, outputs="host").taskgraph
    yield memgraph.plan(tg, 3 * KIB, outputs="host")
    from einpage.models import llama

    tiny = llama.prefill_program(llama.PRESETS["tiny"], 1, 8, "float32").build()
    yield memgraph.plan(tiny, memgraph.streaming_minimum(tiny))


@pytest.mark.parametrize("mg", list(plans_without_a_tier()), ids=["tiny", "host-out", "llama"])
def test_plans_without_a_tier_simulate_as_before(mg):
    """A disk on the machine, or given, changes nothing for a plan that never uses one:
    the same three lanes, times, bytes, events and trace."""
    for machine in ("h100-pcie5", "cpu", NO_DISK):
        base = memgraph.simulate(mg, machine, timeline=True)
        assert base.lanes == STREAMS and set(base.bytes_moved) == set(STREAMS)
        assert set(base.trace_metadata["busy_s"]) == set(STREAMS)
        assert {e.stream for e in base.events} <= set(STREAMS)
        for other in (
            memgraph.simulate(mg, machine, timeline=True, disk="nvme-pcie4"),
            memgraph.simulate(mg, get_cost_model(base.cost_model, disk="nvme-pcie4"),
                              timeline=True),  # fmt: skip
        ):
            assert other.makespan == base.makespan
            assert dict(other.busy) == dict(base.busy)
            assert dict(other.bytes_moved) == dict(base.bytes_moved)
            assert other.node_times == base.node_times and other.events == base.events
        assert memgraph.simulate(mg, machine, disk="nvme-pcie4").cost_model == base.cost_model
        assert "disk" not in str(base) and "read=" not in repr(base), str(base)


def test_simulate_multi_refuses_a_tier_plan_by_name():
    mg = both_plan()
    tg = mg.taskgraph
    placed = PlacedGraph(1, (DevicePart(0, tg, tuple(range(len(tg)))),), (), {"y": (0, "y")})
    with pytest.raises(PlanError, match="device 0's plan of 'tiny' has a host tier"):
        simulate_multi(MultiPlan(placed, (DevicePlan(0, mg, mg.budget),)), TOY)
    untiered = MultiPlan(placed, (DevicePlan(0, device_plan(), mg.budget),))
    assert simulate_multi(untiered, TOY).makespan == 7.0


# -- traces --------------------------------------------------------------------------------


def test_the_chrome_trace_has_the_disk_lanes_after_the_others(tmp_path):
    result = memgraph.simulate(both_plan(), TOY, timeline=True)
    document = result.to_chrome_trace()
    named = {r["tid"]: r["args"]["name"] for r in document["traceEvents"]
             if r["name"] == "thread_name"}  # fmt: skip
    assert [named[t] for t in sorted(named)] == list(LANES)
    records = [r for r in document["traceEvents"] if r["ph"] == "X"]
    on_disk = [(named[r["tid"]], r["cat"], r["ts"], r["dur"], r["args"]["bytes"])
               for r in records if named[r["tid"]] in DISK_STREAMS]  # fmt: skip
    assert on_disk == [
        ("disk_read", "read", 0.0, 2e6, KIB),
        ("disk_write", "write", 5e6, 4e6, KIB),
        ("disk_read", "read", 9e6, 2e6, KIB),
    ]
    path = result.write_chrome_trace(tmp_path / "trace.json")
    events = read_chrome_trace(path)
    assert {e.stream for e in events} == set(LANES)
    assert [(e.stream, e.label) for e in events if e.stream in DISK_STREAMS] == [
        ("disk_read", "read %0 w"), ("disk_write", "write %2"), ("disk_read", "read %2"),
    ]  # fmt: skip
    assert document["otherData"]["bytes_moved"]["disk_read"] == 2 * KIB


def test_a_trace_without_a_tier_has_no_disk_lanes():
    document = memgraph.simulate(device_plan(), TOY, timeline=True).to_chrome_trace()
    names = {r["args"]["name"] for r in document["traceEvents"] if r["name"] == "thread_name"}
    assert names == set(STREAMS)


# -- properties ------------------------------------------------------------------------------


rates = st.sampled_from([64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0])


@settings(max_examples=40, deadline=None)
@given(read=rates, write=rates, h2d=rates, faster=st.sampled_from([1.0, 2.0, 8.0]))
def test_disk_lanes_add_up_and_a_faster_disk_never_slows_a_plan(read, write, h2d, faster):
    model = dataclasses.replace(TOY, h2d_bytes_per_s=h2d, disk_read_bytes_per_s=read,
                                disk_write_bytes_per_s=write)  # fmt: skip
    quick = dataclasses.replace(model, disk_read_bytes_per_s=read * faster,
                                disk_write_bytes_per_s=write * faster)  # fmt: skip
    for make in (checkpoint_plan, spill_plan, both_plan, two_reads_plan):
        mg = make()
        result = memgraph.simulate(mg, model, timeline=True)
        stats = mg.stats
        assert result.busy["disk_read"] == pytest.approx(stats.disk_read_bytes / read)
        assert result.busy["disk_write"] == pytest.approx(stats.disk_write_bytes / write)
        for lane in LANES:  # one node at a time, in node order
            mine = [e for e in result.events if e.stream == lane]
            assert [e.node for e in mine] == sorted(e.node for e in mine)
            assert all(a.end <= b.start for a, b in zip(mine, mine[1:], strict=False))
        for node in mg.nodes:  # nothing starts before what it waits for
            start = result.node_times[node.id][0]
            assert all(result.node_times[d][1] <= start for d in node.deps)
        assert memgraph.simulate(mg, quick).makespan <= result.makespan
        assert result.makespan >= memgraph.simulate(device_plan(), model).makespan


# -- a plan made by the pass -------------------------------------------------------------------


def test_a_plan_made_by_place_host_by_hand():
    """The pass reads w from its checkpoint into a slot, releases it after the reload, and
    offloads %2 into that slot: read [0,2], then as the checkpoint plan, makespan 9."""
    mg = device_plan()
    tiered = place_host(mg, 4 * 4 * KIB, {"w": CheckpointPlace("/checkpoints/w.bin", 4 * KIB, 0)})
    assert [n.kind for n in tiered.nodes].count(NodeKind.READ) == 1
    result = memgraph.simulate(tiered, TOY, timeline=True)
    assert times(tiered, result, NodeKind.READ, 0) == [(0.0, 2.0)]
    assert times(tiered, result, NodeKind.RELOAD, 0) == [(2.0, 3.0)]
    assert result.makespan == 9.0
    assert dict(result.bytes_moved)["disk_read"] == KIB


def test_a_spilling_plan_made_by_place_host_keeps_every_order_in_time():
    """A llama plan whose offloads are spilled: each read of a spilled tensor starts after
    its write ends, each reload from a slot after the read that filled it, and the lanes
    add up to the plan's disk bytes."""
    from einpage.models import llama

    tg = llama.generation_program(llama.PRESETS["tiny"], 1, 16, 6, "float32").build()
    mg = memgraph.plan(tg, memgraph.min_budget(tg)[0])
    names = [n.name for n in mg.nodes if n.kind is NodeKind.INPUT and n.storage is not None]
    offset, places = 0, {}
    for node in mg.nodes:
        if node.kind is NodeKind.INPUT and node.storage is not None:
            places[node.name] = offset
            offset += mg.storages[node.storage].nbytes
    weights = {name: CheckpointPlace("/data/model.safetensors", offset, at)
               for name, at in places.items()}  # fmt: skip
    tiered = place_host(mg, mg.host_bytes // 7, weights)
    assert names and tiered.stats.disk_write_count > 0
    model = get_cost_model("h100-pcie5", disk="nvme-pcie4")
    result = memgraph.simulate(tiered, model, timeline=True)
    start = {i: t[0] for i, t in enumerate(result.node_times)}
    end = {i: t[1] for i, t in enumerate(result.node_times)}
    written: dict[int, float] = {}
    filled: dict[tuple[int, int], float] = {}
    for node in tiered.nodes:
        if node.kind is NodeKind.WRITE:
            written[node.storage] = end[node.id]
        elif node.kind is NodeKind.READ:
            if tiered.storages[node.storage].kind == "offload":
                assert start[node.id] >= written[node.storage]
            filled[(node.storage, node.slot.offset)] = end[node.id]
        elif node.kind is NodeKind.RELOAD and node.slot is not None:
            key = (node.storage, node.slot.offset)
            if key in filled:  # a streamed occupancy (a kept one began with an offload)
                assert start[node.id] >= filled[key]
    stats = tiered.stats
    assert result.busy["disk_read"] == pytest.approx(stats.disk_read_bytes / 7e9)
    assert result.busy["disk_write"] == pytest.approx(stats.disk_write_bytes / 5e9)
    assert result.makespan >= memgraph.simulate(mg, model).makespan


# -- printing and the command line ----------------------------------------------------------


def test_the_tier_rows_say_what_each_tier_needs():
    mg = both_plan()
    stats = mg.stats
    assert (stats.checkpoint_read_bytes, stats.spill_file_bytes) == (KIB, KIB)
    rows = dict(stats.rows())
    assert rows["budget"] == "3.0 KiB" and rows["peak allocated"].startswith("3.0 KiB")
    assert rows["host budget"] == "2.0 KiB" and rows["host peak"] == "1.0 KiB (50.0% of budget)"
    assert rows["read from disk"] == "2.0 KiB in 2"
    assert rows["  from checkpoints"] == "1.0 KiB" and rows["  from the spill file"] == "1.0 KiB"
    assert rows["written to disk"] == "1.0 KiB in 1" and rows["spill file"] == "1.0 KiB"
    header = str(mg).splitlines()[0]
    assert "host budget 2.0 KiB, host peak 1.0 KiB (50.0% of budget), read from disk" in header
    assert "from checkpoints 1.0 KiB, from the spill file 1.0 KiB" in header
    assert dict(checkpoint_plan().stats.rows())["spill file"] == "0 B"
    assert device_plan().stats.tier_rows() == []
    assert "host budget" not in dict(device_plan().stats.rows())
    assert SLOT_H.size == KIB


def test_stats_prints_each_tier_and_the_disk_lanes(capsys, tmp_path):
    path = tmp_path / "tier.json"
    path.write_text(both_plan().to_json())
    code, out, err = cli(capsys, "stats", path)
    assert code == EXIT_OK, err
    lines = [" ".join(line.split()) for line in out.splitlines()]
    for expected in (
        "budget 3.0 KiB",
        "host budget 2.0 KiB",
        "host peak 1.0 KiB (50.0% of budget)",
        "read from disk 2.0 KiB in 2",
        "from checkpoints 1.0 KiB",
        "from the spill file 1.0 KiB",
        "written to disk 1.0 KiB in 1",
        "spill file 1.0 KiB",
        "simulated on h100-pcie5+nvme-pcie4",
    ):
        assert expected in lines, (expected, out)
    assert any(line.startswith("disk_read busy") and line.endswith("2.0 KiB") for line in lines)
    assert any(line.startswith("disk_write busy") and line.endswith("1.0 KiB") for line in lines)

    code, out, err = cli(capsys, "stats", path, "--cost-model", "cpu", "--disk", "nvme-pcie4",
                         "--json")  # fmt: skip
    assert code == EXIT_OK, err
    document = json.loads(out)
    simulated = document["simulated"]
    assert simulated["cost_model"] == "cpu+nvme-pcie4"
    assert simulated["bytes_moved"]["disk_read"] == 2 * KIB
    assert simulated["busy_s"]["disk_write"] == pytest.approx(KIB / 5e9)
    assert document["stats"]["spill_file_bytes"] == KIB
    assert document["stats"]["checkpoint_read_bytes"] == KIB

    code, _, err = cli(capsys, "stats", path, "--disk", "floppy")
    assert code == EXIT_BAD_INPUT and "floppy" in err


def test_show_takes_programs_and_points_a_tier_plan_to_stats(capsys, tmp_path):
    """`einpage show` shows a program; a plan file (with a tier or not) is for `stats`."""
    path = tmp_path / "tier.json"
    path.write_text(both_plan().to_json())
    code, _, err = cli(capsys, "show", path)
    assert code == EXIT_BAD_INPUT
    assert "this is a plan: give it to `einpage run`, `stats` or `render`" in err


def test_every_node_kind_of_a_tier_plan_is_timed_as_stated():
    """read -> disk_read, write -> disk_write, the others as before (a guard for new kinds)."""
    lanes = {NodeKind.READ: "disk_read", NodeKind.WRITE: "disk_write", NodeKind.APPLY: "compute",
             NodeKind.RELOAD: "h2d", NodeKind.OFFLOAD: "d2h"}  # fmt: skip
    result = memgraph.simulate(both_plan(), TOY, timeline=True)
    mg = both_plan()
    for event in result.events:
        node: MemNode = mg[event.node]
        assert lanes[node.kind] == event.stream


def test_stream_timeline_draws_the_disk_lanes():
    pytest.importorskip("matplotlib")
    from memgraph.plots import stream_timeline

    mg = both_plan()
    fig = stream_timeline(memgraph.simulate(mg, TOY, timeline=True).events)
    ax = fig.axes[0]
    titles = [t.get_text() for t in ax.get_yticklabels()]
    assert titles[-2:] == ["disk -> host (read)", "host -> disk (write)"]
    for lane, kind in zip(DISK_STREAMS, (NodeKind.READ, NodeKind.WRITE), strict=True):
        bars = [c for c in ax.collections if c.get_gid() == f"stream:{lane}"]
        assert sum(len(c.get_paths()) for c in bars) == len(mg.of_kind(kind))
        assert f"{lane} busy" in ax.get_title()
