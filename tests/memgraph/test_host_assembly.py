"""Host assembly: split program outputs rebuilt in host memory by sliced offloads.

The planner copies each block of an output-assembly tree (`taskgraph.assembly`) into
its box of the output's host storage; the verifier checks that the boxes are filled
exactly once before the output, and the runtime (with and without host staging) gives
the reference result.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from plans import hand_assembled

import memgraph
import runtime
import taskgraph
from einpage.errors import VerificationError
from memgraph import MemGraph, NodeKind
from memgraph.render import node_lines
from runtime.numpy_backend import NumpyBackend
from taskgraph import TaskGraph
from taskgraph.assembly import assembly_tasks, output_assemblies

MODES = ("sequential", "streams", "random")


class StagingNumpyBackend(NumpyBackend):
    """The NumPy backend with host staging on, as the CuPy backend has it: the output's
    storage is a slot of the host buffer, and sliced offloads copy into its boxes."""

    host_staging = True


def hand_inputs(tg: TaskGraph) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        name: rng.standard_normal(tg[t].shape).astype("float32") for name, t in tg.inputs.items()
    }


def sliced_offloads(mg: MemGraph) -> list:
    return [n for n in mg.nodes if n.kind is NodeKind.OFFLOAD and n.into is not None]


def without(mg: MemGraph, victim: int) -> MemGraph:
    """`mg` without node `victim`: its dependants wait for its dependencies instead."""
    dropped = mg.nodes[victim]
    nodes = []
    for node in mg.nodes:
        if node.id == victim:
            continue
        deps = set()
        for d in node.deps:
            deps |= set(dropped.deps) if d == victim else {d}
        renumbered = tuple(sorted(d - (d > victim) for d in deps))
        nodes.append(dataclasses.replace(node, id=node.id - (node.id > victim), deps=renumbered))
    return MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, dict(mg.info))


def test_the_pieces_of_a_nested_tree_and_their_boxes():
    tg = hand_assembled()
    root = tg.outputs["y"]
    ((found, pieces),) = output_assemblies(tg).items()
    assert found == root
    boxes = {p.box: (tg[p.task].kind, tg[p.base].kind) for p in pieces}
    assert boxes == {
        ((0, 2), (0, 16)): ("view", "einsum"),
        ((0, 2), (16, 16)): ("view", "einsum"),
        ((2, 4), (0, 32)): ("einsum", "einsum"),
    }
    # Concats and leaf views are never applied; the einsum blocks are.
    on_host = assembly_tasks(tg)
    assert {tg[t].kind for t in on_host} == {"concat", "view"} and set(on_host.values()) == {root}


def test_a_hand_made_tree_is_assembled_on_the_host_and_runs_everywhere():
    tg = hand_assembled()
    root = tg.outputs["y"]
    mg = memgraph.plan(tg, "64KiB")
    memgraph.verify(mg)
    fills = sliced_offloads(mg)
    assert len(fills) == 3 and {n.into for n in fills} == {root}
    assert not any(n.kind is NodeKind.APPLY and tg[n.tensor].kind == "concat" for n in mg)
    assert mg.info["outputs_on_host"] == ["y"] and mg.stats.sliced_offload_count == 3
    assert mg.stats.sliced_offload_count == 3
    assert mg.stats.sliced_offload_bytes == sum(tg[n.tensor].nbytes for n in fills)
    # Each block is freed after (and only after) its sliced offload.
    for fill in fills:
        (free,) = [n for n in mg.nodes if n.kind is NodeKind.FREE and n.tensor == fill.tensor]
        assert fill.id in free.deps
    inputs = hand_inputs(tg)
    want = taskgraph.evaluate(tg, inputs)["y"]
    for mode in MODES:
        got = runtime.run(mg, inputs, backend="numpy", mode=mode, seed=3)["y"]
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with runtime.Session(mg, StagingNumpyBackend(), mode="sequential") as session:
        (storage,) = {n.storage for n in fills}
        assert session.layout.storages[storage].shape == tg[root].shape
        assert set(session.layout.storages) == set(mg.storages)  # nothing staged per piece
        np.testing.assert_allclose(session.run(inputs)["y"], want, rtol=1e-6)


def test_a_slice_of_a_block_keeps_the_concats_on_the_device():
    tg = hand_assembled(slice_leaf=True)
    assert output_assemblies(tg) == {} and assembly_tasks(tg) == {}
    mg = memgraph.plan(tg, "64KiB")
    memgraph.verify(mg)
    assert not sliced_offloads(mg) and mg.info["outputs_on_host"] == []
    applied = {tg[n.tensor].kind for n in mg.of_kind(NodeKind.APPLY)}
    assert "concat" in applied
    inputs = hand_inputs(tg)
    got = runtime.run(mg, inputs, backend="numpy", mode="random", seed=1)["y"]
    np.testing.assert_allclose(got, taskgraph.evaluate(tg, inputs)["y"], rtol=1e-6)


def test_a_block_with_another_reader_keeps_the_concats_on_the_device():
    tg = hand_assembled()
    prog_tasks = list(tg.tasks)
    # A second output reads the first piece's base: that piece has another reader.
    base = next(p.base for p in output_assemblies(tg)[tg.outputs["y"]])
    outputs = {**tg.outputs, "piece": base}
    shared = TaskGraph(tuple(prog_tasks), outputs, tg.name)
    assert output_assemblies(shared) == {}
    mg = memgraph.plan(shared, "64KiB")
    memgraph.verify(mg)
    assert not sliced_offloads(mg)
    inputs = hand_inputs(shared)
    got = runtime.run(mg, inputs, backend="numpy", mode="sequential")
    want = taskgraph.evaluate(shared, inputs)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6)


def test_the_verifier_detects_a_missing_sliced_offload():
    mg = memgraph.plan(hand_assembled(), "64KiB")
    fill = sliced_offloads(mg)[1]
    with pytest.raises(VerificationError, match="misses the box"):
        memgraph.verify(without(mg, fill.id))


def test_the_verifier_detects_an_output_that_does_not_wait_for_every_piece():
    mg = memgraph.plan(hand_assembled(), "64KiB")
    fill = sliced_offloads(mg)[-1]  # no later node reaches it but the output
    output = mg.of_kind(NodeKind.OUTPUT)[0]
    deps = tuple(d for d in output.deps if d != fill.id)
    nodes = list(mg.nodes)
    nodes[output.id] = dataclasses.replace(output, deps=deps)
    broken = MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, dict(mg.info))
    with pytest.raises(VerificationError, match=f"missing dependency on n{fill.id}"):
        memgraph.verify(broken)


def test_the_verifier_refuses_a_sliced_offload_into_a_task_that_is_not_an_assembly():
    mg = memgraph.plan(hand_assembled(), "64KiB")
    fill = sliced_offloads(mg)[0]
    nodes = list(mg.nodes)
    nodes[fill.id] = dataclasses.replace(fill, into=fill.tensor)
    broken = MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, dict(mg.info))
    with pytest.raises(VerificationError, match="is not a Concat that assembles"):
        memgraph.verify(broken)


def test_only_offloads_fill_an_assembly():
    mg = memgraph.plan(hand_assembled(), "64KiB")
    root = mg.taskgraph.outputs["y"]
    free = mg.of_kind(NodeKind.FREE)[0]
    nodes = list(mg.nodes)
    nodes[free.id] = dataclasses.replace(free, into=root)
    broken = MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, dict(mg.info))
    with pytest.raises(VerificationError, match="only an offload can fill"):
        memgraph.verify(broken)


def test_the_verifier_refuses_writing_a_box_twice():
    mg = memgraph.plan(hand_assembled(), "64KiB")
    fill = sliced_offloads(mg)[0]
    nodes = list(mg.nodes)
    twice = dataclasses.replace(fill, id=fill.id + 1, deps=(fill.id,))
    shifted = [
        dataclasses.replace(n, id=n.id + 1, deps=tuple(d + (d > fill.id) for d in n.deps))
        for n in nodes[fill.id + 1 :]
    ]
    broken = MemGraph(
        mg.taskgraph,
        (*nodes[: fill.id + 1], twice, *shifted),
        mg.budget,
        mg.alignment,
        dict(mg.info),
    )
    with pytest.raises(VerificationError, match="was already written"):
        memgraph.verify(broken)


def test_sliced_offloads_survive_json_and_show_their_box():
    mg = memgraph.plan(hand_assembled(), "64KiB")
    again = MemGraph.from_json(mg.to_json())
    assert again.nodes == mg.nodes
    memgraph.verify(again)
    root = mg.taskgraph.outputs["y"]
    fill = next(n for n in sliced_offloads(mg) if mg.taskgraph[n.tensor].shape == (4, 32))
    assert fill.describe().endswith(f"into %{root}")
    label = " ".join(line.text for line in node_lines(mg, fill))
    assert f"[2:6, 0:32] of %{root}" in label
    assert memgraph.simulate(mg, "h100-pcie5").bytes_moved["d2h"] >= mg.stats.sliced_offload_bytes


def with_node(mg: MemGraph, node) -> MemGraph:
    nodes = list(mg.nodes)
    nodes[node.id] = node
    return MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, dict(mg.info))


def test_sliced_offloads_carry_the_boxes_that_tile_the_output():
    tg = hand_assembled()
    mg = memgraph.plan(tg, "64KiB")
    root = tg.outputs["y"]
    fills = sliced_offloads(mg)
    (storage,) = {n.storage for n in fills}
    assert mg.storages[storage] == memgraph.HostStorage(
        storage, (6, 32), "float32", 768, root, "assembly"
    )
    boxes = sorted((n.box.starts, n.box.sizes) for n in fills)
    assert boxes == [((0, 0), (2, 16)), ((0, 16), (2, 16)), ((2, 0), (4, 32))]
    assert all(n.box.shape == (6, 32) and n.box.dtype == "float32" for n in fills)


def test_the_verifier_refuses_overlapping_boxes():
    mg = memgraph.plan(hand_assembled(), "64KiB")
    small = sorted((n for n in sliced_offloads(mg) if n.box.sizes == (2, 16)), key=lambda n: n.id)
    first, second = small
    bad = with_node(mg, dataclasses.replace(second, box=first.box))
    with pytest.raises(VerificationError, match=f"was already written by n{first.id}"):
        memgraph.verify(bad)


def test_the_verifier_refuses_a_box_that_is_not_its_leaf_s_place():
    mg = memgraph.plan(hand_assembled(), "64KiB")
    first, second = sorted(
        (n for n in sliced_offloads(mg) if n.box.sizes == (2, 16)), key=lambda n: n.id
    )
    bad = with_node(mg, dataclasses.replace(first, box=second.box))
    with pytest.raises(VerificationError, match="but its box in output assembly"):
        memgraph.verify(bad)


@pytest.mark.parametrize(
    "starts, sizes, message",
    [
        ((5, 0), (2, 16), r"box \[5:7, 0:16\] does not lie inside host#"),
        ((0, 0), (2, 8), "holds 64 bytes of float32, but %.* has 128 bytes"),
    ],
)
def test_the_verifier_checks_each_sliced_offload_box(starts, sizes, message):
    mg = memgraph.plan(hand_assembled(), "64KiB")
    fill = next(n for n in sliced_offloads(mg) if n.box.sizes == (2, 16))
    box = dataclasses.replace(fill.box, starts=starts, sizes=sizes)
    with pytest.raises(VerificationError, match=message):
        memgraph.verify(with_node(mg, dataclasses.replace(fill, box=box)))


def test_a_sliced_offload_needs_its_box():
    mg = memgraph.plan(hand_assembled(), "64KiB")
    fill = sliced_offloads(mg)[0]
    with pytest.raises(VerificationError, match="a sliced offload into host#.* carries no box"):
        memgraph.verify(with_node(mg, dataclasses.replace(fill, box=None)))


def test_the_assembly_storage_has_the_output_s_size():
    mg = memgraph.plan(hand_assembled(), "64KiB")
    storage = sliced_offloads(mg)[0].storage
    entry = dataclasses.replace(mg.storages[storage], shape=(6, 16), nbytes=384)
    bad = MemGraph(
        mg.taskgraph, mg.nodes, mg.budget, mg.alignment, mg.info, {**mg.storages, storage: entry}
    )
    with pytest.raises(VerificationError, match=r"float32\[6,16\].*but it holds assembly"):
        memgraph.verify(bad)
