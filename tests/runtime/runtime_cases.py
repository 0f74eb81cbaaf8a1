"""Shared by the runtime tests (CPU and GPU): programs, inputs, plan makers, comparisons.

Plan makers live in one registry, `PLAN_MAKERS`: a name mapped to a function from a
TaskGraph to a hypothesis strategy of valid MemGraphs for it. Tests parametrize over
the registry: `reference` (tests/plans.reference_plan, which offloads any chosen set of
tensors whatever the budget) and `memgraph` (the planner, `memgraph.plan`, at a random
budget from `min_budget` to the streaming minimum, with a random eviction policy, order
and output placement).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
from hypothesis import strategies as st
from plans import reference_plan
from strategies import TOLERANCE, einsum_cases, join_trees

import einpage as ep
import memgraph
import taskgraph
from memgraph import MemGraph
from memgraph.eviction import POLICIES
from memgraph.planner import OUTPUTS
from taskgraph import TaskGraph, dtypes
from taskgraph.nodes import Gather

PlanMaker = Callable[[TaskGraph], st.SearchStrategy[MemGraph]]


@st.composite
def reference_plans(draw, tg: TaskGraph) -> MemGraph:
    """Plans of `tests.plans.reference_plan` with a random offload set and options."""
    candidates = [t.id for t in tg if t.kind not in ("input", "view")]
    offload = draw(st.sets(st.sampled_from(candidates))) if candidates else set()
    return reference_plan(
        tg,
        offload=frozenset(offload),
        reuse=draw(st.booleans()),
        outputs_to_host=draw(st.booleans()),
    )


@st.composite
def planner_plans(draw, tg: TaskGraph) -> MemGraph:
    """Plans of `memgraph.plan` at a random feasible budget (from `min_budget` to the
    streaming minimum of the drawn order), eviction policy, order and output placement."""
    order = draw(st.sampled_from(sorted(memgraph.ORDERS)), label="order")
    outputs = draw(st.sampled_from(OUTPUTS), label="outputs")
    low, _ = memgraph.min_budget(tg)
    high = max(low, memgraph.streaming_minimum(tg, order=order, outputs=outputs))
    return memgraph.plan(
        tg,
        draw(st.integers(low, high), label="budget"),
        order=order,
        outputs=outputs,
        eviction=draw(st.sampled_from(sorted(POLICIES)), label="eviction"),
    )


PLAN_MAKERS: dict[str, PlanMaker] = {"reference": reference_plans, "memgraph": planner_plans}
"""Plan makers the runtime properties run over (name -> tg -> strategy of MemGraphs)."""


# -- programs ---------------------------------------------------------------------

INDEX = "ijklmnop"


@st.composite
def einsum_programs(draw, dtypes=("float32", "float64", "float16")) -> TaskGraph:
    """A random plain einsum (split into pairwise steps), then a random generalized einsum
    of its result with itself (a join tree and an aggregation), with inputs that are
    randomly activations (on the device) or weights (on the host), and sometimes an
    output that is a view."""
    case = draw(einsum_cases(max_operands=4, max_indices=5, dtypes=dtypes))
    prog = ep.Program("case")
    tensors = [
        prog.input(f"x{i}", shape, case.dtype, role=draw(st.sampled_from(["activation", "weight"])))
        for i, shape in enumerate(case.shapes)
    ]
    y = prog.einsum(case.spec, *tensors)
    terms = INDEX[: y.ndim]
    kept = "".join(c for c in terms if draw(st.booleans()))
    source, _ = draw(join_trees(2, depth=2))
    agg = draw(st.sampled_from(["sum", "max", "min", "prod"]))
    z = prog.einsum(f"{terms},{terms}->{kept}", y, y, join=source, agg=agg)
    prog.output(y, "y")
    prog.output(z, "z")
    if y.ndim >= 2 and draw(st.booleans()):
        prog.output(y.reshape(-1), "y_flat")
    return prog.build()


def block_program(seq=6, d=8, heads=2, vocab=11, dtype="float32", layers=1) -> TaskGraph:
    """A small transformer block using every structural op: gather (embedding), views,
    slices, concat, a causal-mask fill, softmax, rmsnorm, matmuls and SiLU."""
    prog = ep.Program("block")
    ids = prog.input("ids", (seq,), "int64")
    emb = prog.input("emb", (vocab, d), dtype, role="weight")
    x = ep.gather(emb, ids)
    e = d // heads
    for layer in range(layers):
        with prog.scope(f"layers.{layer}"):
            w = {
                name: prog.input(f"{name}{layer}", shape, dtype, role="weight")
                for name, shape in (
                    ("wq", (d, d)),
                    ("wk", (d, d)),
                    ("wv", (d, d)),
                    ("wo", (d, d)),
                    ("w1", (d, 2 * d)),
                    ("w2", (2 * d, d)),
                    ("g", (d,)),
                )
            }
            h = ep.rmsnorm(x, w["g"])
            q = (h @ w["wq"]).reshape(seq, heads, e)
            k = (h @ w["wk"]).reshape(seq, heads, e)
            v = (h @ w["wv"]).reshape(seq, heads, e)
            scores = ep.scale(prog.einsum("qhe,khe->hqk", q, k), 1.0 / math.sqrt(e))
            p = ep.softmax(ep.causal_mask(scores))
            att = prog.einsum("hqk,khe->qhe", p, v).reshape(seq, d)
            x = x + att @ w["wo"]
            x = x + ep.silu(ep.rmsnorm(x) @ w["w1"]) @ w["w2"]
    left, right = x[:, : d // 2], x[:, d // 2 :]
    prog.output(ep.concat([right, left], axis=1), "y")
    prog.output(p, "probs")
    return prog.build()


def mlp_program() -> TaskGraph:
    """The verifier tests' MLP: weights on the host, an output that is a view."""
    prog = ep.Program("mlp")
    x = prog.input("x", (4, 8))
    w1 = prog.input("w1", (8, 16), role="weight")
    w2 = prog.input("w2", (16, 8), role="weight")
    h = ep.gelu(x @ w1)
    y = ep.softmax(h @ w2 + x)
    prog.output(y, "y")
    prog.output(h.reshape(64), "h_flat")
    return prog.build()


