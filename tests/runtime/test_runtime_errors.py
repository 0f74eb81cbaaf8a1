"""Every error of the runtime: typed, raised before any work where possible, naming the culprit."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import threading
import time

import numpy as np
import pytest
from plans import reference_plan
from runtime_cases import block_program, make_inputs, mlp_program

import einpage.cli  # noqa: F401  (every error class of the package defined, in any test order)
import runtime
import runtime.session
import taskgraph
from einpage.cli.outputs import PicturesFailedError
from einpage.errors import (
    BackendError,
    BackendUnavailableError,
    EinpageError,
    GraphError,
    InputError,
    VerificationError,
)
from memgraph import MemGraph, NodeKind, Region
from runtime.backend import NodeFailure
from runtime.numpy_backend import ThreadEvent, ThreadStream

MODES = ("sequential", "threaded", "random")


@pytest.fixture
def mlp():
    tg = mlp_program()
    return reference_plan(tg, offload=frozenset({3})), make_inputs(tg, 0)


def test_missing_extra_and_mistyped_inputs_are_named(mlp):
    mg, inputs = mlp
    with pytest.raises(InputError, match="missing input.*'w2'"):
        runtime.run(mg, {k: v for k, v in inputs.items() if k != "w2"}, "numpy")
    with pytest.raises(InputError, match="unknown input.*'bogus'"):
        runtime.run(mg, {**inputs, "bogus": inputs["x"]}, "numpy")
    with pytest.raises(InputError, match="input 'x': expected dtype float32, got int64"):
        runtime.run(mg, {**inputs, "x": inputs["x"].astype("int64")}, "numpy")
    with pytest.raises(InputError, match=r"input 'x': 1 value\(s\) of the float64 array do not"):
        big = inputs["x"].astype("float64")
        big[0, 1] = 1e300
        runtime.run(mg, {**inputs, "x": big}, "numpy")
    with pytest.raises(InputError, match=r"input 'w1': expected shape \(8, 16\), got \(16, 8\)"):
        runtime.run(mg, {**inputs, "w1": inputs["w1"].T}, "numpy")
    with pytest.raises(InputError, match="mapping"):
        runtime.run(mg, [inputs["x"]], "numpy")


def test_inputs_of_another_float_type_run_as_the_program_declares(mlp):
    """A float64 (or float16) array for a float32 input runs as its astype("float32")
    would: the plan's dtype is what runs, the reference evaluator agrees."""
    mg, inputs = mlp
    wide = {name: value.astype("float64") for name, value in inputs.items()}  # exact widening
    exact = runtime.run(mg, inputs, "numpy")
    np.testing.assert_array_equal(runtime.run(mg, wide, "numpy")["y"], exact["y"])
    reference = taskgraph.evaluate(mg.taskgraph, inputs)
    np.testing.assert_array_equal(taskgraph.evaluate(mg.taskgraph, wide)["y"], reference["y"])
    with runtime.Session(mg, "numpy") as session:
        session.stage({"w1": wide["w1"]})
        got = session.run({k: v for k, v in wide.items() if k != "w1"})
    np.testing.assert_array_equal(got["y"], exact["y"])


def test_inputs_are_checked_before_any_work(mlp, monkeypatch):
    mg, inputs = mlp
    monkeypatch.setattr(runtime.session, "Session", None)  # any work would fail differently
    with pytest.raises(InputError, match="missing input"):
        runtime.run(mg, {}, "numpy")


def test_session_checks_staged_and_given_inputs(mlp):
    mg, inputs = mlp
    with runtime.Session(mg, "numpy") as session:
        with pytest.raises(InputError, match="unknown input.*'nope'"):
            session.stage({"nope": inputs["x"]})
        with pytest.raises(InputError, match="input 'w1': expected dtype float32, got int32"):
            session.stage({"w1": inputs["w1"].astype("int32")})
        session.stage({"w1": inputs["w1"], "w2": inputs["w2"]})
        with pytest.raises(InputError, match="missing input.*'x'"):
            session.run({})
        session.run({"x": inputs["x"]})


class FakeDeviceArray:
    __cuda_array_interface__ = {}

    def __init__(self, array):
        self.shape, self.dtype = array.shape, array.dtype


def test_device_arrays_are_refused_with_a_hint(mlp):
    mg, inputs = mlp
    with pytest.raises(InputError, match=r"input 'x': expected a host \(NumPy\) array.*get\(\)"):
        runtime.run(mg, {**inputs, "x": FakeDeviceArray(inputs["x"])}, "numpy")


