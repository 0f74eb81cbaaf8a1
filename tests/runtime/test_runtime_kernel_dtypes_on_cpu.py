"""The CuPy backend's kernels in every dtype – bfloat16 above all – on the CPU stand-in
(`cpu_cuda`: the kernels' CUDA C compiled with g++, bfloat16 and float16 as host classes
shaped like CuPy 14's), against the NumPy backend's kernels (`taskgraph.evaluate_task`).

Each task is given the same operands (the reference evaluator's values) and held to
the standard `dtype_checks` states: bit for bit where both backends compute it by the
same correctly rounded operations and round once (casts, fills, copies, gathers, the
scatter-add, integer results, joins of + - * / sqrt abs max min where ...), within one
rounding of its dtype where the float32 value may differ (sums in another order, exp,
log, tanh, ...).

On LLaMA tiny in bfloat16 – prefill, int4 and int8 weights, generation with top-k
sampling, a training step – every task but one matmul element is equal bit for bit
(measured). Whole plans run on the stand-in's `CupyBackend` and generate NumPy's ids.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from cpu_cuda import CXX, fake_cupy
from cuda_streams import StandInCupyBackend
from dtype_checks import bits, differing, within_one_rounding
from dtype_checks import compare_every_task as compare_tasks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_cases import bfloat16_llama_programs, einsum_programs, make_inputs

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.cli.presets import load_program, random_inputs
from einpage.models import FAMILIES, llama
from einpage.models.decode import Sampling
from einpage.workloads.generation import GenerationSpec, Planning, plan_generation
from runtime import cuda_codegen, cupy_backend
from runtime.cupy_backend import CupyKernels
from taskgraph import TaskGraph, dtypes
from taskgraph.nodes import ScatterAdd

pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++)")


def compare_every_task(tg: TaskGraph, inputs) -> dict[str, int]:
    """`dtype_checks.compare_every_task` on the stand-in's kernels."""
    cp = fake_cupy()
    return compare_tasks(tg, inputs, CupyKernels(cp), to_device=cp.asarray, to_host=cp.asnumpy)


TINY = llama.PRESETS["tiny"]
MODELS = bfloat16_llama_programs()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_task_of_llama_in_bfloat16_equals_numpys(model):
    tg = MODELS[model]()
    counts = compare_every_task(tg, random_inputs(tg, 0))
    assert counts["bit for bit"] >= 20, counts  # casts, fills, copies, gathers, norms' joins
    assert counts["one rounding"] <= 2, counts  # measured: one matmul, one element


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(tg=einsum_programs(dtypes=("bfloat16",)), seed=st.integers(0, 99))
def test_every_task_of_random_bfloat16_programs_equals_numpys(tg, seed):
    compare_every_task(tg, make_inputs(tg, seed))


# -- casts ------------------------------------------------------------------------------

EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, 1.5, -2.5, 3.0, 1 + 2**-8 + 2**-30, 1 + 2**-11 + 2**-40,
         1 + 2**-8, 1 + 3 * 2**-8, 2.0**-130, 1e-40, 6e-8, 65504.0, 65520.0, 70000.0,
         3.3e38, 3.5e38, 1e300, math.inf, -math.inf, math.nan, 127.0, -128.0, 255.0]  # fmt: skip
"""Values where roundings differ: ties, bfloat16's and float16's double-rounding cases
(1 + 2**-8 + 2**-30 rounds up from float64, to 1 through float32), subnormals,
overflows, infinities, NaN, the ends of int8 and uint8."""


