"""runtime.ray_cluster: hand-made MultiPlans run on a local Ray instance, an actor per
device, equal to a reference composed of `taskgraph.evaluate`; an actor killed mid-run
and a link that never arrives give a `BackendError` naming the device, within bounds."""

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
from runtime.ray_cluster import RayDevices, run_on_ray

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'einpage[cluster]'")


def _assert_equal(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.xdist_group("ray")  # with the tests using `cluster` (tests/multi/conftest.py)
def test_run_on_ray_uses_or_starts_a_local_instance():
    """Run before the module's fixture: with no Ray instance, `run_on_ray` starts a local
    one and shuts it down; with one (another module's), it uses it and leaves it up."""
    made = handmade.make_case("chain")
    inputs = handmade.case_inputs(made, seed=2)
    was_up = ray.is_initialized()
    got = run_on_ray(handmade.plan_case(made, "tight"), inputs, timeout=30)
    _assert_equal(got, handmade.reference(made, inputs))
    assert ray.is_initialized() == was_up


@pytest.mark.parametrize("budget", handmade.BUDGETS)
@pytest.mark.parametrize("name", tuple(handmade.CASES))
def test_hand_made_plans_run_on_ray(cluster, name, budget):
    """Each case on its actors, twice (other inputs the second time: the actors keep
    their arenas between runs); the instance stays up after the actors are closed."""
    made = handmade.make_case(name)
    mp = handmade.plan_case(made, budget)
    with RayDevices(mp, timeout=30) as devices:
        assert len(devices.actors) == mp.devices
        for seed in (1, 2):
            inputs = handmade.case_inputs(made, seed=seed)
            got = devices.run(inputs)
            _assert_equal(got, handmade.reference(made, inputs))
            assert all(value.flags.writeable for value in got.values())
    assert ray.is_initialized()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_orders_run_on_ray(cluster, seed):
    made = handmade.make_case("cycle")
    inputs = handmade.case_inputs(made, seed=3)
    got = run_on_ray(handmade.plan_case(made, "tight"), inputs, order="random", seed=seed)
    _assert_equal(got, handmade.reference(made, inputs))


@settings(max_examples=3, deadline=None)
@given(head=einsum_programs(max_tasks=10), fraction=st.floats(0.0, 1.0), seed=st.integers(0, 99))
def test_random_programs_split_at_links_run_on_ray(cluster, head, fraction, seed):
    """Three actors per example (a few: each example starts its own)."""
    split = handmade.split_program(head, fraction)
    inputs = handmade.split_inputs(split, seed)
    got = run_on_ray(split.mp, inputs, timeout=30)
    tol = TOLERANCE[split.dtype]
    want = handmade.split_reference(split, inputs)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=tol, atol=tol, err_msg=name)


def _inputs() -> dict[str, np.ndarray]:
    return {"w0": np.eye(4, dtype="float32"), "w1": np.eye(4, dtype="float32")}


def test_an_actor_killed_mid_run_names_its_device_without_waiting_for_the_timeout(cluster):
    """Both devices of the cross-wired plan wait for the other's link (up to 60 s); device
    0's actor is killed while it waits: the driver reports it at once and cancels device
    1's wait, and the RayDevices refuse to run again."""
    devices = RayDevices(handmade.cross_wired(), timeout=60, unsafe_skip_verify=True)
    try:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                devices.run(_inputs())
            except BaseException as err:
                errors.append(err)

        runner = threading.Thread(target=run)
        runner.start()
        deadline = time.monotonic() + 20
        while ray.get(devices.actors[0].progress.remote(), timeout=10)[0] == 0:
            assert time.monotonic() < deadline, "device 0 never started its run"
            time.sleep(0.02)
        time.sleep(0.2)  # now waiting for device 1's link
        killed = time.monotonic()
        ray.kill(devices.actors[0])
        runner.join(30)
        assert not runner.is_alive()
        assert time.monotonic() - killed < 15  # far less than the 60 s timeout
        assert len(errors) == 1 and isinstance(errors[0], BackendError)
        assert "device 0's Ray actor died during the run" in str(errors[0])
        with pytest.raises(BackendError, match="device 0's Ray actor died in an earlier run"):
            devices.run(_inputs())
    finally:
        devices.close()


def test_a_link_that_never_arrives_times_out_on_ray(cluster):
    started = time.monotonic()
    with pytest.raises(
        BackendError,
        match=r"device [01] waited more than 0.5 s for 1 link\(s\) that did not arrive: "
        r"n\d+ \(input \"recv:%[12]\".*\) from device [01]'s output 'send:%[12]'",
    ):
        run_on_ray(handmade.cross_wired(), _inputs(), timeout=0.5, unsafe_skip_verify=True)
    assert time.monotonic() - started < 30


def test_an_actor_that_cannot_make_its_runner_gives_the_typed_error(cluster):
    """Each actor makes its own runner; what that raises (here: an option the NumPy
    backend does not have) comes back with its type, naming the device."""
    mp = handmade.plan_case(handmade.make_case("chain"), "100%")
    with pytest.raises(BackendError, match=r"(?s)no option\(s\) \['sparkle'\].*on device 0"):
        RayDevices(mp, sparkle=1)


def test_a_link_to_an_input_that_does_not_exist_is_refused_before_any_actor(cluster):
    mp = handmade.plan_case(handmade.make_case("chain"), "100%")
    bad = dataclasses.replace(mp.links[0], input="recv:%99")
    broken = dataclasses.replace(mp, placed=dataclasses.replace(mp.placed, links=(bad,)))
    with pytest.raises(VerificationError, match=r"^device 1: .* feeds input 'recv:%99'"):
        RayDevices(broken)


def test_one_set_of_actors_stages_once_and_runs_several_plans(cluster):
    """The chain and the cycle on the same 2 actors (each holding its device's share of
    both): weights staged once, then each plan run in turn, twice, equal to its
    reference; a plan the actors do not hold is refused."""
    cases = {"chain": handmade.make_case("chain"), "cycle": handmade.make_case("cycle")}
    plans = {key: handmade.plan_case(made, "tight") for key, made in cases.items()}
    weights = {n: v for n, v in handmade.case_inputs(cases["cycle"], 1).items() if n != "x"}
    with RayDevices(plans, timeout=30) as devices:
        assert len(devices.actors) == 2
        devices.stage(weights)
        for seed in (2, 3):
            x = handmade.case_inputs(cases["cycle"], seed)["x"]
            for key in ("cycle", "chain"):
                given = {**weights, "x": x}
                wanted = handmade.case_inputs(cases[key])
                want = handmade.reference(cases[key], {n: given[n] for n in wanted})
                _assert_equal(devices.run({"x": x}, plan=key), want)
        with pytest.raises(InputError, match="no plan .decode."):
            devices.run({"x": x}, plan="decode")
