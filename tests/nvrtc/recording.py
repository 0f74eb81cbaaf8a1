"""Which kernels the CuPy backend would compile for a program, found without a GPU.

`kernel_sources(tg)` runs the backend's `CupyKernels` over every task of `tg` with a
stand-in `cp` module: NumPy for the library calls (matmuls, copies, argmax, ...) and,
for `ElementwiseKernel` / `ReductionKernel`, recorders that describe each call's
arguments as CuPy would (dtype, ndim after merging contiguous dimensions, contiguity,
32-bit indexing) and render the source CuPy compiles (`cupy_source`). Kernel
outputs are left as they are (zeros): only the sources matter here. cuBLAS GEMMs are
not compiled by CuPy: they are skipped (the copies a GEMM makes in its workspace are
generated kernels, recorded).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import cupy_source
import numpy as np

from runtime.cupy_backend import CupyKernels, evaluate_on_gpu
from taskgraph import TaskGraph
from taskgraph.nodes import Input


def _arg(array_or_scalar: Any, param: cupy_source.Param, merge: bool) -> cupy_source.Arg:
    """CuPy's description of one argument (`merge`: contiguous arrays become 1-D)."""
    if isinstance(array_or_scalar, np.ndarray):
        a = array_or_scalar
        small = a.size < 2**31
        if merge and not param.raw and a.flags.c_contiguous:
            return cupy_source.Arg(a.dtype.name, 1, True, small)
        return cupy_source.Arg(a.dtype.name, a.ndim, bool(a.flags.c_contiguous), small)
    if len(param.type) > 1:
        return cupy_source.Arg(param.type)
    return cupy_source.Arg(np.asarray(array_or_scalar).dtype.name)


def recording_cupy(sources: set[str]) -> Any:
    """A `cp` stand-in whose kernels add the source CuPy would compile to `sources`."""

    class ElementwiseKernel:
        def __init__(self, in_params, out_params, operation, name="kernel", preamble="", **_):
            self.spec = (in_params, out_params, operation, name, preamble)
            self.params = cupy_source.parse_params(in_params, True) + cupy_source.parse_params(
                out_params, False
            )

        def __call__(self, *args, size=None):
            arrays = [a for p, a in zip(self.params, args, strict=True)
                      if not p.raw and isinstance(a, np.ndarray)]  # fmt: skip
            merge = all(a.flags.c_contiguous and a.strides != () for a in arrays) and (
                len({a.shape for a in arrays}) <= 1
            )
            shape = np.broadcast_shapes(*(a.shape for a in arrays)) if arrays else ()
            ndim = 1 if merge else max(len(shape), 1)
            described = [_arg(a, p, merge) for p, a in zip(self.params, args, strict=True)]
            in_params, out_params, operation, name, preamble = self.spec
            sources.add(
                cupy_source.elementwise_code(
                    in_params, out_params, operation, name, described, preamble, ndim
                )
            )

    class ReductionKernel:
        def __init__(self, in_params, out_params, map_expr, reduce_expr, post_map_expr,  # noqa: PLR0913
                     identity, name="reduce", reduce_type=None, preamble="", **_):  # fmt: skip
            self.spec = (in_params, out_params, map_expr, reduce_expr, post_map_expr, identity,
                         name, reduce_type, preamble)  # fmt: skip
            self.params = cupy_source.parse_params(in_params, True) + cupy_source.parse_params(
                out_params, False
            )

        def __call__(self, *args, axis, out):
            shape = np.broadcast_shapes(*(a.shape for a in args if isinstance(a, np.ndarray)))
            axes = axis if isinstance(axis, tuple) else (axis,)
            described = [_arg(a, p, False) for p, a in zip(self.params, [*args, out], strict=True)]
            (in_params, out_params, map_expr, reduce_expr, post_map_expr, identity, name,
             reduce_type, preamble) = self.spec  # fmt: skip
            sources.add(
                cupy_source.reduction_code(
                    in_params, out_params, map_expr, reduce_expr, post_map_expr, identity,
                    name, described, reduce_type, preamble,
                    in_ndim=len(shape), out_ndim=max(len(shape) - len(axes), 1),
                )
            )  # fmt: skip

    class RecordingCupy:
        """NumPy under CuPy's names, with the recording kernel classes."""

        def __getattr__(self, name: str) -> Any:
            return getattr(np, name)

    class DeviceArray(np.ndarray):
        @property
        def data(self) -> Any:  # CuPy's: `.data.ptr` is the address
            return SimpleNamespace(ptr=self.ctypes.data)

    stream = SimpleNamespace(ptr=0, synchronize=lambda: None)
    cp = RecordingCupy()
    cp.ElementwiseKernel = ElementwiseKernel
    cp.ReductionKernel = ReductionKernel
    # kernels leave outputs alone: keep them defined
    cp.empty = lambda shape, dtype=np.float64: np.zeros(shape, dtype).view(DeviceArray)
    cp.asarray = lambda host: np.array(host).view(DeviceArray)
    cp.asnumpy = np.asarray
    cp.cuda = SimpleNamespace(  # a gather's flag copy; GEMMs are cuBLAS's, not compiled here
        runtime=SimpleNamespace(memcpyAsync=lambda *args: None, memcpyDeviceToHost=2),
        get_current_stream=lambda: stream,
    )
    return cp


def kernel_sources(tg: TaskGraph) -> set[str]:
    """The CUDA sources of every generated kernel the CuPy backend would launch for `tg`."""
    sources: set[str] = set()
    inputs = {
        t.op.name: np.zeros(t.shape, dtype=t.dtype) for t in tg.tasks if isinstance(t.op, Input)
    }
    kernels = CupyKernels(recording_cupy(sources), gemm=lambda *call: None)
    evaluate_on_gpu(tg, inputs, kernels)
    return sources
