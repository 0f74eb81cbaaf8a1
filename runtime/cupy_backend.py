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
* Kernels write into arena views: matmul-shaped contractions through cuBLAS
  (`cupy.matmul(..., out=view)` after free reshapes), joins and aggregations through
  `cupy.ElementwiseKernel` / `cupy.ReductionKernel` generated from the join's
  expression tree (`runtime.cuda_codegen`) and cached per distinct expression, and
  the rest through counted fallbacks (`cupy.einsum` into a temporary, then a copy).
* Temporary device memory kernels need comes from a private CuPy memory pool capped
  at `scratch` bytes (default 256 MiB); a run reports the true peak as the arena
  plus the pool's high-water mark (bytes the pool held from the device), so
  peak <= budget + scratch. cuBLAS's own workspace and the CUDA context are outside
  both (as for any CUDA program).

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

from einpage_core.errors import BackendError, BackendUnavailableError, InputError
from einpage_core.units import format_bytes, parse_bytes
from runtime import cuda_codegen
from runtime.backend import Backend, Event, Stream
from runtime.boxcopy import BoxRuns, issue_box_copy
from runtime.contraction import broadcast_operands, evaluate_einsum, matmul_into, matmul_plan
from taskgraph.dispatch import OpTable
from taskgraph.evaluate import compute_dtype
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

__all__ = ["CupyBackend", "CupyKernels", "import_cupy", "evaluate_on_gpu", "INSTALL_HINT"]

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

_CAUSAL_FILL = (
    "float64 value, int64 row0, int64 col0, int64 rows, int64 cols",
    "T out",
    "const ptrdiff_t c = i % cols; const ptrdiff_t r = (i / cols) % rows;"
    " out = (col0 + c > row0 + r) ? (T)value : (T)0;",
    "einpage_causal_fill",
)
_GATHER = (  # the flag is an output: CuPy declares every input const
    "raw T table, raw I ids, int64 row, int64 rows",
    "T out, raw int64 flag",
    "const long long id = (long long)ids[i / row];"
    " if (id < 0 || id >= rows) { flag[0] = 1; flag[1] = id; out = (T)0; }"
    " else { out = table[id * row + i % row]; }",
    "einpage_gather",
)

_SCATTER_ADD = (
    "T src, raw I ids, int64 row, int64 start, int64 rows",
    "raw T out",
    "const long long r = (long long)ids[i / row] - start;"
    " if (r >= 0 && r < rows) { atomicAdd(&out[r * row + i % row], src); }",
    "einpage_scatter_add",
)


