"""A CPU stand-in for the parts of CuPy that the GPU backend's kernels use (tests only).

`FakeCupy` is NumPy plus `ElementwiseKernel` and `ReductionKernel` that compile the
CUDA C they are given with the host C++ compiler (g++) and run it over NumPy arrays,
wrapped in the same loop templates CuPy generates (`out = ...` per element; for a
reduction `_s = REDUCE(_s, static_cast<_type_reduce>(map_expr))` from
`_type_reduce(identity)`, then `POST_MAP(_s)`). Device-only spellings are mapped to
host C++ (`__device__`, `__int_as_float`, ...).

Every dtype of `taskgraph.dtypes` runs, under the C names CuPy 14 gives them: `float16`
and `bfloat16` are host classes shaped like CuPy's (`cupy/float16.cuh`,
`cupy/bfloat16.cuh`): built implicitly from `float` with round-to-nearest-even,
explicitly from other numbers (a `double` goes to a bfloat16 through `float`, as
CuPy's class and `ml_dtypes` do; to a float16 directly, as CUDA's `__half` and NumPy
do), read back as `float`, assigned from anything they can be built from.

Parameters are declared as CuPy declares them: inputs `const` (raw inputs are
`const T*`), so a kernel that writes an input fails to compile here as it does under
NVRTC. An elementwise kernel's threads run in a shuffled order (a GPU promises none),
so a kernel whose result depends on the order its threads run in – float atomics –
gives a different answer here than in index order. `size=` launches a kernel over raw
arrays only. It lets the CuPy backend's kernel dispatch and the generated code run on a
machine without a GPU; it says nothing about CUDA streams, memory or cuBLAS.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from types import SimpleNamespace

import numpy as np

CXX = shutil.which("g++") or shutil.which("c++")

_CTYPE = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float", "float64": "double",
          "int8": "signed char", "uint8": "unsigned char", "int16": "short",
          "uint16": "unsigned short", "int32": "int", "uint32": "unsigned int",
          "int64": "long long", "uint64": "unsigned long long", "bool": "bool"}  # fmt: skip
_CTYPES = {"float32": ctypes.c_float, "float64": ctypes.c_double, "int32": ctypes.c_int32,
           "int64": ctypes.c_int64, "uint8": ctypes.c_uint8, "uint16": ctypes.c_uint16,
           "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64}  # fmt: skip
_ORDER = np.random.default_rng(20240923)
"""Shuffles the order of an elementwise kernel's threads (fixed seed: reproducible runs)."""

_HEADER = r"""
#include <cmath>
#include <cstring>
#include <cstddef>
using namespace std;
#define __device__
#define __forceinline__ inline
static inline float __int_as_float(unsigned int x) { float f; memcpy(&f, &x, 4); return f; }
static inline double __longlong_as_double(unsigned long long x) {
  double d; memcpy(&d, &x, 8); return d;
}
static inline unsigned int __float_as_uint(float x) { unsigned int u; memcpy(&u, &x, 4); return u; }
static inline long long __double_as_longlong(double x) { long long u; memcpy(&u, &x, 8); return u; }
template <typename T> static inline T atomicAdd(T* p, T v) { T old = *p; *p += v; return old; }

static inline unsigned short ep_float_to_bf16(float f) {  // round to nearest even
  unsigned int u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
struct bfloat16 {  // cupy/bfloat16.cuh's interface
  unsigned short bits_;
  bfloat16() : bits_(0) {}
  bfloat16(float v) : bits_(ep_float_to_bf16(v)) {}
  explicit bfloat16(double v) : bfloat16(float(v)) {}
  explicit bfloat16(bool v) : bfloat16(float(v)) {}
  explicit bfloat16(int v) : bfloat16(float(v)) {}
  explicit bfloat16(unsigned int v) : bfloat16(float(v)) {}
  explicit bfloat16(long long v) : bfloat16(float(v)) {}
  explicit bfloat16(unsigned long long v) : bfloat16(float(v)) {}
  operator float() const {
    unsigned int u = (unsigned int)bits_ << 16; float f; memcpy(&f, &u, 4); return f;
  }
  unsigned short to_bits() const { return bits_; }
  bfloat16& operator=(const bfloat16&) = default;
  template <typename T> bfloat16& operator=(const T& rhs) {
    *this = static_cast<bfloat16>(rhs); return *this;
  }
};
struct float16 {  // cupy/float16.cuh's interface, over the compiler's IEEE half
  _Float16 data_;
  float16() : data_(0) {}
  float16(float v) : data_((_Float16)v) {}
  explicit float16(double v) : data_((_Float16)v) {}
  explicit float16(bool v) : data_((_Float16)float(v)) {}
  explicit float16(int v) : data_((_Float16)v) {}
  explicit float16(unsigned int v) : data_((_Float16)v) {}
  explicit float16(long long v) : data_((_Float16)v) {}
  explicit float16(unsigned long long v) : data_((_Float16)v) {}
  operator float() const { return (float)data_; }
  unsigned short to_bits() const { unsigned short u; memcpy(&u, &data_, 2); return u; }
  float16& operator=(const float16&) = default;
  template <typename T> float16& operator=(const T& rhs) {
    *this = static_cast<float16>(rhs); return *this;
  }
};
"""

