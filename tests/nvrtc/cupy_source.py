"""The CUDA C source CuPy compiles for an `ElementwiseKernel` or a `ReductionKernel` call,
made by CuPy's own code generator, without a GPU.

CuPy builds a kernel's source only when it is first called on a device, so a machine
without a GPU never sees it – but the functions that write the source are plain
functions of descriptions of the call, and they run without a device:

* `cupy._core._kernel._get_elementwise_kernel_code(arginfos, type_map, params,
  operation, name, preamble)` for an `ElementwiseKernel`;
* `cupy._core._reduction._ReductionKernel_get_cached_function_code(nin, nout, params,
  arginfos, type_map, name, block_size, reduce_type, identity, map_expr, reduce_expr,
  post_map_expr, preamble, options)` for a `ReductionKernel`.

This module makes their arguments as `ElementwiseKernel.__call__` and
`ReductionKernel._call` make them from real arrays (each argument's `_ArgInfo`: dtype,
ndim after CuPy merges contiguous dimensions, contiguity, 32-bit indexing; the type map
from `_decide_params_type`; the reduction's `IndexT` and block size), calls them, and
puts CuPy's headers first, as `compile_with_cache` does. So the source is CuPy's own:
inputs `const`, the type declarations a dtype needs (`#include "cupy/float16.cuh"`,
`"cupy/bfloat16.cuh"`, which includes `cuda_bf16.h`), the typedefs, the loop or the
block reduction – of the CuPy the `nvrtc` extra installs (the same 14.x as the `gpu`
extras). `nvrtc_tool` compiles it with the options CuPy passes.

It lives with the tests, not in `runtime`: it reaches into CuPy's private functions,
which only a test may depend on (the version the extras pin).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import taskgraph  # noqa: F401  (registers ml_dtypes' bfloat16 with NumPy)

__all__ = ["Arg", "Param", "parse_params", "elementwise_code", "reduction_code", "cupy_headers"]


def _cupy():
    """CuPy's code-generation internals (an `ImportError` naming them when absent)."""
    try:
        import cupy
        from cupy._core import _carray, _kernel, _reduction, _scalar, core
    except ImportError as err:  # pragma: no cover (the nvrtc extra installs CuPy)
        raise ImportError(f"the NVRTC tier renders kernels with CuPy's generator: {err}") from err
    return cupy, _carray, _kernel, _reduction, _scalar, core


def cupy_headers() -> str:
    """What CuPy's `compile_with_cache` puts before every kernel's source."""
    *_, core = _cupy()
    return "".join(f"#include <{header}>\n" for header in core._cupy_header_list)


_ARG_NDARRAY, _ARG_INDEXER, _ARG_SCALAR = 1, 2, 3  # CuPy's _ArgKind


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a kernel definition: `raw T table` -> raw, type "T", "table"."""

    name: str
    type: str
    raw: bool
    is_const: bool


def parse_params(text: str, is_const: bool) -> list[Param]:
    """The parameters of an `in_params` (`is_const=True`) or `out_params` string, read as
    CuPy's `ParameterInfo` reads them."""
    _, _, kernel, *_ = _cupy()
    params = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            info = kernel.ParameterInfo(part, is_const)
        except Exception as err:  # CuPy raises a bare Exception for a syntax error
            raise ValueError(f"kernel parameter {part!r}: {err}") from None
        params.append(Param(info.name, info.ctype if info.dtype is None else str(info.dtype),
                            info.raw, info.is_const))  # fmt: skip
    return params


@dataclass(frozen=True, slots=True)
class Arg:
    """What CuPy knows of one argument when it generates code: an array's `dtype`,
    `ndim`, C-contiguity and whether 32-bit indices suffice, or a scalar (`ndim=None`)."""

    dtype: str
    ndim: int | None = None
    c_contiguous: bool = True
    index_32_bits: bool = True


