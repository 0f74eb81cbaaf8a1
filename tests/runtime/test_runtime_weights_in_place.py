"""Zero-copy weights on the CuPy backend (issue 23), on the CPU stand-in of CuPy.

A weight of at least `CupyBackend.in_place_min` bytes is read where the caller holds it:
its pages are registered (`cudaHostRegister`; read-only for a read-only memory map) and
transfers copy straight from them, instead of from a copy in pinned staging memory.
The stand-in (`cuda_streams.standin_cupy`) records every pinned allocation and every
registration, and refuses, as the driver does, a registration that shares a page with
an earlier one. What is checked: the outputs equal the reference; the pinned buffer
holds no weight read in place; what is pinned in all is `runtime.pinned_bytes`; a copy
happens only where the README says (an array whose pages are partly registered for
another); every registration is undone when the session closes.
"""

from __future__ import annotations

import numpy as np
import pytest
from cpu_cuda import CXX
from cuda_streams import StandInCupyBackend
from runtime_cases import assert_outputs_match, block_program, make_inputs, reference

import einpage as ep
import memgraph
import runtime
from runtime.cupy_backend import CupyBackend
from runtime.hostmem import PAGE

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++)")

READ_ONLY = 8  # cudaHostRegisterReadOnly


@pytest.fixture(scope="module")
def case():
    tg = runtime.declare_workspaces(block_program(layers=2))  # the CuPy kernels' workspaces
    mg = memgraph.plan(tg, memgraph.min_budget(tg)[0])  # weights reloaded from the host
    inputs = make_inputs(tg, 0)
    weights = {n: a for n, a in inputs.items() if n != "ids"}
    return tg, mg, weights, inputs["ids"]


def registered_ranges(cp) -> list[tuple[int, int]]:
    return [(start, start + size) for start, (size, _) in cp.registered.items()]


def inside(array: np.ndarray, ranges) -> bool:
    start, end = array.ctypes.data, array.ctypes.data + array.nbytes
    return any(lo <= start and end <= hi for lo, hi in ranges)


@pytest.mark.parametrize("mode", ["sequential", "streams"])
def test_weights_are_read_where_the_caller_holds_them(case, mode):
    tg, mg, weights, ids = case
    backend = StandInCupyBackend(delay=1e-3, in_place_min=0)  # every weight in place
    with runtime.Session(mg, backend, mode=mode) as session:
        session.stage(weights)
        ranges = registered_ranges(backend.cp)
        assert all(inside(array, ranges) for array in weights.values())
        for seed in range(2):
            got = session.run({"ids": make_inputs(tg, seed)["ids"]})
            assert_outputs_match(
                got, reference(tg, {**weights, "ids": make_inputs(tg, seed)["ids"]})
            )
        memory = session.last.memory
        # Pinned once, at open, for the ids and the scratch; the weights are not in it.
        assert backend.cp.pinned == [session.host_layout.nbytes] == [memory["host_bytes"]]
        weight_bytes = sum(a.nbytes for a in weights.values())
        assert memory["host_bytes"] < runtime.pinned_bytes(mg) - weight_bytes
        assert memory["host_bytes"] + memory["host_in_place_bytes"] == runtime.pinned_bytes(mg)
        assert memory["host_registered_bytes"] >= weight_bytes
        assert memory["host_registered_bytes"] % PAGE == 0
    assert backend.cp.registered == {}  # every registration undone at close
    calls = [call[0] for call in backend.cp.registrations]
    assert calls.count("register") == calls.count("unregister") >= 1


def test_small_weights_are_copied_into_the_one_pinned_buffer(case):
    """Below `in_place_min` (1 MiB) a copy costs less than a registration: the weights of
    this small block are copied, into the buffer allocated once."""
    tg, mg, weights, ids = case
    backend = StandInCupyBackend(delay=1e-3)
    assert backend.in_place_min == CupyBackend.in_place_min == 1 << 20
    with runtime.Session(mg, backend) as session:
        session.stage(weights)
        assert_outputs_match(session.run({"ids": ids}), reference(tg, {**weights, "ids": ids}))
    assert backend.cp.pinned == [runtime.pinned_bytes(mg)]
    assert backend.cp.registrations == []


def big_weight_program(n: int = 512):
    """A program whose weight is 1 MiB (in float32), beside a small one."""
    prog = ep.Program("big")
    x = prog.input("x", (4, n))
    w = prog.input("w", (n, n), role="weight")
    b = prog.input("b", (n,), role="weight")
    prog.output(ep.silu(x @ w) + b, "y")
    return prog.build()


