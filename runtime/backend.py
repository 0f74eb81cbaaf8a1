"""The backend interface: the handful of primitives the interpreter needs, and the registry.

A backend owns device memory and streams; the interpreter owns the plan. The
primitives are:

* memory:   `allocate_arena(nbytes)` (the device arena), `allocate_host(nbytes)` (one
            host buffer for every host storage; pinned on a GPU), and
            `view(arena, offset, shape, dtype)` (a tensor at its planned offset);
* streams:  `stream(name, concurrent)` gives a `Stream` with `record() -> Event`,
            `wait(event)` and `synchronize()`; work issued on one stream runs in
            issue order, and a stream that waits on an event runs nothing issued
            after the wait before the event's work is done;
* work:     `copy_box(host, starts, device, direction, stream)`, the one copy
            primitive: between a box of a host array (the box starting at `starts`,
            of `device`'s shape) and a contiguous device array, in either direction
            ("h2d", "d2h"), so that a sliced copy never needs a contiguous host copy
            of its box (`copy_to_device` and `copy_to_host` are its whole-array
            cases); `compute(task, operands, out, stream, workspace)` (one task's
            kernel, writing `out`; `workspace` is the uint8 view of the region its
            plan gives the kernel's workspace, or None) and `fill_bytes(view, value,
            stream)` (poisoning freed memory);
* host:     `register_host(pointer, nbytes, read_only)` / `unregister_host(pointer)`:
            page-lock memory the caller holds, in place, so that transfers read it
            asynchronously without a staged copy (CuPy: `cudaHostRegister`; a backend
            that does not returns False, and sets no `in_place_min`);
* a run:    `check_plan(mg)` (refuse a plan the backend cannot run as planned, before
            anything is allocated), `running()`, a context manager around issuing and
            synchronizing one run (the CuPy backend refuses every allocation of
            CuPy's there, and reports errors that kernels flagged on the device), and
            `memory_report()`; `clock` says what a trace's times are measured with
            ("wall", "cuda"); `lost_context(error)` says whether an error means the
            device can run nothing more (a sticky CUDA error) and why.

Work primitives only *issue* work; it is done once the stream is synchronized or an
event recorded after it has completed.

Backends are found by name in a registry (`get_backend`); `register_backend(name,
factory)` adds one, as opt_einsum's `register_path_fn` adds a path optimizer.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from einpage_core.errors import BackendError
from taskgraph.nodes import Task

__all__ = [
    "Backend",
    "Stream",
    "Event",
    "NodeFailure",
    "BACKENDS",
    "BACKEND_NAMES",
    "backend_names",
    "get_backend",
    "register_backend",
    "cupy_usable",
    "AUTO_ORDER",
    "auto_backend",
]


class NodeFailure(Exception):
    """Work issued for a MemGraph node raised `error`; `context` is that node, `stream` where."""

    def __init__(self, error: BaseException, context: Any, stream: str):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error
        self.context = context
        self.stream = stream


class Event(abc.ABC):
    """A point in a stream's work; complete once everything issued before it is done."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the event is complete."""

    @abc.abstractmethod
    def seconds_since(self, origin: Event) -> float:
        """Seconds from `origin` to this event (both complete and recorded with timing)."""


class Stream(abc.ABC):
    """An in-order queue of work (a CUDA stream, or a worker thread on the CPU).

    `context` is set by the interpreter to the MemGraph node whose work is being
    issued, so that an error raised later names the node.
    """

    name: str
    context: Any = None

    @abc.abstractmethod
    def record(self, timing: bool = False) -> Event:
        """An event that completes when the work issued so far on this stream is done."""

    @abc.abstractmethod
    def wait(self, event: Event) -> None:
        """Make work issued on this stream from now on wait for `event`."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until all work issued on this stream is done; raise what it raised."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release the stream's resources (threads)."""