_BUILD_DIR = tempfile.mkdtemp(prefix="einpage-cpu-cuda-")
_LIBRARIES: dict[str, ctypes.CDLL] = {}


def _compile(source: str) -> ctypes.CDLL:
    key = hashlib.sha1(source.encode()).hexdigest()[:16]
    if key not in _LIBRARIES:
        path = os.path.join(_BUILD_DIR, key)
        with open(path + ".cpp", "w") as handle:
            handle.write(source)
        result = subprocess.run(
            [CXX, "-O0", "-shared", "-fPIC", "-o", path + ".so", path + ".cpp"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode:
            raise RuntimeError(f"g++ failed:\n{result.stderr}\n--- source ---\n{source}")
        _LIBRARIES[key] = ctypes.CDLL(path + ".so")
    return _LIBRARIES[key]


def _parse_params(text: str) -> list[tuple[bool, str, str]]:
    """`"raw T table, float32 x"` -> [(raw, type, name), ...]."""
    params = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        words = part.split()
        raw = words[0] == "raw"
        type_name, name = words[-2], words[-1]
        params.append((raw, type_name, name))
    return params


def _bind(params, args) -> dict[str, str]:
    """Type placeholders (single capitals) resolved from the arguments' dtypes."""
    bound: dict[str, str] = {}
    for (_, type_name, _), arg in zip(params, args, strict=True):
        if type_name not in _CTYPE and isinstance(arg, np.ndarray):
            bound[type_name] = arg.dtype.name
    return bound


def _ctype(type_name: str, bound: dict[str, str]) -> str:
    return _CTYPE[bound.get(type_name, type_name)]


def _dtype(type_name: str, bound: dict[str, str]) -> str:
    return bound.get(type_name, type_name)


class ElementwiseKernel:
    def __init__(self, in_params, out_params, operation, name="kernel", preamble="", **_):
        self.params = _parse_params(in_params) + _parse_params(out_params)
        self.n_in = len(_parse_params(in_params))
        self.operation = operation
        self.name = name
        self.preamble = preamble

    def __call__(self, *args, size=None):
        args = [_device(a) for a in args]
        bound = _bind(self.params, args)
        arrays = [a for (raw, _, _), a in zip(self.params, args, strict=True)
                  if not raw and isinstance(a, np.ndarray)]  # fmt: skip
        if arrays:
            shape = np.broadcast_shapes(*(a.shape for a in arrays))
        elif size is not None:  # only raw arrays: the launch says how many threads
            shape = (size,)
        else:
            raise TypeError(f"{self.name}: a kernel of raw arrays only needs size=")
        decls, loop, call = [], [], []
        outputs = []
        for position, ((raw, type_name, name), arg) in enumerate(
            zip(self.params, args, strict=True)
        ):
            ctype = _ctype(type_name, bound)
            if raw:  # CuPy declares inputs const, raw ones too
                data = np.ascontiguousarray(arg)
                const = "const " if position < self.n_in else ""
                decls.append(f"{const}{ctype}* {name}")
                call.append(data)
                if position >= self.n_in:
                    outputs.append((arg, data))
            elif isinstance(arg, np.ndarray):
                data = np.ascontiguousarray(np.broadcast_to(arg, shape))
                if position >= self.n_in:
                    data = data.copy()
                    outputs.append((arg, data))
                    loop.append(f"{ctype}& {name} = {name}_p[i];")
                else:
                    loop.append(f"const {ctype} {name} = {name}_p[i];")
                decls.append(f"{ctype}* {name}_p")
                call.append(data)
            else:
                decls.append(f"{ctype} {name}")
                call.append(_CTYPES[_dtype(type_name, bound)](arg))
        typedefs = "".join(f"typedef {_CTYPE[d]} {t};\n" for t, d in bound.items())
        source = (
            f"{_HEADER}{self.preamble}\n{typedefs}"
            f'extern "C" void run(ptrdiff_t _n, const long long* _order, {", ".join(decls)}) {{\n'
            f"  for (ptrdiff_t _t = 0; _t < _n; ++_t) {{\n    const ptrdiff_t i = _order[_t];\n"
            f"    {' '.join(loop)}\n    {self.operation}\n  }}\n}}\n"
        )
        lib = _compile(source)
        count = int(np.prod(shape))
        order = _ORDER.permutation(count).astype(np.int64)
        lib.run(ctypes.c_ssize_t(count), _pointer(order), *(_pointer(c) for c in call))
        for target, data in outputs:
            target[...] = data.reshape(target.shape) if data.shape != target.shape else data


class ReductionKernel:
    def __init__(self, in_params, out_params, map_expr, reduce_expr, post_map_expr, identity,
                 name="reduce_kernel", reduce_type=None, preamble="", **_):  # fmt: skip
        self.inputs = _parse_params(in_params)
        self.outputs = _parse_params(out_params)
        self.map_expr, self.reduce_expr, self.post_map_expr = map_expr, reduce_expr, post_map_expr
        self.identity = identity
        self.reduce_type = reduce_type
        self.preamble = preamble

    def __call__(self, *args, axis, out):
        args = tuple(_device(a) for a in args)
        bound = _bind(self.inputs + self.outputs, [*args, out])
        shape = np.broadcast_shapes(*(a.shape for a in args if isinstance(a, np.ndarray)))
        axes = tuple(a % len(shape) for a in (axis if isinstance(axis, tuple) else (axis,)))
        kept = [d for d in range(len(shape)) if d not in axes]
        out_size = int(np.prod([shape[d] for d in kept]))
        red_size = int(np.prod([shape[d] for d in axes]))
        call, decls, loads = [], [], []
        for (_, type_name, name), arg in zip(self.inputs, args, strict=True):
            ctype = _ctype(type_name, bound)
            if not isinstance(arg, np.ndarray):  # a scalar: a parameter of the kernel, as CuPy's
                decls.append(f"{ctype} {name}")
                call.append(_CTYPES[_dtype(type_name, bound)](arg))
                continue
            full = np.broadcast_to(arg, shape).transpose(kept + list(axes))
            call.append(np.ascontiguousarray(full).reshape(out_size, red_size))
            decls.append(f"const {ctype}* {name}_p")
            loads.append(f"const {ctype} {name} = {name}_p[o * R + r];")
        (_, out_type, out_name), = self.outputs  # fmt: skip
        out_ctype = _ctype(out_type, bound)
        result = np.ascontiguousarray(out, dtype=_dtype(out_type, bound)).reshape(out_size).copy()
        typedefs = "".join(f"typedef {_CTYPE[d]} {t};\n" for t, d in bound.items())
        source = (
            f"{_HEADER}{self.preamble}\n{typedefs}"
            f"#define REDUCE(a, b) ({self.reduce_expr})\n"
            f"#define POST_MAP(a) ({self.post_map_expr})\n"
            f"typedef {self.reduce_type or out_ctype} _type_reduce;\n"
            f'extern "C" void run(ptrdiff_t O, ptrdiff_t R, {", ".join(decls)}, '
            f"{out_ctype}* _raw_{out_name}) {{\n"
            f"  for (ptrdiff_t o = 0; o < O; ++o) {{\n    const ptrdiff_t _i = o;\n"
            f"    _type_reduce _s = _type_reduce({self.identity});\n"
            f"    for (ptrdiff_t r = 0; r < R; ++r) {{\n      const ptrdiff_t _J = r;\n"
            f"      {' '.join(loads)}\n"
            f"      _type_reduce _a = static_cast<_type_reduce>({self.map_expr});\n"
            f"      _s = REDUCE(_s, _a);\n    }}\n"
            f"    {out_ctype}& {out_name} = _raw_{out_name}[o];\n    POST_MAP(_s);\n  }}\n}}\n"
        )
        lib = _compile(source)
        lib.run(ctypes.c_ssize_t(out_size), ctypes.c_ssize_t(red_size),
                *(_pointer(c) for c in call), _pointer(result))  # fmt: skip
        out[...] = result.reshape(out.shape)


def _device(value):
    """A NumPy scalar as the 0-d array it stands for: indexing a 0-d array with `()`
    gives a scalar in NumPy and a 0-d array in CuPy; the backend passes scalar parameters
    as Python numbers."""
    return np.asarray(value) if isinstance(value, np.generic) else value


def _pointer(value):
    if isinstance(value, np.ndarray):
        return value.ctypes.data_as(ctypes.c_void_p)
    return value


def _as_cupy_14(reduction):
    """NumPy's `argmax`/`argmin`, refusing bfloat16 as CuPy 14.2's do (their loops cover
    bool, the integers, float16/32/64 and the complex types: `_routines_statistics.pyx`)."""

    def call(a, axis=None, **kwargs):
        if np.asarray(a).dtype.name == "bfloat16":
            raise TypeError(f"Wrong type ({a.dtype}) of arguments for cupy_{reduction.__name__}")
        return reduction(a, axis=axis, **kwargs)

    return call


def _partition_as_cupy_14(a, kth, axis=-1):
    """`np.partition`, refusing bfloat16 where CuPy 14.2 sorts the whole array with thrust
    (rows shorter than 32, or a kth that rounds up to 1024 or more), which has no bfloat16:
    "Sorting arrays with dtype 'bfloat16' is not supported"."""
    length = np.asarray(a).shape[axis]
    max_k = max(32, 1 << int(kth).bit_length())
    if np.asarray(a).dtype.name == "bfloat16" and (length < 32 or max_k >= 1024):
        raise NotImplementedError("Sorting arrays with dtype 'bfloat16' is not supported")
    return np.partition(a, kth, axis=axis)


def fake_cupy() -> SimpleNamespace:
    """NumPy under CuPy's names, with the compiled kernel classes above."""
    return SimpleNamespace(
        ElementwiseKernel=ElementwiseKernel,
        ReductionKernel=ReductionKernel,
        matmul=np.matmul,
        einsum=np.einsum,
        concatenate=np.concatenate,
        transpose=np.transpose,
        broadcast_to=np.broadcast_to,
        asarray=np.asarray,
        asnumpy=np.asarray,
        empty=np.empty,
        zeros=np.zeros,
        int64=np.int64,
        uint8=np.uint8,
        sum=np.sum,
        max=np.max,
        min=np.min,
        prod=np.prod,
        maximum=np.maximum,
        minimum=np.minimum,
        exp=np.exp,
        log=np.log,
        sqrt=np.sqrt,
        tanh=np.tanh,
        abs=np.abs,
        where=np.where,
        argmax=_as_cupy_14(np.argmax),
        argmin=_as_cupy_14(np.argmin),
        partition=_partition_as_cupy_14,
    )


# -- copies -------------------------------------------------------------------------


class FakeCudaRuntime:
    """The copy calls of `cupy.cuda.runtime` on the CPU: "device" pointers are host
    addresses (NumPy arrays stand in for device memory), and each copy runs at once with
    `ctypes.memmove`. `calls` records (name, bytes) per call."""

    memcpyHostToDevice = 1
    memcpyDeviceToHost = 2

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def memcpyAsync(self, dst, src, size, kind, stream):  # noqa: N802 (CuPy's name)
        assert kind in (self.memcpyHostToDevice, self.memcpyDeviceToHost)
        self.calls.append(("memcpyAsync", size))
        ctypes.memmove(dst, src, size)

    def memcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):  # noqa: N802
        assert kind in (self.memcpyHostToDevice, self.memcpyDeviceToHost)
        assert width <= dpitch and width <= spitch, "cudaErrorInvalidPitchValue"
        self.calls.append(("memcpy2DAsync", width * height))
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)


