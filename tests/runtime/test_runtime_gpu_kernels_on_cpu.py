"""The CuPy backend's kernel layer without a GPU: generated CUDA C, matmul layouts, dispatch.

* `runtime.cuda_codegen`: every join function has a translation; the generated
  expressions, compiled with g++ (device spellings mapped to host C++), agree with
  the reference evaluator on random join trees; with nvcc (when installed) the
  device code compiles for a real GPU target.
* `runtime.contraction`: matmul-shaped einsums as GEMM plans (strided, batched, in place
  where cuBLAS can read the layouts, else through a workspace), run as cuBLAS would run
  them (`fake_cublas`).
* `CupyKernels` over `cpu_cuda.fake_cupy()` (NumPy plus g++-compiled Elementwise/
  ReductionKernels): every task of random programs equals the reference.
"""

from __future__ import annotations

import math
import shutil
import subprocess

import numpy as np
import pytest
from cpu_cuda import CXX, fake_cupy
from fake_cublas import strided_gemm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_cases import assert_outputs_match, block_program, einsum_programs, make_inputs
from strategies import einsum_cases, join_trees

import einpage as ep
import taskgraph
from runtime import cuda_codegen
from runtime.contraction import SLOWER, gemm_plan, gemm_plans, reduction_seconds, run_gemm
from runtime.cupy_backend import CupyKernels, evaluate_on_gpu
from taskgraph.einsum import EinsumSpec, normalize
from taskgraph.expr import FUNCTIONS, Call, Var, parse

needs_cxx = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++)")

# -- code generation --------------------------------------------------------------


def test_every_join_function_has_a_cuda_translation():
    for name, fn in FUNCTIONS.items():
        expr = Call(name, tuple(Var(i) for i in range(fn.arity)))
        text = cuda_codegen.join_to_c(expr, "float32")
        assert "in0" in text and name not in ("max", "min") or "ep_" in text


def test_generated_sources():
    src = cuda_codegen.elementwise_source(parse("exp(a - b) / c", 3), ["float32"] * 3, "float32")
    assert src.in_params == "float32 in0, float32 in1, float32 in2"
    assert src.out_params == "float32 out"
    assert src.operation == "out = (exp((((float)in0) - ((float)in1))) / ((float)in2));"
    assert src.name.startswith("einpage_join_") and src.name.isidentifier()
    red = cuda_codegen.reduction_source(parse("a", 1), "max", ["float16"], "float16")
    assert (red.reduce_type, red.reduce_expr, red.post_map_expr) == (
        "float",
        "ep_max(a, b)",
        "out = a",
    )
    assert red.identity == "__int_as_float(0xff800000)"
    double = cuda_codegen.reduction_source(parse("a * b", 2), "min", ["float64"] * 2, "float64")
    assert double.reduce_type == "double" and "0x7ff0" in double.identity
    # Same expression and dtypes: the same source (so the same cached kernel).
    again = cuda_codegen.elementwise_source(parse("exp(a - b) / c", 3), ["float32"] * 3, "float32")
    assert again == src and hash(again) == hash(src)
    assert cuda_codegen.supports(["int64"], "int64")
    assert cuda_codegen.supports(["uint8"], "bfloat16")
    assert not cuda_codegen.supports(["bfloat16"], "int64")


def _harness(sources: list[tuple[str, str]], work: str) -> str:
    body = "\n".join(
        f'extern "C" {work} f{i}({work} in0, {work} in1, {work} in2) {{ return {text}; }}'
        for i, (_, text) in enumerate(sources)
    )
    return (
        "#include <cmath>\nusing namespace std;\n#define __device__\n"
        f"#define __forceinline__ inline\n{cuda_codegen.PREAMBLE}\n{body}\n"
    )


