"""Every kernel the CuPy backend can launch compiles for real GPUs (sm_80 and sm_90), with
NVRTC, on a machine without a GPU or a driver.

The sources are the ones CuPy would compile – made by CuPy's own code generator
(`cupy_source`), compiled with the options CuPy passes (`nvrtc_tool`) – for:

* every kernel of the backend's catalog (`runtime.cuda_codegen.catalog`: the fixed
  kernels – copy, gather, the scatter-add's keys and sort – under every dtype their type
  placeholders take, fills and scatter-sums in every dtype), called with contiguous and
  with strided arrays;
* the whole join grammar (one expression using every function and operator) for every
  pair of operand and output dtypes generated kernels take – bfloat16, float16, the
  integers – elementwise, and under every aggregation;
* every kernel the backend launches on the test programs and the models
  (`recording.kernel_sources`), bfloat16 ones included; each is a join kernel or one of
  the catalog's, so the catalog lists every other kernel there is.

Locally the tier skips when the wheels are missing; under CI it must run (`make test`
installs them through the `nvrtc` extra).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import cupy_source
import pytest
from nvrtc_tool import compile_errors, missing
from recording import kernel_sources

import einpage as ep
from einpage.cli.presets import load_program
from einpage.models import generation, gpt2, llama
from einpage.models.decode import Sampling
from einpage.program.optim import AdamW
from einpage.program.quantize import Quantization
from einpage.workloads.training import training_graph
from runtime import cuda_codegen
from taskgraph import dtypes
from taskgraph.expr import BINARY_OPS, FUNCTIONS, BinOp, Call, parse

ABSENT = missing()
if ABSENT and os.environ.get("CI"):
    raise RuntimeError(f"CI runs the NVRTC compile tier: {ABSENT}")
pytestmark = pytest.mark.skipif(ABSENT is not None, reason=ABSENT or "")

ARCHES = ("sm_80", "sm_90")
FLOATS = ("float16", "bfloat16", "float32", "float64")


@cache
def compiled(source: str, arch: str) -> str | None:
    """NVRTC's log for `source` on `arch`, or None; each source compiled once per run
    (programs share many kernels)."""
    return compile_errors(source, arch)


def compile_all(sources: set[str]) -> list[str]:
    """Compile every source for every architecture; the failures, with NVRTC's log."""
    jobs = [(source, arch) for source in sorted(sources) for arch in ARCHES]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        logs = list(pool.map(lambda job: compiled(*job), jobs))
    return [
        f"--- {arch} ---\n{log}\n--- source ---\n{source}"
        for (source, arch), log in zip(jobs, logs, strict=True)
        if log is not None
    ]


PROGRAMS = (
    "mlp f32", "mlp f16", "llama:tiny-gqa f16", "gpt2:tiny f16", "gpt2:tiny f32",
    "qwen2:tiny f16", "llama int4 f16", "llama int8 f32", "llama generation f16",
    "gpt2 sampling f32", "llama training f32", "llama training f16",
    "llama:tiny bf16", "llama int4 bf16", "llama generation bf16", "llama training bf16",
)  # fmt: skip


@cache
def program_kernels() -> dict[str, set[str]]:
    """The generated kernels of the test programs and the models, by program."""
    tiny = llama.PRESETS["tiny"]
    graphs = {
        "mlp f32": load_program("mlp", dtype="float32"),
        "mlp f16": load_program("mlp", dtype="float16"),
        "llama:tiny-gqa f16": load_program("llama:tiny-gqa", batch=2, seq=16, dtype="float16"),
        "gpt2:tiny f16": load_program("gpt2:tiny", batch=2, seq=16, dtype="float16"),
        "gpt2:tiny f32": load_program("gpt2:tiny", batch=1, seq=8, dtype="float32"),
        "qwen2:tiny f16": load_program("qwen2:tiny", batch=1, seq=8, dtype="float16"),
        "llama int4 f16": llama.prefill_program(
            tiny, 1, 8, "float16", "last", quant=Quantization(4, 32)
        ).build(),
        "llama int8 f32": llama.prefill_program(
            tiny, 1, 8, "float32", "last", quant=Quantization(8, 32)
        ).build(),
        "llama generation f16": generation.generation_program(
            llama.FAMILY, tiny, 2, 5, 3, "float16", page_size=4
        ).build(),
        "gpt2 sampling f32": generation.generation_program(
            gpt2.FAMILY,
            gpt2.PRESETS["tiny"],
            1,
            4,
            3,
            "float32",
            sampling=Sampling(temperature=0.7, top_k=5),
        ).build(),  # fmt: skip
        "llama training f32": training_graph(tiny, 2, 8, AdamW(lr=1e-3)),
        "llama training f16": training_graph(tiny, 1, 8, AdamW(lr=1e-3), "float16"),
        "llama:tiny bf16": load_program("llama:tiny", batch=1, seq=8, dtype="bfloat16"),
        "llama int4 bf16": llama.prefill_program(
            tiny, 1, 8, "bfloat16", "last", quant=Quantization(4, 32)
        ).build(),
        "llama generation bf16": generation.generation_program(
            llama.FAMILY,
            tiny,
            1,
            4,
            2,
            "bfloat16",
            page_size=4,
            sampling=Sampling(temperature=0.7, top_k=5),
        ).build(),  # fmt: skip
        "llama training bf16": training_graph(tiny, 1, 8, AdamW(lr=1e-3), "bfloat16"),
    }
    assert tuple(graphs) == PROGRAMS
    return {name: kernel_sources(tg) for name, tg in graphs.items()}


