"""Running a plan for several devices (`memgraph.multi.MultiPlan`) on Ray: an actor per device.

Each actor owns one device: a `runtime.multi.DeviceRunner` over that device's MemGraph
(its own arena: NumPy on a CPU, CuPy on the GPU Ray gives the actor), executing the plan
dependency-driven exactly as `runtime.multi.run_devices` does in one process – the same
code, not a copy. A link's tensor goes from the source actor to the target actor: when
the source's `output` node of the link has run, the source calls the target's `deliver`,
which puts the array (through Ray's object store) in the target's inbox for that run.
Actors are threaded (`max_concurrency`), so deliveries and cancellations run beside the
executor.

A direct link (`Link.path == "peer"`: a `send` node on the source, a `recv` node on the
target) is a *buffered* send here (`RayPeers`): the send copies its region into a fresh
array and delivers it through the object store to the target actor, keyed by the link's
index (`runtime.multi.offer_key`), and is done at once – the copy is taken, so the
source may free its region whatever the target does, in any order. The recv waits for
the array and writes it into its region. The rendezvous the plan allows (one copy
between the arenas: NCCL or CUDA peer copies between GPUs) is not built: that needs
GPUs, and an actor's CuPy arena sends through the host like this.

The driver (`RayDevices`, or `run_on_ray` for one run) checks the plans
(`runtime.multi.check_multi`), puts each original input in the object store once
(`ray.put`), starts every device's run and gathers the outputs. Waits are bounded: an
actor waits at most `timeout` seconds for a link (`BackendError` naming the device and
the nodes it waits for); an actor that dies (`ray.exceptions.RayActorError`) or fails
makes the driver cancel the other devices' runs and raise `BackendError` naming the
device. Ray is an optional extra: `pip install 'einpage[cluster]'`.

Several MultiPlans over the same devices (a generation's step plans) share the actors:
`RayDevices({key: mp, ...})`, each actor holding its device's share of every plan;
`stage(inputs)` places inputs (weights) once on the actors that read them, and
`run(inputs, plan=key)` runs one plan.

>>> out = run_on_ray(mp, inputs, timeout=30)                     # doctest: +SKIP
>>> with RayDevices(mp) as devices:                              # doctest: +SKIP
...     first = devices.run(inputs)
...     second = devices.run(other_inputs)
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from einpage_core.errors import BackendError, InputError
from einpage_core.optional import require
from memgraph.graph import MemGraph
from memgraph.multi import Link, MultiPlan
from runtime.multi import (
    DEFAULT_TIMEOUT,
    DeviceRunner,
    Inbox,
    Key,
    check_order,
    check_plans,
    check_timeout,
    device_inputs,
    first_failure,
    gather,
    offer_key,
    on_device,
    staging,
)

__all__ = [
    "RayDevices",
    "DeviceActor",
    "RayPeers",
    "run_on_ray",
    "MAX_CONCURRENCY",
    "START_TIMEOUT",
]

MAX_CONCURRENCY = 4
"""Threads of each actor: its run, and deliveries and cancellations beside it."""

START_TIMEOUT = 120.0
"""Seconds the driver waits for the actors to be up (each makes its arena)."""

POLL_SECONDS = 1.0
"""How often the driver looks again while runs are under way."""


def _ray() -> Any:
    return require("ray", extra="cluster")


class RayPeers:
    """Direct links between Ray actors (`runtime.multi.PeerLinks`) for run `run`: a
    buffered send – the source's region copied into a fresh host array (from a CuPy
    arena too) and delivered through the object store to the target actor's inbox under
    the link's offer key; done at once, so nothing is acknowledged. `actors` are every
    device's actor handle (None for an idle device, which receives nothing)."""

    def __init__(self, actors: list[Any], run: int):
        self.actors = actors
        self.run = run

    def __repr__(self) -> str:
        return f"<RayPeers run={self.run} devices={len(self.actors)}>"

    def offer(self, index: int, link: Link, view: Any) -> bool:
        value = view.get() if hasattr(view, "get") and not isinstance(view, np.ndarray) else view
        copy = np.array(value, copy=True)  # taken now: the source may free its region
        if self.actors[link.target] is not None:
            self.actors[link.target].deliver.remote(self.run, offer_key(index), copy)
        return True

    def acknowledge(self, index: int, link: Link) -> None:
        """Nothing: the send was done when its copy was taken."""


