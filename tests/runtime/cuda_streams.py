"""A CPU stand-in for the CUDA side of CuPy that the whole `CupyBackend` uses (tests only).

`StandInCupyBackend` is the real `CupyBackend` – its arena, pinned host buffer, streams,
events, box copies and kernels – over `standin_cupy()`, which mimics the CuPy API it
calls, asynchronously as a GPU does:

* device memory is `cpu_cuda.fake_cupy`'s, counted (`cp.memory`: the arena, and any
  array a CuPy call would make, refused during a run): one NumPy byte buffer per
  `cuda.Memory`; `MemoryPointer` does pointer arithmetic; `ndarray(shape, dtype,
  memptr)` is a NumPy view there (whose `.data.ptr` is its address, as a CuPy array's);
* `cuda.Stream(non_blocking=True)` is a worker thread with a queue; `Event.record`
  enqueues a marker, `Stream.wait_event` makes the worker wait for it, `synchronize`
  waits for the queue, `launch_host_func` queues a host function (in which a CUDA call
  fails, as CUDA forbids it); `cuda.PinnedMemory` is host memory whose allocations are
  recorded;
* `runtime.memcpyAsync` / `memcpy2DAsync` are queued on their stream and happen later,
  after a random delay (`delay` seconds at most, from `seed`);
* kernels (the g++-compiled `cpu_cuda` ones, NumPy for the rest) run on the stream the
  backend launched them on, in its order: the backend's `compute` and `fill_bytes` are
  queued on that stream's worker, as a kernel launch is.

So a missing `wait_event`, a copy on the wrong stream or a read of a buffer before its
copy lands gives a wrong answer here, as it would on a GPU. Kernels run in every dtype
(`cpu_cuda`'s host classes stand for CuPy's float16 and bfloat16).

Host memory and faults, as CUDA has them:

* `cp.device_allocations` lists every `cuda.Memory` made (the arena among them),
  `cp.pinned` every `cuda.PinnedMemory`; `runtime.hostRegister` / `hostUnregister`
  page-lock memory in place (`cp.registered` holds what is registered now, by address;
  `cp.registrations` every call), refusing, as the driver does, a range that shares a
  page with one registered already (`cudaErrorHostMemoryAlreadyRegistered`) and an
  unregistration of an address never registered;
* a kernel fault (`StandInCupyBackend(fault_at=task id)`: an illegal address in that
  task's kernel) is *sticky*: it happens when the kernel runs on its stream's worker,
  later than its launch, and from then on every call – a launch, a copy, an event, a
  synchronization, on any stream – raises it (`CUDARuntimeError`, status 700), as a lost
  CUDA context does.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import random
import threading
import time
from types import SimpleNamespace

from cpu_cuda import fake_cupy

from runtime.cupy_backend import CupyBackend, CupyKernels


class CUDARuntimeError(RuntimeError):
    """`cupy.cuda.runtime.CUDARuntimeError`: a CUDA error code (`status`) and its name."""

    NAMES = {
        700: "cudaErrorIllegalAddress: an illegal memory access was encountered",
        712: "cudaErrorHostMemoryAlreadyRegistered: part or all of the requested memory "
        "range is already mapped",
        713: "cudaErrorHostMemoryNotRegistered: pointer does not correspond to a "
        "registered memory region",
        800: "cudaErrorNotPermitted: operation not permitted (a CUDA call in a host function)",
    }

    def __init__(self, status: int):
        super().__init__(self.NAMES.get(status, f"cudaError {status}"))
        self.status = status


HOST_FUNCTION = threading.local()
"""`active` while a stream's worker runs a host function (`launch_host_func`)."""


class Context:
    """The CUDA context's sticky error: once set, every call raises it. A call from a host
    function fails too, as CUDA forbids it (`cudaErrorNotPermitted`)."""

    def __init__(self) -> None:
        self.error: CUDARuntimeError | None = None

    def check(self) -> None:
        if getattr(HOST_FUNCTION, "active", False):
            raise CUDARuntimeError(800)
        if self.error is not None:
            raise CUDARuntimeError(self.error.status)