def grammar_programs():
    """One program per float dtype using every join function and operator, elementwise and
    under every aggregation, plus a cast and the causal fill."""
    for dtype in FLOATS:
        prog = ep.Program(f"grammar-{dtype}")
        a, b, c = (prog.input(n, (3, 4), dtype) for n in "abc")
        outs = []
        for name, fn in FUNCTIONS.items():
            args = ["a", "b", "c"][: fn.arity]
            outs.append(prog.einsum("ij,ij,ij->ij", a, b, c, join=f"{name}({', '.join(args)})"))
        for op in BINARY_OPS:
            outs.append(prog.einsum("ij,ij->ij", a, b, join=f"a {op} b"))
        for agg in ("sum", "max", "min", "prod"):
            outs.append(prog.einsum("ij,ij->i", a, b, join="exp(a) - b", agg=agg))
        outs.append(prog.einsum("ij->ij", a, dtype="float32" if dtype != "float32" else "float64"))
        outs.append(prog.fill((4, 4), float("-inf"), dtype, pattern="causal"))
        ids = prog.input("ids", (5,), "int64")
        outs.append(prog.gather(a, ids))
        for i, out in enumerate(outs):
            prog.output(out, f"out{i}")
        yield dtype, prog.build()


GRAMMAR = parse(
    "where(a < b, max(exp(a) - log(b), min(sqrt(c), tanh(a))), rsqrt(c) * sigmoid(a) / silu(b))"
    " + gelu(a) ** relu(b) + (a <= b) + (a > c) + (b >= c) + (a == b) + (a != c) - (-a)"
    " + a ** b + max(a, b) + min(a, c) + abs(a) + relu(b) + floor(c) + where(a, b, c) + 2.5",
    3,
)
"""Every join function and operator in one expression."""
INTEGER_GRAMMAR = parse(
    "(a <= b) + (a > c) + (b >= c) + (a == b) + (a != c) - (-a) + a ** b"
    " + max(a, b) * min(a, c) + abs(a) + relu(b) + floor(c) + where(a, b, c) - a / b",
    3,
)
"""The functions and operators NumPy keeps integers in (and `/`), for an integer task of
int8/uint8 operands: `exp` of those is float16 in NumPy, which generated kernels refuse."""


def _nodes(expr):
    yield expr
    children = expr.args if isinstance(expr, Call) else ()
    if isinstance(expr, BinOp):
        children = (expr.left, expr.right)
    for child in children:
        yield from _nodes(child)


def dtype_pairs() -> list[tuple[str, str]]:
    """Every (operand dtype, output dtype) generated kernels take."""
    return [(i, o) for o in dtypes.DTYPES for i in dtypes.DTYPES if cuda_codegen.supports([i], o)]


def grammar_source(in_dtype: str, out_dtype: str) -> cuda_codegen.ElementwiseSource:
    try:
        return cuda_codegen.elementwise_source(GRAMMAR, [in_dtype] * 3, out_dtype)
    except ep.UnsupportedError:
        return cuda_codegen.elementwise_source(INTEGER_GRAMMAR, [in_dtype] * 3, out_dtype)


def render_elementwise(source, binding=None, strided=False) -> str:
    """CuPy's source for `source` called with arrays of the dtypes its parameters name (or
    `binding` gives its placeholders), scalars where `source.scalars` says, contiguous
    (merged to one dimension) or `strided` (three dimensions, not contiguous)."""
    binding = binding or {}
    params = cupy_source.parse_params(source.in_params, True) + cupy_source.parse_params(
        source.out_params, False
    )
    args = []
    for param in params:
        dtype = binding.get(param.type, param.type)
        if param.name in source.scalars:
            args.append(cupy_source.Arg(dtype))
        elif param.raw:
            args.append(cupy_source.Arg(dtype, 1))
        else:
            args.append(cupy_source.Arg(dtype, 3 if strided else 1, not strided))
    ndim = 3 if strided and any(not p.raw and p.name not in source.scalars for p in params) else 1
    return cupy_source.elementwise_code(
        source.in_params, source.out_params, source.operation, source.name, args,
        source.preamble, ndim,
    )  # fmt: skip


