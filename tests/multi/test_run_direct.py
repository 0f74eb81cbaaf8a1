"""Direct links run: plans from `plan_devices(..., sends="direct")` – a chain pipeline on 2
and 3 devices, LLaMA-tiny and GPT-2-tiny prefill placed tensor parallel (the all-reduce
partials go direct) and as a pipeline – run in one process (`run_devices`, `LocalDevices`)
in ready and random order, and once on Ray, each equal to `taskgraph.evaluate` of the
unsplit graph. A send offers the source's arena bytes and is done only once the target
has copied them: the source runs other nodes meanwhile, the free of the sent region
waits, and a mutant plan whose free does not wait for its send reads poison. Waits for
an offer or an acknowledgement are bounded and name the device and the node; a failure
on one device stops the other; a plain `runtime.run` or `Session` refuses a device's
plan with sends before allocating anything."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import workloads
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import program_inputs
from test_placement import layered_programs
from test_placement_driver import chain

import einpage as ep
import runtime
import runtime.numpy_backend
import taskgraph
from einpage_core.errors import BackendError, EinpageError, VerificationError
from memgraph import min_budget
from memgraph.graph import MemGraph
from memgraph.multi import plan_devices, verify_multi
from memgraph.nodes import NodeKind
from memgraph.placement import place
from runtime.multi import DeviceRunner, Inbox, InboxPeers, LocalDevices, PeerPort, run_devices

ORDERS = [("ready", None)] + [("random", seed) for seed in range(3)]


DELAY = 0.3
"""Seconds a test holds the target's copy back (so that the source surely runs ahead)."""


def direct_plan(tg, devices: int, strategy: str = "pipeline", budget="tight"):
    """`tg` placed by `strategy` and planned with direct sends, at each device's smallest
    budget ("tight") or at `budget`; verified, with at least one link direct."""
    placed = place(tg, devices, strategy)
    if budget == "tight":
        budget = [min_budget(part.tg)[0] for part in placed.parts]
    mp = plan_devices(placed, devices, budget, sends="direct")
    verify_multi(mp)
    assert mp.info["direct"]["links"] > 0, mp.info["direct"]
    assert sum(link.path == "peer" for link in mp.links) == mp.info["direct"]["links"]
    return mp


def chain_case(devices: int):
    tg, arrays = chain(widths=(16,) * (2 * devices + 1))
    return tg, arrays, direct_plan(tg, devices)


def kinds(mg, kind):
    return [node for node in mg.nodes if node.kind is kind]


# -- equal to the reference ----------------------------------------------------------


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("order,seed", ORDERS)
def test_a_chain_pipeline_sent_direct_equals_the_reference(devices, order, seed):
    tg, arrays, mp = chain_case(devices)
    assert all(link.path == "peer" for link in mp.links)  # every stage boundary direct
    for plan in mp.plans:  # tight: the budgets force reloads beyond the first loads
        assert plan.mg.stats.peak_bytes <= plan.budget
    got = run_devices(mp, arrays, order=order, seed=seed, timeout=30)
    workloads.assert_close(got, taskgraph.evaluate(tg, arrays), 1e-5)


PREFILLS = {
    "llama": lambda: workloads.llama_gqa_prefill(2),
    "gpt2": workloads.gpt2_prefill,
}


@pytest.fixture(scope="module", params=[(m, s) for m in PREFILLS for s in ("tensor", "pipeline")])
def prefill(request):
    """A prefill placed on 2 devices, at each device's smallest budget, sent direct."""
    model, strategy = request.param
    case = PREFILLS[model]()
    mp = direct_plan(case.tg, 2, strategy)
    return case, mp, taskgraph.evaluate(case.tg, case.inputs)


@pytest.mark.parametrize("order,seed", ORDERS)
def test_prefills_sent_direct_equal_the_unsplit_reference(prefill, order, seed):
    case, mp, want = prefill
    if mp.placed.strategy == "tensor":  # partials go both ways
        assert {(k.source, k.target) for k in mp.links if k.path == "peer"} == {(0, 1), (1, 0)}
    got = run_devices(mp, case.inputs, order=order, seed=seed, timeout=30)
    workloads.assert_close(got, want, case.rtol)


