"""The CUDA C source CuPy compiles for an `ElementwiseKernel` or a `ReductionKernel` call.

CuPy builds a kernel's source only when it is first called on a device, so a machine
without a GPU never sees it. This module renders the same source from the kernel's
definition and a description of its arguments, following CuPy's templates
(`cupy/_core/_kernel.pyx` and `_reduction.pyx`, CuPy 13-14):

* every *input* parameter is declared `const` – `const CArray<T, ndim, c_contiguous,
  index_32_bits> name` for a raw array (CuPy 14's four-parameter `CArray`),
  `const T &name = _raw_name[_ind.get()];` for an element, `const T name` for a
  scalar – unless written `_non_const`; outputs are not;
* single-letter type placeholders become `typedef`s; float16 pulls in
  `cupy/float16.cuh`; CuPy's own headers (`cupy/complex.cuh`, `carray.cuh`,
  `atomics.cuh`, `math_constants.h`) come first, as `compile_with_cache` prepends them;
* elementwise: one `CUPY_FOR` loop over a `CIndexer`; reduction: the shared-memory
  block reduction with `REDUCE`/`POST_MAP` macros, `_type_reduce`, `IndexT` and a
  `const int _block_stride`, block size 512.

What it does not model: the dimension merging CuPy applies to C-contiguous arrays
(`reduce_dims`: we pass the ndim the arrays have after it, which for contiguous
operands is 1) and kernel-name mangling. Neither changes whether a kernel compiles.
The tests beside it (`recording`, `test_nvrtc_kernels`) compile these sources with
NVRTC for sm_80 and sm_90 without a GPU.

It lives with those tests, not in `runtime`: the CuPy backend compiles its kernels
through CuPy's `ElementwiseKernel`/`ReductionKernel`, never through this copy of
CuPy's private templates, which is a model of what CuPy would generate (to be kept in
step with the CuPy versions the `gpu` and `nvrtc` extras allow).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from string import Template

__all__ = [
    "Arg",
    "Param",
    "parse_params",
    "elementwise_code",
    "reduction_code",
    "CUPY_HEADERS",
    "REDUCTION_BLOCK_SIZE",
]

CUPY_HEADERS = (
    "#include <cupy/complex.cuh>\n"
    "#include <cupy/carray.cuh>\n"
    "#include <cupy/atomics.cuh>\n"
    "#include <cupy/math_constants.h>\n"
)
"""What CuPy's `compile_with_cache` puts before every kernel's source."""

REDUCTION_BLOCK_SIZE = 512
"""CuPy's default reduction block size on CUDA."""

_C_TYPE = {
    "bool": "bool",
    "int8": "signed char",
    "uint8": "unsigned char",
    "int16": "short",
    "uint16": "unsigned short",
    "int32": "int",
    "uint32": "unsigned int",
    "int64": "long long",
    "uint64": "unsigned long long",
    "float16": "float16",
    "float32": "float",
    "float64": "double",
}
"""C names of the dtypes CuPy's kernels take (`cupy._core._scalar.get_typename`)."""


