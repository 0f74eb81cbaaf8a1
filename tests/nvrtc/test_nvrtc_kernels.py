"""Every kernel the CuPy backend generates compiles for real GPUs (sm_80 and sm_90), with
NVRTC, on a machine without a GPU or a driver.

The sources are the ones CuPy would compile (`cupy_source` here, inputs `const` as
CuPy declares them), for every kernel the backend launches on the test programs and
the models (`recording.kernel_sources`) and for the whole join grammar (every
function and operator, elementwise and under each aggregation, in every float dtype).
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
from runtime.cupy_backend import _GATHER
from taskgraph.expr import BINARY_OPS, FUNCTIONS

ABSENT = missing()
if ABSENT and os.environ.get("CI"):
    raise RuntimeError(f"CI runs the NVRTC compile tier: {ABSENT}")
pytestmark = pytest.mark.skipif(ABSENT is not None, reason=ABSENT or "")

ARCHES = ("compute_80", "compute_90")
FLOATS = ("float16", "float32", "float64")


def compile_all(sources: set[str]) -> list[str]:
    """Compile every source for every architecture; the failures, with NVRTC's log."""
    jobs = [(source, arch) for source in sorted(sources) for arch in ARCHES]
    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = list(pool.map(lambda job: compile_errors(*job), jobs))
    return [
        f"--- {arch} ---\n{log}\n--- source ---\n{source}"
        for (source, arch), log in zip(jobs, logs, strict=True)
        if log is not None
    ]


PROGRAMS = (
    "mlp f32", "mlp f16", "llama:tiny-gqa f16", "gpt2:tiny f16", "gpt2:tiny f32",
    "qwen2:tiny f16", "llama int4 f16", "llama int8 f32", "llama generation f16",
    "gpt2 sampling f32", "llama training f32", "llama training f16",
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
    }
    assert tuple(graphs) == PROGRAMS
    return {name: kernel_sources(tg) for name, tg in graphs.items()}


def grammar_programs():
    """One program per dtype using every join function and operator, elementwise and
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


def test_the_tier_catches_an_input_written_by_a_kernel():
    """Today's gather kernel wrote its `raw int64 flag`, an input, which CuPy declares
    const: NVRTC refuses it exactly as a GPU machine would."""
    broken = (
        "raw T table, raw I ids, int64 row, int64 rows, raw int64 flag",
        "T out",
        _GATHER[2],
        "einpage_gather_as_it_was",
    )
    arg = cupy_source.Arg
    args = [arg("float32", 2), arg("int64", 1), arg("int64"), arg("int64"), arg("int64", 1),
            arg("float32", 1)]  # fmt: skip
    source = cupy_source.elementwise_code(*broken, args)
    fixed = cupy_source.elementwise_code(*_GATHER, [args[i] for i in (0, 1, 2, 3, 5, 4)])
    assert compile_errors(fixed, "compute_80") is None
    assert "const CArray<long long, 1, 1, 1> flag" in source
    log = compile_errors(source, "compute_80")
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


def test_the_generated_kernels_cover_every_dtype_and_kind():
    every = set().union(*program_kernels().values())
    text = "\n".join(every)
    for needle in ("typedef float16 T", "float16 &out", "einpage_gather", "einpage_scatter_add",
                   "einpage_causal_fill", "#define REDUCE"):  # fmt: skip
        assert needle in text, needle
