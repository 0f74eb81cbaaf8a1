"""The NVRTC tier's source renderer (`cupy_source`, beside these tests): CuPy's own code
generator, fed descriptions of a call, renders CuPy's declarations without a GPU; it is
the tests' own – no package imports it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("cupy", reason="the renderer is CuPy's generator: pip install '.[nvrtc]'")

import cupy_source  # noqa: E402

from runtime import cuda_codegen  # noqa: E402
from taskgraph.expr import parse  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("einpage_core", "taskgraph", "memgraph", "runtime", "einpage")


def test_the_renderer_lives_with_the_tests_not_in_the_runtime():
    """It calls CuPy's private code generator to show NVRTC what CuPy would compile; the
    backend compiles through CuPy itself, so no package may depend on it."""
    assert Path(cupy_source.__file__).resolve().parent == Path(__file__).resolve().parent
    assert not (ROOT / "runtime" / "cupy_source.py").exists()
    users = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "cupy_source" in path.read_text(encoding="utf-8")
    ]
    assert users == []


def test_cupy_source_renders_cupys_declarations():
    code = cupy_source.elementwise_code(
        "float32 x, raw T table, int64 n", "T y", "y = x + table[n];", "k",
        [cupy_source.Arg("float32", 1), cupy_source.Arg("float16", 2),
         cupy_source.Arg("int64"), cupy_source.Arg("float16", 1)],
    )  # fmt: skip
    assert code.startswith("#include <cupy/complex.cuh>\n#include <cupy/carray.cuh>\n")
    assert '#include "cupy/float16.cuh"' in code and "typedef float16 T;" in code
    assert (
        "(const CArray<float, 1, 1, 1> _raw_x, const CArray<float16, 2, 1, 1> table, "
        "const long long n, CArray<float16, 1, 1, 1> _raw_y, CIndexer<1, 1> _ind)"
    ) in code
    assert "const float &x = _raw_x[_ind.get()];" in code and "T &y = _raw_y[_ind.get()];" in code
    params = cupy_source.parse_params("_non_const raw int64 flag", True)
    assert params == [cupy_source.Param("flag", "int64", True, False)]
    with pytest.raises(ValueError, match="mutable"):
        cupy_source.parse_params("mutable float32 x", True)


def test_cupy_source_renders_bfloat16_as_cupy_14_names_it():
    """CuPy 14 names ml_dtypes' bfloat16 `bfloat16` (its class in `cupy/bfloat16.cuh`,
    over `__nv_bfloat16` from `cuda_bf16.h`), declared before the typedefs."""
    source = cuda_codegen.reduction_source(parse("a", 1), "max", ["bfloat16"], "bfloat16")
    code = cupy_source.reduction_code(
        source.in_params, source.out_params, source.map_expr, source.reduce_expr,
        source.post_map_expr, source.identity, source.name,
        [cupy_source.Arg("bfloat16", 2, False), cupy_source.Arg("bfloat16", 1)],
        source.reduce_type, source.preamble,
    )  # fmt: skip
    assert '#include "cupy/bfloat16.cuh"' in code and "typedef int IndexT;" in code
    assert code.index("bfloat16.cuh") < code.index("typedef int IndexT;")
    assert "typedef float _type_reduce;" in code
    assert "const bfloat16 in0 = _raw_in0[_in_ind.get()];" in code
    assert "bfloat16 &out = _raw_out[_out_ind.get()];" in code