def test_unverifiable_plan_is_refused_and_verification_is_cached(mlp, monkeypatch):
    mg, inputs = mlp
    apply = mg.of_kind(NodeKind.APPLY)[1]
    nodes = list(mg.nodes)
    nodes[apply.id] = dataclasses.replace(apply, deps=())
    bad = MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment)
    calls = []
    checker = importlib.import_module("memgraph.verify")  # memgraph.verify is the function
    real = checker.verify
    monkeypatch.setattr(checker, "verify", lambda m: calls.append(m) or real(m))
    for _ in range(2):
        with pytest.raises(VerificationError, match=f"refusing to run.*n{apply.id} "):
            runtime.run(bad, inputs, "numpy")
        runtime.run(mg, inputs, "numpy")
    assert calls.count(bad) == 1 and calls.count(mg) == 1


def test_not_a_memgraph():
    takes = "runtime.run takes a memgraph.MemGraph, got TaskGraph .*a plan: einpage.compile"
    with pytest.raises(GraphError, match=takes):
        runtime.run(mlp_program(), {}, "numpy")


def test_unknown_backend_mode_and_option(mlp):
    mg, inputs = mlp
    with pytest.raises(BackendError, match="unknown backend 'tpu'; valid: 'auto', 'numpy', 'cupy'"):
        runtime.run(mg, inputs, "tpu")
    with pytest.raises(BackendError, match="unknown mode 'fast'"):
        runtime.run(mg, inputs, "numpy", mode="fast")
    with pytest.raises(BackendError, match=r"backend 'numpy' has no option\(s\) \['scratch'\]"):
        runtime.run(mg, inputs, "numpy", scratch=1)
    with pytest.raises(BackendError, match="timeout must be a positive number"):
        runtime.run(mg, inputs, "numpy", timeout=0)


def test_cupy_requested_without_cupy(mlp, monkeypatch):
    mg, inputs = mlp
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    with pytest.raises(BackendUnavailableError, match="CuPy.*not installed.*pip install"):
        runtime.run(mg, inputs, "cupy")
    assert not runtime.cupy_usable()
    with runtime.Session(mg, "auto") as session:
        assert session.backend.name == "numpy"


@pytest.mark.parametrize("mode", MODES)
def test_kernel_errors_surface_from_worker_threads(mode):
    tg = block_program()
    mg = reference_plan(tg, offload=frozenset({4, 9}))
    inputs = make_inputs(tg, 0)
    inputs["ids"][2] = 99  # out of range for the embedding table
    started = time.perf_counter()
    with pytest.raises(InputError, match="id 99 is out of range") as info:
        runtime.run(mg, inputs, "numpy", mode=mode, timeout=30)
    assert time.perf_counter() - started < 10
    # The node is named in the message itself (what the CLI prints), on Python 3.10 too,
    # not in a 3.11+ note that only a traceback shows.
    gather = next(n for n in mg.of_kind(NodeKind.APPLY) if tg[n.tensor].kind == "gather")
    message = str(info.value)
    assert "id 99 is out of range" in message.splitlines()[0]
    assert f"\nwhile running n{gather.id} (apply" in message
    assert not getattr(info.value, "__notes__", None)


def _subclasses(cls: type) -> list[type]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in _subclasses(child))]


MADE_OTHERWISE = {
    PicturesFailedError: lambda message: PicturesFailedError([("plot", EinpageError(message))]),
}
"""Error classes whose first argument is not a message, and how to make one."""


