"""bfloat16 end to end below the models: the dtype table, programs and JSON, the reference
evaluator against PyTorch's bfloat16 ops, the planner's bytes, partitioning, and the
NumPy runtime's arena views.

The evaluator computes a bfloat16 task in float32 and rounds it once (as PyTorch's
bfloat16 kernels do), so against PyTorch on the same bfloat16 inputs:

* a matmul (one task: float32 accumulation, one rounding) is within one bfloat16
  rounding of torch's, elementwise: |ours - torch| <= 2**-8 |torch| (measured: equal
  bit for bit on the CPU);
* softmax (three tasks: max, sum of exp, normalize; the sum is rounded to bfloat16
  where torch's fused softmax keeps it in float32) and RMSNorm (two tasks: the mean
  square, rounded, then the normalization) are within `TWO_ROUNDINGS` = 2**-7 of the
  output's scale (measured: at most 5e-3 for softmax, 6.6e-3 for RMSNorm as Hugging
  Face's LLaMA writes it).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.cli.presets import load_program, random_inputs
from einpage.errors import DTypeError, InputError, UnsupportedError
from taskgraph import TaskGraph, dtypes
from taskgraph.partition import partition

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

ONE_ROUNDING = 2.0**-8
"""A bfloat16 rounding: at most half an ulp, 2**-8 of the value (8 significant bits)."""
TWO_ROUNDINGS = 2.0**-7


def bf16(shape, seed: int, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(ml_dtypes.bfloat16)


def to_torch(array: np.ndarray):
    return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)


def evaluate(build, *arrays: np.ndarray) -> np.ndarray:
    """`build(*tensors)` as a one-output bfloat16 program, evaluated on `arrays`."""
    prog = ep.Program("bf16")
    tensors = [prog.input(f"x{i}", a.shape, "bfloat16") for i, a in enumerate(arrays)]
    prog.output(build(*tensors), "y")
    out = taskgraph.evaluate(prog.build(), {f"x{i}": a for i, a in enumerate(arrays)})["y"]
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    return out.astype(np.float32)


# -- the dtype table --------------------------------------------------------------------


def test_the_dtype_table_knows_bfloat16():
    info = dtypes.info("bfloat16")
    assert (info.itemsize, info.bits, info.kind, info.compute, info.raw) == (
        2,
        16,
        "float",
        "float32",
        "uint16",
    )
    assert info.numpy == np.dtype(ml_dtypes.bfloat16) and info.numpy.itemsize == 2
    assert dtypes.canonical(ml_dtypes.bfloat16) == dtypes.canonical("bf16") == "bfloat16"
    assert dtypes.short("bfloat16") == "bf16" and dtypes.is_float("bfloat16")
    assert "bfloat16" in dtypes.FLOAT_DTYPES and "bfloat16" not in dtypes.INT_DTYPES
    assert dtypes.nbytes("bfloat16", 5) == 10
    assert dtypes.is_float_array(np.dtype("bfloat16")) and not dtypes.is_float_array("int64")
    for name, row in dtypes.TABLE.items():  # every row agrees with NumPy
        assert np.dtype(row.raw).itemsize == row.itemsize == np.dtype(name).itemsize
        assert np.dtype(row.raw).kind == "u"
    with pytest.raises(DTypeError, match="unsupported dtype 'float8'.*bfloat16"):
        dtypes.canonical("float8")


def test_a_packed_row_has_bytes_but_no_item_size():
    int4 = dtypes.DType("int4", "i4", 4, "int", "int32", "uint8")
    assert -(-3 * int4.bits // 8) == 2
    with pytest.raises(DTypeError, match="packs 4-bit elements"):
        _ = int4.itemsize


# -- programs, JSON, checks -------------------------------------------------------------


def small_program(dtype: str = "bfloat16") -> TaskGraph:
    prog = ep.Program("small")
    x = prog.input("x", (4, 8), dtype)
    w = prog.input("w", (8, 6), dtype, role="weight")
    ids = prog.input("ids", (3,), "int64")
    h = ep.gelu(x @ w)
    rows = prog.gather(prog.concat([h, prog.fill((2, 6), 0.5, dtype)], 0), ids)
    prog.output(ep.softmax(rows, axis=-1), "p")
    prog.output(ep.rmsnorm(h[1:3, :]), "r")
    prog.output(h.astype("float32").sum(axis=0), "s32")
    return prog.build()


def small_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": bf16((4, 8), seed), "w": bf16((8, 6), seed + 1), "ids": np.array([5, 0, 2])}


def test_bfloat16_programs_list_serialize_and_check_inputs():
    tg = small_program()
    assert tg[0].type_str == "bf16[4,8]" and tg[0].nbytes == 64
    assert TaskGraph.from_json(tg.to_json()).tasks == tg.tasks
    wrong = {**small_inputs(), "x": np.zeros((4, 8), np.int32)}
    with pytest.raises(InputError, match="expected dtype bfloat16, got int32"):
        taskgraph.evaluate(tg, wrong)
    wide = {**small_inputs(), "x": small_inputs()["x"].astype(np.float32)}
    for name, value in taskgraph.evaluate(tg, wide).items():  # float32 runs as bfloat16
        np.testing.assert_array_equal(value, taskgraph.evaluate(tg, small_inputs())[name])
    with pytest.raises(DTypeError, match="operand 1 is float32 but operand 0 is bfloat16"):
        prog = ep.Program()
        prog.einsum("i,i->i", prog.input("a", (2,), "bf16"), prog.input("b", (2,)))


def test_the_evaluator_rounds_each_task_once_from_float32():
    tg = small_program()
    inputs = small_inputs()
    out = taskgraph.evaluate(tg, inputs)
    assert {k: v.dtype.name for k, v in out.items()} == {
        "p": "bfloat16",
        "r": "bfloat16",
        "s32": "float32",
    }
    wide = taskgraph.evaluate(tg, inputs, dtype="float64")
    for name in ("p", "r"):
        assert wide[name].dtype == np.float64
        scale = float(np.abs(wide[name]).max())
        error = np.abs(out[name].astype(np.float64) - wide[name]).max() / scale
        assert error <= 4 * ONE_ROUNDING, name  # a few roundings from the exact value
    h = (inputs["x"].astype(np.float32) @ inputs["w"].astype(np.float32)).astype("bfloat16")
    prog = ep.Program()
    prog.output(prog.input("x", (4, 8), "bfloat16") @ prog.input("w", (8, 6), "bfloat16"), "h")
    got = taskgraph.evaluate(prog.build(), {"x": inputs["x"], "w": inputs["w"]})["h"]
    np.testing.assert_array_equal(got.view(np.uint16), h.view(np.uint16))


# -- against PyTorch's bfloat16 ops -------------------------------------------------------


@pytest.mark.parametrize(
    "left, right",
    [((32, 64), (64, 48)), ((8, 4096), (4096, 16)), ((4, 16, 64), (4, 64, 16)), ((64,), (64, 8))],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_matmul_equals_torch_within_one_rounding(left, right, seed):
    a, b = bf16(left, seed), bf16(right, seed + 10)
    got = evaluate(lambda x, y: x @ y, a, b)
    want = (to_torch(a) @ to_torch(b)).float().numpy()
    assert np.all(np.abs(got - want) <= ONE_ROUNDING * np.abs(want) + 1e-30)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_softmax_equals_torch_within_two_roundings(seed):
    a = bf16((16, 256), seed, scale=3.0)
    got = evaluate(lambda x: ep.softmax(x, axis=-1), a)
    want = torch.softmax(to_torch(a), dim=-1).float().numpy()
    assert np.abs(got - want).max() <= TWO_ROUNDINGS * np.abs(want).max()
    np.testing.assert_allclose(got.sum(axis=-1), 1.0, atol=2 * TWO_ROUNDINGS)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rmsnorm_equals_torch_within_two_roundings(seed):
    x, w = bf16((16, 256), seed), bf16((256,), seed + 5, scale=0.1) + np.float32(1.0)
    w = w.astype(ml_dtypes.bfloat16)
    got = evaluate(lambda a, b: ep.rmsnorm(a, b, eps=1e-5), x, w)
    xt, wt = to_torch(x), to_torch(w)
    fused = torch.nn.functional.rms_norm(xt, (256,), wt, 1e-5).float().numpy()
    hf = (xt.float() * torch.rsqrt(xt.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(
        torch.bfloat16
    )
    hf = (wt * hf).float().numpy()  # as Hugging Face's LlamaRMSNorm writes it
    for want in (fused, hf):
        assert np.abs(got - want).max() <= TWO_ROUNDINGS * np.abs(want).max()


def test_a_fused_join_rounds_once_where_torch_rounds_per_op():
    a, b = bf16((64, 32), 0), bf16((64, 32), 1)
    fused = evaluate(lambda x, y: x.program.einsum("ij,ij->ij", x, y, join="silu(a) * b"), a, b)
    at, bt = to_torch(a), to_torch(b)
    once = (torch.nn.functional.silu(at.float()) * bt.float()).to(torch.bfloat16).float().numpy()
    assert np.all(np.abs(fused - once) <= ONE_ROUNDING * np.abs(once) + 1e-30)
    per_op = (torch.nn.functional.silu(at) * bt).float().numpy()  # two roundings
    two_tasks = evaluate(lambda x, y: ep.silu(x) * y, a, b)  # two tasks, two roundings
    assert np.all(np.abs(two_tasks - per_op) <= TWO_ROUNDINGS * np.abs(per_op) + 1e-30)


# -- the planner, partitioning, the runtime -----------------------------------------------


def test_plans_count_two_bytes_and_run_exactly_as_the_reference():
    tg = small_program()
    wide = small_program("float32")
    for alignment in (1, 16):  # a bound in exact bytes (1), and rounded as a plan is
        assert 2 * memgraph.min_budget(tg, alignment)[0] <= memgraph.min_budget(wide, alignment)[0]
    for alignment in (8, 16):  # the planner's alignments: a power of two >= 8
        peak = memgraph.streaming_minimum(tg, alignment=alignment)
        assert peak < memgraph.streaming_minimum(wide, alignment=alignment)
    inputs = small_inputs(3)
    want = taskgraph.evaluate(tg, inputs)
    low, _ = memgraph.min_budget(tg)
    for budget in (low, (low + memgraph.streaming_minimum(tg)) // 2):
        mg = memgraph.plan(tg, budget)
        memgraph.verify(mg)
        again = memgraph.MemGraph.from_json(mg.to_json())
        assert again.to_json() == mg.to_json()
        for mode in ("sequential", "random", "threaded"):
            got = runtime.run(again, inputs, backend="numpy", mode=mode, seed=budget)
            for name, value in want.items():
                assert got[name].dtype == value.dtype, name
                np.testing.assert_array_equal(got[name], value, err_msg=f"{name} {mode}")


def test_partitioned_bfloat16_graphs_stay_within_the_dtype_rounding():
    prog = ep.Program("mm")
    a = prog.input("a", (8, 512), "bfloat16")
    b = prog.input("b", (512, 8), "bfloat16", role="weight")
    prog.output(ep.softmax(a @ b, axis=-1), "y")
    tg = prog.build()
    parted = partition(tg, "4KiB")  # a and b are 8 KiB each: the sum over 512 is split
    assert any(t.block.kind == "partial" for t in parted.tasks)
    assert all(t.dtype in ("bfloat16",) for t in parted.tasks)
    inputs = {"a": bf16((8, 512), 0, 0.1), "b": bf16((512, 8), 1, 0.1)}
    want = taskgraph.evaluate(tg, inputs)["y"].astype(np.float32)
    got = taskgraph.evaluate(parted, inputs)["y"]  # partials rounded to bf16, then combined
    assert np.abs(got.astype(np.float32) - want).max() <= 4 * ONE_ROUNDING * np.abs(want).max()
    mg = memgraph.plan(parted, memgraph.min_budget(parted)[0])
    out = runtime.run(mg, inputs, backend="numpy", mode="random")["y"]
    np.testing.assert_array_equal(out, got)


def test_presets_build_in_bfloat16():
    tg = load_program("llama:tiny", batch=1, seq=4, dtype="bfloat16")
    assert {t.dtype for t in tg} == {"bfloat16", "int64"}
    inputs = random_inputs(tg, seed=0)
    assert inputs["embed"].dtype.name == "bfloat16"
    logits = taskgraph.evaluate(tg, inputs)["logits"]
    assert logits.dtype.name == "bfloat16" and np.isfinite(logits.astype(np.float32)).all()
    mlp = load_program("mlp", dtype="bf16")
    assert {t.dtype for t in mlp} == {"bfloat16"}


def test_a_backend_without_bfloat16_refuses_the_plan_before_allocating():
    """CuPy has no bfloat16: a backend that says so refuses the plan with what is missing."""
    from runtime.numpy_backend import NumpyBackend

    allocated = []

    class NoBfloat16(NumpyBackend):
        name = "no-bf16"
        unsupported_dtypes = {"bfloat16": "no bfloat16 kernels here"}

        def allocate_arena(self, nbytes):
            allocated.append(nbytes)
            return super().allocate_arena(nbytes)

    mg = memgraph.plan(small_program(), "1GiB")
    with pytest.raises(
        UnsupportedError, match=r"no-bf16 backend cannot run bfloat16 .*no bfloat16 kernels"
    ):
        runtime.run(mg, small_inputs(3), backend=NoBfloat16())
    assert allocated == []
    wide = memgraph.plan(small_program("float32"), "1GiB")
    wide_inputs = {k: v if k == "ids" else v.astype("float32") for k, v in small_inputs(3).items()}
    runtime.run(wide, wide_inputs, backend=NoBfloat16())
    assert allocated


def test_the_cupy_backend_runs_bfloat16_with_numpy_2_1_2_or_later():
    """CuPy 14 gives `ml_dtypes.bfloat16` arrays a kernel type (`bfloat16`, from
    `cupy/bfloat16.cuh`) from NumPy 2.1.2 on: the backend refuses bfloat16 only before."""
    from runtime.cupy_backend import CupyBackend, _unsupported_dtypes

    assert np.lib.NumpyVersion(np.__version__) >= "2.1.2"
    assert CupyBackend.unsupported_dtypes == {}
    old = _unsupported_dtypes("2.0.2")
    assert list(old) == ["bfloat16"] and "NumPy 2.1.2 or later" in old["bfloat16"]
    assert "NumPy 2.0.2 is installed" in old["bfloat16"] and "backend='numpy'" in old["bfloat16"]


def test_auto_never_picks_a_backend_that_would_refuse_the_plan(monkeypatch):
    """On a GPU machine "auto" means CuPy, unless CuPy would refuse a dtype of the plan:
    then it means NumPy, which runs every dtype (a fake GPU backend refusing bfloat16)."""
    from runtime import backend as backends
    from runtime.numpy_backend import NumpyBackend

    class RefusesBfloat16(NumpyBackend):
        name = "fake-gpu"
        unsupported_dtypes = {"bfloat16": "no bfloat16 kernels here"}
        arena_on_host = False  # as a GPU's: its host memory needs differ from NumPy's

    monkeypatch.setattr(backends, "cupy_usable", lambda: True)
    monkeypatch.setitem(backends.BACKENDS, "cupy", lambda: RefusesBfloat16)
    assert backends.auto_backend({"float32", "int64"}) == "cupy"
    assert backends.auto_backend({"bfloat16", "int64"}) == "numpy"
    narrow = memgraph.plan(small_program(), "1GiB")
    with runtime.Session(narrow, "auto") as session:
        assert session.backend.name == "numpy"
        got = session.run(small_inputs(3))
    want = taskgraph.evaluate(narrow.taskgraph, small_inputs(3))
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)
    wide = memgraph.plan(small_program("float32"), "1GiB")
    with runtime.Session(wide, "auto") as session:
        assert session.backend.name == "fake-gpu"
    # a generation's host-memory check counts for the backend the run will choose
    from einpage.models import FAMILIES
    from einpage.workloads.generate import check_run_memory
    from einpage.workloads.generation import GenerationSpec, Planning, plan_generation

    llama = FAMILIES["llama"]
    for dtype, chosen in (("bfloat16", "numpy"), ("float32", RefusesBfloat16())):
        spec = GenerationSpec(llama, llama.presets["tiny"], 1, 4, 2, dtype, 4, None)
        plan = plan_generation(spec, "100%", Planning(way="unrolled"))
        assert check_run_memory(plan, "auto", None) == check_run_memory(plan, chosen, None)


def test_the_evaluator_selects_in_bfloat16_as_in_float32():
    """ml_dtypes' bfloat16 sort does not order NaNs (`np.sort` leaves [3, nan, 1] as is),
    so the k-th largest of a row with a NaN was whatever its partition left there; the
    evaluator selects among the values widened to float32 (exactly), where NaNs sort last
    as NumPy's floats do, and rounds nothing: the result is one of the row's values."""
    rows = np.array([[3, np.nan, 1, 5, 2, np.nan, 4], [0.5, -2, 7, 7, 1, 0, -1]])
    prog = ep.Program("select")
    x = prog.input("x", rows.shape, "bfloat16")
    for k in (1, 2, 3, 7):
        prog.output(ep.kth_largest(x, k), f"top{k}")
    prog.output(ep.argmax(x), "argmax")
    prog.output(ep.argmin(x), "argmin")
    got = taskgraph.evaluate(prog.build(), {"x": rows.astype(ml_dtypes.bfloat16)})
    wide = rows.astype(np.float32)
    for k in (1, 2, 3, 7):
        want = np.partition(wide, 7 - k, axis=-1)[:, 7 - k]
        np.testing.assert_array_equal(got[f"top{k}"].astype(np.float32), want)
    np.testing.assert_array_equal(got["argmax"], np.argmax(wide, axis=-1))
    np.testing.assert_array_equal(got["argmin"], np.argmin(wide, axis=-1))