def test_local_devices_run_a_direct_plan_twice(prefill):
    """Weights staged once, two runs (ready, then random order on other runners): each
    equal to the reference, nothing of the first run's links left for the second."""
    case, mp, want = prefill
    weights = {n: v for n, v in case.inputs.items() if n != "tokens"}
    activations = {n: v for n, v in case.inputs.items() if n not in weights}
    for order, seed in (("ready", None), ("random", 7)):
        with LocalDevices(mp, order=order, seed=seed, timeout=30) as devices:
            devices.stage(weights)
            for _ in range(2):
                workloads.assert_close(devices.run(activations), want, case.rtol)


@settings(max_examples=12, deadline=None)
@given(
    case=layered_programs(),
    tight=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    order=st.sampled_from(["ready", "random"]),
)
def test_random_layered_programs_sent_direct_equal_the_reference(case, tight, seed, order):
    """Whatever links the rewrite makes direct (links may go back to an earlier device),
    the run equals the unsplit reference."""
    tg, devices = case
    placed = place(tg, devices)
    mp = plan_devices(placed, devices, workloads.random_budgets(placed, tight), sends="direct")
    verify_multi(mp)
    inputs = program_inputs(tg, seed)
    got = run_devices(mp, inputs, order=order, seed=seed, timeout=30)
    workloads.assert_close(got, taskgraph.evaluate(tg, inputs), workloads.tolerance_of(tg))


def test_a_sent_tensor_that_is_also_an_output_of_its_device_stays_an_output():
    prog = ep.Program("chain")
    x = prog.input("x", (4, 16))
    for i in range(4):
        x = ep.tanh(x @ prog.input(f"w{i}", (16, 16), role="weight"))
        if i == 1:
            prog.output(x, "mid")  # the tensor device 0 sends to device 1
    prog.output(x, "y")
    tg = prog.build()
    mp = plan_devices(tg, 2, "100%", sends="direct")
    assert mp.outputs["mid"][0] == 0 and mp.links[0].source == 0
    assert mp.links[0].path == "peer"  # sent direct, and its host copy kept as "mid"
    verify_multi(mp)
    arrays = program_inputs(tg, 0)
    got = run_devices(mp, arrays, timeout=30)
    workloads.assert_close(got, taskgraph.evaluate(tg, arrays), 1e-5)


# -- one copy, a rendezvous -----------------------------------------------------------


@pytest.fixture
def timeline(monkeypatch):
    """Records (device, node kind, node id, time) after each node a runner runs, and
    (device, "copied", link, time) after each direct copy; the target of every copy
    waits `DELAY` seconds before copying. Also records each offered view."""
    events: list[tuple[int, str, int, float]] = []
    offered: list[tuple[int, object]] = []
    lock = threading.Lock()
    run_node, recv, offer = DeviceRunner._run_node, PeerPort.recv, InboxPeers.offer

    def logged_run_node(self, plan, node):
        run_node(self, plan, node)
        with lock:
            events.append((self.device, node.kind.value, node.id, time.monotonic()))

    def late_recv(self, node, view, stream):
        time.sleep(DELAY)
        recv(self, node, view, stream)
        with lock:
            events.append((self.device, "copied", node.link, time.monotonic()))

    def recorded_offer(self, index, link, view):
        offered.append((index, view))
        return offer(self, index, link, view)

    monkeypatch.setattr(DeviceRunner, "_run_node", logged_run_node)
    monkeypatch.setattr(PeerPort, "recv", late_recv)
    monkeypatch.setattr(InboxPeers, "offer", recorded_offer)
    return events, offered