@needs_cxx
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(trees=st.lists(join_trees(3, depth=3), min_size=25, max_size=25))
def test_generated_joins_match_the_reference_when_compiled(trees, tmp_path_factory):
    import ctypes

    rng = np.random.default_rng(0)
    points = rng.standard_normal((3, 64))
    for work, dtype, tol in (("double", "float64", 1e-9), ("float", "float32", 2e-4)):
        exprs = [parse(source, 3) for source, _ in trees]
        sources = [
            (s, cuda_codegen.join_to_c(e, dtype)) for (s, _), e in zip(trees, exprs, strict=True)
        ]
        folder = tmp_path_factory.mktemp("joins")
        (folder / "j.cpp").write_text(_harness(sources, work))
        command = [
            CXX,
            "-O0",
            "-shared",
            "-fPIC",
            "-o",
            str(folder / "j.so"),
            str(folder / "j.cpp"),
        ]
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        lib = ctypes.CDLL(str(folder / "j.so"))
        c_type = ctypes.c_double if work == "double" else ctypes.c_float
        values = points.astype(dtype)
        for i, expr in enumerate(exprs):
            fn = getattr(lib, f"f{i}")
            fn.restype, fn.argtypes = c_type, [c_type] * 3
            with np.errstate(all="ignore"):
                want = np.asarray(taskgraph.expr.evaluate(expr, list(values), np), dtype=dtype)
            want = np.broadcast_to(want, values[0].shape)
            got = np.array([fn(*map(float, values[:, j])) for j in range(values.shape[1])], dtype)
            scale = np.maximum(1.0, np.abs(want))
            close = np.isclose(got, want, rtol=tol, atol=tol * scale, equal_nan=True)
            assert close.all(), f"{sources[i][0]} -> {sources[i][1]}"


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_generated_device_code_compiles_with_nvcc(tmp_path):
    exprs = ["gelu(a) * silu(b)", "where(a > b, rsqrt(1.0 + a * a), -b) ** 2.0",
             "max(relu(a), min(b, abs(a))) / (1.0 + sigmoid(b))", "exp(a - b) / c",
             "log(1.0 + a * a) + tanh(b) - sqrt(1.0 + b * b)", "a * rsqrt(b + 1e-06)"]  # fmt: skip
    kernels = []
    for n, source in enumerate(exprs):
        for work in ("float", "double"):
            expr = parse(source, 3)
            dtype = "float64" if work == "double" else "float32"
            body = cuda_codegen.join_to_c(expr, dtype)
            agg = ["sum", "max", "min", "prod"][n % 4]
            red = cuda_codegen.reduction_source(expr, agg, [dtype] * 3, dtype)
            kernels.append(
                f'extern "C" __global__ void k{n}_{work}(const {work}* in0_p, const {work}* in1_p,'
                f" const {work}* in2_p, {work}* out_p) {{\n"
                f"  int i = threadIdx.x; {work} in0 = in0_p[i], in1 = in1_p[i], in2 = in2_p[i];\n"
                f"  typedef {red.reduce_type} _type_reduce;\n"
                f"  _type_reduce _s = _type_reduce({red.identity});\n"
                f"  _type_reduce _a = static_cast<_type_reduce>({body});\n"
                f"  #define REDUCE(a, b) ({red.reduce_expr})\n  _s = REDUCE(_s, _a);\n"
                f"  out_p[i] = _s;\n}}"
            )
    (tmp_path / "k.cu").write_text(cuda_codegen.PREAMBLE + "\n".join(kernels))
    result = subprocess.run(
        [NVCC, "-c", "-arch=sm_80", "-o", str(tmp_path / "k.o"), str(tmp_path / "k.cu")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


# -- GEMM layouts ------------------------------------------------------------------


def copy_into(source, target):
    target[...] = source


def run_plan(plan, spec, shapes, dtype="float64", seed=0):
    """The plan's GEMMs (`fake_cublas.strided_gemm`, as strict as cuBLAS) on random
    operands, against `numpy.einsum`."""
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal(s).astype(dtype) for s in shapes)
    out = np.full(EinsumSpec.parse(spec).output_shape(shapes), np.nan, dtype)
    workspace = np.full(plan.workspace, 0xFF, np.uint8)  # poisoned: nothing may be assumed
    run_gemm(plan, a, b, out, workspace, strided_gemm, copy_into)
    np.testing.assert_allclose(out, np.einsum(spec, a, b), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("spec", "shapes", "expected"),
    [
        ("mk,kn->mn", [(3, 4), (4, 5)], (0, 1)),
        ("mk,kn->nm", [(3, 4), (4, 5)], (0, 1)),
        ("bqd,bkd->bqk", [(2, 3, 4), (2, 5, 4)], (0, 1)),
        ("hqk,khe->qhe", [(2, 3, 3), (3, 2, 4)], (0, 1)),  # a permuted output, in place
        ("bmk,bkn->mbn", [(2, 3, 4), (2, 4, 5)], (0, 1)),
        ("bsd,gred->bgrse", [(2, 16, 64), (2, 4, 8, 64)], (0, 2)),  # LLaMA's q/k/v
        ("bhqk,bhke->bqhe", [(2, 3, 4, 5), (2, 3, 5, 8)], (0, 2)),  # attention's values
        ("ik,k->i", [(3, 4), (4,)], (0, 1)),
        ("k,k->", [(4,), (4,)], (0, 1)),
        ("bk,bk->b", [(3, 4), (3, 4)], (0, 1)),
        # The attention output's heads (g, r) and e are not one dimension of it: copied.
        ("bgrse,gred->bsd", [(2, 4, 2, 64, 128), (4, 2, 128, 128)], (1 << 20, 1)),
        # Short reductions whose GEMMs would need copies: a generated reduction kernel.
        ("bgrse,gred->bsd", [(1, 4, 2, 16, 64), (4, 2, 64, 64)], None),
        ("ij,ji->", [(3, 4), (4, 3)], None),
        ("ikb,kjb->ijb", [(3, 4, 5), (4, 6, 5)], None),
    ],
)
def test_gemm_plans(spec, shapes, expected):
    plan = gemm_plan(EinsumSpec.parse(spec), shapes, "float64", "float64")
    assert (plan and (plan.workspace, plan.calls)) == expected
    for candidate in gemm_plans(EinsumSpec.parse(spec), shapes, "float64", "float64"):
        run_plan(candidate, spec, shapes)


def test_llama_qkv_projection_at_7b_scale_needs_no_workspace():
    """`bsd,gred->bgrse` at LLaMA-7B batch 32 x 8192: the old path went through a 2 GiB
    temporary; the GEMMs write the permuted output in place (32 calls over b, each a
    batch of 32 heads of 8192 x 128 x 4096)."""
    plan = gemm_plan(
        EinsumSpec.parse("bsd,gred->bgrse"), [(32, 8192, 4096), (32, 1, 128, 4096)],
        "float16", "float16",
    )  # fmt: skip
    call = plan.call
    assert plan.workspace == 0 and plan.calls == 32 and call.batch == 32
    assert (call.m, call.n, call.k, call.c_dtype) == (128, 8192, 4096, "float16")


@pytest.mark.parametrize("spec", ["ij,jk->k", "ij,j->ij", "ij,kl->ijkl", "i->i", "ij,ij,ij->"])
def test_not_matmul_shaped(spec):
    parsed = EinsumSpec.parse(spec)
    shapes = [tuple(3 for _ in term) for term in parsed.inputs]
    assert gemm_plan(parsed, shapes, "float32", "float32") is None


def test_gemm_dtypes():
    spec = EinsumSpec.parse("mk,kn->mn")
    shapes = [(3, 4), (4, 5)]
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        assert gemm_plan(spec, shapes, dtype, dtype).call.c_dtype == dtype
    assert gemm_plan(spec, shapes, "float16", "float32").call.compute == 68  # float32 sums
    assert gemm_plan(spec, shapes, "float64", "float64").call.compute == 70
    assert gemm_plan(spec, shapes, "int64", "int64") is None
    assert gemm_plan(spec, shapes, "float32", "float16") is None


@given(case=einsum_cases(max_operands=2, dtypes=("float64",)), seed=st.integers(0, 99))
def test_every_gemm_plan_of_random_pairs_computes_the_einsum(case, seed):
    """Each way of running a random matmul-shaped einsum (every choice of copies and of
    rows), run as cuBLAS would run it, equals `numpy.einsum`; the chosen one is among them,
    or it is None (the generated reduction kernel) only where that kernel is within
    `SLOWER` of the fastest and every GEMM way as fast would need a workspace."""
    if len(case.shapes) != 2:
        return
    parsed = normalize(case.spec, case.shapes).spec
    plans = gemm_plans(parsed, case.shapes, "float64", "float64")
    chosen = gemm_plan(parsed, case.shapes, "float64", "float64")
    if chosen is not None:
        assert chosen in plans
    elif plans:
        kernel = reduction_seconds(parsed, case.shapes, "float64", "float64")
        fastest = min(kernel, *(plan.seconds for plan in plans))
        assert kernel <= SLOWER * fastest
        assert all(plan.workspace > 0 for plan in plans if plan.seconds <= SLOWER * fastest)
    for plan in plans:
        run_plan(plan, str(parsed), case.shapes, seed=seed)


# -- the kernel layer on the CPU stand-in -----------------------------------------


@needs_cxx
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(tg=einsum_programs(dtypes=("float32", "float64")), seed=st.integers(0, 99))
def test_cupy_kernels_on_cpu_match_the_reference(tg, seed):
    inputs = make_inputs(tg, seed)
    kernels = CupyKernels(fake_cupy())
    with np.errstate(all="ignore"):
        got = evaluate_on_gpu(tg, inputs, kernels)
        want = taskgraph.evaluate(tg, inputs)
    assert_outputs_match(got, want)


@needs_cxx
def test_cupy_kernels_on_cpu_run_a_transformer_block():
    tg = block_program(dtype="float32", layers=2)
    inputs = make_inputs(tg, 0)
    kernels = CupyKernels(fake_cupy())
    got = evaluate_on_gpu(tg, inputs, kernels)
    assert_outputs_match(got, taskgraph.evaluate(tg, inputs))
    used = set(kernels.counters)
    assert {"cublas", "elementwise_kernel", "reduction_kernel", "gather", "fill"} <= used
    assert {"copy", "concat"} <= used
    assert kernels.counters["gemm_workspace_copies"] == 0


@needs_cxx
def test_gather_kernel_flags_bad_ids():
    tg = block_program()
    inputs = make_inputs(tg, 0)
    inputs["ids"][1] = -3
    with pytest.raises(ep.InputError, match="id -3 is out of range"):
        evaluate_on_gpu(tg, inputs, CupyKernels(fake_cupy()))


@needs_cxx
def test_the_stand_in_declares_inputs_const_as_cupy_does():
    """A kernel writing a raw input (the gather kernel's flag once was one) fails to
    compile on the stand-in, as NVRTC refuses it for a GPU."""
    cp = fake_cupy()
    writes_input = cp.ElementwiseKernel("raw int64 flag, float32 x", "float32 y",
                                        "flag[0] = 1; y = x;", "writes_input")  # fmt: skip
    with pytest.raises(RuntimeError, match="read-only"):
        writes_input(np.zeros(2, np.int64), np.ones(3, np.float32), np.empty(3, np.float32))
    as_output = cp.ElementwiseKernel("float32 x", "float32 y, raw int64 flag",
                                     "flag[0] = 1; y = x;", "writes_output")  # fmt: skip
    flag, y = np.zeros(2, np.int64), np.empty(3, np.float32)
    as_output(np.ones(3, np.float32), y, flag)
    assert flag[0] == 1 and (y == 1).all()


@needs_cxx
def test_causal_fill_with_an_origin():
    prog = ep.Program()
    x = prog.input("x", (2, 3, 4))
    mask = prog._add(taskgraph.Fill(-math.inf, "causal", (0, 1, 2)), (), (2, 3, 4), "float32")
    prog.output(mask + x, "y")
    tg = prog.build()
    inputs = make_inputs(tg, 0)
    assert_outputs_match(evaluate_on_gpu(tg, inputs, CupyKernels(fake_cupy())),
                         taskgraph.evaluate(tg, inputs))  # fmt: skip
