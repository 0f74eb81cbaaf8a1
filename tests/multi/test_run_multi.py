"""runtime.multi: MultiPlans made by hand run in one process, a thread per device, equal to
a reference composed of `taskgraph.evaluate` of each device's TaskGraph; failures name
the device, waits are bounded and every thread is joined."""

from __future__ import annotations

import dataclasses
import threading
import time

import handmade
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import TOLERANCE, einsum_programs

from einpage_core.errors import BackendError, InputError, VerificationError
from memgraph.nodes import NodeKind
from runtime.multi import DeviceRunner, Inbox, LocalDevices, run_devices

CASES = tuple(handmade.CASES)
ORDERS = [("ready", None)] + [("random", seed) for seed in range(4)]


def _device_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("einpage-device-")]


def _assert_equal(got, want, rtol=1e-5, atol=1e-6):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


@pytest.fixture(scope="module", params=CASES)
def case(request):
    made = handmade.make_case(request.param)
    inputs = handmade.case_inputs(made, seed=1)
    return made, inputs, handmade.reference(made, inputs)


@pytest.mark.parametrize("budget", handmade.BUDGETS)
@pytest.mark.parametrize("order,seed", ORDERS)
def test_hand_made_plans_equal_the_reference(case, budget, order, seed):
    made, inputs, want = case
    mp = handmade.plan_case(made, budget)
    got = run_devices(mp, inputs, order=order, seed=seed, timeout=30)
    _assert_equal(got, want)
    assert not _device_threads()


def test_tight_budgets_move_more_than_the_links_and_outputs():
    """The 'tight' budgets make the runs above exercise offloads, not only first loads."""
    for name in CASES:
        mp = handmade.plan_case(handmade.make_case(name), "tight")
        for plan in mp.plans:
            tg = plan.mg.taskgraph
            sent = sum(tg[i].nbytes for i in tg.outputs.values())
            assert plan.mg.stats.offload_bytes > sent, (name, plan.device)


def test_the_cycle_really_goes_back_and_forth():
    """Device 0's plan reads device 1's result after sending it its own: the run needs
    the links in both directions, while device 0 is running."""
    made = handmade.make_case("cycle")
    mp = handmade.plan_case(made, "tight")
    sources = {(link.source, link.target) for link in mp.links}
    assert sources == {(0, 1), (1, 0)}
    tg0 = mp.plans[0].mg.taskgraph
    assert set(tg0.outputs) >= {"send:%10"} and "recv:%20" in tg0.inputs


def test_a_device_that_fails_names_itself_and_stops_the_others(monkeypatch):
    """Device 1 of the cycle fails in its first apply; device 0, waiting for device 1's
    link, is cancelled at once (not after the timeout), and both threads are joined."""
    made = handmade.make_case("cycle")
    mp = handmade.plan_case(made, "100%")
    inputs = handmade.case_inputs(made)
    import runtime.numpy_backend

    real = runtime.numpy_backend.evaluate_task
    device1_tasks = {id(t) for t in mp.plans[1].mg.taskgraph.tasks}

    def broken(task, operands, out):
        if id(task) in device1_tasks:
            raise ValueError(f"kernel of %{task.id} exploded")
        return real(task, operands, out=out)

    monkeypatch.setattr(runtime.numpy_backend, "evaluate_task", broken)
    started = time.monotonic()
    with pytest.raises(
        BackendError, match=r"(?s)apply.*ValueError: kernel of %\d+ exploded.*device 1"
    ):
        run_devices(mp, inputs, timeout=20)
    assert time.monotonic() - started < 10
    assert not _device_threads()


def test_a_link_that_never_arrives_times_out_naming_the_device_and_its_nodes():
    mp = handmade.cross_wired()
    inputs = {"w0": np.eye(4, dtype="float32"), "w1": np.eye(4, dtype="float32")}
    started = time.monotonic()
    with pytest.raises(
        BackendError,
        match=r"device [01] waited more than 0.3 s for 1 link\(s\) that did not arrive: "
        r"n\d+ \(input \"recv:%[12]\".*\) from device [01]'s output 'send:%[12]'",
    ):
        run_devices(mp, inputs, timeout=0.3, unsafe_skip_verify=True)
    assert time.monotonic() - started < 5
    assert not _device_threads()


