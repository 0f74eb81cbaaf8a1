"""A CPU stand-in for the parts of CuPy that the GPU backend's kernels use (tests only).

`fake_cupy()` is CuPy's API as the backend calls it, over NumPy:

* `ElementwiseKernel` and `ReductionKernel` compile the CUDA C they are given with the
  host C++ compiler (g++) and run it over NumPy arrays, wrapped in the same loop
  templates CuPy generates (`out = ...` per element; for a reduction
  `_s = REDUCE(_s, static_cast<_type_reduce>(map_expr))` from `_type_reduce(identity)`,
  then `POST_MAP(_s)`). Device-only spellings are mapped to host C++ (`__device__`,
  `__int_as_float`, ...). Parameters are declared as CuPy declares them: inputs `const`
  (raw inputs are `const T*`), so a kernel that writes an input fails to compile here
  as it does under NVRTC. An elementwise kernel's threads run in a shuffled order (a GPU
  promises none), so a kernel whose result depends on the order its threads run in –
  float atomics – gives a different answer here than in index order. `size=` launches a
  kernel over raw arrays only.
* Every dtype of `taskgraph.dtypes` runs, under the C names CuPy 14 gives them: `float16`
  and `bfloat16` are host classes shaped like CuPy's (`cupy/float16.cuh`,
  `cupy/bfloat16.cuh`): built implicitly from `float` with round-to-nearest-even,
  explicitly from other numbers (a `double` goes to a bfloat16 through `float`, as
  CuPy's class and `ml_dtypes` do; to a float16 directly, as CUDA's `__half` and NumPy
  do), read back as `float`, assigned from anything they can be built from. CuPy 14.2's
  `argmax`/`argmin`/`partition` refuse bfloat16 here as there.
* `cuda.cublas.gemmStridedBatchedEx` runs on raw device addresses as cuBLAS does
  (`fake_cublas`: column-major, leading dimensions, batch strides; refusing what cuBLAS
  refuses and any element outside the allocation the address points into).
* Device memory is *faithful*: every allocation is counted by the fake's
  `DeviceMemory` – `cuda.Memory` (the arena), `empty`/`zeros`/`asarray`, and the result
  of every CuPy function or array method that makes a new array (`matmul`,
  `concatenate`, `einsum`, `argmax`, `partition`, `astype`, ufuncs and operators, a
  reshape that copies, ...: a device array subclass traps each one) – with the live
  bytes and the peak. Such temporaries are taken from CuPy's current allocator
  (`cuda.using_allocator`, as a CuPy pool allocation would), so while the backend runs
  a plan – when its allocator refuses every request – each one is an error.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
from fake_cublas import strided_gemm

from runtime.contraction import CUDA_R, GemmCall

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
            [CXX, "-O0", "-ffp-contract=off", "-shared", "-fPIC", "-o", path + ".so",
             path + ".cpp"],  # fmt: skip
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
    """A kernel argument as the kernel reads it: a device array as the plain NumPy array
    of its memory; a NumPy scalar as the 0-d array it stands for (indexing a 0-d array
    with `()` gives a scalar in NumPy and a 0-d array in CuPy; the backend passes scalar
    parameters as Python numbers)."""
    if isinstance(value, _DeviceArray):
        return value.view(np.ndarray)
    return np.asarray(value) if isinstance(value, np.generic) else value


def _pointer(value):
    if isinstance(value, np.ndarray):
        return value.ctypes.data_as(ctypes.c_void_p)
    return value


# -- device memory, counted ---------------------------------------------------------


class DeviceMemory:
    """The stand-in's device memory: every allocation, the bytes live and the peak.

    `allocate(nbytes, what, pool)` gives a zeroed byte buffer at a 256-aligned address
    (as cudaMalloc's), released (and uncounted) when nothing refers to it any more. A
    *pool* allocation – what CuPy takes from its memory pool for an array it makes –
    first asks the current allocator
    (`using_allocator`), as CuPy does: the backend's refuses every request during a run,
    so a temporary there is an error. `allocations` lists (what, bytes) of each one;
    `find(address, nbytes)` is the live allocation holding those bytes (what a kernel or
    a copy at a raw address reads), or a `MemoryError` as a GPU's fault would be.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.allocations: list[tuple[str, int]] = []
        self.allocator: Callable[[int], Any] | None = None
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._blocks: dict[int, tuple[int, Any, int]] = {}  # start -> (bytes, owner, offset)
        self._roots: dict[int, int] = {}  # the owner's address -> start

    def allocate(self, nbytes: int, what: str, pool: bool = True) -> np.ndarray:
        if pool and self.allocator is not None:
            self.allocator(nbytes)  # CuPy's pool asks its allocator: the backend's refuses
        buffer = np.zeros(max(nbytes, 1) + 255, dtype=np.uint8)
        offset = -buffer.ctypes.data % 256
        self.register(buffer, nbytes, what, offset)
        return buffer[offset : offset + nbytes]

    def register(self, owner: np.ndarray, nbytes: int, what: str, offset: int = 0) -> None:
        """Count `nbytes` of `owner`'s memory from byte `offset` until it is released."""
        start = owner.ctypes.data + offset
        with self._lock:
            self.allocations.append((what, nbytes))
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            bisect.insort(self._starts, start)
            self._blocks[start] = (nbytes, weakref.ref(owner), offset)
            self._roots[owner.ctypes.data] = start
        weakref.finalize(owner, self._release, start, nbytes, owner.ctypes.data)

    def _release(self, start: int, nbytes: int, root: int) -> None:
        with self._lock:
            self.live -= nbytes
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start:
                del self._starts[i]
                del self._blocks[start]
            if self._roots.get(root) == start:
                del self._roots[root]

    def holds(self, array: np.ndarray) -> bool:
        """Whether `array`'s memory is (inside) a counted allocation."""
        root = array
        while isinstance(root, np.ndarray) and root.base is not None:
            root = root.base
        if not isinstance(root, np.ndarray):
            return True  # memory of another object (a host buffer): not device memory
        with self._lock:
            start = self._roots.get(root.ctypes.data)
            block = None if start is None else self._blocks.get(start)
        return block is not None and block[1]() is root

    def find(self, address: int, nbytes: int) -> tuple[np.ndarray, int]:
        """The live allocation holding bytes `[address, address + nbytes)`, and the
        offset of `address` in it."""
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i >= 0:
                start = self._starts[i]
                size, ref, offset = self._blocks[start]
                owner = ref()
                if owner is not None and address + nbytes <= start + size:
                    flat = np.asarray(owner).view(np.uint8).reshape(-1)
                    return flat[offset : offset + max(size, 1)], address - start
        raise MemoryError(
            f"device bytes [{address:#x}, +{nbytes}) are in no live allocation: on a GPU, "
            "an illegal address"
        )

    def counted(self, result: Any, what: str) -> Any:
        """Count each array in `result` that owns memory no allocation holds (a CuPy
        function's new array), as a pool allocation."""
        arrays = result if isinstance(result, tuple | list) else (result,)
        for array in arrays:
            if isinstance(array, np.ndarray) and not self.holds(array):
                root = array
                while root.base is not None:
                    root = root.base
                if self.allocator is not None:
                    self.allocator(root.nbytes)
                self.register(root, root.nbytes, what)
        return result


class _DeviceArray(np.ndarray):
    """A NumPy array in stand-in device memory; `.data.ptr` is its address (as CuPy's).
    Each fake's subclass (`memory` set) counts the new arrays NumPy makes from it: by
    ufuncs and operators, by array functions (`concatenate`, `einsum`, `argmax`, ...),
    and by methods (`astype`, `copy`, a reshape that copies)."""

    memory: DeviceMemory

    @property
    def data(self):  # noqa: D102 (CuPy's attribute)
        return SimpleNamespace(ptr=self.ctypes.data)

    def __array_finalize__(self, obj: Any) -> None:
        if obj is not None and self.base is None:  # a method made a new array
            self.memory.counted(self, "a new array of an array method")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [x.view(np.ndarray) if isinstance(x, _DeviceArray) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(
                x.view(np.ndarray) if isinstance(x, _DeviceArray) else x for x in kwargs["out"]
            )
            return getattr(ufunc, method)(*plain, **kwargs)
        result = getattr(ufunc, method)(*plain, **kwargs)
        return self._device(self.memory.counted(result, f"the result of {ufunc.__name__}"))

    def __array_function__(self, func, types, args, kwargs):
        result = func._implementation(*_plain(args), **_plain(kwargs))
        return self._device(self.memory.counted(result, f"the result of {func.__name__}"))

    def _device(self, result: Any) -> Any:
        if isinstance(result, tuple):
            return tuple(self._device(r) for r in result)
        if isinstance(result, np.ndarray) and not isinstance(result, _DeviceArray):
            return result.view(type(self))
        return result


def _plain(value: Any) -> Any:
    """`value` with device arrays seen as plain NumPy arrays (same memory)."""
    if isinstance(value, _DeviceArray):
        return value.view(np.ndarray)
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


_INVERSE_CUDA_R = {code: dtype for dtype, code in CUDA_R.items()}


class FakeCublas:
    """`cupy.cuda.cublas.gemmStridedBatchedEx` on the stand-in's memory: each operand at
    its raw address (found in `memory`), the product as `fake_cublas.strided_gemm`
    computes it, with alpha and beta read from host memory. The handle's math mode
    (`setMathMode`) starts at cuBLAS's default, which lets a GEMM with a 16-bit output add
    split-K partial sums in 16 bits: such a GEMM is refused here unless the mode
    disallows it (`CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION`), since its result
    would then differ from float32 sums rounded once."""

    DISALLOW_REDUCED_PRECISION_REDUCTION = 16

    def __init__(self, memory: DeviceMemory):
        self.memory = memory
        self.calls: list[GemmCall] = []
        self.math_mode: dict[int, int] = {}  # handle -> mode

    def setMathMode(self, handle: int, mode: int) -> None:  # noqa: N802 (cuBLAS's name)
        self.math_mode[handle] = mode

    def gemmStridedBatchedEx(  # noqa: N802, PLR0913 (cuBLAS's name and arguments)
        self, handle, transa, transb, m, n, k, alpha, a, a_type, lda, stride_a, b, b_type, ldb,
        stride_b, beta, c, c_type, ldc, stride_c, batch, compute, algo,
    ) -> None:  # fmt: skip
        if a_type != b_type:
            raise ValueError("A and B of different types")
        a_dtype, c_dtype = _INVERSE_CUDA_R[a_type], _INVERSE_CUDA_R[c_type]
        reduced = not self.math_mode.get(handle, 0) & self.DISALLOW_REDUCED_PRECISION_REDUCTION
        if c_dtype in ("float16", "bfloat16") and reduced:
            raise ValueError(
                f"a {c_dtype} GEMM in a math mode that lets cuBLAS add partial sums in "
                f"{c_dtype}: set CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION"
            )
        call = GemmCall(transa, transb, m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c,
                        batch, False, a_dtype, c_dtype, compute)  # fmt: skip
        self.calls.append(call)
        scale = ctypes.c_double if a_dtype == "float64" else ctypes.c_float
        if scale.from_address(alpha).value != 1 or scale.from_address(beta).value != 0:
            raise ValueError("the backend asks for alpha 1 and beta 0")
        arrays = [self._array(pointer, dtype) for pointer, dtype in
                  ((a, a_dtype), (b, a_dtype), (c, c_dtype))]  # fmt: skip
        strided_gemm(call, arrays[0], 0, arrays[1], 0, arrays[2], 0)

    def _array(self, address: int, dtype: str) -> np.ndarray:
        itemsize = np.dtype(_numpy_dtype(dtype)).itemsize
        flat, offset = self.memory.find(address, itemsize)
        if offset % itemsize:
            raise ValueError(f"address {address:#x} is not aligned for {dtype}")
        usable = (flat.size - offset) // itemsize * itemsize
        return flat[offset : offset + usable].view(_numpy_dtype(dtype))


def _numpy_dtype(dtype: str) -> Any:
    from taskgraph import dtypes

    return dtypes.numpy_dtype(dtype)


class _Stream:
    """The default stream of the kernel-only stand-in: work runs when issued."""

    ptr = 0

    def synchronize(self) -> None:
        return None
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
    """CuPy's API as the backend calls it, over NumPy, with counted device memory
    (`cp.memory`, a `DeviceMemory`); see the module docstring. Copies between host and
    device (`cuda.runtime.memcpyAsync`) run at once."""
    memory = DeviceMemory()
    device_array = type("DeviceArray", (_DeviceArray,), {"memory": memory})

    def empty(shape, dtype=np.float64) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        buffer = memory.allocate(count * dtype.itemsize, "empty")
        return buffer.view(dtype).reshape(shape).view(device_array)

    def asarray(host) -> np.ndarray:
        host = np.asarray(host)
        array = empty(host.shape, host.dtype)
        array[...] = host
        return array

    class Memory:
        """`cupy.cuda.Memory`: `size` bytes straight from the device (no pool)."""

        def __init__(self, size: int):
            self.buffer = memory.allocate(size, "cuda.Memory", pool=False)
            self.ptr = self.buffer.ctypes.data
            self.size = size

    class MemoryPointer:
        """`cupy.cuda.MemoryPointer`: a memory and a byte offset; `+ n` moves it."""

        def __init__(self, mem: Memory, offset: int):
            self.mem, self.offset = mem, offset
            self.ptr = mem.ptr + offset

        def __add__(self, n: int):
            return MemoryPointer(self.mem, self.offset + n)

    def ndarray(shape, dtype, memptr) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        flat = memptr.mem.buffer[memptr.offset : memptr.offset + count * dtype.itemsize]
        return flat.view(dtype).reshape(shape).view(device_array)

    @contextlib.contextmanager
    def using_allocator(allocator):
        previous, memory.allocator = memory.allocator, allocator
        try:
            yield
        finally:
            memory.allocator = previous

    def counting(function: Callable, name: str) -> Callable:
        def call(*args, **kwargs):
            return memory.counted(function(*_plain(args), **_plain(kwargs)), f"cp.{name}")

        return call

    cp = SimpleNamespace(
        memory=memory,
        DeviceArray=device_array,
        ElementwiseKernel=ElementwiseKernel,
        ReductionKernel=ReductionKernel,
        ndarray=ndarray,
        empty=empty,
        zeros=lambda shape, dtype=np.float64: empty(shape, dtype),
        asarray=asarray,
        asnumpy=lambda array: np.array(
            array.view(np.ndarray) if isinstance(array, np.ndarray) else array
        ),  # fmt: skip
        int64=np.int64,
        cuda=SimpleNamespace(
            Memory=Memory,
            MemoryPointer=MemoryPointer,
            using_allocator=using_allocator,
            cublas=FakeCublas(memory),
            device=SimpleNamespace(get_cublas_handle=lambda: 1),
            runtime=FakeCudaRuntime(),
            get_current_stream=_Stream,
            memory=SimpleNamespace(OutOfMemoryError=MemoryError),
        ),
        uint8=np.uint8,
    )
    cupy_14 = {"argmax": _as_cupy_14(np.argmax), "argmin": _as_cupy_14(np.argmin),
               "partition": _partition_as_cupy_14}  # fmt: skip
    for name in ("matmul", "einsum", "concatenate", "transpose", "broadcast_to", "sum", "max",
                 "min", "prod", "maximum", "minimum", "exp", "log", "sqrt", "tanh", "abs",
                 "where", "argmax", "argmin", "partition"):  # fmt: skip
        setattr(cp, name, counting(cupy_14.get(name, getattr(np, name)), name))
    return cp


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
