"""A `Session` holds all its state: what it acquires is released by one path, whether a
set-up step fails or the session closes; `run` leaves nothing behind; a plan is verified
once, the verdict kept on the plan (no module-level caches keyed by plan)."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import threading
import weakref

import numpy as np
import pytest
from runtime_cases import assert_outputs_match, block_program, make_inputs, reference

import memgraph
import runtime
import runtime.backend
import runtime.session
from einpage.errors import (
    BackendError,
    EinpageError,
    InputError,
    UnsupportedError,
    VerificationError,
)
from memgraph import MemGraph, NodeKind
from runtime.numpy_backend import NumpyBackend


class Recording(NumpyBackend):
    """The NumPy backend, remembering what it handed out (weakly) and whether it was
    closed, and failing at the set-up step named by its `fail_at` option."""

    OPTIONS = ("timeout", "fail_at")
    made: list[Recording] = []

    def __init__(self, timeout: float = 30.0, fail_at: str | None = None):
        super().__init__(timeout)
        self.fail_at = fail_at
        self.closed = False
        self.buffers: list[weakref.ref] = []
        self.streams: list = []
        if fail_at == "unsupported":
            self.unsupported_dtypes = {"float32": "this backend refuses float32"}
        Recording.made.append(self)

    def _fail(self, step: str) -> None:
        if self.fail_at == step:
            raise BackendError(f"injected failure at {step}")

    def allocate_arena(self, nbytes: int) -> np.ndarray:
        self._fail("allocate_arena")
        arena = super().allocate_arena(nbytes)
        self.buffers.append(weakref.ref(arena))
        return arena

    def allocate_host(self, nbytes: int) -> np.ndarray:
        self._fail("allocate_host")
        host = super().allocate_host(nbytes)
        self.buffers.append(weakref.ref(host))
        return host

    def stream(self, name: str, concurrent: bool):
        if len(self.streams) == 1:
            self._fail("second stream")
        stream = super().stream(name, concurrent)
        self.streams.append(stream)
        return stream

    def close(self) -> None:
        self.closed = True

    def live_buffers(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.buffers)


@pytest.fixture
def recording(monkeypatch):
    """The `Recording` class, registered as backend "recording" (made by name, so a
    session owns and closes it)."""
    monkeypatch.setattr(Recording, "made", [])
    monkeypatch.setitem(runtime.backend.BACKENDS, "recording", lambda: Recording)
    return Recording


@pytest.fixture
def plan():
    """A plan with offloads and reloads (host storage of its own, three streams in
    streams mode)."""
    tg = block_program()
    mg = memgraph.plan(tg, memgraph.min_budget(tg)[0])
    assert mg.stats.offload_count > 0
    return mg


def _worker_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("einpage-")}


def _interpreter_fails(*args, **kwargs):
    del args, kwargs  # hold no buffer in this frame (the error's traceback keeps it)
    raise BackendError("injected failure at interpreter")


STEPS = {
    "unsupported": UnsupportedError,
    "host_budget": EinpageError,  # HostBudgetError
    "allocate_arena": BackendError,
    "allocate_host": BackendError,
    "second stream": BackendError,
    "interpreter": BackendError,
}


@pytest.mark.parametrize("step", sorted(STEPS))
def test_a_failed_set_up_step_releases_what_the_earlier_ones_acquired(
    step, plan, recording, monkeypatch
):
    before = _worker_threads()
    options: dict = {"fail_at": step}
    if step == "host_budget":
        options["host_budget"] = 1
    if step == "interpreter":
        monkeypatch.setattr(runtime.session, "Interpreter", _interpreter_fails)
    with pytest.raises(STEPS[step]) as info:
        runtime.Session(plan, "recording", mode="streams", **options)
    # Checked while the error (and through its traceback the half-made session) lives.
    (backend,) = recording.made
    assert "injected failure" in str(info.value) or step in ("unsupported", "host_budget")
    assert backend.closed, "the backend the session made was not closed"
    assert backend.live_buffers() == 0, "buffers of the failed session are still held"
    assert all(not s._thread.is_alive() for s in backend.streams), "a stream kept its thread"
    assert _worker_threads() <= before
    if step == "second stream":
        assert len(backend.streams) == 1  # the first stream was made, and closed


def test_a_plan_failing_verification_acquires_nothing(plan, recording):
    nodes = list(plan.nodes)
    apply = plan.of_kind(NodeKind.APPLY)[1]
    nodes[apply.id] = dataclasses.replace(apply, deps=())
    bad = MemGraph(plan.taskgraph, tuple(nodes), plan.budget, plan.alignment)
    with pytest.raises(VerificationError, match="refusing to run"):
        runtime.Session(bad, "recording")
    assert recording.made == []


def test_close_releases_what_the_set_up_acquired(plan, recording):
    before = _worker_threads()
    inputs = make_inputs(plan.taskgraph, 0)
    with runtime.Session(plan, "recording", mode="streams") as session:
        (backend,) = recording.made
        assert len(backend.streams) == 3 and _worker_threads() > before
        assert_outputs_match(session.run(inputs), reference(plan.taskgraph, inputs))
        assert backend.live_buffers() == 2 and not backend.closed
    assert backend.closed and backend.live_buffers() == 0
    assert _worker_threads() <= before
    session.close()  # closing twice is harmless
    with pytest.raises(BackendError, match="closed"):
        session.run(inputs)


def test_a_backend_instance_given_to_a_session_is_not_closed_by_it(plan):
    backend = Recording()
    with runtime.Session(plan, backend):
        pass
    assert not backend.closed and backend.live_buffers() == 0
    with pytest.raises(BackendError, match="injected failure at allocate_host"):
        runtime.Session(plan, Recording(fail_at="allocate_host"))
    assert not Recording.made[-1].closed  # the caller's to close


@pytest.mark.parametrize("mode", ["sequential", "threaded"])
def test_run_leaves_nothing_behind(plan, mode):
    """`run` makes and closes a session: after it returns (or fails), none of its buffers
    or threads is held anywhere – nothing is kept for a later call."""
    before = _worker_threads()
    tg = plan.taskgraph
    backend = Recording()
    inputs = make_inputs(tg, 0)
    assert_outputs_match(runtime.run(plan, inputs, backend, mode=mode), reference(tg, inputs))
    assert len(backend.buffers) == 2 and backend.live_buffers() == 0
    bad = {**inputs, "ids": np.full(tg[tg.inputs["ids"]].shape, 50)}
    with pytest.raises(InputError, match="out of range"):
        runtime.run(plan, bad, backend, mode=mode)
    assert len(backend.buffers) == 4 and backend.live_buffers() == 0
    assert _worker_threads() <= before


def test_runs_of_a_session_reuse_its_buffers_and_never_read_stale_bytes(plan):
    mg, tg = plan, plan.taskgraph
    with runtime.Session(mg, "numpy") as session:
        arena, host = session.arena, session.host
        for seed in range(3):  # stale bytes of the previous run never leak into results
            inputs = make_inputs(tg, seed)
            assert_outputs_match(session.run(inputs), reference(tg, inputs), f"seed={seed}")
            assert session.arena is arena and session.host is host
        with runtime.Session(mg, "numpy") as other:  # another session: buffers of its own
            assert other.arena is not arena and other.host is not host


def test_a_plan_is_verified_once_and_keeps_its_verdict(plan, monkeypatch):
    checker = importlib.import_module("memgraph.verify")  # memgraph.verify is the function
    calls = []
    real = checker.verify
    monkeypatch.setattr(checker, "verify", lambda m: calls.append(m) or real(m))
    report = plan.verified()
    assert report == real(plan) and report.nodes == len(plan)
    inputs = make_inputs(plan.taskgraph, 0)
    runtime.run(plan, inputs, "numpy")
    with runtime.Session(plan, "numpy"), runtime.Session(plan, "numpy", mode="random"):
        pass
    assert plan.verified() is report and calls == [plan]

    nodes = list(plan.nodes)
    apply = plan.of_kind(NodeKind.APPLY)[1]
    nodes[apply.id] = dataclasses.replace(apply, deps=())
    bad = MemGraph(plan.taskgraph, tuple(nodes), plan.budget, plan.alignment)
    raised = set()
    for _ in range(2):  # a failure is remembered too, and raised afresh each time
        with pytest.raises(VerificationError, match=f"n{apply.id} ") as info:
            bad.verified()
        assert info.value.node == apply.id
        raised.add((str(info.value), len(info.traceback)))  # the same, not a growing one
        with pytest.raises(VerificationError, match=f"refusing to run.*n{apply.id} "):
            runtime.Session(bad, "numpy")
    assert len(raised) == 1 and calls == [plan, bad]
    again = dataclasses.replace(bad)  # another plan object: verified afresh
    with pytest.raises(VerificationError):
        again.verified()
    assert calls == [plan, bad, again]


def test_a_plan_and_its_verdict_are_collected_together(plan):
    """The verdict lives on the plan: nothing keyed by plans outlives them."""
    nodes = list(plan.nodes)
    apply = plan.of_kind(NodeKind.APPLY)[1]
    nodes[apply.id] = dataclasses.replace(apply, deps=())
    bad = MemGraph(plan.taskgraph, tuple(nodes), plan.budget, plan.alignment)
    with pytest.raises(VerificationError):
        runtime.run(bad, make_inputs(plan.taskgraph, 0), "numpy")
    gone = weakref.ref(bad)
    del bad
    gc.collect()
    assert gone() is None


def test_the_session_module_keeps_no_state_between_sessions():
    """No module-level container in `runtime.session` (a cache keyed by plan, buffers
    kept for later runs): what a session holds is its own."""
    containers = (dict, list, set, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)
    state = [
        name
        for name, value in vars(runtime.session).items()
        if isinstance(value, containers) and not name.startswith("__")
    ]
    assert state == []