def test_a_send_offers_the_arena_and_its_free_waits_for_the_copy(timeline):
    """Device 0 offers a view of its own arena (no copy), keeps running other nodes while
    device 1 holds the copy back, and frees the sent region only after the copy."""
    events, offered = timeline
    tg, arrays, mp = chain_case(2)
    with LocalDevices(mp, timeout=30, poison=True) as devices:
        got = devices.run(arrays)
        arena = devices.runners[0].arena
        assert [index for index, _ in offered] == [0]
        assert np.shares_memory(offered[0][1], arena)  # the source's bytes themselves
    workloads.assert_close(got, taskgraph.evaluate(tg, arrays), 1e-5)
    mg = mp.plans[0].mg
    (send,) = kinds(mg, NodeKind.SEND)
    (free,) = [n for n in kinds(mg, NodeKind.FREE) if send.id in n.deps]
    when = {(d, kind, i): t for d, kind, i, t in events}
    sent, freed, copied = when[0, "send", send.id], when[0, "free", free.id], when[1, "copied", 0]
    assert sent < copied < freed
    between = [i for d, kind, i, t in events if d == 0 and sent < t < copied]
    assert between, "device 0 ran nothing while its send waited for the copy"
    assert copied - sent >= DELAY * 0.9


def free_not_waiting_for_send(mp, device: int = 0):
    """`mp` with device `device`'s free of its sent region depending on what the send
    depends on instead of the send: the region can be freed (poisoned) before the copy."""
    plan = mp.plans[device]
    nodes = list(plan.mg.nodes)
    (send,) = kinds(plan.mg, NodeKind.SEND)
    (free,) = [n for n in nodes if n.kind is NodeKind.FREE and send.id in n.deps]
    nodes[free.id] = dataclasses.replace(
        free, deps=tuple(sorted((set(free.deps) - {send.id}) | set(send.deps)))
    )
    old = plan.mg
    mg = MemGraph(old.taskgraph, tuple(nodes), old.budget, old.alignment, dict(old.info),
                  old.storages)  # fmt: skip
    plans = list(mp.plans)
    plans[device] = dataclasses.replace(plan, mg=mg)
    return dataclasses.replace(mp, plans=tuple(plans))


def test_a_free_that_does_not_wait_for_its_send_reads_poison(timeline):
    """The mutant frees (poisons) the sent region as soon as the send is offered; the
    target, holding its copy back, copies poison: the outputs are wrong (NaN), where
    the same run of the real plan is right. The verifier refuses the mutant."""
    tg, arrays, mp = chain_case(2)
    want = taskgraph.evaluate(tg, arrays)
    mutant = free_not_waiting_for_send(mp)
    with pytest.raises(VerificationError):
        verify_multi(mutant)
    workloads.assert_close(run_devices(mp, arrays, timeout=30, poison=True), want, 1e-5)
    try:
        got = run_devices(mutant, arrays, timeout=30, poison=True, unsafe_skip_verify=True)
    except EinpageError:
        return  # an error is as good a detection as a wrong answer
    assert not np.allclose(got["y"], want["y"])
    assert np.isnan(got["y"]).all()


# -- waits are bounded, failures stop the other device ---------------------------------


def _on(device: int) -> bool:
    return threading.current_thread().name == f"einpage-device-{device}"


def test_a_target_waiting_on_a_recv_for_a_late_source_times_out_naming_both(monkeypatch):
    """Device 0 hangs in an apply before its send; device 1 gives up after the timeout,
    naming its recv and the send it waits for; device 0 stops at its next node."""
    real = runtime.numpy_backend.evaluate_task

    def slow_on_device_0(task, operands, out):
        if _on(0):
            time.sleep(2.0)
        return real(task, operands, out=out)

    monkeypatch.setattr(runtime.numpy_backend, "evaluate_task", slow_on_device_0)
    tg, arrays, mp = chain_case(2)
    started = time.monotonic()
    with pytest.raises(
        BackendError,
        match=r"device 1 waited more than 0.3 s for 1 link\(s\) that did not arrive: "
        r"n\d+ \(recv \"recv:%\d+\".*\) for device 0's send of 'send:%\d+' \(link#0\)",
    ):
        run_devices(mp, arrays, timeout=0.3)
    assert time.monotonic() - started < 10
    assert not [t for t in threading.enumerate() if t.name.startswith("einpage-device-")]