CONTEXT = Context()
"""The one context of the stand-in's streams (reset by `standin_cupy`)."""
class StandInStream:
    """`cupy.cuda.Stream(non_blocking=True)`: work runs in order on a worker thread.
    `with stream:` makes it the thread's current stream (`current_stream()`), as CuPy's."""

    _ptrs = itertools.count(0x1000, 0x10)
    by_ptr: dict[int, StandInStream] = {}
    current = threading.local()

    def __init__(self, non_blocking: bool = True):
        self.ptr = next(self._ptrs)
        self.by_ptr[self.ptr] = self
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.worker = threading.Thread(target=self._work, daemon=True)
        self.worker.start()

    def _work(self) -> None:
        while True:
            job = self.queue.get()
            try:
                if job is None:
                    return
                if CONTEXT.error is not None:  # a lost context runs nothing more
                    self.error = self.error or CUDARuntimeError(CONTEXT.error.status)
                if self.error is None or getattr(job, "after_failure", False):
                    job()  # after a failure only events fire: nothing waits forever
            except BaseException as err:  # noqa: BLE001 (reported on synchronize)
                self.error = err
            finally:
                self.queue.task_done()

    def submit(self, job) -> None:
        """Queue `job`; issued from this stream's own work (a kernel's launch issuing a copy
        on its stream), it runs now: next in the stream's order, as on a GPU. A call after
        a fault fails, as every CUDA call then does."""
        CONTEXT.check()
        if threading.current_thread() is self.worker:
            job()
            return
        self.queue.put(job)

    def launch_host_func(self, callback, arg) -> None:
        """`Stream.launch_host_func`: `callback(arg)` runs on the host in the stream's
        order – after the work queued before it, before the work queued after it – and
        makes no CUDA call (one fails, as on a GPU)."""

        def job() -> None:
            HOST_FUNCTION.active = True
            try:
                callback(arg)
            finally:
                HOST_FUNCTION.active = False

        self.submit(job)

    def wait_event(self, event: StandInEvent) -> None:
        def wait() -> None:  # a lost context ends the wait: the event will never come
            while not event.done.wait(0.01):
                CONTEXT.check()

        self.submit(wait)

    def synchronize(self) -> None:
        self.queue.join()
        CONTEXT.check()
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def __enter__(self):
        self.previous = getattr(self.current, "stream", None)
        self.current.stream = self
        return self

    def __exit__(self, *exc) -> None:
        self.current.stream = self.previous


def current_stream():
    """`cupy.cuda.get_current_stream()`: the stream of the innermost `with`, else the
    null stream (ptr 0), whose work runs when it is issued."""
    stream = getattr(StandInStream.current, "stream", None)
    return stream if stream is not None else _NullStream()


class _NullStream:
    ptr = 0

    def submit(self, job) -> None:
        job()

    def synchronize(self) -> None:
        return None


class StandInEvent:
    """`cupy.cuda.Event`: set when its stream reaches it; records the time it did."""

    def __init__(self, disable_timing: bool = True, **_):
        self.done = threading.Event()
        self.at: float | None = None

    def record(self, stream: StandInStream) -> None:
        self.done.clear()

        def mark() -> None:
            self.at = time.perf_counter()
            self.done.set()

        mark.after_failure = True
        stream.submit(mark)

    def synchronize(self) -> None:
        self.done.wait()


