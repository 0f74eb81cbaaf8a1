"""The workloads on several devices on a local Ray instance (`runtime.ray_cluster`: an
actor and a NumPy arena per device, links through Ray's object store): LLaMA-tiny and
GPT-2-tiny prefill on 2-4 actors, an unrolled generation, a decode step and a training
step on 2, each at every device's smallest budget (offloads forced), equal to
`taskgraph.evaluate` of the unsplit graph; random layered programs at random budgets
(a few examples: each starts its actors). One Ray instance for the module
(`num_cpus=2`, no dashboard), shut down at its end."""

from __future__ import annotations

import pytest
import workloads
from strategies import program_inputs

import einpage as ep
import taskgraph
from runtime.ray_cluster import RayDevices
from taskgraph.builder import GraphBuilder
from taskgraph.einsum import EinsumSpec
from taskgraph.nodes import Einsum, Input

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'einpage[cluster]'")

LOCAL = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False}


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance for the module (one already up is used and left up)."""
    started = not ray.is_initialized()
    if started:
        ray.init(**LOCAL)
    yield
    if started:
        ray.shutdown()


def test_a_device_the_placement_leaves_idle_gets_no_actor_and_the_rest_runs(cluster):
    """Weight "a" is device 0's group, but its one reader also reads the larger "b" and
    goes to device 1: device 0's graph is empty. Its plan has no outputs, which JSON
    cannot carry to an actor; it needs none (it computes nothing)."""
    prog = ep.Program("idle")
    a = prog.input("a", (2, 2), role="weight")
    b = prog.input("b", (2, 3), role="weight")
    c = prog.input("c", (3,), role="weight")
    prog.output(prog.einsum("ij,ik->k", a, b) * c, "y")
    tg = prog.build()
    mp, _ = workloads.smallest_plans(tg, 2)
    assert len(mp.plans[0].mg) == 0 and not mp.links
    with RayDevices(mp, timeout=30) as devices:
        assert devices.actors[0] is None and devices.actors[1] is not None
        assert "actors=1" in repr(devices)
        for seed in (0, 1):
            inputs = program_inputs(tg, seed)
            workloads.assert_close(devices.run(inputs), taskgraph.evaluate(tg, inputs), 1e-5)


def test_a_device_with_only_dead_code_gets_no_actor_and_its_link_is_not_sent(cluster):
    """h = x @ w0 is device 0's output "y"; h @ w1, on device 1 with w1, is read by no
    output: device 1's graph (a link's input, w1, the dead matmul) has no outputs, so
    it gets no actor and device 0 sends it nothing."""
    builder = GraphBuilder("dead")
    x = builder.add(Input("x"), (), (4, 8), "float32")
    w0 = builder.add(Input("w0", role="weight"), (), (8, 8), "float32")
    w1 = builder.add(Input("w1", role="weight"), (), (8, 8), "float32")
    matmul = Einsum(EinsumSpec.parse("ij,jk->ik"))
    h = builder.add(matmul, [x, w0])
    builder.add(matmul, [h, w1])  # dead
    builder.output(h, "y")
    tg = builder.build()
    mp, _ = workloads.smallest_plans(tg, 2)
    assert [bool(p.mg.taskgraph.outputs) for p in mp.plans] == [True, False]
    assert [(k.source, k.target) for k in mp.links] == [(0, 1)]
    inputs = program_inputs(tg, 3)
    with RayDevices(mp, timeout=30) as devices:
        assert devices.actors[1] is None
        workloads.assert_close(devices.run(inputs), taskgraph.evaluate(tg, inputs), 1e-5)