def test_a_source_whose_copy_is_never_acknowledged_times_out_naming_its_send(monkeypatch):
    """Device 1 copies but never acknowledges: device 0's free of the sent region waits,
    and device 0 gives up after the timeout naming its send and the target."""

    def copy_without_acknowledging(self, node, view, stream):
        offered = self.offers.pop(node.link)
        self.backend.copy_to_device(view, offered, self.stream)

    monkeypatch.setattr(PeerPort, "recv", copy_without_acknowledging)
    tg, arrays, mp = chain_case(2)
    with pytest.raises(
        BackendError,
        match=r"device 0 waited more than 0.3 s for 1 link\(s\) that did not arrive: "
        r"n\d+ \(send \"send:%\d+\".*\) for device 1 to copy it \(link#0, 'recv:%\d+'\)",
    ):
        run_devices(mp, arrays, timeout=0.3)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failure_on_either_end_stops_the_other_at_once(monkeypatch, failing):
    """Device 0 fails before its send (device 1 waits on the recv) or device 1 fails in
    its recv (device 0 waits for the acknowledgement): the other is cancelled at once,
    not after the timeout, and the error names the device that failed."""
    real_apply, real_recv = runtime.numpy_backend.evaluate_task, PeerPort.recv

    def apply(task, operands, out):
        if failing == 0 and _on(0):
            raise RuntimeError("the source broke")
        return real_apply(task, operands, out=out)

    def recv(self, node, view, stream):
        if failing == 1:
            raise RuntimeError("the target broke")
        real_recv(self, node, view, stream)

    monkeypatch.setattr(runtime.numpy_backend, "evaluate_task", apply)
    monkeypatch.setattr(PeerPort, "recv", recv)
    tg, arrays, mp = chain_case(2)
    started = time.monotonic()
    broke = "source" if failing == 0 else "target"
    with pytest.raises(BackendError, match=rf"(?s)the {broke} broke.*device {failing}"):
        run_devices(mp, arrays, timeout=20)
    assert time.monotonic() - started < 5


# -- a device's plan alone -------------------------------------------------------------


def test_a_device_s_plan_with_sends_is_refused_alone_before_anything_is_allocated(monkeypatch):
    tg, arrays, mp = chain_case(2)

    def no_arena(self, nbytes):
        raise AssertionError("allocated an arena for a plan that cannot run alone")

    monkeypatch.setattr(runtime.numpy_backend.NumpyBackend, "allocate_arena", no_arena)
    target = mp.plans[1].mg
    mine = {n: v for n, v in arrays.items() if n in target.taskgraph.inputs}
    said = r"send/recv node\(s\) copying between devices .*runs only with its other devices"
    with pytest.raises(BackendError, match=said):
        runtime.run(target, mine, backend="numpy")
    with pytest.raises(BackendError, match=r"^plan 'a' .*" + said):
        runtime.Session({"a": target, "b": mp.plans[0].mg}, "numpy")


def test_a_runner_given_no_peers_for_a_direct_plan_says_so():
    tg, arrays, mp = chain_case(2)
    with DeviceRunner(0, mp.plans[0].mg, mp.links, "numpy", unsafe_skip_verify=True) as runner:
        mine = {n: v for n, v in arrays.items() if n in runner.driver_inputs}
        said = r"device 0: .*1 direct link\(s\) \(link#0\).*no peers"
        with pytest.raises(BackendError, match=said):
            runner.run_linked(mine, Inbox(), lambda link, value: None, timeout=1)


# -- on Ray ----------------------------------------------------------------------------


def test_a_direct_tensor_parallel_prefill_runs_on_ray_actors(cluster):
    """Ray sends direct links buffered (a copy through the object store); the plan's
    outputs equal the reference, twice on the same actors."""
    from runtime.ray_cluster import RayDevices

    case = workloads.llama_gqa_prefill(2)
    mp = direct_plan(case.tg, 2, "tensor")
    want = taskgraph.evaluate(case.tg, case.inputs)
    with RayDevices(mp, timeout=30, order="random", seed=1) as actors:
        for _ in range(2):
            workloads.assert_close(actors.run(case.inputs), want, case.rtol)