class CupyKernels:
    """One task's kernel into an output view, by op kind; counts which path each took.

    `HANDLERS` holds the method of each op kind (an `OpTable`: complete at import).
    Generated kernels are built once per distinct (expression, dtypes) and cached;
    CuPy compiles each once per device and caches the binary on disk.
    """

    def __init__(self, cp: Any):
        self.cp = cp
        self.counters: Counter[str] = Counter()
        self.flags: list[tuple[Task, Any]] = []
        self._elementwise: dict[cuda_codegen.ElementwiseSource, Any] = {}
        self._reduction: dict[cuda_codegen.ReductionSource, Any] = {}
        self._fixed: dict[str, Any] = {}

    def run(self, task: Task, operands: Sequence[Any], out: Any) -> None:
        """Issue `task`'s kernel on the current stream, writing `out`."""
        self.HANDLERS.of(task.op)(self, task, operands, out)

    # -- cached kernels --

    def _fixed_kernel(self, spec: tuple[str, str, str, str]) -> Any:
        kernel = self._fixed.get(spec[3])
        if kernel is None:
            kernel = self._fixed[spec[3]] = self.cp.ElementwiseKernel(*spec)
        return kernel

    def elementwise_kernel(self, source: cuda_codegen.ElementwiseSource) -> Any:
        kernel = self._elementwise.get(source)
        if kernel is None:
            kernel = self._elementwise[source] = self.cp.ElementwiseKernel(
                source.in_params,
                source.out_params,
                source.operation,
                source.name,
                preamble=source.preamble,
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
            )
        return kernel

    # -- op kinds --

    def einsum(self, task: Task, operands: Sequence[Any], out: Any) -> None:
        cp = self.cp
        op: Einsum = task.op  # type: ignore[assignment]
        spec = op.spec
        same_dtype = all(a.dtype == out.dtype for a in operands)
        if op.is_plain and len(operands) == 2 and same_dtype:
            plan = matmul_plan(spec, [a.shape for a in operands])
            if plan is not None:
                in_place = matmul_into(cp, plan, operands[0], operands[1], out)
                self.counters["cublas" if in_place else "cublas_via_temporary"] += 1
                return
            if spec.reduced:  # an index reduced from one operand: not one matmul
                work = compute_dtype(task.dtype)
                out[...] = cp.einsum(str(spec), *(a.astype(work, copy=False) for a in operands))
                self.counters["einsum_fallback"] += 1
                return
        in_dtypes = [a.dtype.name for a in operands]
        if not cuda_codegen.supports(in_dtypes, task.dtype):
            out[...] = evaluate_einsum(cp, task, operands)
            self.counters["generic_fallback"] += 1
            return
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

    def fill(self, task: Task, operands: Sequence[Any], out: Any) -> None:
        op: Fill = task.op  # type: ignore[assignment]
        self.counters["fill"] += 1
        if op.pattern == "full":
            out.fill(op.value)
            return
        origin = op.origin or (0,) * len(task.shape)
        rows, cols = task.shape[-2], task.shape[-1]
        kernel = self._fixed_kernel(_CAUSAL_FILL)
        kernel(float(op.value), origin[-2], origin[-1], rows, cols, out)

    def gather(self, task: Task, operands: Sequence[Any], out: Any) -> None:
        table, ids = operands
        row = math.prod(table.shape[1:])
        flag = self.cp.zeros(2, dtype=self.cp.int64)
        self._fixed_kernel(_GATHER)(table, ids, row, table.shape[0], out, flag)
        self.flags.append((task, flag))
        self.counters["gather"] += 1

    def slice(self, task: Task, operands: Sequence[Any], out: Any) -> None:
        op: Slice = task.op  # type: ignore[assignment]
        box = tuple(slice(s, s + n) for s, n in zip(op.starts, task.shape, strict=True))
        out[...] = operands[0][box]
        self.counters["copy"] += 1

    def concat(self, task: Task, operands: Sequence[Any], out: Any) -> None:
        op: Concat = task.op  # type: ignore[assignment]
        self.cp.concatenate(list(operands), axis=op.axis, out=out)
        self.counters["concat"] += 1

    def view(self, task: Task, operands: Sequence[Any], out: Any) -> None:
        out[...] = operands[0].reshape(task.shape)
        self.counters["copy"] += 1

    def scatter_add(self, task: Task, operands: Sequence[Any], out: Any) -> None:
        op: ScatterAdd = task.op  # type: ignore[assignment]
        src, ids = operands
        work = compute_dtype(task.dtype)  # float16 sums in float32, as the reference does
        acc = out if out.dtype.name == work else self.cp.zeros(out.shape, dtype=work)
        acc.fill(0)
        row = math.prod(task.shape[1:])
        kernel = self._fixed_kernel(_SCATTER_ADD)
        kernel(src.astype(work, copy=False), ids, row, op.start, task.shape[0], acc)
        if acc is not out:
            out[...] = acc
        self.counters["scatter_add"] += 1

    def argreduce(self, task: Task, operands: Sequence[Any], out: Any) -> None:
        op: ArgReduce = task.op  # type: ignore[assignment]
        pick = self.cp.argmax if op.agg == "argmax" else self.cp.argmin
        out[...] = pick(operands[0], axis=-1)
        self.counters["argreduce"] += 1

    def kth_largest(self, task: Task, operands: Sequence[Any], out: Any) -> None:
        op: KthLargest = task.op  # type: ignore[assignment]
        at = operands[0].shape[-1] - op.k  # the k-th largest is the (n-k)-th smallest
        out[...] = self.cp.partition(operands[0], at, axis=-1)[..., at]
        self.counters["kth_largest"] += 1

    HANDLERS: ClassVar[OpTable[Callable[[CupyKernels, Task, Sequence[Any], Any], None]]]
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
        for task, flag in flags:
            seen, bad = (int(x) for x in self.cp.asnumpy(flag))
            if seen:
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