def test_the_verifier_refuses_a_cross_wired_plan_before_anything_runs():
    """The plan whose devices wait for each other is a cycle of the union: verify_multi
    (which run_devices calls first) names it, so no run of a verified plan can hang."""
    inputs = {"w0": np.eye(4, dtype="float32"), "w1": np.eye(4, dtype="float32")}
    with pytest.raises(VerificationError, match="cycle"):
        run_devices(handmade.cross_wired(), inputs, timeout=0.3)
    assert not _device_threads()


def test_every_device_plan_is_verified_first_naming_the_device():
    made = handmade.make_case("chain")
    mp = handmade.plan_case(made, "tight")
    mg = mp.plans[1].mg
    apply = next(n for n in mg.nodes if n.kind is NodeKind.APPLY and n.deps)
    broken_node = dataclasses.replace(apply, deps=())
    nodes = tuple(broken_node if n.id == apply.id else n for n in mg.nodes)
    broken = dataclasses.replace(mg, nodes=nodes)
    plans = (mp.plans[0], dataclasses.replace(mp.plans[1], mg=broken))
    bad = dataclasses.replace(mp, plans=plans)
    with pytest.raises(VerificationError, match="^device 1: .*missing dependency"):
        run_devices(bad, handmade.case_inputs(made))
    assert not _device_threads()


def test_inputs_are_checked_against_every_device():
    made = handmade.make_case("fanout")
    mp = handmade.plan_case(made, "100%")
    inputs = handmade.case_inputs(made)
    less = {k: v for k, v in inputs.items() if k != "bias"}
    with pytest.raises(InputError, match=r"missing input\(s\): 'bias' \(device\(s\) \[2\]\)"):
        run_devices(mp, less)
    with pytest.raises(InputError, match="unknown input.*'recv:%10'"):
        run_devices(mp, {**inputs, "recv:%10": np.zeros((48, 48), "float32")})
    wrong = {**inputs, "bias": np.zeros(3, "float32")}
    with pytest.raises(InputError, match="bias"):
        run_devices(mp, wrong)
    with pytest.raises(BackendError, match="unknown order 'fifo'"):
        run_devices(mp, inputs, order="fifo")


def test_an_inbox_wait_is_bounded_and_cancellable():
    inbox = Inbox()
    started = time.monotonic()
    assert inbox.take(["a"], 0.05) is None
    assert time.monotonic() - started >= 0.05
    inbox.put("a", np.ones(2))
    assert set(inbox.take(["a", "b"], 1.0)) == {"a"}
    waiter_error: list[BaseException] = []

    def wait() -> None:
        try:
            inbox.take(["b"], 30.0)
        except BaseException as err:
            waiter_error.append(err)

    thread = threading.Thread(target=wait)
    thread.start()
    inbox.cancel("stopped: device 3 failed")
    thread.join(5.0)
    assert not thread.is_alive()
    assert isinstance(waiter_error[0], BackendError) and "device 3" in str(waiter_error[0])


# -- random programs, split by hand at links ------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    head=einsum_programs(max_tasks=12),
    fraction=st.floats(0.0, 1.0),
    order=st.sampled_from(["ready", "random"]),
    seed=st.integers(0, 2**16),
)
def test_random_programs_split_at_links_equal_the_reference(head, fraction, order, seed):
    """A random program on device 0 whose output `out` feeds device 1, which feeds device
    2, each device planned under a random budget between its smallest and its resident
    peak: the outputs equal `taskgraph.evaluate` of the three parts in turn."""
    split = handmade.split_program(head, fraction)
    inputs = handmade.split_inputs(split, seed)
    got = run_devices(split.mp, inputs, order=order, seed=seed, timeout=30)
    tol = TOLERANCE[split.dtype]
    _assert_equal(got, handmade.split_reference(split, inputs), rtol=tol, atol=tol)


