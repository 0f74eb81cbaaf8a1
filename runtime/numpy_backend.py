"""The NumPy backend: the reference executor of plans, on the CPU.

The arena is one `uint8` buffer of exactly `budget` bytes (aligned to 256 bytes);
every tensor is a view of it at its planned offset, so a planning bug corrupts
results here just as it would on a GPU. A copy of a box (`copy_box`) is one
`np.copyto` between the box's view of the host array and the arena view. Kernels
are `taskgraph.evaluate_task`, the reference evaluator's, writing into the output's
arena view (`out=`: straight from `np.einsum`, the aggregations, `np.take`, ...;
float16 and bfloat16 results, computed in float32, are cast into it). A bfloat16
tensor is a NumPy view of the arena with `ml_dtypes`' bfloat16 dtype, like any other.

Streams come in two kinds: `ImmediateStream` runs work as it is issued (the
sequential and random-order modes), `ThreadStream` is a worker thread that runs its
queue in order, the CPU's model of a CUDA stream (the threaded mode). Events work
as on a GPU: a stream that waits on an event runs nothing issued after the wait
until the event's stream has finished the work issued before it.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from einpage_core.errors import BackendError
from runtime.backend import Backend, Event, NodeFailure, Stream
from taskgraph.evaluate import evaluate_task
from taskgraph.nodes import Task

__all__ = ["NumpyBackend", "ImmediateStream", "ThreadStream", "ARENA_ALIGNMENT"]

ARENA_ALIGNMENT = 256
"""The arena's base address is a multiple of this (as cudaMalloc's is)."""


# -- immediate streams ------------------------------------------------------------


class ImmediateEvent(Event):
    """Complete when made; remembers when."""

    __slots__ = ("time",)

    def __init__(self) -> None:
        self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def seconds_since(self, origin: Event) -> float:
        return self.time - origin.time  # type: ignore[attr-defined]


class ImmediateStream(Stream):
    """Runs each piece of work when it is issued; events and waits are trivially satisfied."""

    def __init__(self, name: str):
        self.name = name
        self.context = None

    def __repr__(self) -> str:
        return f"<ImmediateStream {self.name}>"

    def submit(self, work: Callable[[], Any]) -> None:
        work()

    def record(self, timing: bool = False) -> Event:
        return ImmediateEvent()

    def wait(self, event: Event) -> None:
        pass

    def synchronize(self) -> None:
        pass


# -- worker-thread streams --------------------------------------------------------


class ThreadEvent(Event):
    """Set by a worker thread when it reaches the event in its queue."""

    __slots__ = ("flag", "time", "failure")

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.time = 0.0
        self.failure: NodeFailure | None = None

    def fire(self, failure: NodeFailure | None) -> None:
        self.time = time.perf_counter()
        self.failure = failure
        self.flag.set()

    def synchronize(self) -> None:
        self.flag.wait()

    def seconds_since(self, origin: Event) -> float:
        return self.time - origin.time  # type: ignore[attr-defined]


class _Wait:
    __slots__ = ("event",)

    def __init__(self, event: ThreadEvent):
        self.event = event


_STOP = object()


class ThreadStream(Stream):
    """A worker thread running its queue in order, with events like a CUDA stream.

    After a piece of work raises, the stream skips later work (it still fires its
    events, so nothing waits forever) and passes the failure on to streams that wait
    on its events; `synchronize` raises it as a `NodeFailure`. Every wait has a
    `timeout` (seconds): a stream that waits longer fails instead of hanging.
    """

    def __init__(self, name: str, timeout: float):
        self.name = name
        self.timeout = timeout
        self.context = None
        self.failure: NodeFailure | None = None
        self._queue: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"einpage-{name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<ThreadStream {self.name}>"

    def submit(self, work: Callable[[], Any]) -> None:
        self._queue.put((work, self.context))

    def record(self, timing: bool = False) -> Event:
        event = ThreadEvent()
        self._queue.put((event, None))
        return event

    def wait(self, event: Event) -> None:
        if not isinstance(event, ThreadEvent):
            raise BackendError(f"stream {self.name!r} cannot wait on {event!r}")
        self._queue.put((_Wait(event), self.context))

    def synchronize(self) -> None:
        event = self.record()
        if not event.flag.wait(self.timeout):
            raise BackendError(
                f"stream {self.name!r} did not finish its work within {self.timeout} s; "
                "the run is abandoned (raise timeout= for longer kernels)"
            )
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put((_STOP, None))
            self._thread.join(timeout=self.timeout)

    def _loop(self) -> None:
        while True:
            item, context = self._queue.get()
            if item is _STOP:
                return
            try:
                if isinstance(item, ThreadEvent):
                    item.fire(self.failure)
                elif isinstance(item, _Wait):
                    self._wait(item.event, context)
                elif self.failure is None:
                    item()
            except BaseException as err:  # surfaced by synchronize(), never lost
                if self.failure is None:
                    self.failure = NodeFailure(err, context, self.name)

    def _wait(self, event: ThreadEvent, context: Any) -> None:
        if not event.flag.wait(self.timeout):
            error = BackendError(
                f"stream {self.name!r} waited more than {self.timeout} s for an event"
            )
            self.failure = self.failure or NodeFailure(error, context, self.name)
        elif event.failure is not None and self.failure is None:
            self.failure = event.failure


# -- the backend ------------------------------------------------------------------


class NumpyBackend(Backend):
    """Plans executed with NumPy on the CPU (see the module docstring).

    Option: `timeout` (seconds, default 300), the longest a worker thread waits for
    another stream's event, and a run for its streams to finish.
    """

    name = "numpy"
    OPTIONS = ("timeout",)
    default_mode = "sequential"
    host_staging = False
    arena_on_host = True

    def __init__(self, timeout: float = 300.0):
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise BackendError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)

    def __repr__(self) -> str:
        return "<NumpyBackend>"

    def allocate_arena(self, nbytes: int) -> np.ndarray:
        raw = np.empty(nbytes + ARENA_ALIGNMENT, dtype=np.uint8)
        start = -raw.ctypes.data % ARENA_ALIGNMENT
        return raw[start : start + nbytes]

    def allocate_host(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def view(self, arena: np.ndarray, offset: int, shape: tuple[int, ...], dtype: str) -> Any:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        return arena[offset : offset + nbytes].view(dtype).reshape(shape)

    def stream(self, name: str, concurrent: bool) -> Stream:
        return ThreadStream(name, self.timeout) if concurrent else ImmediateStream(name)

    def copy_box(
        self,
        host: np.ndarray,
        starts: Sequence[int],
        device: np.ndarray,
        direction: str,
        stream: Stream,
    ) -> None:
        """`np.copyto` between the box's view of the host array (the caller's array, or a
        storage's slot) and the arena view: no intermediate copy."""
        if len(starts) != host.ndim or device.ndim != host.ndim:
            raise BackendError(
                f"a box starting at {list(starts)} with shape {list(device.shape)} is not a "
                f"box of a host array of shape {list(host.shape)}"
            )
        index = tuple(slice(s, s + n) for s, n in zip(starts, device.shape, strict=True))
        box = host[(*index, ...)]  # a view, even of a 0-d array
        if box.shape != device.shape:
            raise BackendError(
                f"the box at {list(starts)} of shape {list(device.shape)} does not lie inside "
                f"a host array of shape {list(host.shape)}"
            )
        if direction == "h2d":
            work = functools.partial(np.copyto, device, box)
        elif direction == "d2h":
            work = functools.partial(np.copyto, box, device)
        else:
            raise BackendError(f"copy direction must be 'h2d' or 'd2h', got {direction!r}")
        stream.submit(work)  # type: ignore[attr-defined]

    def compute(
        self,
        task: Task,
        operands: Sequence[np.ndarray],
        out: np.ndarray,
        stream: Stream,
        workspace: np.ndarray | None = None,
    ) -> None:
        """The reference kernel into `out`. The workspace a plan gives a task (for the CuPy
        kernels) is not needed here; the interpreter poisons it when poisoning."""
        stream.submit(functools.partial(evaluate_task, task, operands, out=out))  # type: ignore[attr-defined]

    def fill_bytes(self, view: np.ndarray, value: int, stream: Stream) -> None:
        stream.submit(functools.partial(view.fill, value))  # type: ignore[attr-defined]
