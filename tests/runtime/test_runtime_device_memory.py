"""The plan's promise on the CPU stand-in of a GPU: no device byte outside the budget.

Every plan here runs on the whole `CupyBackend` over `cuda_streams.standin_cupy()`, whose
device memory is counted (`cpu_cuda.DeviceMemory`): the arena, and every array any CuPy
function or array method would make, which CuPy takes from its allocator – refused by
the backend while a run issues work. Each run must allocate the arena alone (at most
the budget) and equal the reference evaluator: LLaMA, GPT-2 and Qwen2 prefill,
generation (unrolled and step plans), a training step, int8/int4 weights, at budgets
that offload, and random programs. Reintroducing the old GEMM path – the product into a
temporary, then a transposing copy – fails the run, naming the task.
"""

from __future__ import annotations

import numpy as np
import pytest
from cpu_cuda import CXX
from cuda_streams import StandInCupyBackend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_cases import assert_outputs_match, einsum_programs, make_inputs

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.errors import BackendError
from einpage.models import gpt2, llama, qwen2
from einpage.program.optim import AdamW
from einpage.program.quantize import Quantization, quantize_weights
from einpage.workloads.generate import Planning, Running, generate
from einpage.workloads.training import training_graph, training_inputs
from runtime import cupy_backend
from runtime.interpreter import arena_bytes

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++)")

RNG = np.random.default_rng(23)
FAMILIES = {"llama": llama, "gpt2": gpt2, "qwen2": qwen2}


def standin_run(mg, inputs, seed: int = 0):
    """One run of `mg` on the stand-in (copies landing after random delays); the outputs
    and the stand-in's device memory."""
    backend = StandInCupyBackend(delay=2e-4, seed=seed)
    with runtime.Session(mg, backend) as session:
        out = session.run(inputs, seed=seed)
    return out, backend.cp.memory


def assert_only_the_arena(memory, mg) -> None:
    """Device memory: the arena alone, within the budget."""
    assert memory.allocations == [("cuda.Memory", arena_bytes(mg))], memory.allocations
    assert memory.peak <= mg.budget


def random_weights(cfg) -> dict[str, np.ndarray]:
    return {
        name: (RNG.standard_normal(shape) * 0.05).astype(np.float32)
        for name, shape in cfg.weight_shapes().items()
    }


def tight_budget(tg) -> int:
    """A budget that offloads: halfway from the smallest budget to the streaming minimum."""
    low, _ = memgraph.min_budget(runtime.declare_workspaces(tg))
    return (low + memgraph.streaming_minimum(runtime.declare_workspaces(tg))) // 2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_allocates_the_arena_alone(family):
    module = FAMILIES[family]
    cfg = module.PRESETS["tiny"]
    tokens = RNG.integers(0, cfg.vocab_size, (2, 8))
    tg = module.prefill_program(cfg, 2, 8, "float32", "all").build()
    inputs = module.prefill_inputs(cfg, tokens, random_weights(cfg))
    want = taskgraph.evaluate(tg, inputs)
    for budget in ("100%", tight_budget(tg)):
        mg = ep.compile(tg, budget).plan
        got, memory = standin_run(mg, inputs)
        assert_outputs_match(got, want)
        assert_only_the_arena(memory, mg)
    assert mg.stats.offload_bytes + mg.stats.reload_bytes > 0


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_prefill_allocates_the_arena_alone(bits):
    cfg = llama.PRESETS["tiny"]
    weights = random_weights(cfg)
    tokens = RNG.integers(0, cfg.vocab_size, (1, 8))
    tg = llama.prefill_program(cfg, 1, 8, quant=Quantization(bits, 32)).build()
    inputs = llama.prefill_inputs(cfg, tokens, quantize_weights(cfg, weights, bits, 32))
    mg = ep.compile(tg, tight_budget(tg)).plan
    got, memory = standin_run(mg, inputs)
    assert_outputs_match(got, taskgraph.evaluate(tg, inputs))
    assert_only_the_arena(memory, mg)