class CupyBackend(Backend):
    """Plans executed with CuPy on a CUDA GPU (see the module docstring).

    Options: `scratch` (bytes or a size string, default "256MiB"): the most device
    memory kernels may use beyond the arena for temporaries; `device`: the CUDA
    device id (default: the current device).
    """

    name = "cupy"
    OPTIONS = ("scratch", "device")
    default_mode = "streams"
    host_staging = True
    clock = "cuda"
    unsupported_dtypes = {
        "bfloat16": "CuPy has no bfloat16 dtype, and this backend has neither raw 16-bit "
        "bfloat16 kernels nor a cuBLAS bf16 GEMM; run it with backend='numpy', or build "
        "the program in float16 (load the checkpoint with dtype='float16')",
    }

    def __init__(self, scratch: int | str = "256MiB", device: int | None = None):
        cp = import_cupy()
        self.cp = cp
        self.scratch_limit = parse_bytes(scratch)
        if self.scratch_limit <= 0:
            raise BackendError(f"scratch must be a positive size, got {scratch!r}")
        self.device = cp.cuda.Device(cp.cuda.runtime.getDevice() if device is None else device)
        with self.device:
            self.pool = cp.cuda.MemoryPool()
            self.pool.set_limit(size=self.scratch_limit)
        self.kernels = CupyKernels(cp)
        self._scratch_peak = 0

    def __repr__(self) -> str:
        return f"<CupyBackend device={self.device.id} scratch={format_bytes(self.scratch_limit)}>"

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

    def compute(self, task: Task, operands: Sequence[Any], out: Any, stream: Stream) -> None:
        with stream.cuda:  # type: ignore[attr-defined]
            self.kernels.run(task, operands, out)

    def fill_bytes(self, view: Any, value: int, stream: Stream) -> None:
        with stream.cuda:  # type: ignore[attr-defined]
            view.fill(value)

    def _malloc(self, size: int) -> Any:
        try:
            memory = self.pool.malloc(size)
        except self.cp.cuda.memory.OutOfMemoryError:
            raise BackendError(
                f"a kernel needs {format_bytes(size)} of temporary device memory beyond the "
                f"arena, but the scratch area of {format_bytes(self.scratch_limit)} has "
                f"{format_bytes(self.pool.total_bytes())} in use: raise scratch= (e.g. "
                "runtime.run(..., scratch='1GiB')) or partition the program"
            ) from None
        self._scratch_peak = max(self._scratch_peak, self.pool.total_bytes())
        return memory

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self._scratch_peak = self.pool.total_bytes()
        self.kernels.counters.clear()
        self.kernels.flags.clear()
        with self.device, self.cp.cuda.using_allocator(self._malloc):
            yield
            self.kernels.check_flags()

    def memory_report(self, arena_bytes: int) -> dict[str, Any]:
        return {
            "arena_bytes": arena_bytes,
            "scratch_peak_bytes": self._scratch_peak,
            "scratch_limit": self.scratch_limit,
            "device_peak_bytes": arena_bytes + self._scratch_peak,
        }

    def counters(self) -> dict[str, int]:
        return dict(self.kernels.counters)

    def close(self) -> None:
        with self.device:
            self.pool.free_all_blocks()


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
    first, every task its own allocation, the same kernels as the backend (`kernels`, whose
    `cp` may be any module with CuPy's interface)."""
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
            kernels.run(task, [values[i] for i in task.inputs], out)
            values[task.id] = out
    kernels.check_flags()  # copies the flags to the host: waits for the kernels
    return {name: cp.asnumpy(values[i]) for name, i in tg.outputs.items()}