def render_reduction(source, in_dtypes, out_dtype, out_ndim=1) -> str:
    """CuPy's source for the reduction `source` of strided 2-d operands (scalars where
    `source.scalars` says) into an output of `out_ndim` dimensions (0: one row)."""
    params = cupy_source.parse_params(source.in_params, True)
    array = cupy_source.Arg  # a strided 2-d operand, or one contiguous row
    args = [
        array(d) if p.name in source.scalars else array(d, 2, False) if out_ndim else array(d, 1)
        for p, d in zip(params, in_dtypes, strict=True)
    ] + [cupy_source.Arg(out_dtype, out_ndim)]
    return cupy_source.reduction_code(
        source.in_params, source.out_params, source.map_expr, source.reduce_expr,
        source.post_map_expr, source.identity, source.name, args, source.reduce_type,
        source.preamble, in_ndim=2 if out_ndim else 1, out_ndim=out_ndim,
    )  # fmt: skip


def test_the_tier_catches_an_input_written_by_a_kernel():
    """The gather kernel once wrote its `raw int64 flag`, an input, which CuPy declares
    const: NVRTC refuses it exactly as a GPU machine would."""
    gather = cuda_codegen.GATHER.source
    broken = (
        "raw T table, raw I ids, int64 row, int64 rows, raw int64 flag",
        "T out",
        gather.operation,
        "einpage_gather_as_it_was",
    )
    arg = cupy_source.Arg
    args = [arg("float32", 2), arg("int64", 1), arg("int64"), arg("int64"), arg("int64", 1),
            arg("float32", 1)]  # fmt: skip
    source = cupy_source.elementwise_code(*broken, args)
    fixed = cupy_source.elementwise_code(
        gather.in_params, gather.out_params, gather.operation, gather.name,
        [args[i] for i in (0, 1, 2, 3, 5, 4)],
    )  # fmt: skip
    assert compile_errors(fixed, "sm_80") is None
    assert "const CArray<long long, 1, 1, 1> flag" in source
    log = compile_errors(source, "sm_80")
    assert log is not None and "modifiable lvalue" in log


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_kernel_of_the_test_programs_and_models_compiles(name):
    sources = program_kernels()[name]
    assert sources, f"{name}: no generated kernel was launched"
    failures = compile_all(sources)
    assert not failures, f"{len(failures)} of {2 * len(sources)} compiles failed:\n" + "\n".join(
        failures[:3]
    )


@pytest.mark.parametrize("dtype, tg", list(grammar_programs()), ids=FLOATS)
def test_every_join_function_operator_and_aggregation_compiles(dtype, tg):
    sources = kernel_sources(tg)
    reductions = [s for s in sources if "#define REDUCE" in s]
    assert len(reductions) >= 4 and len(sources) - len(reductions) >= len(FUNCTIONS)
    failures = compile_all(sources)
    assert not failures, "\n".join(failures[:3])


def test_the_grammar_uses_every_function_and_operator():
    nodes = list(_nodes(GRAMMAR))
    assert {n.fn for n in nodes if isinstance(n, Call)} >= set(FUNCTIONS)
    assert {n.op for n in nodes if isinstance(n, BinOp)} == set(BINARY_OPS)
    pairs = dtype_pairs()
    assert ("uint8", "bfloat16") in pairs and ("int8", "float16") in pairs
    assert ("bfloat16", "float32") in pairs and ("float64", "bfloat16") in pairs
    assert ("int64", "int64") in pairs and ("bfloat16", "int64") not in pairs
    integer = {grammar_source(i, o).operation for i, o in pairs if not dtypes.is_float(o)}
    assert any("ep_ipow" in op for op in integer) and any("exp(" in op for op in integer)


@pytest.mark.parametrize("out_dtype", dtypes.DTYPES)
def test_the_whole_grammar_compiles_for_every_dtype_pair(out_dtype):
    """Elementwise for every operand dtype into `out_dtype`, contiguous, and strided too
    into bfloat16 and float32 (the join's code does not depend on the layout)."""
    sources = set()
    for in_dtype, out in dtype_pairs():
        if out == out_dtype:
            source = grammar_source(in_dtype, out)
            sources.add(render_elementwise(source))
            if out in ("bfloat16", "float32"):
                sources.add(render_elementwise(source, strided=True))
    failures = compile_all(sources)
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:2])


