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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import program_inputs
from test_placement import layered_programs

import einpage as ep
import taskgraph
from memgraph.multi import plan_devices
from memgraph.placement import place
from runtime.ray_cluster import RayDevices, run_on_ray
from taskgraph.builder import GraphBuilder
from taskgraph.einsum import EinsumSpec
from taskgraph.nodes import Einsum, Input

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'einpage[cluster]'")


@pytest.mark.parametrize(
    "make,devices",
    [
        (workloads.llama_prefill, 2),
        (workloads.llama_prefill, 3),
        (workloads.llama_prefill, 4),
        (workloads.gpt2_prefill, 2),
        (workloads.gpt2_prefill, 3),
        (workloads.gpt2_prefill, 4),
        (workloads.partitioned_prefill, 3),
    ],
)
def test_prefill_runs_on_ray_actors_equal_to_the_unsplit_reference(cluster, make, devices):
    """Twice on the same actors, the second time on other tokens (the arenas are kept)."""
    case = make()
    mp, roomy = workloads.smallest_plans(case.tg, devices)
    workloads.assert_forced_to_move(mp, roomy)
    with RayDevices(mp, timeout=30) as actors:
        assert len(actors.actors) == devices
        for tokens in (case.inputs["tokens"], case.inputs["tokens"][::-1]):
            inputs = {**case.inputs, "tokens": tokens.copy()}
            got = actors.run(inputs)
            workloads.assert_close(got, taskgraph.evaluate(case.tg, inputs), case.rtol)


@pytest.mark.parametrize("model,order,seed", [("llama", "ready", None), ("llama", "random", 3),
                                              ("gpt2", "random", 4)])  # fmt: skip
def test_an_unrolled_generation_runs_on_two_ray_actors(cluster, model, order, seed):
    """LLaMA's chosen ids go from device 1's head back to device 0's embedding each
    step; GPT-2's last hidden states go back to its tied head on device 0."""
    case = workloads.generation(model, new=3)
    mp, roomy = workloads.smallest_plans(case.tg, 2)
    assert {(k.source, k.target) for k in mp.links} == {(0, 1), (1, 0)}
    workloads.assert_forced_to_move(mp, roomy)
    got = run_on_ray(mp, case.inputs, order=order, seed=seed, timeout=30)
    workloads.assert_close(got, taskgraph.evaluate(case.tg, case.inputs), case.rtol)


def test_a_decode_step_runs_on_two_ray_actors_each_with_its_layers_pages(cluster):
    case = workloads.decode_step()
    mp, roomy = workloads.smallest_plans(case.tg, 2)
    for page in workloads.kv_pages(case.tg):
        name = case.tg[page].op.name
        assert sum(name in p.mg.taskgraph.inputs for p in mp.plans) == 1, name
    workloads.assert_forced_to_move(mp, roomy)
    got = run_on_ray(mp, case.inputs, timeout=30)
    workloads.assert_close(got, taskgraph.evaluate(case.tg, case.inputs), case.rtol)


def test_a_training_step_runs_on_two_ray_actors(cluster):
    case = workloads.training_step()
    mp, roomy = workloads.smallest_plans(case.tg, 2)
    assert {(k.source, k.target) for k in mp.links} == {(0, 1), (1, 0)}
    workloads.assert_forced_to_move(mp, roomy)
    got = run_on_ray(mp, case.inputs, order="random", seed=1, timeout=30)
    workloads.assert_close(got, taskgraph.evaluate(case.tg, case.inputs), case.rtol)


@settings(
    max_examples=3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=layered_programs(), tight=st.floats(0.0, 1.0), seed=st.integers(0, 99))
def test_random_layered_programs_at_random_budgets_run_on_ray(cluster, case, tight, seed):
    """2-4 actors per example, budgets between each device's smallest and its resident
    peak."""
    tg, devices = case
    placed = place(tg, devices)
    mp = plan_devices(placed, devices, workloads.random_budgets(placed, tight))
    inputs = program_inputs(tg, seed)
    got = run_on_ray(mp, inputs, order="random", seed=seed, timeout=30)
    workloads.assert_close(got, taskgraph.evaluate(tg, inputs), workloads.tolerance_of(tg))


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