class DeviceActor:
    """The body of one device's Ray actor (`ray.remote(DeviceActor)`): a `DeviceRunner`
    over the device's share of each plan (by key, sent as JSON: a MemGraph is rebuilt
    from it in the actor; `links` by the same keys), and an inbox per run for the links
    that arrive (a link may arrive before the run that takes it has started)."""

    def __init__(
        self,
        device: int,
        plan_json: Mapping[Any, str],
        links: Mapping[Any, tuple[Link, ...]],
        backend: str,
        order: str,
        seed: int | None,
        poison: bool | None,
        options: dict[str, Any],
    ):
        self.device = device
        self._inboxes: dict[int, Inbox] = {}
        self._lock = threading.Lock()
        self.failure: Exception | None = None
        self.runner: DeviceRunner | None = None
        try:
            self.runner = DeviceRunner(
                device,
                {key: MemGraph.from_json(text) for key, text in plan_json.items()},
                dict(links),
                backend,
                order=order,
                seed=seed,
                poison=poison,
                unsafe_skip_verify=True,  # the driver verified the plans
                **options,
            )
        except Exception as err:  # raised by `ready`: a typed error, not a dead actor
            self.failure = err

    def __repr__(self) -> str:
        return f"<DeviceActor device={self.device} {self.runner!r}>"

    def ready(self) -> int:
        """The device id, once the actor is up (its arena allocated); raises what making
        its runner raised."""
        if self.failure is not None:
            raise self.failure
        return self.device

    def progress(self) -> tuple[int, int]:
        """Nodes done in the current (or last) run, and nodes of the plan."""
        return self.runner.progress if self.runner is not None else (0, 0)

    def _inbox(self, run: int) -> Inbox:
        with self._lock:
            return self._inboxes.setdefault(run, Inbox())

    def deliver(self, run: int, name: Key, array: np.ndarray) -> None:
        """Link input `name` of run `run` has arrived (or a direct link's copy, under its
        offer key)."""
        self._inbox(run).put(name, array)

    def cancel(self, run: int, reason: str) -> None:
        """Stop run `run`'s waits: another device failed."""
        self._inbox(run).cancel(reason)

    def stage(self, inputs: dict[str, Any], timeout: float) -> None:
        """Place inputs once for every plan that reads them (`DeviceRunner.stage`):
        `inputs` maps each name to its object reference."""
        self._runner().stage(_fetched(inputs, timeout))

    def _runner(self) -> DeviceRunner:
        if self.runner is None:  # `ready` raised it already; RayDevices do not run then
            raise BackendError(f"device {self.device}'s actor has no runner: {self.failure}")
        return self.runner

    def run(
        self,
        run: int,
        inputs: dict[str, Any],
        peers: list[Any],
        timeout: float,
        plan: Any = None,
    ) -> dict[str, np.ndarray]:
        """Run plan `plan` (its key; default the first) once: `inputs` maps each input the
        driver gives to its object reference; `peers` are every device's actor handle,
        to deliver links to."""
        arrays = _fetched(inputs, timeout)

        def send(link: Link, value: np.ndarray) -> None:
            if peers[link.target] is not None:  # an idle device reads nothing
                peers[link.target].deliver.remote(run, link.input, value)

        runner = self._runner()
        try:
            return runner.run_linked(
                arrays, self._inbox(run), send, timeout=timeout, plan=plan,
                peers=RayPeers(peers, run),
            )  # fmt: skip
        finally:
            with self._lock:
                self._inboxes.pop(run, None)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


def _fetched(refs: Mapping[str, Any], timeout: float) -> dict[str, np.ndarray]:
    """The arrays of `refs` (name -> object reference), from the object store."""
    names = list(refs)
    got = _ray().get([refs[n] for n in names], timeout=timeout)
    return dict(zip(names, got, strict=True))