# -- inputs and comparisons -------------------------------------------------------


def bfloat16_llama_programs(batch: int = 1, seq: int = 8) -> dict[str, Callable[[], TaskGraph]]:
    """LLaMA tiny in bfloat16, every kind of program a model makes (prefill of `batch` x
    `seq`, int4 and int8 weights, generation with top-k sampling, a training step), each
    built when called: the task-by-task checks of the CuPy kernels run them all."""
    from einpage.cli.presets import load_program
    from einpage.models import generation, llama
    from einpage.models.decode import Sampling
    from einpage.program.optim import AdamW
    from einpage.program.quantize import Quantization
    from einpage.workloads.training import training_graph

    tiny = llama.PRESETS["tiny"]
    return {
        "prefill": lambda: load_program("llama:tiny", batch=batch, seq=seq, dtype="bfloat16"),
        "int4 weights": lambda: llama.prefill_program(
            tiny, 1, 8, "bfloat16", "last", quant=Quantization(4, 32)
        ).build(),
        "int8 weights": lambda: llama.prefill_program(
            tiny, 1, 8, "bfloat16", "last", quant=Quantization(8, 32)
        ).build(),
        "generation, top-k": lambda: generation.generation_program(
            llama.FAMILY,
            tiny,
            1,
            4,
            2,
            "bfloat16",
            page_size=4,
            sampling=Sampling(temperature=0.7, top_k=5),
        ).build(),  # fmt: skip
        "training step": lambda: training_graph(tiny, 1, 8, AdamW(lr=1e-3), "bfloat16"),
    }


def make_inputs(tg: TaskGraph, seed: int) -> dict[str, np.ndarray]:
    """Random inputs: standard normal floats, and integer ids within the rows of every table
    they index."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, task_id in tg.inputs.items():
        task = tg[task_id]
        if dtypes.is_float(task.dtype):  # bfloat16 too
            arrays[name] = rng.standard_normal(task.shape).astype(task.dtype)
            continue
        rows = [
            tg[tg[user].inputs[0]].shape[0]
            for user in tg.consumers[task_id]
            if isinstance(tg[user].op, Gather) and tg[user].inputs[1] == task_id
        ]
        arrays[name] = rng.integers(0, min(rows, default=2), size=task.shape).astype(task.dtype)
    return arrays


def assert_outputs_match(
    got: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], what: str = ""
) -> None:
    """Same names, shapes and dtypes, and values within the dtype's tolerance."""
    assert set(got) == set(expected), what
    for name, want in expected.items():
        have = got[name]
        assert isinstance(have, np.ndarray), f"{what} {name}: {type(have)}"
        assert have.shape == want.shape and have.dtype == want.dtype, f"{what} {name}"
        tol = TOLERANCE.get(str(want.dtype), 0.0)
        finite = np.abs(want[np.isfinite(want)]) if want.dtype.kind == "f" else np.abs(want)
        scale = max(1.0, float(finite.max(initial=0.0)))
        np.testing.assert_allclose(
            have, want, rtol=tol, atol=tol * scale, err_msg=f"{what} output {name!r}"
        )


def outputs_match(got: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray]) -> bool:
    try:
        assert_outputs_match(got, expected)
    except AssertionError:
        return False
    return True


def reference(tg: TaskGraph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return taskgraph.evaluate(tg, inputs)