def _made_with_message(cls: type, message: str) -> EinpageError:
    """An instance of `cls` given `message` first (some make their own message from it),
    its other required arguments set to 1."""
    if cls in MADE_OTHERWISE:
        return MADE_OTHERWISE[cls](message)
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, message
    required = [p for p in params if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    return cls(message, *(1 for _ in required))


@pytest.mark.parametrize("cls", _subclasses(EinpageError), ids=lambda cls: cls.__name__)
def test_every_einpage_error_says_where_a_run_failed_in_its_message(cls):
    """The runtime adds the failing node to any einpage error's message, keeping its type
    and attributes: `str()` says it for every error class (ImportError's too)."""
    error = _made_with_message(cls, "boom")
    said = str(error)
    assert said
    failure = NodeFailure(error, "n3 (apply %3)", "compute")
    public = runtime.session._public_error(failure)
    assert public is error and type(public) is cls
    assert str(public) == f"{said}\nwhile running n3 (apply %3) on stream 'compute'"


@pytest.mark.parametrize("mode", MODES)
def test_other_exceptions_become_backend_errors_naming_the_node(mode, monkeypatch):
    tg = mlp_program()
    mg = reference_plan(tg, offload=frozenset({3}))

    def broken(task, operands, out):
        raise ValueError(f"kernel of %{task.id} exploded")

    monkeypatch.setattr(runtime.numpy_backend, "evaluate_task", broken)
    first = mg.of_kind(NodeKind.APPLY)[0]
    with pytest.raises(BackendError, match=rf"n{first.id} \(apply .*ValueError: kernel of %3"):
        runtime.run(mg, make_inputs(tg, 0), "numpy", mode=mode, timeout=30)


def test_a_session_survives_a_failed_run(monkeypatch):
    tg = block_program()
    mg = reference_plan(tg)
    inputs = make_inputs(tg, 0)
    bad = {**inputs, "ids": np.full_like(inputs["ids"], 50)}
    with runtime.Session(mg, "numpy", mode="threaded", timeout=30) as session:
        with pytest.raises(InputError):
            session.run(bad)
        good = session.run(inputs)
        assert np.isfinite(good["y"]).all()


def test_a_wait_that_never_ends_times_out():
    stream = ThreadStream("h2d", timeout=0.2)
    try:
        stream.wait(ThreadEvent())  # never fired
        time.sleep(0.5)  # the worker gives up waiting after 0.2 s
        with pytest.raises(NodeFailure, match="waited more than 0.2 s"):
            stream.synchronize()
    finally:
        stream.close()


def test_a_stuck_stream_times_out_instead_of_hanging():
    release = threading.Event()
    stream = ThreadStream("compute", timeout=0.2)
    try:
        stream.submit(lambda: release.wait(5))
        with pytest.raises(BackendError, match="did not finish its work within 0.2 s"):
            stream.synchronize()
    finally:
        release.set()
        stream.close()
    assert not stream._thread.is_alive()


def test_regions_outside_the_arena_fail_cleanly_when_unverified(mlp):
    mg, inputs = mlp
    alloc = mg.of_kind(NodeKind.ALLOC)[-1]
    nodes = list(mg.nodes)
    far = Region(mg.budget + 1024, alloc.region.size)
    for node in mg.nodes:
        if node.tensor == alloc.tensor and node.region == alloc.region and node.id >= alloc.id:
            nodes[node.id] = dataclasses.replace(node, region=far)
    bad = MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment)
    with pytest.raises(BackendError, match="does not fit in the arena"):
        runtime.run(bad, inputs, "numpy", unsafe_skip_verify=True)


def test_closed_session(mlp):
    mg, inputs = mlp
    session = runtime.Session(mg, "numpy")
    session.close()
    session.close()
    with pytest.raises(BackendError, match="closed"):
        session.run(inputs)
    assert "closed" in repr(session)


def test_every_error_is_an_einpage_error():
    for cls in (BackendError, BackendUnavailableError, InputError, VerificationError):
        assert issubclass(cls, EinpageError)


def test_registered_backends_are_found_by_name(mlp, monkeypatch):
    from runtime import backend as backend_module
    from runtime.numpy_backend import NumpyBackend

    mg, inputs = mlp
    monkeypatch.setattr(backend_module, "BACKENDS", dict(backend_module.BACKENDS))

    class CountingBackend(NumpyBackend):
        name = "counting"
        copies = 0

        def copy_box(self, host, starts, device, direction, stream):
            CountingBackend.copies += 1
            super().copy_box(host, starts, device, direction, stream)

    runtime.register_backend("counting", CountingBackend)
    runtime.register_backend("counting-lazy", lambda: CountingBackend)
    assert runtime.backend_names()[-2:] == ("counting", "counting-lazy")
    want = runtime.run(mg, inputs, "numpy")
    for name in ("counting", "counting-lazy"):
        got = runtime.run(mg, inputs, name, mode="streams")
        assert all(np.array_equal(got[k], want[k]) for k in want)
    assert CountingBackend.copies > 0
    with pytest.raises(BackendError, match="'counting' is already registered"):
        runtime.register_backend("counting", CountingBackend)
    with pytest.raises(BackendError, match="other than 'auto'"):
        runtime.register_backend("auto", CountingBackend)
    with pytest.raises(BackendError, match="expected a Backend subclass or a function"):
        runtime.register_backend("bad", 3)
    runtime.register_backend("broken", lambda: int)
    with pytest.raises(BackendError, match="its factory gave <class 'int'>, not a Backend"):
        runtime.run(mg, inputs, "broken")
    with pytest.raises(BackendError, match="unknown backend 'tpu'; valid: .*'counting-lazy'"):
        runtime.run(mg, inputs, "tpu")