class RayDevices:
    """The actors of a MultiPlan `mp`, one per device, ready to run it (see the module
    docstring) – or of several MultiPlans over the same devices, by key (as
    `runtime.Session` keys plans; one MultiPlan is key 0), each actor holding its
    device's share of every plan: `stage(inputs)` places inputs once on every actor
    whose plans read them, `run(inputs, plan=key)` runs one plan (as
    `runtime.multi.LocalDevices` does in one process). Uses the Ray instance already
    initialised, or starts a local one (`ray_init` keywords; by default `num_cpus=2`, no
    dashboard) and shuts it down on `close()`. `backend` ("numpy" or "cupy": then each
    actor asks Ray for a GPU), `order`, `seed` and `poison` are each device's, as in
    `runtime.multi.run_devices`; `timeout` the default of `run`; `actor_options` go to
    Ray's `.options()` (resources).

    `actors` are the actor handles, by device; None for an idle device, whose graph has
    no outputs: a placement can leave a device without tasks (its weights all read by
    tasks that go with a larger weight elsewhere), or with only tasks whose results
    nothing reads (a program's dead code). Nothing an idle device could do is seen, and
    its plan cannot be sent as JSON (a TaskGraph without outputs is not a program), so it
    gets no actor and links to it are not sent. With several plans a device is idle when
    it is in every plan; its share of a plan in which it has no outputs is left out.
    """

    def __init__(
        self,
        mp: MultiPlan | Mapping[Any, MultiPlan],
        *,
        backend: str = "numpy",
        order: str = "ready",
        seed: int | None = None,
        poison: bool | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        unsafe_skip_verify: bool = False,
        ray_init: Mapping[str, Any] | None = None,
        actor_options: Mapping[str, Any] | None = None,
        **options: Any,
    ):
        if not isinstance(backend, str):
            raise BackendError(
                f"give the backend by name: each actor makes its own, got {type(backend).__name__}"
            )
        check_order(order)
        check_timeout(timeout)
        self.plans = check_plans(mp, unsafe_skip_verify)
        ray = _ray()
        self.mp = next(iter(self.plans.values()))
        self.timeout = float(timeout)
        self.actors: list[Any] = []
        self._staged: list[set[str]] = [set() for _ in range(self.mp.devices)]
        self._dead: dict[int, str] = {}
        self._runs = itertools.count()
        self._started = False
        if not ray.is_initialized():
            settings = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False}
            ray.init(**{**settings, **(ray_init or {})})
            self._started = True
        try:
            self._start(ray, backend, order, seed, poison, actor_options or {}, options)
        except BaseException:
            self.close()
            raise

    def _start(
        self,
        ray: Any,
        backend: str,
        order: str,
        seed: int | None,
        poison: bool | None,
        actor_options: Mapping[str, Any],
        options: dict[str, Any],
    ) -> None:
        resources = {"num_gpus": 1} if backend == "cupy" else {}
        remote = ray.remote(DeviceActor).options(
            max_concurrency=MAX_CONCURRENCY, **{**resources, **actor_options}
        )
        for device in range(self.mp.devices):
            shares = {
                key: mp.plans[device].mg.to_json()
                for key, mp in self.plans.items()
                if mp.plans[device].mg.taskgraph.outputs
            }
            if not shares:
                self.actors.append(None)
                continue
            self.actors.append(
                remote.remote(
                    device,
                    shares,
                    {key: tuple(self.plans[key].links) for key in shares},
                    backend,
                    order,
                    seed,
                    poison,
                    options,
                )
            )
        calls = {
            actor.ready.remote(): device
            for device, actor in enumerate(self.actors)
            if actor is not None
        }
        done, pending = ray.wait(list(calls), num_returns=len(calls), timeout=START_TIMEOUT)
        if pending:
            late = sorted(calls[ref] for ref in pending)
            raise BackendError(
                f"the Ray actors of device(s) {late} were not up within {START_TIMEOUT} s "
                "(does the Ray instance have the resources: a CPU, or a GPU each for cupy?)"
            )
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as err:  # the actor's constructor raised
                cause = err.cause if isinstance(err.cause, BaseException) else err
                raise on_device(cause, calls[ref]) from err
            except Exception as err:
                raise BackendError(
                    f"device {calls[ref]}'s Ray actor could not start: {_first_line(err)}"
                ) from err

    def __repr__(self) -> str:
        busy = sum(actor is not None for actor in self.actors)
        state = "closed" if not self.actors else f"actors={busy}"
        return f"<RayDevices devices={self.mp.devices} {state}>"

    def __enter__(self) -> RayDevices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if not self.actors:
            raise BackendError("these RayDevices are closed")
        if self._dead:
            device, why = next(iter(self._dead.items()))
            raise BackendError(f"device {device}'s Ray actor died in an earlier run ({why})")

    def stage(self, inputs: Mapping[str, Any], *, timeout: float | None = None) -> None:
        """Place `inputs` (name -> host array) once on every actor whose plans read them
        (each array put in the object store once); later runs use them unless given
        again. A failure names the device, as `run`'s do."""
        ray = _ray()
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        self._check_usable()
        per_device = staging(self.plans, inputs)
        refs = {name: ray.put(np.asarray(value)) for name, value in inputs.items()}
        calls = {}
        for device, actor in enumerate(self.actors):
            mine = {name: refs[name] for name in per_device[device]}
            if actor is None or not mine:
                continue
            calls[actor.stage.remote(mine, timeout)] = device
        self._gather(ray, calls, {}, timeout, None)
        for device, mine in enumerate(per_device):
            self._staged[device] |= set(mine)

    def run(
        self, inputs: Mapping[str, Any], *, plan: Any = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """Run plan `plan` (its key; default the first) once on `inputs` (name -> host
        array) and what is staged; return its original outputs.

        `timeout` (default: the one given when made) bounds each wait of a device for a
        link. A failure on a device – an error, or its actor dying – cancels the others
        and raises, naming the device; a device whose actor died stays unusable."""
        ray = _ray()
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        self._check_usable()
        key = next(iter(self.plans)) if plan is None else plan
        if key not in self.plans:
            known = ", ".join(map(repr, self.plans))
            raise InputError(f"these RayDevices have no plan {key!r}; their plans: {known}")
        mp = self.plans[key]
        staged = device_inputs(mp, inputs, self._staged)
        refs = {name: ray.put(np.asarray(value)) for name, value in inputs.items()}
        run = next(self._runs)
        calls = {}
        results: dict[int, dict[str, Any]] = {}
        for device, actor in enumerate(self.actors):
            if actor is None or not mp.plans[device].mg.taskgraph.outputs:
                results[device] = {}  # idle: no inputs, no links, no outputs
                continue
            mine = {name: refs[name] for name in staged[device]}
            calls[actor.run.remote(run, mine, self.actors, timeout, key)] = device
        self._gather(ray, calls, results, timeout, run)
        # Arrays from the object store are read-only views of it: hand out arrays of
        # the caller's own, as `runtime.run` does.
        return {name: np.array(value, copy=True) for name, value in gather(mp, results).items()}

    def _gather(
        self,
        ray: Any,
        calls: dict[Any, int],
        results: dict[int, Any],
        timeout: float,
        run: int | None,
    ) -> None:
        """Wait for every call (device by its object reference) and put its result in
        `results`; on a failure, cancel run `run`'s other devices (None: nothing to
        cancel) and raise it, naming the device."""
        failures: list[tuple[int, BaseException]] = []
        pending = list(calls)
        while pending and not failures:
            # A device's waits are bounded by `timeout`; a dead actor's call fails at once.
            done, pending = ray.wait(pending, num_returns=1, timeout=POLL_SECONDS)
            for ref in done:
                self._outcome(ray, calls[ref], ref, results, failures)
        if failures:
            reason = f"stopped: device {failures[0][0]} failed"
            for ref in pending:
                if run is not None:
                    self.actors[calls[ref]].cancel.remote(run, reason)
            if pending:  # the cancelled runs end at once; their outcomes are gathered too
                done, _ = ray.wait(pending, num_returns=len(pending), timeout=timeout)
                for ref in done:
                    self._outcome(ray, calls[ref], ref, results, failures)
            device, error = first_failure(failures)
            public = on_device(error, device)
            if public is error:
                raise public
            raise public from error

    def _outcome(
        self,
        ray: Any,
        device: int,
        ref: Any,
        results: dict[int, dict[str, Any]],
        failures: list[tuple[int, BaseException]],
    ) -> None:
        """The result of device `device`'s run `ref`, or its failure."""
        try:
            results[device] = ray.get(ref, timeout=self.timeout)
        except ray.exceptions.RayActorError as err:
            why = _first_line(err)
            self._dead[device] = why
            failures.append(
                (device, BackendError(f"device {device}'s Ray actor died during the run: {why}"))
            )
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if isinstance(err.cause, BaseException) else err
            failures.append((device, cause))
        except ray.exceptions.GetTimeoutError as err:
            failures.append((device, BackendError(f"device {device}'s result did not come: {err}")))

    def close(self) -> None:
        """Stop the actors (their arenas go with them), and the Ray instance if these
        RayDevices started it."""
        ray = _ray()
        actors, self.actors = self.actors, []
        for actor in actors:
            if actor is None:  # an idle device's
                continue
            with contextlib.suppress(Exception):  # an actor that is gone already
                ray.kill(actor)
        if self._started:
            self._started = False
            ray.shutdown()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def run_on_ray(
    mp: MultiPlan,
    inputs: Mapping[str, Any],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    **options: Any,
) -> dict[str, Any]:
    """Run the MultiPlan `mp` once on Ray, an actor per device (`RayDevices`, made and
    closed here: keywords as `RayDevices` takes them); return the original outputs."""
    with RayDevices(mp, timeout=timeout, **options) as devices:
        return devices.run(inputs)