class Backend(abc.ABC):
    """Executes the primitives of a plan on one kind of memory. See the module docstring."""

    name: ClassVar[str]
    OPTIONS: ClassVar[tuple[str, ...]] = ()
    """Keyword options the constructor accepts (`runtime.run(..., **options)` passes them)."""
    RETIRED: ClassVar[Mapping[str, str]] = {}
    """Options it once accepted, each with why it is gone (`get_backend` says so)."""
    default_mode: ClassVar[str] = "sequential"
    host_staging: ClassVar[bool] = False
    """Whether device inputs and outputs pass through host staging buffers (pinned memory
    on a GPU, so that their transfers are asynchronous)."""
    unsupported_dtypes: ClassVar[Mapping[str, str]] = {}
    """Dtypes this backend cannot run, each with what is missing; a `Session` refuses a
    plan holding one (`UnsupportedError`) before allocating anything."""
    arena_on_host: ClassVar[bool] = False
    """Whether the arena is host memory (NumPy), so that it counts with the host buffer
    against the host memory available (`runtime.session.check_host_budget`)."""
    clock: ClassVar[str] = "wall"
    """What its events' times are measured with: "wall" (the host's clock) or "cuda"
    (CUDA events); a run's `Trace` says it."""
    in_place_min: ClassVar[int | None] = None
    """On a staging backend that can `register_host`: weights of at least this many bytes
    are read where the caller holds them (registered in place) instead of being copied
    into a staging slot (`runtime.hostmem`); None: every input is copied."""

    @abc.abstractmethod
    def allocate_arena(self, nbytes: int) -> Any: ...

    @abc.abstractmethod
    def allocate_host(self, nbytes: int) -> np.ndarray:
        """A host `uint8` buffer of `nbytes` bytes that transfers may read and write."""

    @abc.abstractmethod
    def view(self, arena: Any, offset: int, shape: tuple[int, ...], dtype: str) -> Any:
        """The arena bytes at `offset` as a C-contiguous array of `shape` and `dtype`."""

    @abc.abstractmethod
    def stream(self, name: str, concurrent: bool) -> Stream:
        """A new stream; `concurrent=False` may give one that runs work as it is issued."""

    @abc.abstractmethod
    def copy_box(
        self,
        host: np.ndarray,
        starts: Sequence[int],
        device: Any,
        direction: str,
        stream: Stream,
    ) -> None:
        """Copy between the box of the C-contiguous host array `host` that starts at
        `starts` and has `device`'s shape, and the contiguous device array `device` (of
        `host`'s dtype): into `device` for direction "h2d", into the box for "d2h"."""

    def copy_to_device(self, dst: Any, src: np.ndarray, stream: Stream) -> None:
        """Copy all of contiguous host array `src` into device array `dst` (as many elements:
        a 0-d array and its 1-element copy from `np.ascontiguousarray` are alike)."""
        host = src.reshape(dst.shape) if src.shape != dst.shape else src
        self.copy_box(host, (0,) * host.ndim, dst, "h2d", stream)

    def copy_to_host(self, dst: np.ndarray, src: Any, stream: Stream) -> None:
        """Copy all of device array `src` into contiguous host array `dst` (as many elements)."""
        host = dst.reshape(src.shape) if dst.shape != src.shape else dst
        self.copy_box(host, (0,) * host.ndim, src, "d2h", stream)

    @abc.abstractmethod
    def compute(
        self, task: Task, operands: Sequence[Any], out: Any, stream: Stream, workspace: Any = None
    ) -> None:
        """Issue `task`'s kernel reading the operand views and writing the view `out`;
        `workspace` is the uint8 view of its kernel's workspace region (None: none)."""

    def check_plan(self, mg: Any) -> None:  # noqa: B027  (optional hook)
        """Raise a typed error when this backend cannot run the MemGraph `mg` as planned
        (e.g. a kernel needing more workspace than the plan gives its task)."""

    @abc.abstractmethod
    def fill_bytes(self, view: Any, value: int, stream: Stream) -> None:
        """Set every byte of the (uint8) view to `value`."""

    def register_host(self, pointer: int, nbytes: int, read_only: bool) -> bool:
        """Page-lock the `nbytes` of host memory at `pointer` (whole pages) in place, so
        that copies from it are asynchronous; `read_only` when the memory cannot be
        written (a read-only memory map). Returns whether it was done: this backend
        does not (it reads host memory wherever it is)."""
        return False

    def unregister_host(self, pointer: int) -> None:  # noqa: B027  (optional hook)
        """Undo `register_host` of the memory at `pointer`."""

    def lost_context(self, error: BaseException) -> str | None:
        """Why the device can run nothing more after `error` (a sticky CUDA error: the
        context is lost), or None when it can."""
        return None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Wraps the issuing and synchronization of one run."""
        yield

    def memory_report(self, arena_bytes: int) -> dict[str, Any]:
        """Device memory the last run used, in bytes (see each backend)."""
        return {"arena_bytes": arena_bytes, "device_peak_bytes": arena_bytes}

    def counters(self) -> dict[str, int]:
        """How the last run's kernels were executed (e.g. cuBLAS calls, fallbacks)."""
        return {}

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release resources not owned by arrays (e.g. memory pools)."""


def _numpy_backend() -> type[Backend]:
    from runtime.numpy_backend import NumpyBackend

    return NumpyBackend


def _cupy_backend() -> type[Backend]:
    from runtime.cupy_backend import CupyBackend  # imports nothing from CuPy until used

    return CupyBackend


BACKENDS: dict[str, Callable[[], type[Backend]]] = {
    "numpy": _numpy_backend,
    "cupy": _cupy_backend,
}
"""Backend classes by name, loaded on first use (`register_backend` adds to it)."""

BACKEND_NAMES = ("auto", *BACKENDS)
"""The built-in backend names and "auto" (`backend_names()` includes registered ones)."""


def backend_names() -> tuple[str, ...]:
    """Every name `get_backend` accepts: "auto" and each registered backend."""
    return ("auto", *BACKENDS)


def register_backend(name: str, factory: type[Backend] | Callable[[], type[Backend]]) -> None:
    """Make a backend available by `name` to `get_backend`, `runtime.run` and `Session`.

    `factory` is a `Backend` subclass, or a function of no arguments that returns one
    (to import it only when first used). Names are unique: registering a name again
    raises `BackendError`.

    >>> class Traced(NumpyBackend): name = "traced"       # doctest: +SKIP
    >>> register_backend("traced", Traced)                # doctest: +SKIP
    >>> runtime.run(mg, inputs, backend="traced")         # doctest: +SKIP
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise BackendError(
            f"a backend name must be a non-empty string other than 'auto', got {name!r}"
        )
    if name in BACKENDS:
        raise BackendError(
            f"backend {name!r} is already registered; registered: {', '.join(BACKENDS)}"
        )
    if isinstance(factory, type) and issubclass(factory, Backend):
        cls = factory
        BACKENDS[name] = lambda: cls
    elif callable(factory):
        BACKENDS[name] = factory
    else:
        raise BackendError(
            f"backend {name!r}: expected a Backend subclass or a function returning one, "
            f"got {type(factory).__name__}"
        )