def cast_inputs(dtype: str, out: str, rng) -> np.ndarray:
    if dtypes.is_float(dtype):
        values = np.array(EDGES + list(rng.standard_normal(40) * 50), np.float64)
        if not dtypes.is_float(out):  # float to integer: only values the integer holds
            info = np.iinfo(out)
            values = np.trunc(values[np.isfinite(values)])
            values = values[(values >= max(info.min, -(2**31))) & (values <= min(info.max, 2**31))]
        with np.errstate(all="ignore"):
            return values.astype(dtypes.numpy_dtype(dtype))
    info = np.iinfo(dtype)
    ends = [info.min, info.max, 0, 1, info.max // 2]
    return np.concatenate([np.array(ends), rng.integers(info.min, info.max, 40)]).astype(dtype)


@pytest.mark.parametrize("out", dtypes.DTYPES)
def test_casts_between_every_pair_of_dtypes_equal_numpys_bit_for_bit(out):
    """A cast is one generated kernel (`in0` read, converted in the task's work type,
    stored with one rounding), for every operand dtype generated kernels take."""
    rng = np.random.default_rng(0)
    for source in dtypes.DTYPES:
        if not cuda_codegen.supports([source], out):
            continue
        x = cast_inputs(source, out, rng)
        prog = ep.Program("cast")
        prog.output(prog.einsum("i->i", prog.input("x", x.shape, source), dtype=out), "y")
        counts = compare_every_task(prog.build(), {"x": x})
        assert counts == {"bit for bit": 1, "one rounding": 0, "equal anyway": 0}


def test_an_integer_result_follows_numpys_promotions():
    """Integer tasks keep their integer operands and compute each node in NumPy's dtype:
    int8 sums wrap at 8 bits, uint8 comparisons are of wrapped values, an int64 divided by
    a constant is float64 truncated back (the training step's label arithmetic)."""
    rng = np.random.default_rng(1)
    prog = ep.Program("ints")
    a8, b8 = prog.input("a8", (64,), "int8"), prog.input("b8", (64,), "int8")
    u8, v8 = prog.input("u8", (64,), "uint8"), prog.input("v8", (64,), "uint8")
    labels = prog.input("labels", (64,), "int64")
    prog.output(prog.einsum("i,i->i", a8, b8, join="a + b * b"), "wrap")
    prog.output(prog.einsum("i,i->i", u8, v8, join="(a - b) > a", dtype="uint8"), "compare")
    prog.output(prog.einsum("i->i", labels, join="a / 16.0"), "high")
    prog.output(prog.einsum("i,i->", a8, b8, join="max(a, b) - abs(b)"), "sum")
    prog.output(prog.einsum("i->i", labels, join="a - 16 * floor(a / 16)", dtype="float32"),
                "low")  # fmt: skip
    tg = prog.build()
    inputs = {
        "a8": rng.integers(-128, 128, 64).astype(np.int8),
        "b8": rng.integers(-128, 128, 64).astype(np.int8),
        "u8": rng.integers(0, 256, 64).astype(np.uint8),
        "v8": rng.integers(0, 256, 64).astype(np.uint8),
        "labels": rng.integers(0, 50000, 64).astype(np.int64),
    }
    counts = compare_every_task(tg, inputs)
    assert counts["bit for bit"] == len(tg.outputs)
    wrapped = inputs["a8"].astype(np.int64) + inputs["b8"].astype(np.int64) ** 2
    assert (wrapped != wrapped.astype(np.int8)).any()  # the inputs do overflow 8 bits


# -- fills and copies -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", dtypes.FLOAT_DTYPES)
def test_fills_round_their_value_as_the_evaluator_does(dtype):
    """The value goes to the work type first, then to the dtype (NumPy's `np.full(...,
    dtype=work).astype(dtype)`): a float16 fill of 1 + 2**-11 + 2**-40 is 1.0 (through
    float32: a tie, to even), not the 1.00098 a direct rounding gives."""
    prog = ep.Program("fills")
    prog.output(prog.fill((3, 5), 1 + 2**-11 + 2**-40, dtype), "full")
    prog.output(prog.fill((4, 4), -math.inf, dtype, pattern="causal"), "causal")
    prog.output(prog.fill((2, 3), 1 + 2**-8 + 2**-30, dtype), "bf16 tie")
    tg = prog.build()
    counts = compare_every_task(tg, {})
    assert counts["bit for bit"] == 3


def test_slices_views_and_concatenations_are_copy_kernels_in_any_dtype():
    for dtype in ("bfloat16", "float16", "int8", "int64", "float64"):
        prog = ep.Program("copies")
        x = prog.input("x", (4, 6), dtype)
        y = prog.input("y", (4, 2), dtype)
        both = prog.concat([x, y, x[:, 1:3]], axis=1)
        prog.output(both, "both")
        prog.output(prog.view(both, (2, 2, 10)), "view")
        prog.output(prog.concat([x[1:3, :], x[0:1, :]], axis=0), "rows")
        tg = prog.build()
        rng = np.random.default_rng(2)
        inputs = {
            n: (rng.standard_normal(s) * 9).astype(dtypes.numpy_dtype(dtype))
            for n, s in (("x", (4, 6)), ("y", (4, 2)))
        }
        compare_every_task(tg, inputs)


# -- argmax, argmin and the k-th largest ---------------------------------------------------


def selection_rows(dtype: str, n: int = 40) -> np.ndarray:
    """Rows to select from: random, with a repeated maximum and minimum (NumPy takes the
    first), and for floats NaNs (the first NaN wins argmax and argmin; NaNs sort last),
    infinities, -0 and +0, one row all NaN."""
    rng = np.random.default_rng(6)
    if not dtypes.is_float(dtype):
        info = np.iinfo(dtype)
        rows = rng.integers(info.min, info.max, (5, n), endpoint=True)
        rows[1, [3, 9]] = info.max
        rows[1, [4, 20]] = info.min
        rows[2] = 7
        return rows.astype(dtype)
    rows = rng.standard_normal((7, n)) * 100
    rows[1, [3, 9]] = rows[1].max() + 1
    rows[1, [4, 20]] = rows[1].min() - 1
    rows[2, 11], rows[2, 30] = np.nan, np.nan
    rows[3, [0, 5]] = [-np.inf, np.inf]
    rows[4, :] = 0.0
    rows[4, ::3] = -0.0
    rows[5, :] = np.nan
    rows[6, 17] = np.nan
    with np.errstate(all="ignore"):
        return rows.astype(dtypes.numpy_dtype(dtype))


@pytest.mark.parametrize("dtype", dtypes.DTYPES)
def test_argmax_argmin_and_the_kth_largest_equal_numpys_in_every_dtype(dtype):
    """Generated reductions, bit for bit NumPy's, where CuPy 14's own `argmax`/`argmin`
    have no bfloat16 loop and its `partition` sorts with thrust, which has no bfloat16
    (the stand-in refuses them as CuPy does), and both allocate their results."""
    x = selection_rows(dtype)
    prog = ep.Program("select")
    t = prog.input("x", x.shape, dtype)
    prog.output(ep.argmax(t), "argmax")
    prog.output(ep.argmin(t), "argmin")
    for k in (1, 2, 7, x.shape[1] - 1, x.shape[1]):
        prog.output(ep.kth_largest(t, k), f"top{k}")
    prog.output(ep.kth_largest(t[0], 3), "one row")
    counts = compare_every_task(prog.build(), {"x": x})
    assert counts["bit for bit"] == 10  # the row (a slice, a view), 2 arg-reductions, 6 selections


# -- the scatter-add --------------------------------------------------------------------


def scatter_program(rows: int, n: int, row: int, dtype: str, start: int = 0) -> TaskGraph:
    prog = ep.Program("scatter")
    src = prog.input("src", (n, row), dtype)
    ids = prog.input("ids", (n,), "int64")
    out = prog._add(ScatterAdd(start), (src, ids), (rows, row), None)
    prog.output(out, "table")
    return prog.build()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_the_scatter_add_equals_numpys_add_at_bit_for_bit_every_run(dtype):
    """Many ids repeat (sums whose float32 value depends on the order of its terms), some
    are outside the block's rows; the stand-in runs threads in a shuffled order, as a GPU
    may: the sorted scatter-add still sums each row's sources in position order."""
    rng = np.random.default_rng(3)
    rows, n, row, start = 7, 300, 5, 2
    tg = scatter_program(rows, n, row, dtype, start)
    src = rng.standard_normal((n, row)) * 10.0 ** rng.integers(-3, 4, (n, 1))
    inputs = {"src": src.astype(dtypes.numpy_dtype(dtype)),
              "ids": rng.integers(0, rows + 4, n).astype(np.int64)}  # fmt: skip
    want = taskgraph.evaluate(tg, inputs)["table"]
    runs = []
    for _ in range(3):
        cp = fake_cupy()
        kernels = CupyKernels(cp)
        (task,) = [t for t in tg.tasks if isinstance(t.op, ScatterAdd)]
        got = np.empty(task.shape, dtypes.numpy_dtype(dtype))
        nbytes = cuda_codegen.scatter_add_workspace(task, [(n, row), (n,)])
        kernels.run(task, [inputs["src"], inputs["ids"]], got, cp.empty(nbytes, np.uint8))
        assert not differing(got, want).any()
        runs.append(got)
    assert all((bits(r) == bits(runs[0])).all() for r in runs)
    if dtype in ("float32", "float64"):  # the sums do depend on the order of their terms
        shuffled = np.zeros((rows, row), dtype)
        order = rng.permutation(n)
        ids = inputs["ids"][order]
        keep = (ids >= start) & (ids < start + rows)
        np.add.at(shuffled, ids[keep] - start, inputs["src"][order][keep])
        assert (shuffled != want).any()


def test_the_scatter_add_declares_its_workspace_and_uses_that_many_bytes():
    tg = scatter_program(rows=5, n=9, row=3, dtype="float32")
    (task,) = [t for t in tg.tasks if isinstance(t.op, ScatterAdd)]
    shapes = [tg[i].shape for i in task.inputs]
    nbytes = cuda_codegen.scatter_add_workspace(task, shapes)
    assert nbytes == 8 * 16  # nine int64 keys, padded to sixteen for the bitonic sort
    rng = np.random.default_rng(4)
    src = rng.standard_normal((9, 3)).astype(np.float32)
    ids = rng.integers(0, 5, 9)
    workspace = np.full(nbytes + 24, 0xAB, np.uint8)  # the kernels leave the rest alone
    out = np.empty((5, 3), np.float32)
    CupyKernels(fake_cupy()).run(task, [src, ids], out, workspace)
    assert (workspace[nbytes:] == 0xAB).all()
    keys = workspace[:nbytes].view(np.int64)
    assert (np.diff(keys[:9]) > 0).all() and (keys[:9] >> 32 == np.sort(ids)).all()
    assert (keys[9:] == np.iinfo(np.int64).max).all()  # the padding sorts last
    assert not differing(out, taskgraph.evaluate(tg, {"src": src, "ids": ids})["table"]).any()
    with pytest.raises(ep.UnsupportedError, match="2\\*\\*32 ids"):
        cuda_codegen.scatter_add_workspace(task, [(2**32, 3), (2**32,)])


# -- whole plans on the stand-in's CupyBackend --------------------------------------------


def test_a_bfloat16_llama_plan_runs_on_the_cupy_backend_at_an_offloading_budget():
    tg = load_program("llama:tiny", batch=1, seq=8, dtype="bfloat16")
    inputs = random_inputs(tg, 1)
    mg = ep.compile(tg, "50%").plan
    assert mg.stats.reload_bytes > 0
    with runtime.Session(mg, StandInCupyBackend(delay=1e-3, seed=1)) as session:
        got = session.run(inputs)
    want = runtime.run(mg, inputs, "numpy")
    for name, value in want.items():
        assert got[name].dtype == value.dtype == np.dtype(ml_dtypes.bfloat16)
        assert within_one_rounding(got[name], value), name


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_bfloat16_generation_on_the_cupy_backend_gives_numpys_ids(way):
    family = FAMILIES["llama"]
    spec = GenerationSpec(family, family.presets["tiny"], 2, 5, 4, "bfloat16", 4,
                          Sampling(temperature=0.8, top_k=5))  # fmt: skip
    rng = np.random.default_rng(5)
    weights = {name: (0.3 * rng.standard_normal(shape, dtype=np.float32)).astype("bfloat16")
               for name, shape in spec.cfg.weight_shapes().items()}  # fmt: skip
    prompt = np.random.default_rng(9).integers(0, spec.cfg.vocab_size, (2, 5))
    plan = plan_generation(spec, "60%", Planning(way=way))
    want = plan.run(weights, prompt, seed=3, backend="numpy").ids
    got = plan.run(weights, prompt, seed=3, backend=StandInCupyBackend(delay=5e-4)).ids
    np.testing.assert_array_equal(got, want)


def test_memgraph_plans_of_bfloat16_programs_are_not_refused_by_the_cupy_backend():
    mg = memgraph.plan(load_program("mlp", dtype="bfloat16"), "1GiB")
    runtime.session.refuse_unsupported(mg, StandInCupyBackend())  # nothing refused


def test_16_bit_gemms_keep_their_partial_sums_in_float32(monkeypatch):
    """cuBLAS's default math lets a GEMM with a 16-bit output add split-K partial sums in
    16 bits, a rounding more than the NumPy backend's float32 sums rounded once; every
    GEMM sets CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION first, and the stand-in's
    cuBLAS refuses a 16-bit GEMM without it."""
    prog = ep.Program("product")
    x, w = prog.input("x", (4, 64), "bfloat16"), prog.input("w", (64, 32), "bfloat16")
    prog.output(prog.einsum("ik,kj->ij", x, w), "y")
    tg = prog.build()
    compare_every_task(tg, make_inputs(tg, 0))
    monkeypatch.setattr(cupy_backend, "FLOAT32_REDUCTIONS", 0)  # cuBLAS's default math
    with pytest.raises(ValueError, match="DISALLOW_REDUCED_PRECISION_REDUCTION"):
        compare_every_task(tg, make_inputs(tg, 0))


def test_a_gemm_refuses_operands_that_are_not_c_contiguous():
    """The arena holds every tensor C-contiguous, and cuBLAS is given raw addresses: a
    transposed operand (as `cupy.asarray` keeps a NumPy array's layout) is refused by
    name, not read at the wrong places (a GPU run of the kernels' own test gave products
    of the wrong sign before the tests made their operands contiguous)."""
    prog = ep.Program("product")
    x, w = prog.input("x", (4, 64), "float32"), prog.input("w", (64, 32), "float32")
    prog.output(prog.einsum("ik,kj->ij", x, w), "y")
    tg = prog.build()
    (task,) = [t for t in tg.tasks if t.is_compute]
    cp = fake_cupy()
    x_t = cp.asarray(np.ones((64, 4), np.float32)).T  # (4, 64), transposed strides
    w = cp.asarray(np.ones((64, 32), np.float32))
    with pytest.raises(ep.BackendError, match="C-contiguous"):
        CupyKernels(cp).run(task, [x_t, w], cp.empty((4, 32), np.float32))