def _arginfo(arg: Arg, scalar_dtype: np.dtype | None = None):
    cupy, _, kernel, _, scalar, _ = _cupy()
    if arg.ndim is None:  # CuPy casts the scalar to its parameter's type first
        dtype = scalar_dtype if scalar_dtype is not None else np.dtype(arg.dtype)
        return kernel._ArgInfo(_ARG_SCALAR, scalar.CScalar, dtype, 0, True, True)
    return kernel._ArgInfo(
        _ARG_NDARRAY, cupy.ndarray, np.dtype(arg.dtype), arg.ndim, arg.c_contiguous,
        arg.index_32_bits,
    )  # fmt: skip


def _indexer(ndim: int):
    _, carray, kernel, *_ = _cupy()
    return kernel._ArgInfo(_ARG_INDEXER, carray.Indexer, None, ndim, True, True)


def _types(in_params: str, out_params: str, args: Sequence[Arg], n_in: int):
    """CuPy's `_decide_params_type` for these arguments: (in types, out types, type map)."""
    cupy, *_ = _cupy()
    probe = cupy.ElementwiseKernel(in_params, out_params, ";", "einpage_probe")
    in_types = tuple(None if a.ndim is None else np.dtype(a.dtype) for a in args[:n_in])
    out_types = tuple(np.dtype(a.dtype) for a in args[n_in:])
    return probe._decide_params_type(in_types, out_types)


def elementwise_code(
    in_params: str,
    out_params: str,
    operation: str,
    name: str,
    args: Sequence[Arg],
    preamble: str = "",
    indexer_ndim: int = 1,
) -> str:
    """The source CuPy compiles for `ElementwiseKernel(in_params, out_params, operation,
    name, preamble=preamble)` called with `args` (inputs then outputs), whose indexer has
    `indexer_ndim` dimensions (after CuPy's merging)."""
    cupy, _, kernel, *_ = _cupy()
    definition = cupy.ElementwiseKernel(in_params, out_params, operation, name, preamble=preamble)
    n_in = definition.nin
    in_types, _, type_map = _types(in_params, out_params, args, n_in)
    infos = [_arginfo(a, in_types[i] if i < n_in else None) for i, a in enumerate(args)]
    code = kernel._get_elementwise_kernel_code(
        (*infos, _indexer(indexer_ndim)), type_map, definition.params, definition.operation,
        definition.name, definition.preamble,
    )  # fmt: skip
    return cupy_headers() + code


def reduction_code(
    in_params: str,
    out_params: str,
    map_expr: str,
    reduce_expr: str,
    post_map_expr: str,
    identity: str,
    name: str,
    args: Sequence[Arg],
    reduce_type: str | None = None,
    preamble: str = "",
    in_ndim: int = 2,
    out_ndim: int = 1,
    in_size: int = 1 << 16,
    out_size: int = 1 << 8,
) -> str:
    """The source CuPy compiles for `ReductionKernel(in_params, out_params, map_expr,
    reduce_expr, post_map_expr, identity, name, reduce_type, preamble=preamble)` called
    with `args` (inputs then the output), reducing `in_size` elements (`in_ndim`
    dimensions) to `out_size` (`out_ndim`)."""
    cupy, _, kernel, reduction, scalar, _ = _cupy()
    definition = cupy.ReductionKernel(
        in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, name,
        reduce_type=reduce_type, preamble=preamble,
    )  # fmt: skip
    n_in = definition.nin
    in_types, _, type_map = _types(in_params, out_params, args, n_in)
    index = "int64" if in_size // max(out_size, 1) > 0x7FFFFFFF else "int32"
    type_map = kernel._TypeMap(type_map._pairs + (("IndexT", index),))
    block_size, block_stride, _ = reduction._get_block_specs(in_size, out_size, 1, -1)
    infos = (
        *(_arginfo(a, in_types[i] if i < n_in else None) for i, a in enumerate(args)),
        _indexer(in_ndim),
        _indexer(out_ndim),
        kernel._ArgInfo(_ARG_SCALAR, scalar.CScalar, np.dtype("int32"), 0, True, True),
    )
    code = reduction._ReductionKernel_get_cached_function_code(
        definition.nin, definition.nout, definition._params, infos, type_map, definition.name,
        block_size, definition.reduce_type, definition.identity, definition.map_expr,
        definition.reduce_expr, definition.post_map_expr, definition.preamble,
        definition.options,
    )  # fmt: skip
    return cupy_headers() + code