def test_a_weight_of_1_mib_is_registered_and_a_small_one_copied():
    tg = big_weight_program()
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    inputs = make_inputs(tg, 0)
    backend = StandInCupyBackend(delay=1e-3)
    with runtime.Session(mg, backend) as session:
        session.stage({"w": inputs["w"], "b": inputs["b"]})
        assert_outputs_match(session.run({"x": inputs["x"]}), reference(tg, inputs))
        ranges = registered_ranges(backend.cp)
        assert inside(inputs["w"], ranges) and not inside(inputs["b"], ranges)
        assert session.last.memory["host_in_place_bytes"] == inputs["w"].nbytes
    assert backend.cp.pinned == [runtime.pinned_bytes(mg) - inputs["w"].nbytes]


def test_arrays_sharing_pages_are_registered_together_or_the_later_one_copied():
    """Two weights that are views of one buffer share a page. Staged together, their
    pages are one registration; staged one after the other, the second shares a page
    with the first's registration, which the driver refuses: it is copied into pinned
    memory allocated then (the one case of a copy a weight of that size gets)."""
    tg = big_weight_program(256)
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    inputs = make_inputs(tg, 0)
    buffer = np.empty(256 + 3 + 256 * 256, np.float32)
    b, w = buffer[:256], buffer[259:].reshape(256, 256)  # w starts on b's page
    w[...], b[...] = inputs["w"], inputs["b"]
    want = reference(tg, inputs)

    together = StandInCupyBackend(delay=1e-3, in_place_min=0)
    with runtime.Session(mg, together) as session:
        session.stage({"w": w, "b": b})
        assert_outputs_match(session.run({"x": inputs["x"]}), want)
        assert len(together.cp.registered) == 1
        assert inside(w, registered_ranges(together.cp)) and inside(
            b, registered_ranges(together.cp)
        )
    assert together.cp.pinned == [session.host_layout.nbytes]

    apart = StandInCupyBackend(delay=1e-3, in_place_min=0)
    with runtime.Session(mg, apart) as session:
        session.stage({"b": b})
        session.stage({"w": w})
        assert_outputs_match(session.run({"x": inputs["x"]}), want)
        assert len(apart.cp.registered) == 1 and not inside(w, registered_ranges(apart.cp))
        assert session.last.memory["host_in_place_bytes"] == b.nbytes
    assert apart.cp.pinned == [session.host_layout.nbytes, w.nbytes]  # the buffer, w's copy


def test_a_read_only_memory_map_is_registered_read_only(tmp_path):
    """A weight memory-mapped read-only from a file (as safetensors maps a checkpoint) is
    registered in place with cudaHostRegisterReadOnly, never written."""
    tg = big_weight_program()
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    inputs = make_inputs(tg, 0)
    path = tmp_path / "w.bin"
    inputs["w"].tofile(path)
    mapped = np.memmap(path, np.float32, mode="r", shape=inputs["w"].shape)
    backend = StandInCupyBackend(delay=1e-3)
    with runtime.Session(mg, backend) as session:
        session.stage({"w": mapped, "b": inputs["b"]})
        assert_outputs_match(session.run({"x": inputs["x"]}), reference(tg, inputs))
        ((size, flags),) = backend.cp.registered.values()
        assert flags == READ_ONLY and size >= mapped.nbytes
    assert backend.cp.registered == {}


def test_staging_a_weight_again_releases_the_pages_of_the_old_array():
    tg = big_weight_program()
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    inputs = make_inputs(tg, 0)
    backend = StandInCupyBackend(delay=1e-3)
    with runtime.Session(mg, backend) as session:
        session.stage({"w": inputs["w"], "b": inputs["b"]})
        (old,) = backend.cp.registered
        again = inputs["w"] * 2
        session.stage({"w": again})
        (new,) = backend.cp.registered
        assert new != old and ("unregister", old) in [c[:2] for c in backend.cp.registrations]
        got = session.run({"x": inputs["x"]})
        assert_outputs_match(got, reference(tg, {**inputs, "w": again}))
        calls = len(backend.cp.registrations)
        session.stage({"w": again})  # the same array again: nothing registered again
        session.run({"x": inputs["x"], "w": again})  # nor when a run is given it
        assert len(backend.cp.registrations) == calls and list(backend.cp.registered) == [new]
    assert backend.cp.registered == {}