def test_random_orders_differ_by_seed_and_honour_dependencies_and_links(monkeypatch):
    """The order a device runs its nodes in: in "ready" order a link's output node runs
    as soon as it can; random orders differ between seeds, and every order runs a node
    after its dependencies and a link's input node after the link arrived."""
    from runtime.multi import DeviceRunner

    made = handmade.make_case("cycle")
    mp = handmade.plan_case(made, "tight")
    inputs = handmade.case_inputs(made)
    real = DeviceRunner._run_node
    runs: dict[int, list[int]] = {}
    arrived: dict[int, dict[str, int]] = {}
    real_stage = DeviceRunner.stage

    def run_node(self, plan, node):
        runs[self.device].append(node.id)
        return real(self, plan, node)

    def stage(self, arrays):
        for name in arrays:
            if name in self.receives:
                arrived[self.device][name] = len(runs[self.device])
        return real_stage(self, arrays)

    monkeypatch.setattr(DeviceRunner, "_run_node", run_node)
    monkeypatch.setattr(DeviceRunner, "stage", stage)
    orders = {}
    for order, seed in (("ready", None), ("random", 0), ("random", 1)):
        runs.update({d: [] for d in range(mp.devices)})
        arrived.update({d: {} for d in range(mp.devices)})
        run_devices(mp, inputs, order=order, seed=seed, timeout=30)
        for plan in mp.plans:
            done = runs[plan.device]
            position = {node_id: k for k, node_id in enumerate(done)}
            assert sorted(done) == list(range(len(plan.mg.nodes)))
            for node in plan.mg.nodes:
                assert all(position[dep] < position[node.id] for dep in node.deps)
                if node.kind is NodeKind.INPUT and node.name.startswith("recv:"):
                    assert arrived[plan.device][node.name] <= position[node.id]
        orders[(order, seed)] = {d: tuple(r) for d, r in runs.items()}
    assert orders[("random", 0)] != orders[("random", 1)]
    assert orders[("random", 0)] != orders[("ready", None)]
    send = next(
        n for n in mp.plans[0].mg.nodes if n.kind is NodeKind.OUTPUT and n.name == "send:%10"
    )
    producer = max(send.deps)
    ready = orders[("ready", None)][0]
    assert ready.index(send.id) == ready.index(producer) + 1


def test_ray_missing_names_the_extra(monkeypatch):
    import sys

    from einpage_core.errors import MissingDependencyError
    from runtime.ray_cluster import RayDevices

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    mp = handmade.plan_case(handmade.make_case("chain"), "100%")
    with pytest.raises(MissingDependencyError, match=r"pip install 'einpage\[cluster\]'"):
        RayDevices(mp)


def test_a_failure_stops_a_device_that_is_computing(monkeypatch):
    """Device 1 fails at its first apply while device 0 computes (slowly): device 0 stops
    before its next node instead of finishing its plan."""
    made = handmade.make_case("chain")
    mp = handmade.plan_case(made, "100%")
    fed = (*mp.placed.inputs, "recv:%10")
    unlinked = dataclasses.replace(mp, placed=dataclasses.replace(mp.placed, links=(), inputs=fed))
    inputs = {**handmade.case_inputs(made), "recv:%10": np.ones((48, 48), "float32")}
    import runtime.numpy_backend

    real = runtime.numpy_backend.evaluate_task
    device0 = {id(t) for t in mp.plans[0].mg.taskgraph.tasks}
    applies = mp.plans[0].mg.of_kind(NodeKind.APPLY)
    ran: list[int] = []

    def slow_or_broken(task, operands, out):
        if id(task) not in device0:
            raise ValueError("device 1's kernel exploded")
        ran.append(task.id)
        time.sleep(0.2)
        return real(task, operands, out=out)

    monkeypatch.setattr(runtime.numpy_backend, "evaluate_task", slow_or_broken)
    with pytest.raises(BackendError, match="(?s)device 1's kernel exploded.*on device 1"):
        run_devices(unlinked, inputs, timeout=20)
    assert len(ran) < len(applies)
    assert not _device_threads()