def c_type(dtype: str) -> str:
    """The C type CuPy names `dtype` by; `KeyError` names the dtypes it knows."""
    try:
        return _C_TYPE[dtype]
    except KeyError:
        raise KeyError(f"no CuPy C type for {dtype!r}; known: {sorted(_C_TYPE)}") from None


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a kernel definition: `raw T table` -> raw, type "T", "table"."""

    name: str
    type: str
    raw: bool
    is_const: bool


def parse_params(text: str, is_const: bool) -> list[Param]:
    """The parameters of an `in_params` (`is_const=True`) or `out_params` string."""
    params = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        words = part.split()
        if len(words) < 2:
            raise ValueError(f"kernel parameter {part!r}: expected '[raw] TYPE NAME'")
        raw, const = False, is_const
        for word in words[:-2]:
            if word == "raw":
                raw = True
            elif word == "_non_const":
                const = False
            else:
                raise ValueError(f"kernel parameter {part!r}: unknown keyword {word!r}")
        params.append(Param(words[-1], words[-2], raw, const))
    return params


@dataclass(frozen=True, slots=True)
class Arg:
    """What CuPy knows of one argument when it generates code: an array's `dtype`,
    `ndim`, C-contiguity and whether 32-bit indices suffice, or a scalar (`ndim=None`)."""

    dtype: str
    ndim: int | None = None
    c_contiguous: bool = True
    index_32_bits: bool = True

    def c_type(self) -> str:
        if self.ndim is None:
            return c_type(self.dtype)
        return (
            f"CArray<{c_type(self.dtype)}, {self.ndim}, {int(self.c_contiguous)}, "
            f"{int(self.index_32_bits)}>"
        )


def _bind(params: Sequence[Param], args: Sequence[Arg]) -> dict[str, str]:
    """Placeholder types (`T`, `I`) -> the dtype of the first argument declared with them."""
    bound: dict[str, str] = {}
    for param, arg in zip(params, args, strict=True):
        if len(param.type) == 1 and param.type not in bound:
            bound[param.type] = arg.dtype
    return bound


def _element_type(param: Param, bound: dict[str, str]) -> str:
    return param.type if len(param.type) == 1 else c_type(param.type)


def _prologue(bound: dict[str, str], args: Sequence[Arg], extra: Sequence[tuple[str, str]] = ()):
    """Headers, the float16 declaration when needed and the typedefs (sorted, as CuPy's
    `_TypeMap`)."""
    dtypes = {a.dtype for a in args} | set(bound.values())
    decls = "#include <cupy/float16.cuh>\n" if "float16" in dtypes else ""
    pairs = sorted([(t, c_type(d)) for t, d in bound.items()] + list(extra))
    typedefs = "".join(f"typedef {ctype} {name};\n" for name, ctype in pairs)
    return CUPY_HEADERS + decls + typedefs


def _signature(params: Sequence[Param], args: Sequence[Arg]) -> list[str]:
    out = []
    for param, arg in zip(params, args, strict=True):
        ctype = arg.c_type()
        name = param.name if param.raw or arg.ndim is None else "_raw_" + param.name
        out.append(f"{'const ' if param.is_const else ''}{ctype} {name}")
    return out


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
    name, preamble=preamble)` called with `args` (inputs then outputs)."""
    params = parse_params(in_params, True) + parse_params(out_params, False)
    bound = _bind(params, args)
    loads = []
    for param, arg in zip(params, args, strict=True):
        if not param.raw and arg.ndim is not None:
            element = _element_type(param, bound)
            const = "const " if param.is_const else ""
            loads.append(f"{const}{element} &{param.name} = _raw_{param.name}[_ind.get()];")
    signature = ", ".join([*_signature(params, args), f"CIndexer<{indexer_ndim}, 1> _ind"])
    body = "\n".join([*loads, operation])
    return _prologue(bound, args) + Template(_ELEMENTWISE).substitute(
        preamble=preamble, name=name, params=signature, operation=body
    )


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
) -> str:
    """The source CuPy compiles for `ReductionKernel(in_params, out_params, map_expr,
    reduce_expr, post_map_expr, identity, name, reduce_type, preamble=preamble)` called
    with `args` (inputs then the output)."""
    params = parse_params(in_params, True) + parse_params(out_params, False)
    bound = _bind(params, args)
    n_in = len(parse_params(in_params, True))
    inputs = [
        f"const {_element_type(p, bound)} {p.name} = _raw_{p.name}[_in_ind.get()];"
        if p.is_const
        else f"{_element_type(p, bound)}& {p.name} = _raw_{p.name}[_in_ind.get()];"
        for p, a in zip(params[:n_in], args[:n_in], strict=True)
        if not p.raw and a.ndim is not None
    ]
    outputs = [
        f"{_element_type(p, bound)} &{p.name} = _raw_{p.name}[_out_ind.get()];"
        for p, a in zip(params[n_in:], args[n_in:], strict=True)
        if not p.raw and a.ndim is not None and not p.is_const
    ]
    signature = ", ".join(
        [*_signature(params, args), f"CIndexer<{in_ndim}, 1> _in_ind",
         f"CIndexer<{out_ndim}, 1> _out_ind", "const int _block_stride"]
    )  # fmt: skip
    if reduce_type is None:
        reduce_type = _element_type(params[n_in], bound)
    return _prologue(bound, args, [("IndexT", "int")]) + Template(_REDUCTION).substitute(
        preamble=preamble,
        reduce_expr=reduce_expr,
        post_map_expr=post_map_expr,
        reduce_type=reduce_type,
        name=name,
        params=signature,
        block_size=REDUCTION_BLOCK_SIZE,
        identity=identity,
        input_expr="\n".join(inputs),
        pre_map_expr=map_expr,
        output_expr="\n".join(outputs),
    )


_ELEMENTWISE = """
${preamble}
extern "C" __global__ void ${name}(${params}) {
  ;
  #pragma unroll 1
  CUPY_FOR(i, _ind.size()) {
    _ind.set(i);
    ${operation};
  }
  ;
}
"""

_REDUCTION = """
${preamble}
#define REDUCE(a, b) (${reduce_expr})
#define POST_MAP(a) (${post_map_expr})
#define _REDUCE(_offset) if (_tid < _offset) { \\
  _type_reduce _a = _sdata[_tid], _b = _sdata[(_tid + _offset)]; \\
  _sdata[_tid] = REDUCE(_a, _b); \\
}

typedef ${reduce_type} _type_reduce;
extern "C" __global__ void ${name}(${params}) {
  __shared__ char _sdata_raw[${block_size} * sizeof(_type_reduce)];
  _type_reduce *_sdata = reinterpret_cast<_type_reduce*>(_sdata_raw);
  unsigned int _tid = threadIdx.x;
  IndexT _J_offset = _tid >> __popc(_block_stride - 1);
  ptrdiff_t _j_offset = (ptrdiff_t)_J_offset * _out_ind.size();
  IndexT _J_stride = ${block_size} >> __popc(_block_stride - 1);
  ptrdiff_t _j_stride = (ptrdiff_t)_J_stride * _out_ind.size();
  for (ptrdiff_t _i_base = (ptrdiff_t)blockIdx.x * _block_stride;
       _i_base < _out_ind.size();
       _i_base += (ptrdiff_t)gridDim.x * _block_stride) {
    _type_reduce _s = _type_reduce(${identity});
    ptrdiff_t _i = _i_base + (_tid & (_block_stride - 1));
    IndexT _J = _J_offset;
    for (ptrdiff_t _j = _i + _j_offset; _j < _in_ind.size();
         _j += _j_stride, _J += _J_stride) {
      _in_ind.set(_j);
      ${input_expr}
      _type_reduce _a = static_cast<_type_reduce>(${pre_map_expr});
      _s = REDUCE(_s, _a);
    }
    _sdata[_tid] = _s;
    __syncthreads();
    for (unsigned int _block = ${block_size} / 2; _block >= _block_stride; _block >>= 1) {
      if (_tid < _block) {
        _REDUCE(_block);
      }
      __syncthreads();
    }
    if (_tid < _block_stride) {
      _s = _sdata[_tid];
    }
    if (_tid < _block_stride && _i < _out_ind.size()) {
      _out_ind.set(static_cast<ptrdiff_t>(_i));
      ${output_expr}
      POST_MAP(_s);
    }
  }
}
"""
