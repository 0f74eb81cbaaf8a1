"""The cost model's topology: how devices share host links, what a preset states, and that
the peer link does not change a plan whose links are all staged through the host (direct
links on it: tests/multi/test_simulate_peer.py)."""

from __future__ import annotations

import dataclasses

import pytest
import sim_plans

from einpage.errors import EinpageError
from memgraph.cost import PRESETS, CostModel, Topology
from memgraph.simulate_multi import simulate_multi


def test_a_cost_model_without_a_topology_has_each_device_on_its_own_host_link():
    for name in ("h100-pcie5", "cpu"):
        topology = PRESETS[name].topology
        assert topology == Topology()
        assert (topology.devices, topology.devices_per_host_link) == (None, 1)
        assert topology.staged_through_host and topology.peer_bytes_per_s is None
        assert [topology.host_link(d) for d in range(3)] == [0, 1, 2]
    # The existing presets' rates are unchanged by the new field.
    assert PRESETS["h100-pcie5"] == CostModel("h100-pcie5", 400e12, 2.0e12, 50e9, 50e9, 5e-6, 10e-6)


def test_devices_are_grouped_on_host_links_in_order():
    topology = Topology(devices=8, devices_per_host_link=2)
    assert [topology.host_link(d) for d in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert topology.describe() == (
        "8 devices, 2 per host link; direct sends PCIe peer-to-peer over the host links"
    )


def test_the_8xh100_sxm_preset_states_its_machine():
    model = PRESETS["8xh100-sxm"]
    topology = model.topology
    assert (topology.devices, topology.devices_per_host_link) == (8, 1)
    assert topology.peer_bytes_per_s == 450e9  # NVLink 4: 900 GB/s both directions
    assert topology.device_memory_bytes == 80 * 10**9
    assert (model.flops_per_s, model.device_bytes_per_s) == (520e12, 3.35e12)
    assert model.h2d_bytes_per_s == model.d2h_bytes_per_s == 50e9
    assert topology.describe().endswith("; direct sends over a 450 GB/s peer link")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"devices": 0}, "devices must be a positive int or None, got 0"),
        ({"devices_per_host_link": 0}, "devices_per_host_link must be a positive int, got 0"),
        ({"devices_per_host_link": 1.5}, "devices_per_host_link must be a positive int, got 1.5"),
        ({"staged_through_host": False}, "cannot stage tensors through host memory.* not built"),
        ({"peer_bytes_per_s": 0.0}, "peer_bytes_per_s must be positive or None, got 0.0"),
        ({"device_memory_bytes": -1}, "device_memory_bytes must be positive or None, got -1"),
    ],
)
def test_a_bad_topology_is_refused_naming_the_field(fields, message):
    with pytest.raises(EinpageError, match=message):
        Topology(**fields)


def test_a_cost_model_needs_a_topology_object():
    with pytest.raises(EinpageError, match="cost model 'x': topology must be a Topology, got int"):
        CostModel("x", 1e12, 1e12, 1e9, 1e9, topology=2)


def test_the_peer_link_does_not_time_links_staged_through_the_host():
    # A tensor sent between devices through the host costs the same whatever the peer link.
    mp = sim_plans.chain()
    model = PRESETS["8xh100-sxm"]
    slow_peer = dataclasses.replace(
        model, topology=dataclasses.replace(model.topology, peer_bytes_per_s=1.0)
    )
    assert simulate_multi(mp, model).makespan == simulate_multi(mp, slow_peer).makespan
    result = simulate_multi(mp, model)
    assert result.host_link_bytes[0]["d2h"] == result.host_link_bytes[1]["h2d"] > 0