def cupy_usable() -> bool:
    """Whether CuPy is installed and can see a CUDA device."""
    try:
        import cupy
    except Exception:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:
        return False


AUTO_ORDER = ("cupy", "numpy")
"""The backends "auto" considers, in order of preference."""


def _usable(name: str) -> bool:
    """Whether backend `name` can run here at all (CuPy: installed, and a GPU seen)."""
    return cupy_usable() if name == "cupy" else True


def auto_backend(dtypes: Iterable[str] = ()) -> str:
    """The backend "auto" stands for, for a plan holding tensors of `dtypes`: the first of
    `AUTO_ORDER` that is usable here and refuses none of them (`unsupported_dtypes`), so
    "auto" never picks a backend that would refuse the plan; NumPy runs every dtype."""
    needed = set(dtypes)
    for name in AUTO_ORDER:
        if not _usable(name):
            continue
        cls = BACKENDS[name]()
        if not needed & set(getattr(cls, "unsupported_dtypes", {})):
            return name
    return "numpy"


def get_backend(
    name: str | Backend = "auto", *, dtypes: Iterable[str] = (), **options: Any
) -> Backend:
    """A backend by name: "numpy", "cupy", or "auto" (`auto_backend(dtypes)`: CuPy when a
    GPU is usable and CuPy runs every dtype in `dtypes` – the plan's –, else NumPy).

    A `Backend` instance is returned as is (then `options` must be empty).
    """
    if isinstance(name, Backend):
        if options:
            raise BackendError(f"options {sorted(options)} cannot be applied to a backend instance")
        return name
    names = backend_names()
    if name not in names:
        raise BackendError(f"unknown backend {name!r}; valid: {', '.join(repr(n) for n in names)}")
    if name == "auto":
        name = auto_backend(dtypes)
    cls = BACKENDS[name]()
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendError(f"backend {name!r}: its factory gave {cls!r}, not a Backend subclass")
    accepted = getattr(cls, "OPTIONS", ())
    retired = getattr(cls, "RETIRED", {})
    for option in sorted(set(options) & set(retired)):
        raise BackendError(f"backend {name!r} has no option {option!r} any more: {retired[option]}")
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        valid = ", ".join(accepted) or "none"
        raise BackendError(f"backend {name!r} has no option(s) {unknown}; its options: {valid}")
    return cls(**options)