@pytest.mark.parametrize("agg", sorted(cuda_codegen.AGGREGATIONS))
def test_the_grammar_compiles_under_every_aggregation(agg):
    """Each aggregation into every dtype, from operands of that dtype and from int8."""
    sources = set()
    for out_dtype in dtypes.DTYPES:
        for in_dtype in {out_dtype, "int8"}:
            expr = GRAMMAR if dtypes.is_float(out_dtype) else INTEGER_GRAMMAR
            source = cuda_codegen.reduction_source(expr, agg, [in_dtype] * 3, out_dtype)
            sources.add(render_reduction(source, [in_dtype] * 3, out_dtype))
    failures = compile_all(sources)
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:2])


def test_every_catalogued_kernel_compiles_for_every_dtype():
    """The fixed kernels under every binding of their placeholders, the fills in every
    float dtype and the scatter-sums in every dtype; the copy with strided arrays too
    (slices read strided views, concatenations write them; every other kernel's arrays
    are whole tensors)."""
    entries = list(cuda_codegen.catalog())
    names = {source.name for source, _ in entries}
    assert {fixed.source.name for fixed in cuda_codegen.FIXED} <= names
    assert {f"einpage_fill_{d}" for d in dtypes.FLOAT_DTYPES} <= names
    assert {f"einpage_scatter_sum_{d}" for d in dtypes.DTYPES} <= names
    sources = set()
    for source, binding in entries:
        sources.add(render_elementwise(source, binding))
        if source == cuda_codegen.COPY.source:
            sources.add(render_elementwise(source, binding, strided=True))
    assert any("bfloat16.cuh" in s for s in sources)
    failures = compile_all(sources)
    assert not failures, f"{len(failures)} of {2 * len(sources)} failed:\n" + "\n".join(
        failures[:2]
    )


def test_every_catalogued_reduction_compiles_for_every_dtype():
    """argmax, argmin and the k-th largest's counting pass, in every dtype (CuPy 14's own
    argmax has no bfloat16 loop, and its partition sorts with thrust, which has no
    bfloat16: the backend launches these instead)."""
    sources = set()
    for source in cuda_codegen.reduction_catalog():
        params = cupy_source.parse_params(source.in_params, True)
        outputs = cupy_source.parse_params(source.out_params, False)
        for out_ndim in (1, 0):  # rows, or one row (`_raw_out[_i]` of a 0-d output)
            sources.add(
                render_reduction(source, [p.type for p in params], outputs[0].type, out_ndim)
            )
    assert len(sources) == 2 * 3 * len(dtypes.DTYPES)
    failures = compile_all(sources)
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:2])


def test_no_kernel_adds_floats_with_atomics():
    """A float atomic makes sums depend on the order threads run in: none is left (the
    scatter-add sorts, then sums in position order)."""
    for source, _ in cuda_codegen.catalog():
        assert "atomic" not in source.operation + source.preamble, source.name
    for source in cuda_codegen.reduction_catalog():
        text = source.map_expr + source.reduce_expr + source.post_map_expr + source.preamble
        assert "atomic" not in text, source.name
    assert "atomic" not in cuda_codegen.PREAMBLE


def test_the_catalog_lists_every_kernel_the_programs_launch():
    """Every kernel launched on the programs is a join kernel (generated per expression)
    or one of the catalog's, so compiling the catalog compiles every other kernel."""
    catalogued = {source.name for source, _ in cuda_codegen.catalog()}
    catalogued |= {source.name for source in cuda_codegen.reduction_catalog()}
    launched = set()
    for sources in program_kernels().values():
        for text in sources:
            launched.add(text.split('extern "C" __global__ void ', 1)[1].split("(", 1)[0])
    generated = {n for n in launched if n.startswith(("einpage_join_", "einpage_reduce_"))}
    assert launched - generated <= catalogued, launched - generated - catalogued
    assert {"einpage_copy", "einpage_gather", "einpage_scatter_keys", "einpage_bitonic_step",
            "einpage_scatter_sum_bfloat16", "einpage_fill_bfloat16", "einpage_argmax_bfloat16",
            "einpage_kth_count_bfloat16", "einpage_kth_unkey_bfloat16"} <= launched  # fmt: skip


def test_the_generated_kernels_cover_every_dtype_and_kind():
    every = set().union(*program_kernels().values())
    text = "\n".join(every)
    for needle in ("typedef float16 T", "float16 &out", "typedef bfloat16 T", "bfloat16 &out",
                   "const unsigned char &in0", "einpage_gather", "einpage_scatter_sum",
                   "einpage_causal_fill", "#define REDUCE"):  # fmt: skip
        assert needle in text, needle
