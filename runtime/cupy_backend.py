"""The CuPy backend: plans executed on a CUDA GPU.

* The arena is one device allocation (`cupy.cuda.Memory`, outside any memory pool) of
  the bytes the plan uses, at most `budget` (`runtime.interpreter.arena_bytes`);
  tensors are `cupy.ndarray` views of it at their planned offsets (`memptr=arena +
  offset`).
* Host memory is one pinned (page-locked) buffer allocated up front and carved into
  the plans' host storages and the staging slots of device-side inputs and outputs
  (`runtime.hostmem`), so every transfer is an asynchronous copy and nothing is pinned
  per transfer. Weights of at least `in_place_min` bytes (1 MiB) are not copied into
  it: their pages are registered where the caller holds them (`cudaHostRegister`,
  read-only for a read-only memory map) and unregistered when the session closes. A
  copy moves a box of a host array (`copy_box`: all of it, the rows of a sliced
  weight, the box of a block in an output assembled on the host) straight between
  its place in the pinned buffer and the arena, as contiguous runs or 2D copies
  (`cudaMemcpyAsync` / `cudaMemcpy2DAsync`, see `runtime.boxcopy`): no contiguous
  host copy of a box is staged.
* Streams are non-blocking CUDA streams (compute, h2d, d2h); every cross-stream
  dependency is a `cupy.cuda.Event` recorded on one stream and waited on by another.
* Kernels write into arena views, and use no device memory outside the plan: matmul-
  shaped contractions are cuBLAS GEMMs (`gemmStridedBatchedEx`, float32 accumulation
  for 16-bit dtypes) reading the operands and writing the output where they are, with
  leading dimensions and batch strides (`runtime.contraction`); what no GEMM can read in
  place is copied into the task's workspace, a region of the arena the plan gives its
  apply (`runtime.workspace`). Joins and aggregations are `cupy.ElementwiseKernel` /
  `cupy.ReductionKernel` generated from the join's expression tree
  (`runtime.cuda_codegen`), cached per distinct expression, reading strided broadcast
  views in place – casts of integer weights and bfloat16 tensors included. The other op
  kinds are the fixed kernels of `runtime.cuda_codegen`: fills, copies for slices, views
  and concatenations, gathers (the error flag in the task's workspace), a deterministic
  scatter-add without atomics (its sort keys in the workspace), argmax/argmin and the
  k-th largest as reductions writing their output.
* bfloat16 tensors are `ml_dtypes.bfloat16` arrays, which CuPy 14 supports (its
  `bfloat16` kernel type, `cupy/bfloat16.cuh`, needs NumPy 2.1.2 or later); kernels
  read them as float and round once when storing, as the NumPy backend does.
* While a run issues work, CuPy's allocator refuses every request (`BackendError`
  naming the task): a CuPy call that would allocate a temporary is a bug, not memory
  taken behind the plan's back. What remains outside the arena is CUDA's own: the
  context, and cuBLAS's workspace (4 MiB a handle, 32 MiB on Hopper), as for any CUDA
  program.

Nothing here imports CuPy at module import time; creating a `CupyBackend` does, and
raises `BackendUnavailableError` with an install hint when CuPy or a GPU is missing.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from einpage_core.errors import BackendError, BackendUnavailableError, InputError, UnsupportedError
from einpage_core.units import format_bytes
from runtime import cuda_codegen
from runtime.backend import Backend, Event, Stream
from runtime.boxcopy import BoxRuns, issue_box_copy
from runtime.contraction import (
    COMPUTE_32F,
    COMPUTE_64F,
    CUDA_R,
    GemmCall,
    broadcast_operands,
    run_gemm,
)
from runtime.workspace import GATHER_FLAG, einsum_gemm, kernel_workspace
from taskgraph.dispatch import OpTable
from taskgraph.graph import TaskGraph
from taskgraph.nodes import (
    ArgReduce,
    Concat,
    Einsum,
    Fill,
    Gather,
    Input,
    KthLargest,
    ScatterAdd,
    Slice,
    Task,
    View,
)

__all__ = [
    "CupyBackend",
    "CupyKernels",
    "CublasGemm",
    "import_cupy",
    "evaluate_on_gpu",
    "INSTALL_HINT",
    "RETIRED_OPTIONS",
]

INSTALL_HINT = (
    "install CuPy for your CUDA version: pip install 'einpage[gpu]' (CUDA 12.x, "
    "cupy-cuda12x) or 'einpage[gpu-cuda13]' (CUDA 13.x, cupy-cuda13x)"
)


def import_cupy() -> Any:
    """CuPy, if it is installed and sees a CUDA device; else `BackendUnavailableError`."""
    try:
        import cupy
    except ImportError as err:
        raise BackendUnavailableError(
            f"backend 'cupy' needs CuPy, which is not installed ({err}); {INSTALL_HINT}; "
            "or use backend='numpy' (or 'auto', which picks CuPy only when a GPU is usable)"
        ) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        raise BackendUnavailableError(
            f"CuPy is installed but no CUDA GPU is usable here ({type(err).__name__}: {err}); "
            "use backend='numpy' or 'auto'"
        ) from None
    if count == 0:
        raise BackendUnavailableError(
            "CuPy is installed but sees no CUDA device; use backend='numpy' or 'auto'"
        )
    return cupy


# -- streams and events -----------------------------------------------------------


class CupyEvent(Event):
    """A recorded `cupy.cuda.Event`."""

    __slots__ = ("cp", "cuda")

    def __init__(self, cp: Any, cuda: Any):
        self.cp = cp
        self.cuda = cuda

    def synchronize(self) -> None:
        self.cuda.synchronize()

    def seconds_since(self, origin: Event) -> float:
        return self.cp.cuda.get_elapsed_time(origin.cuda, self.cuda) / 1e3  # type: ignore[attr-defined]


class CupyStream(Stream):
    """A non-blocking CUDA stream (it does not synchronize with the legacy default stream)."""

    def __init__(self, name: str, cp: Any):
        self.name = name
        self.cp = cp
        self.context = None
        self.cuda = cp.cuda.Stream(non_blocking=True)

    def __repr__(self) -> str:
        return f"<CupyStream {self.name} {self.cuda.ptr:#x}>"

    def record(self, timing: bool = False) -> Event:
        event = self.cp.cuda.Event(disable_timing=not timing)
        event.record(self.cuda)
        return CupyEvent(self.cp, event)

    def wait(self, event: Event) -> None:
        self.cuda.wait_event(event.cuda)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        self.cuda.synchronize()


# -- kernels ----------------------------------------------------------------------

KERNEL_OPTIONS = ("--fmad=false",)
"""NVRTC options of every generated kernel: no fused multiply-adds, so that `c * a + b`
rounds after the product and after the sum, as NumPy's operations (the NumPy backend's)
do, and a join's float32 value equals theirs bit for bit (on an H200, AdamW's moment
update differed in a quarter of its elements with CUDA's default contraction). The
kernels are bound by memory, not by their arithmetic."""

GEMM_DEFAULT = -1  # cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT
FLOAT32_REDUCTIONS = 16  # cublasMath_t CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION
"""The math mode of every GEMM: cuBLAS's default math (tensor cores for 16-bit operands,
no TF32 for float32 ones) with partial sums kept in the compute type. By default cuBLAS
may add a split-K GEMM's partial sums in the output's 16 bits, an extra rounding the
NumPy backend (float32 sums, rounded once) never makes."""


class CublasGemm:
    """`runtime.contraction.GemmCall`s as `cublasGemmStridedBatchedEx` through CuPy's
    bindings, on the current stream (CuPy sets the handle's stream to it), reading and
    writing device arrays at element offsets; alpha 1 and beta 0 in the compute type, on
    the host; each call in `FLOAT32_REDUCTIONS` math mode (set before it: CuPy's own
    routines may set the shared handle's mode to theirs)."""

    def __init__(self, cp: Any):
        self.cp = cp
        self.scalars = {  # alpha, beta in each compute type
            COMPUTE_32F: np.array([1.0, 0.0], dtype=np.float32),
            COMPUTE_64F: np.array([1.0, 0.0], dtype=np.float64),
        }

    def __call__(
        self, call: GemmCall, a: Any, a_offset: int, b: Any, b_offset: int, c: Any, c_offset: int
    ) -> None:
        cuda = self.cp.cuda
        scalars = self.scalars[call.compute]
        alpha = scalars.ctypes.data
        beta = alpha + scalars.itemsize
        handle = cuda.device.get_cublas_handle()
        cuda.cublas.setMathMode(handle, FLOAT32_REDUCTIONS)
        cuda.cublas.gemmStridedBatchedEx(
            handle,
            call.transa,
            call.transb,
            call.m,
            call.n,
            call.k,
            alpha,
            _address(a, a_offset),
            CUDA_R[call.a_dtype],
            call.lda,
            call.stride_a,
            _address(b, b_offset),
            CUDA_R[call.a_dtype],
            call.ldb,
            call.stride_b,
            beta,
            _address(c, c_offset),
            CUDA_R[call.c_dtype],
            call.ldc,
            call.stride_c,
            call.batch,
            call.compute,
            GEMM_DEFAULT,
        )


def _address(array: Any, offset: int) -> int:
    """The device address of element `offset` of a contiguous device array."""
    return array.data.ptr + offset * array.itemsize


class CupyKernels:
    """One task's kernel into an output view, by op kind; counts which path each took.

    `HANDLERS` holds the method of each op kind (an `OpTable`: complete at import).
    Generated kernels are built once per distinct (expression, dtypes) and cached;
    CuPy compiles each once per device and caches the binary on disk. `gemm` issues
    cuBLAS GEMMs (`CublasGemm`; a CPU stand-in in the tests). `current` is the task whose
    kernel is being issued (the backend's allocator names it).
    """

    def __init__(self, cp: Any, gemm: Callable[..., None] | None = None):
        self.cp = cp
        self.gemm = gemm if gemm is not None else CublasGemm(cp)
        self.counters: Counter[str] = Counter()
        self.flags: list[tuple[Task, np.ndarray]] = []
        self.current: Task | None = None
        self._elementwise: dict[cuda_codegen.ElementwiseSource, Any] = {}
        self._reduction: dict[cuda_codegen.ReductionSource, Any] = {}

    def run(self, task: Task, operands: Sequence[Any], out: Any, workspace: Any = None) -> None:
        """Issue `task`'s kernel on the current stream, writing `out`; `workspace` is the
        uint8 device array of its workspace (None when it has none)."""
        self.current = task
        needed = kernel_workspace(task, [(a.shape, a.dtype.name) for a in operands])
        held = 0 if workspace is None else workspace.size
        if held < needed:
            raise BackendError(
                f"task {task.line()} needs a kernel workspace of {needed} bytes but was given "
                f"{held}: its plan was made from a TaskGraph whose workspaces were not "
                "declared; plan runtime.declare_workspaces(tg) (einpage.compile does)"
            )
        self.HANDLERS.of(task.op)(self, task, operands, out, workspace)

    # -- cached kernels --

    def elementwise_kernel(self, source: cuda_codegen.ElementwiseSource) -> Any:
        kernel = self._elementwise.get(source)
        if kernel is None:
            kernel = self._elementwise[source] = self.cp.ElementwiseKernel(
                source.in_params,
                source.out_params,
                source.operation,
                source.name,
                preamble=source.preamble,
                options=KERNEL_OPTIONS,
            )
        return kernel

    def reduction_kernel(self, source: cuda_codegen.ReductionSource) -> Any:
        kernel = self._reduction.get(source)
        if kernel is None:
            kernel = self._reduction[source] = self.cp.ReductionKernel(
                source.in_params,
                source.out_params,
                source.map_expr,
                source.reduce_expr,
                source.post_map_expr,
                source.identity,
                source.name,
                reduce_type=source.reduce_type,
                preamble=source.preamble,
                options=KERNEL_OPTIONS,
            )
        return kernel

    def copy(self, source: Any, target: Any) -> None:
        """Copy the (strided) device array `source` into the view `target` (a kernel)."""
        self.elementwise_kernel(cuda_codegen.COPY.source)(source, target)
        self.counters["copy"] += 1

    # -- op kinds --

    def einsum(self, task: Task, operands: Sequence[Any], out: Any, workspace: Any) -> None:
        op: Einsum = task.op  # type: ignore[assignment]
        spec = op.spec
        gemm = einsum_gemm(task, [(a.shape, a.dtype.name) for a in operands])
        if gemm is not None:
            strided = [a.strides for a in (*operands, out) if not a.flags.c_contiguous]
            if strided:  # cuBLAS would read them at the wrong places
                raise BackendError(
                    f"task {task.line()}: its GEMMs read the operands and write the output as "
                    f"C-contiguous arrays (as the arena holds tensors), got strides {strided[0]}"
                )
            run_gemm(gemm, operands[0], operands[1], out, workspace, self.gemm, self.copy)
            self.counters["cublas"] += gemm.calls
            self.counters["gemm_workspace_copies"] += len(gemm.copies)
            return
        in_dtypes = [a.dtype.name for a in operands]
        if not cuda_codegen.supports(in_dtypes, task.dtype):
            raise UnsupportedError(
                f"task {task.line()}: no CUDA kernel computes {', '.join(in_dtypes)} -> "
                f"{task.dtype} on the cupy backend; run it with backend='numpy'"
            )
        views = broadcast_operands(spec, operands)
        if spec.reduced:
            source = cuda_codegen.reduction_source(op.join_expr, op.agg, in_dtypes, task.dtype)
            axes = tuple(range(len(spec.output), len(spec.indices)))
            self.reduction_kernel(source)(*views, axis=axes, out=out)
            self.counters["reduction_kernel"] += 1
        else:
            source = cuda_codegen.elementwise_source(op.join_expr, in_dtypes, task.dtype)
            self.elementwise_kernel(source)(*views, out)
            self.counters["elementwise_kernel"] += 1

    def fill(self, task: Task, operands: Sequence[Any], out: Any, workspace: Any) -> None:
        op: Fill = task.op  # type: ignore[assignment]
        kernel = self.elementwise_kernel(cuda_codegen.fill_source(task.dtype, op.pattern))
        if op.pattern == "full":
            kernel(float(op.value), out)
        else:
            origin = op.origin or (0,) * len(task.shape)
            rows, cols = task.shape[-2], task.shape[-1]
            kernel(float(op.value), origin[-2], origin[-1], rows, cols, out)
        self.counters["fill"] += 1

    def gather(self, task: Task, operands: Sequence[Any], out: Any, workspace: Any) -> None:
        """Rows of the table into `out`; an id out of range sets the flag (in the task's
        workspace), which is copied to the host right away and read after the run (on a
        GPU, a copy into pageable memory returns once done: the host waits for the gather
        here, which the flag's check needs anyway)."""
        cp = self.cp
        table, ids = operands
        row = math.prod(table.shape[1:])
        flag = workspace[:GATHER_FLAG].view(np.int64)
        flag.fill(0)
        gather = self.elementwise_kernel(cuda_codegen.GATHER.source)
        gather(table, ids, row, table.shape[0], out, flag)
        seen = np.zeros(2, dtype=np.int64)
        runtime = cp.cuda.runtime
        runtime.memcpyAsync(
            seen.ctypes.data,
            flag.data.ptr,
            GATHER_FLAG,
            runtime.memcpyDeviceToHost,
            cp.cuda.get_current_stream().ptr,
        )
        self.flags.append((task, seen))
        self.counters["gather"] += 1

    def slice(self, task: Task, operands: Sequence[Any], out: Any, workspace: Any) -> None:
        op: Slice = task.op  # type: ignore[assignment]
        box = tuple(slice(s, s + n) for s, n in zip(op.starts, task.shape, strict=True))
        self.copy(operands[0][box], out)

    def concat(self, task: Task, operands: Sequence[Any], out: Any, workspace: Any) -> None:
        """Each operand copied into its slice of `out` (CuPy's concatenate would allocate an
        array of pointers on the device)."""
        op: Concat = task.op  # type: ignore[assignment]
        axis = op.axis % len(task.shape)
        start = 0
        for operand in operands:
            size = operand.shape[axis]
            self.copy(operand, out[(slice(None),) * axis + (slice(start, start + size),)])
            start += size
        self.counters["concat"] += 1

    def view(self, task: Task, operands: Sequence[Any], out: Any, workspace: Any) -> None:
        self.copy(operands[0].reshape(task.shape), out)

    def scatter_add(self, task: Task, operands: Sequence[Any], out: Any, workspace: Any) -> None:
        """Deterministic, without atomics: the ids' sort keys (`cuda_codegen.SCATTER_KEYS`)
        sorted in the task's workspace (`cuda_codegen.scatter_add_workspace` bytes) by a
        bitonic sort, then each output element sums its row's sources in position order
        (`cuda_codegen.scatter_sum_source`), as numpy.add.at does."""
        op: ScatterAdd = task.op  # type: ignore[assignment]
        src, ids = operands
        nbytes = cuda_codegen.scatter_add_workspace(task, [src.shape, ids.shape])
        size = nbytes // 8
        if not size:  # no ids: every row is zero
            self.elementwise_kernel(cuda_codegen.fill_source(task.dtype, "full"))(0.0, out)
            self.counters["scatter_add"] += 1
            return
        keys = workspace[:nbytes].view(np.int64)
        make_keys = self.elementwise_kernel(cuda_codegen.SCATTER_KEYS.source)
        make_keys(ids, ids.size, op.start, task.shape[0], keys, size=size)
        step = self.elementwise_kernel(cuda_codegen.BITONIC_STEP.source)
        for k, j in cuda_codegen.bitonic_steps(size):
            step(k, j, keys, size=size)
        source = cuda_codegen.scatter_sum_source(task.dtype, src.dtype.name)
        self.elementwise_kernel(source)(src, keys, size, math.prod(task.shape[1:]), out)
        self.counters["scatter_add"] += 1

    def argreduce(self, task: Task, operands: Sequence[Any], out: Any, workspace: Any) -> None:
        """NumPy's argmax/argmin over the last axis, by a reduction of (value, position)
        pairs (`cuda_codegen.argreduce_source`) writing `out`: any dtype, deterministic."""
        op: ArgReduce = task.op  # type: ignore[assignment]
        source = cuda_codegen.argreduce_source(operands[0].dtype.name, op.agg)
        self.reduction_kernel(source)(operands[0], axis=-1, out=out)
        self.counters["argreduce"] += 1

    def kth_largest(self, task: Task, operands: Sequence[Any], out: Any, workspace: Any) -> None:
        """The k-th largest over the last axis by radix selection on keys kept in `out`
        (`cuda_codegen.kth_largest_sources`): one counting pass per bit, no temporary."""
        op: KthLargest = task.op  # type: ignore[assignment]
        kernels = cuda_codegen.kth_largest_sources(task.dtype)
        keys = out.view(kernels.key_dtype)
        self.elementwise_kernel(kernels.zero)(keys)
        count = self.reduction_kernel(kernels.count)
        for bit in kernels.bits:
            count(operands[0], op.k, out.size, bit, axis=-1, out=keys)
        self.elementwise_kernel(kernels.unkey)(keys)
        self.counters["kth_largest"] += 1

    HANDLERS: ClassVar[OpTable[Callable[[CupyKernels, Task, Sequence[Any], Any, Any], None]]]
    HANDLERS = OpTable(
        "CuPy kernels",
        {
            Einsum: einsum,
            Fill: fill,
            Gather: gather,
            Slice: slice,
            Concat: concat,
            View: view,
            ScatterAdd: scatter_add,
            ArgReduce: argreduce,
            KthLargest: kth_largest,
        },
        without={Input: "inputs are copied to the device, not computed"},
    )

    def check_flags(self) -> None:
        """After a run has finished: raise `InputError` for a gather that saw a bad id."""
        flags, self.flags = self.flags, []
        for task, seen in flags:
            flagged, bad = (int(x) for x in seen)
            if flagged:
                raise InputError(f"gather %{task.id}: id {bad} is out of range for its table")


# -- the backend ------------------------------------------------------------------

HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault
HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the device only reads it

STICKY_ERRORS = {
    700: "cudaErrorIllegalAddress (an illegal memory access)",
    714: "cudaErrorHardwareStackError",
    715: "cudaErrorIllegalInstruction",
    716: "cudaErrorMisalignedAddress (a misaligned load or store)",
    717: "cudaErrorInvalidAddressSpace",
    718: "cudaErrorInvalidPc",
    719: "cudaErrorLaunchFailure (a kernel faulted)",
    710: "cudaErrorAssert (a device-side assert)",
    214: "cudaErrorECCUncorrectable",
}
"""CUDA errors that lose the context (the runtime's and the driver's codes agree):
after one, every CUDA call in the process fails with it, and the device must be reset."""


RETIRED_OPTIONS = {
    "scratch": "kernels no longer use device memory outside the plan: a task whose kernel "
    "needs a workspace declares it before planning (runtime.declare_workspaces, which "
    "einpage.compile runs), and the plan holds it within the budget; drop the option "
    "(raise the budget if a plan needs more)",
}
"""Options the CuPy backend once took, with why they are gone (a `BackendError` says it)."""


def _unsupported_dtypes(numpy_version: str) -> dict[str, str]:
    """What this backend refuses with NumPy `numpy_version`: nothing from NumPy 2.1.2
    on; before it, bfloat16 (CuPy 14 gives `ml_dtypes.bfloat16` arrays a kernel type
    only from NumPy 2.1.2 on: `cupy._core._scalar`).

    >>> _unsupported_dtypes("2.4.0"), sorted(_unsupported_dtypes("1.26.4"))
    ({}, ['bfloat16'])
    """
    if np.lib.NumpyVersion(numpy_version) >= "2.1.2":
        return {}
    return {
        "bfloat16": f"CuPy 14 runs bfloat16 (ml_dtypes') arrays only with NumPy 2.1.2 or later, "
        f"and NumPy {numpy_version} is installed: upgrade NumPy, or run it with "
        "backend='numpy', or build the program in float16 (load the checkpoint with "
        "dtype='float16')"
    }


class CupyBackend(Backend):
    """Plans executed with CuPy on a CUDA GPU (see the module docstring).

    Option: `device`, the CUDA device id (default: the current device).
    """

    name = "cupy"
    OPTIONS = ("device",)
    RETIRED = RETIRED_OPTIONS
    default_mode = "streams"
    host_staging = True
    clock = "cuda"
    unsupported_dtypes = _unsupported_dtypes(np.__version__)

    def __init__(self, device: int | None = None):
        cp = import_cupy()
        self.cp = cp
        self.device = cp.cuda.Device(cp.cuda.runtime.getDevice() if device is None else device)
        self.kernels = CupyKernels(cp)

    def __repr__(self) -> str:
        return f"<CupyBackend device={self.device.id}>"

    def check_plan(self, mg: Any) -> None:
        """`BackendError` naming the first task whose kernel needs more workspace than its
        plan holds (a plan of a TaskGraph whose workspaces were not declared), before
        anything is allocated."""
        tg = mg.taskgraph
        for task in tg:
            if not task.is_compute:
                continue
            needed = kernel_workspace(task, [(tg[i].shape, tg[i].dtype) for i in task.inputs])
            if needed > task.workspace:
                raise BackendError(
                    f"task {task.line()} needs a kernel workspace of {format_bytes(needed)} "
                    f"({needed} bytes) on the cupy backend, but its plan holds "
                    f"{task.workspace} bytes: plan runtime.declare_workspaces(tg) instead of "
                    "tg (einpage.compile declares them), so that the budget covers it"
                )

    def allocate_arena(self, nbytes: int) -> Any:
        cp = self.cp
        with self.device:
            try:
                memory = cp.cuda.Memory(max(nbytes, 1))
            except (cp.cuda.memory.OutOfMemoryError, cp.cuda.runtime.CUDARuntimeError) as err:
                free, total = cp.cuda.runtime.memGetInfo()
                raise BackendError(
                    f"cannot allocate the arena of {format_bytes(nbytes)} ({nbytes} bytes) on "
                    f"GPU {self.device.id}: {format_bytes(free)} of {format_bytes(total)} is free "
                    f"({type(err).__name__}: {err}); plan for a smaller budget"
                ) from None
            return cp.cuda.MemoryPointer(memory, 0)

    def allocate_host(self, nbytes: int) -> np.ndarray:
        """`nbytes` of page-locked memory, allocated once for the session outside CuPy's
        pinned-memory pool, so that it is returned to the system when the session's
        buffer is dropped (a pool would keep it for the process's lifetime)."""
        cp = self.cp
        with self.device:
            try:
                memory = cp.cuda.PinnedMemory(max(nbytes, 1))
            except cp.cuda.runtime.CUDARuntimeError as err:
                raise BackendError(
                    f"cannot allocate {format_bytes(nbytes)} ({nbytes} bytes) of pinned host "
                    f"memory ({type(err).__name__}: {err}); see runtime.pinned_bytes(plan)"
                ) from None
            pointer = cp.cuda.PinnedMemoryPointer(memory, 0)
            return np.ndarray((max(nbytes, 1),), dtype=np.uint8, buffer=pointer)[:nbytes]

    in_place_min = 1 << 20
    """Weights of at least 1 MiB are registered where they are rather than copied: below
    that a copy costs less than a registration (a driver call that locks whole pages)."""

    def register_host(self, pointer: int, nbytes: int, read_only: bool) -> bool:
        """`cudaHostRegister` of the pages at `pointer` (read-only for memory that cannot
        be written); False when the driver refuses (the session then copies)."""
        runtime = self.cp.cuda.runtime
        flags = HOST_REGISTER_READ_ONLY if read_only else HOST_REGISTER_DEFAULT
        with self.device:
            try:
                runtime.hostRegister(pointer, nbytes, flags)
            except runtime.CUDARuntimeError as err:
                if self.lost_context(err) is not None:
                    raise
                return False
        return True

    def unregister_host(self, pointer: int) -> None:
        with self.device:
            self.cp.cuda.runtime.hostUnregister(pointer)

    def lost_context(self, error: BaseException) -> str | None:
        """A sticky CUDA error – an illegal address, a kernel fault, a failed launch –
        after which every call in this process fails; read from the error's status
        (CuPy's runtime and driver errors carry the CUDA error code)."""
        status = getattr(error, "status", None)
        if not isinstance(status, int) or status not in STICKY_ERRORS:
            return None
        return f"CUDA error {status}, {STICKY_ERRORS[status]}"

    def view(self, arena: Any, offset: int, shape: tuple[int, ...], dtype: str) -> Any:
        return self.cp.ndarray(shape, dtype=dtype, memptr=arena + offset)

    def stream(self, name: str, concurrent: bool) -> Stream:
        with self.device:
            return CupyStream(name, self.cp)

    def copy_box(
        self,
        host: np.ndarray,
        starts: Sequence[int],
        device: Any,
        direction: str,
        stream: Stream,
    ) -> None:
        """The box's runs (`runtime.boxcopy`) as asynchronous copies on `stream`, straight
        between the host array (pinned: a slot of the host buffer) and the arena."""
        runs = box_runs(host, starts, device)
        cuda = stream.cuda  # type: ignore[attr-defined]
        issue_box_copy(
            self.cp.cuda.runtime, runs, host.ctypes.data, device.data.ptr, direction, cuda.ptr
        )

    def compute(
        self, task: Task, operands: Sequence[Any], out: Any, stream: Stream, workspace: Any = None
    ) -> None:
        with stream.cuda:  # type: ignore[attr-defined]
            self.kernels.run(task, operands, out, workspace)

    def fill_bytes(self, view: Any, value: int, stream: Stream) -> None:
        with stream.cuda:  # type: ignore[attr-defined]
            view.fill(value)

    def _refuse(self, size: int) -> Any:
        """CuPy's allocator while a run issues work: every request is an error naming the
        task, for nothing may take device memory behind the plan's back."""
        task = self.kernels.current
        where = f"task {task.line()}" if task is not None else "the run"
        raise BackendError(
            f"{where} asked CuPy for {format_bytes(size)} ({size} bytes) of device memory "
            "outside the plan; every kernel must use the arena alone (its operands, its "
            "output and its declared workspace): this is a bug of the cupy backend"
        )

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self.kernels.counters.clear()
        self.kernels.flags.clear()
        self.kernels.current = None
        with self.device, self.cp.cuda.using_allocator(self._refuse):
            yield
        self.kernels.current = None
        self.kernels.check_flags()

    def memory_report(self, arena_bytes: int) -> dict[str, Any]:
        """The arena is all the device memory a run takes (kernels allocate nothing):
        `device_peak_bytes` is its size. CUDA's context and cuBLAS's workspace are not
        counted."""
        return {"arena_bytes": arena_bytes, "device_peak_bytes": arena_bytes}

    def counters(self) -> dict[str, int]:
        return dict(self.kernels.counters)


def box_runs(host: np.ndarray, starts: Sequence[int], device: Any) -> BoxRuns:
    """The runs of the box of `host` at `starts` of `device`'s shape, after checking that
    both arrays are C-contiguous, of one dtype, and that the box lies inside `host`."""
    if not host.flags.c_contiguous or not device.flags.c_contiguous:
        raise BackendError(
            f"a box copy needs C-contiguous arrays (host: {host.flags.c_contiguous}, "
            f"device: {device.flags.c_contiguous})"
        )
    if np.dtype(host.dtype) != np.dtype(device.dtype):
        raise BackendError(f"a box copy between {host.dtype} (host) and {device.dtype} (device)")
    return BoxRuns.of(host.shape, host.itemsize, starts, device.shape)


def evaluate_on_gpu(
    tg: TaskGraph, inputs: Mapping[str, Any], kernels: CupyKernels | None = None
) -> dict[str, np.ndarray]:
    """Plain CuPy execution without a plan (the benchmark's baseline): every input uploaded
    first, every task its own allocation (and its kernel's workspace), the same kernels as
    the backend (`kernels`, whose `cp` may be any module with CuPy's interface)."""
    kernels = kernels or CupyKernels(import_cupy())
    cp = kernels.cp
    tg.check_inputs(inputs)
    values: dict[int, Any] = {}
    for task in tg.tasks:
        if isinstance(task.op, Input):
            values[task.id] = cp.asarray(inputs[task.op.name])
        elif task.op.aliases_input:
            values[task.id] = values[task.inputs[0]].reshape(task.shape)
        else:
            out = cp.empty(task.shape, dtype=task.dtype)
            operands = [values[i] for i in task.inputs]
            size = kernel_workspace(task, [(a.shape, a.dtype.name) for a in operands])
            workspace = cp.empty(size, dtype=np.uint8) if size else None
            kernels.run(task, operands, out, workspace)
            values[task.id] = out
    cp.cuda.get_current_stream().synchronize()  # the gather flags' copies have landed
    kernels.check_flags()
    return {name: cp.asnumpy(values[i]) for name, i in tg.outputs.items()}
