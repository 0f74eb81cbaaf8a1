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
  waits for the queue; `cuda.PinnedMemory` is host memory whose allocations are
  recorded;
* `runtime.memcpyAsync` / `memcpy2DAsync` are queued on their stream and happen later,
  after a random delay (`delay` seconds at most, from `seed`);
* kernels (the g++-compiled `cpu_cuda` ones, NumPy for the rest) run on the stream the
  backend launched them on, in its order: the backend's `compute` and `fill_bytes` are
  queued on that stream's worker, as a kernel launch is.

So a missing `wait_event`, a copy on the wrong stream or a read of a buffer before its
copy lands gives a wrong answer here, as it would on a GPU. Only float32/float64 and
integer kernels (the `cpu_cuda` kernels have no float16).
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
                if self.error is None or getattr(job, "after_failure", False):
                    job()  # after a failure only events fire: nothing waits forever
            except BaseException as err:  # noqa: BLE001 (reported on synchronize)
                self.error = err
            finally:
                self.queue.task_done()

    def submit(self, job) -> None:
        """Queue `job`; issued from this stream's own work (a kernel's launch issuing a copy
        on its stream), it runs now: next in the stream's order, as on a GPU."""
        if threading.current_thread() is self.worker:
            job()
            return
        self.queue.put(job)

    def wait_event(self, event: StandInEvent) -> None:
        self.submit(event.done.wait)

    def synchronize(self) -> None:
        self.queue.join()
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


def standin_cupy(delay: float = 2e-3, seed: int = 0) -> SimpleNamespace:
    """CuPy's API as `CupyBackend` uses it (see the module docstring). `cp.pinned`
    lists the sizes of the pinned allocations made."""
    cp = fake_cupy()
    cp.pinned = []

    class PinnedMemory:
        def __init__(self, size: int):
            cp.pinned.append(size)
            self.buffer = bytearray(size)

    cuda = cp.cuda
    cuda.PinnedMemory = PinnedMemory
    cuda.PinnedMemoryPointer = lambda mem, offset: memoryview(mem.buffer)[offset:]
    cuda.Stream = StandInStream
    cuda.Event = StandInEvent
    cuda.runtime = StandInRuntime(delay, seed)
    cuda.get_current_stream = current_stream
    cuda.get_elapsed_time = lambda a, b: 1e3 * ((b.at or 0.0) - (a.at or 0.0))
    cp.cuda.runtime.CUDARuntimeError = RuntimeError
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

    def __init__(self, delay: float = 2e-3, seed: int = 0):
        self.cp = standin_cupy(delay, seed)
        self.device = _Device()
        self.kernels = CupyKernels(self.cp)

    def compute(self, task, operands, out, stream, workspace=None) -> None:
        stream.cuda.submit(
            lambda: CupyBackend.compute(self, task, operands, out, stream, workspace)
        )

    def fill_bytes(self, view, value, stream) -> None:
        stream.cuda.submit(lambda: CupyBackend.fill_bytes(self, view, value, stream))