@pytest.mark.parametrize("end", ["output", "input"])
def test_a_link_between_names_the_devices_lack_is_refused_first(end):
    made = handmade.make_case("chain")
    mp = handmade.plan_case(made, "100%")
    bad = dataclasses.replace(mp.links[0], **{end: "%99"})
    broken = dataclasses.replace(mp, placed=dataclasses.replace(mp.placed, links=(bad,)))
    device, verb = (0, "reads output") if end == "output" else (1, "feeds input")
    with pytest.raises(VerificationError, match=rf"^device {device}: .* {verb} '%99'"):
        run_devices(broken, handmade.case_inputs(made))
    assert not _device_threads()


# -- several plans over the same devices: LocalDevices ------------------------------------


def _two_plans():
    """The chain and the cycle, both on 2 devices, sharing their inputs' names (the
    cycle's are a superset): plans by key, the cases, and the weights (all but `x`)."""
    cases = {"chain": handmade.make_case("chain"), "cycle": handmade.make_case("cycle")}
    plans = {key: handmade.plan_case(made, "tight") for key, made in cases.items()}
    weights = {n: v for n, v in handmade.case_inputs(cases["cycle"], 1).items() if n != "x"}
    return plans, cases, weights


def _case_reference(made, given):
    wanted = handmade.case_inputs(made)
    return handmade.reference(made, {name: given[name] for name in wanted})


def test_local_devices_stage_once_and_run_several_plans_in_turn(monkeypatch):
    """Each device's runner holds its share of both plans; the weights are staged once,
    each on the devices that read it, and every run gives each plan's reference."""
    plans, cases, weights = _two_plans()
    staged: list[tuple[int, str]] = []
    real = DeviceRunner.stage

    def recorded(self, arrays):
        staged.extend((self.device, name) for name in arrays)
        return real(self, arrays)

    monkeypatch.setattr(DeviceRunner, "stage", recorded)
    with LocalDevices(plans, timeout=30) as devices:
        devices.stage(weights)
        once = sorted(staged)
        for seed in (2, 3):
            x = handmade.case_inputs(cases["cycle"], seed)["x"]
            for key in ("cycle", "chain", "cycle"):
                got = devices.run({"x": x}, plan=key)
                _assert_equal(got, _case_reference(cases[key], {**weights, "x": x}))
    readers = {
        (p.device, name)
        for mp in plans.values()
        for p in mp.plans
        for name in p.mg.taskgraph.inputs
    }
    assert once == sorted(set(once)) and set(once) <= readers
    assert {name for _, name in once} == set(weights)
    assert not any(name in weights for _, name in staged[len(once) :])  # never again
    assert not _device_threads()


def test_local_devices_refuse_what_no_plan_reads_a_missing_input_and_an_unknown_plan():
    plans, _, weights = _two_plans()
    with LocalDevices(plans, timeout=30) as devices:
        with pytest.raises(InputError, match="unknown input\\(s\\) 'nope'"):
            devices.stage({"nope": np.zeros(2)})
        devices.stage({n: v for n, v in weights.items() if not n.startswith("l2.")})
        with pytest.raises(
            InputError, match="missing input\\(s\\): 'l2.w0' \\(device\\(s\\) \\[0\\]\\)"
        ):
            devices.run({"x": np.zeros((48, 48), "float32")}, plan="cycle")
        with pytest.raises(InputError, match="no plan 'decode'; their plans: 'chain', 'cycle'"):
            devices.run({}, plan="decode")
    with pytest.raises(BackendError, match="these LocalDevices are closed"):
        devices.run({}, plan="chain")
