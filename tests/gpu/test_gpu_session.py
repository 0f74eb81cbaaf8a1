"""Issue 23 on a real GPU: one session per generation, weights read in place, errors at
the node, aligned regions. The same properties are checked on the CPU stand-in of CuPy
(tests/runtime/test_runtime_generation_session.py, test_runtime_weights_in_place.py,
test_runtime_node_errors.py); these run them against CUDA itself.

Skipped cleanly without CuPy or a usable GPU. No fault is injected here: a real sticky
error would lose the CUDA context of the whole test process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import runtime

if not runtime.cupy_usable():
    pytest.skip(
        "needs CuPy and a CUDA GPU (pip install 'einpage[gpu]' or '.[gpu-cuda13]')",
        allow_module_level=True,
    )

import cupy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from runtime_cases import assert_outputs_match, make_inputs, reference  # noqa: E402

import einpage as ep  # noqa: E402
import memgraph  # noqa: E402
from einpage.errors import BackendError  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.workloads.generation import GenerationSpec, Planning, plan_generation  # noqa: E402
from memgraph import NodeKind  # noqa: E402
from runtime.cupy_backend import CupyBackend, CupyKernels  # noqa: E402
from runtime.hostmem import PAGE  # noqa: E402

pytestmark = pytest.mark.gpu


class Counting(CupyBackend):
    """The CuPy backend, counting its arena and pinned allocations."""

    def __init__(self, **options):
        super().__init__(**options)
        self.arenas: list[int] = []
        self.hosts: list[int] = []

    def allocate_arena(self, nbytes):
        self.arenas.append(nbytes)
        return super().allocate_arena(nbytes)

    def allocate_host(self, nbytes):
        self.hosts.append(nbytes)
        return super().allocate_host(nbytes)


def test_a_step_plan_generation_is_one_session_on_the_gpu():
    cfg = llama.PRESETS["tiny"]
    spec = GenerationSpec(llama.FAMILY, cfg, 2, 5, 7, "float32", page_size=4)
    plan = plan_generation(spec, "60%", Planning(way="steps", chunk_steps=2))
    assert len(plan.decoders) >= 2
    rng = np.random.default_rng(0)
    weights = {
        n: (0.2 * rng.standard_normal(s)).astype(np.float32) for n, s in cfg.weight_shapes().items()
    }
    prompt = np.arange(10).reshape(2, 5) % cfg.vocab_size
    want = plan.run(weights, prompt, backend="numpy")
    backend = Counting()
    got = plan.run(weights, prompt, backend=backend, mode="streams")
    np.testing.assert_array_equal(got.ids, want.ids)
    plans = list(plan.session_plans.values())
    assert backend.arenas == [max(runtime.interpreter.arena_bytes(mg) for mg in plans)]
    assert backend.hosts == [got.reports[-1].memory["host_bytes"]]  # tiny weights: copied
    memory = got.reports[-1].memory
    assert memory["host_bytes"] + memory["host_in_place_bytes"] == runtime.pinned_bytes(plans)
    for report in got.reports:
        assert report.memory["device_peak_bytes"] <= max(mg.budget for mg in plans)


def big_weight_program(n: int = 1024):
    prog = ep.Program("big")
    x = prog.input("x", (8, n))
    w = prog.input("w", (n, n), role="weight")  # 4 MiB: read in place
    b = prog.input("b", (n,), role="weight")  # 4 KiB: copied
    prog.output(ep.silu(x @ w) + b, "y")
    return prog.build()


def test_a_large_weight_is_registered_in_place_and_unregistered_at_close():
    tg = big_weight_program()
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    inputs = {n: a * 0.05 for n, a in make_inputs(tg, 0).items()}
    backend = Counting()
    with runtime.Session(mg, backend, mode="streams") as session:
        session.stage({"w": inputs["w"], "b": inputs["b"]})
        got = session.run({"x": inputs["x"]})
        memory = session.last.memory
    assert_outputs_match(got, reference(tg, inputs))
    assert memory["host_in_place_bytes"] == inputs["w"].nbytes
    assert memory["host_registered_bytes"] >= inputs["w"].nbytes
    assert backend.hosts == [runtime.pinned_bytes(mg) - inputs["w"].nbytes]
    first_page = inputs["w"].ctypes.data // PAGE * PAGE  # where its registration began
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):  # unregistered at close
        cupy.cuda.runtime.hostUnregister(first_page)


def test_a_read_only_memory_map_runs_in_place_or_copied(tmp_path):
    """Registered read-only where the device supports it, else copied: right either way."""
    tg = big_weight_program()
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    inputs = {n: a * 0.05 for n, a in make_inputs(tg, 0).items()}
    path = tmp_path / "w.bin"
    inputs["w"].tofile(path)
    mapped = np.memmap(path, np.float32, mode="r", shape=inputs["w"].shape)
    with runtime.Session(mg, "cupy") as session:
        session.stage({"w": mapped, "b": inputs["b"]})
        got = session.run({"x": inputs["x"]})
    assert_outputs_match(got, reference(tg, inputs))


def test_debug_mode_names_the_failing_node_by_its_line(monkeypatch):
    tg = big_weight_program(256)
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    inputs = make_inputs(tg, 0)
    second = mg.of_kind(NodeKind.APPLY)[1]
    real = CupyKernels.run

    def run(self, task, operands, out, workspace=None):
        if task.id == second.tensor:
            raise ValueError("exploded")
        return real(self, task, operands, out, workspace)

    monkeypatch.setattr(CupyKernels, "run", run)
    with pytest.raises(BackendError) as info:
        runtime.run(mg, inputs, "cupy", mode="streams", debug=True)
    assert str(info.value).startswith(f"{second.line()} failed on stream 'compute'")


def test_the_arena_and_every_region_are_aligned_on_the_gpu():
    tg = big_weight_program(256)
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg))
    with runtime.Session(mg, "cupy") as session:
        session.run(make_inputs(tg, 0))
        base = session.arena.ptr
        assert base % 256 == 0
        for node in mg.nodes:
            if node.kind is NodeKind.ALLOC:
                view = session.interpreter.device_view(node.region, node.tensor)
                assert view.data.ptr % 256 == 0 and view.data.ptr % view.itemsize == 0