def test_a_training_step_allocates_the_arena_alone():
    cfg = llama.PRESETS["tiny"]
    optimizer = AdamW(lr=1e-3)
    tg = training_graph(cfg, 1, 8, optimizer)
    tokens = RNG.integers(0, cfg.vocab_size, (1, 8))
    labels = RNG.integers(0, cfg.vocab_size, (1, 8))
    inputs = training_inputs(cfg, optimizer, tokens, labels, random_weights(cfg))
    mg = ep.compile(tg, "60%", outputs="host").plan
    assert mg.stats.offload_bytes + mg.stats.reload_bytes > 0
    got, memory = standin_run(mg, inputs)
    assert_outputs_match(got, taskgraph.evaluate(tg, inputs))
    assert_only_the_arena(memory, mg)


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_generation_allocates_within_its_budgets(way):
    """Every plan of a generation runs in an arena within its budget, and nothing else is
    allocated; the tokens are the NumPy backend's."""
    cfg = llama.PRESETS["tiny"]
    weights = random_weights(cfg)
    prompt = RNG.integers(0, cfg.vocab_size, (2, 5))
    chunks = {"chunk_steps": 2} if way == "steps" else {}
    options = {"plan": Planning(way=way, **chunks), "weights": weights, "page_size": 4}
    want = generate(cfg, prompt, 4, "60%", **options)
    backend = StandInCupyBackend(delay=2e-4)
    got = generate(cfg, prompt, 4, "60%", run=Running(backend=backend), **options)
    np.testing.assert_array_equal(got.ids, want.ids)
    compiled = got.plan.plans.values() if isinstance(got.plan.plans, dict) else got.plan.plans
    plans = [c.plan for c in compiled]
    arenas = sorted(arena_bytes(mg) for mg in plans)
    memory = backend.cp.memory
    assert {what for what, _ in memory.allocations} == {"cuda.Memory"}
    assert sorted({size for _, size in memory.allocations}) == sorted(set(arenas))
    assert memory.peak <= max(mg.budget for mg in plans)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(einsum_programs(dtypes=("float32", "float64")), st.integers(0, 2), st.integers(0, 99))
def test_random_programs_allocate_the_arena_alone(tg, which, seed):
    tg = runtime.declare_workspaces(tg)
    low, _ = memgraph.min_budget(tg)
    high = max(low, memgraph.streaming_minimum(tg))
    mg = memgraph.plan(tg, [low, (low + high) // 2, high][which])
    inputs = make_inputs(tg, seed)
    got, memory = standin_run(mg, inputs, seed)
    assert_outputs_match(got, taskgraph.evaluate(tg, inputs))
    assert_only_the_arena(memory, mg)


def old_gemm_path(cp):
    """The GEMM path as it was, over the CuPy module `cp`: the product into a temporary of
    the grouped layout (`cp.matmul`), then a transposing copy into the output. It takes
    `(task, a, b, out)`."""

    def run(task, a, b, out, copy) -> None:
        spec = task.op.spec
        a_term, b_term = spec.inputs
        k = [c for c in a_term if c not in spec.output]
        m = [c for c in spec.output if c in a_term]
        n = [c for c in spec.output if c in b_term and c not in a_term]
        sizes = spec.index_sizes([a.shape, b.shape])
        left = cp.transpose(a, [a_term.index(c) for c in m + k])
        right = cp.transpose(b, [b_term.index(c) for c in k + n])
        rows, inner, cols = (int(np.prod([sizes[c] for c in g])) for g in (m, k, n))
        product = cp.matmul(left.reshape(rows, inner), right.reshape(inner, cols))
        grouped = product.reshape([sizes[c] for c in m + n])
        copy(cp.transpose(grouped, [(m + n).index(c) for c in spec.output]), out)

    return run


def test_a_transposing_temporary_fails_the_run(monkeypatch):
    """With the GEMM path put back as it was (the product into a temporary the size of
    the output, then transposed into place), LLaMA's q/k/v projection asks CuPy for
    memory during the run: refused, naming the task; nothing past the arena is taken."""
    cfg = llama.PRESETS["tiny"]
    tg = llama.prefill_program(cfg, 2, 8, "float32", "last").build()
    tokens = RNG.integers(0, cfg.vocab_size, (2, 8))
    inputs = llama.prefill_inputs(cfg, tokens, random_weights(cfg))
    mg = ep.compile(tg, "100%").plan
    backend = StandInCupyBackend(delay=0)
    old = old_gemm_path(backend.cp)
    matmul_shaped = cupy_backend.einsum_gemm

    def einsum(kernels, task, operands, out, workspace):
        if matmul_shaped(task, [(a.shape, a.dtype.name) for a in operands]) is None:
            return cupy_backend.CupyKernels.einsum(kernels, task, operands, out, workspace)
        old(task, *operands, out, kernels.copy)

    handlers = dict(cupy_backend.CupyKernels.HANDLERS.items())
    handlers[taskgraph.Einsum] = einsum
    monkeypatch.setattr(backend.kernels, "HANDLERS", handlers_table(handlers))
    refused = r"task %\d+ .*bgrse.* asked CuPy for .* outside the plan"
    with pytest.raises(BackendError, match=refused), runtime.Session(mg, backend) as session:
        session.run(inputs)
    assert backend.cp.memory.allocations == [("cuda.Memory", arena_bytes(mg))]


def handlers_table(handlers):
    """An object with `of(op)`, as `CupyKernels.HANDLERS` is used."""
    return type("Handlers", (), {"of": staticmethod(lambda op: handlers[type(op)])})()