class FakeDeviceArray:
    """A NumPy array dressed as a CuPy device array for copies: `.data.ptr` is its address."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.shape, self.dtype, self.flags = array.shape, array.dtype, array.flags
        self.data = SimpleNamespace(ptr=array.ctypes.data)


def fake_cupy_backend():
    """A `CupyBackend` whose copies go to a `FakeCudaRuntime` (no GPU, no CuPy); only its
    copy primitive works. Returns (backend, runtime, a stand-in stream)."""
    from runtime.cupy_backend import CupyBackend

    cuda_runtime = FakeCudaRuntime()
    backend = object.__new__(CupyBackend)
    backend.cp = SimpleNamespace(cuda=SimpleNamespace(runtime=cuda_runtime))
    stream = SimpleNamespace(cuda=SimpleNamespace(ptr=0))
    return backend, cuda_runtime, stream


def _numpy_backend_class():
    from runtime.numpy_backend import NumpyBackend

    return NumpyBackend


class CudaCopiesBackend(_numpy_backend_class()):
    """The NumPy backend with host staging (as CuPy has it) whose copies are the CuPy
    backend's (`fake_cupy_backend`), issued in order on the NumPy streams."""

    host_staging = True

    def __init__(self):
        super().__init__()
        self.cupy, self.cuda_runtime, self.fake_stream = fake_cupy_backend()

    def copy_box(self, host, starts, device, direction, stream):
        def work():
            wrapped = FakeDeviceArray(device)
            self.cupy.copy_box(host, starts, wrapped, direction, self.fake_stream)

        stream.submit(work)