class StandInRuntime:
    """`cupy.cuda.runtime`: async copies on their stream after a random delay."""

    memcpyHostToDevice = 1
    memcpyDeviceToHost = 2

    def __init__(self, delay: float, seed: int):
        self.delay, self.rng = delay, random.Random(seed)
        self.lock = threading.Lock()
        self.registered: dict[int, tuple[int, int]] = {}  # address -> (bytes, flags)
        self.registrations: list[tuple[str, int, int, int]] = []

    def _later(self, stream_ptr: int, copy) -> None:
        with self.lock:
            pause = self.rng.uniform(0, self.delay)

        def job() -> None:
            time.sleep(pause)
            copy()

        stream = StandInStream.by_ptr.get(stream_ptr) if stream_ptr else _NullStream()
        stream.submit(job)

    def memcpyAsync(self, dst, src, size, kind, stream):  # noqa: N802 (CuPy's name)
        self._later(stream, lambda: ctypes.memmove(dst, src, size))

    def memcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):  # noqa: N802
        def copy() -> None:
            for row in range(height):
                ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

        self._later(stream, copy)

    def getDevice(self) -> int:  # noqa: N802
        return 0

    def hostRegister(self, ptr: int, size: int, flags: int) -> None:  # noqa: N802
        """Page-lock `[ptr, ptr + size)` in place: refused when a page of it is registered."""
        CONTEXT.check()
        page = 4096
        first, last = ptr // page, -(-(ptr + size) // page)
        for start, (length, _) in self.registered.items():
            if start // page < last and first < -(-(start + length) // page):
                raise CUDARuntimeError(712)
        self.registered[ptr] = (size, flags)
        self.registrations.append(("register", ptr, size, flags))

    def hostUnregister(self, ptr: int) -> None:  # noqa: N802
        CONTEXT.check()
        if ptr not in self.registered:
            raise CUDARuntimeError(713)
        size, flags = self.registered.pop(ptr)
        self.registrations.append(("unregister", ptr, size, flags))


def standin_cupy(delay: float = 2e-3, seed: int = 0) -> SimpleNamespace:
    """CuPy's API as `CupyBackend` uses it (see the module docstring). `cp.pinned`
    lists the sizes of the pinned allocations made."""
    cp = fake_cupy()
    cp.pinned = []
    cp.device_allocations = []
    CONTEXT.error = None

    class PinnedMemory:
        def __init__(self, size: int):
            cp.pinned.append(size)
            self.buffer = bytearray(size)

    cuda = cp.cuda
    counted_memory = cuda.Memory

    def device_memory(size: int):
        CONTEXT.check()
        cp.device_allocations.append(size)
        return counted_memory(size)

    cuda.Memory = device_memory
    cuda.PinnedMemory = PinnedMemory
    cuda.PinnedMemoryPointer = lambda mem, offset: memoryview(mem.buffer)[offset:]
    cuda.Stream = StandInStream
    cuda.Event = StandInEvent
    cuda.runtime = StandInRuntime(delay, seed)
    cuda.get_current_stream = current_stream
    cuda.get_elapsed_time = lambda a, b: 1e3 * ((b.at or 0.0) - (a.at or 0.0))
    cuda.runtime.CUDARuntimeError = CUDARuntimeError
    cp.registered = cuda.runtime.registered
    cp.registrations = cuda.runtime.registrations
    return cp


class _Device:
    id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class StandInCupyBackend(CupyBackend):
    """The real `CupyBackend` over `standin_cupy()`: kernels are launched on the stream
    the backend names and run in its order on that stream's worker."""

    name = "cupy-standin"

    def __init__(
        self,
        delay: float = 2e-3,
        seed: int = 0,
        fault_at: int | None = None,
        in_place_min: int | None = CupyBackend.in_place_min,
    ):
        self.cp = standin_cupy(delay, seed)
        self.device = _Device()
        self.kernels = CupyKernels(self.cp)
        self.fault_at = fault_at
        self.in_place_min = in_place_min

    def compute(self, task, operands, out, stream, workspace=None) -> None:
        if task.id == self.fault_at:
            stream.cuda.submit(_fault)
            return
        stream.cuda.submit(
            lambda: CupyBackend.compute(self, task, operands, out, stream, workspace)
        )

    def fill_bytes(self, view, value, stream) -> None:
        stream.cuda.submit(lambda: CupyBackend.fill_bytes(self, view, value, stream))


def _fault() -> None:
    """A kernel that reads an illegal address: the context is lost from now on."""
    CONTEXT.error = CUDARuntimeError(700)
    raise CONTEXT.error
