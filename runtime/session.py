"""Running plans: `run` for one call, `Session` to keep the arena and staged inputs alive.

A `Session` verifies its MemGraph (once per plan: `MemGraph.verified` remembers the
verdict on the plan), allocates the device arena (the bytes the plan uses, at most its
budget: `runtime.interpreter.arena_bytes`) and one host buffer for every host storage,
and creates the streams of its mode. `stage(weights)` places inputs once; each
`run(activations)` then places only the inputs it is given, issues every node in the
mode's order, synchronizes, and returns the outputs as fresh host NumPy arrays.
`session.last` is a `RunReport` (timings, the trace when asked for, memory and kernel
counters). Closing it (or leaving its `with` block) stops the streams, drops the
buffers and closes a backend it made.

`run` makes a session per call and closes it before returning: nothing of a run
outlives it, in this module or elsewhere. Fresh buffers cost their first-touch page
faults on every call (on a 122 MiB NumPy arena, about 180 ms against 90 ms of compute:
`benchmarks/runtime_bench.py`), so repeated runs of one plan belong in a `Session`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from einpage_core.errors import (
    BackendError,
    EinpageError,
    InputError,
    UnsupportedError,
    VerificationError,
    expect_graph,
)
from einpage_core.host import available_memory
from einpage_core.progress import Tick, ticks
from einpage_core.units import format_bytes, parse_bytes
from memgraph.graph import MemGraph
from memgraph.nodes import MemNode, NodeKind
from memgraph.trace import node_event
from memgraph.verify import VerifyReport
from runtime.backend import Backend, Event, NodeFailure, Stream, get_backend
from runtime.interpreter import POISON_BYTE, HostLayout, Interpreter, arena_bytes
from runtime.schedule import Schedule, check_dependencies, random_order, resolve_mode
from runtime.trace import Trace

__all__ = ["run", "Session", "RunReport", "verified"]

PLAN_FIRST = " (a plan: einpage.compile(program, budget).plan, or MemGraph.from_json)"
"""What a run takes, said when given something else (a TaskGraph, a file name)."""


def verified(mg: MemGraph) -> VerifyReport:
    """`memgraph.verify(mg)`, run once per plan (`MemGraph.verified` remembers the
    verdict, failures too); a failure is refused as a plan the runtime will not run."""
    try:
        return mg.verified()
    except VerificationError as err:
        raise VerificationError(
            f"refusing to run a plan that fails verification: {err}", err.node
        ) from None


@dataclass(frozen=True)
class RunReport:
    """What one run did.

    `seconds` is the wall-clock time from placing the inputs to having the outputs on
    the host. `memory` (bytes): `arena_bytes`, `host_bytes`, `device_peak_bytes` (the
    arena plus any other device memory the run allocated, on CuPy from its memory
    pool's high-water mark) and, on CuPy, `scratch_peak_bytes` and `scratch_limit`.
    `counters` says how kernels ran (e.g. `cublas`, `einsum_fallback`).
    """

    backend: str
    mode: str
    seconds: float
    nodes: int
    seed: int | None
    trace: Trace | None = None
    memory: dict[str, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)

    def __repr__(self) -> str:
        peak = self.memory.get("device_peak_bytes")
        shown = f" device_peak={format_bytes(peak)}" if peak is not None else ""
        return (
            f"<RunReport {self.backend}/{self.mode} nodes={self.nodes} "
            f"seconds={self.seconds:.6f}{shown}>"
        )


def _conform_partial(mg: MemGraph, arrays: Any) -> dict[str, Any]:
    """Some of the inputs (for `stage`), checked and converted as
    `TaskGraph.conform_inputs` does for all of them."""
    if not isinstance(arrays, Mapping):
        raise InputError(f"inputs must be a mapping of name to array, got {type(arrays).__name__}")
    tg = mg.taskgraph
    unknown = [name for name in arrays if name not in tg.inputs]
    if unknown:
        known = ", ".join(map(repr, tg.inputs))
        raise InputError(f"unknown input(s) {', '.join(map(repr, unknown))}; inputs are {known}")
    _reject_device_arrays(arrays)
    conformed = tg.conform_inputs({**_placeholders(mg, exclude=arrays), **arrays})
    return {name: conformed[name] for name in arrays}


class _Placeholder:
    """Stands in for an input that is not being checked (its expected shape and dtype)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: str):
        self.shape = shape
        self.dtype = np.dtype(dtype)


def _placeholders(mg: MemGraph, exclude: Mapping[str, Any]) -> dict[str, _Placeholder]:
    tg = mg.taskgraph
    return {
        name: _Placeholder(tg[i].shape, tg[i].dtype)
        for name, i in tg.inputs.items()
        if name not in exclude
    }


def _reject_device_arrays(arrays: Mapping[str, Any]) -> None:
    for name, value in arrays.items():
        if hasattr(value, "__cuda_array_interface__") and not isinstance(value, np.ndarray):
            raise InputError(
                f"input {name!r}: expected a host (NumPy) array, got {type(value).__module__}."
                f"{type(value).__name__}; pass value.get() instead"
            )


def refuse_unsupported(mg: MemGraph, backend: Backend) -> None:
    """`UnsupportedError` when `mg` holds a tensor of a dtype `backend` cannot run,
    naming the dtype, how many tasks have it, an example, and what is missing."""
    for dtype, missing in backend.unsupported_dtypes.items():
        tasks = [t for t in mg.taskgraph.tasks if t.dtype == dtype]
        if tasks:
            example = tasks[0].label or f"%{tasks[0].id}"
            raise UnsupportedError(
                f"the {backend.name} backend cannot run {dtype} tensors ({len(tasks)} tasks "
                f"of this plan, e.g. {example}): {missing}"
            )


class HostBudgetError(BackendError):
    """The plan needs more host (pinned) memory than the session's `host_budget`."""


def pinned_bytes(mg: MemGraph) -> int:
    """The bytes of host memory a staging backend (CuPy: page-locked memory) allocates
    for `mg`, once per session: every host storage of the plan (`mg.host_bytes`, each
    rounded up to the host alignment) plus a staging slot for each device-side input
    and output. Nothing else is pinned: sliced reloads and host-assembled outputs copy
    boxes of these slots."""
    return HostLayout.of(mg, True).nbytes


def check_host_budget(
    layout: HostLayout, host_budget: int | str | None, backend: Backend, arena: int = 0
) -> None:
    """`HostBudgetError` when `layout` needs more than `host_budget` bytes – or, without
    one, when it and an `arena` of host memory (NumPy's) need more than the host memory
    available now (`einpage_core.host.available_memory`), before anything is allocated."""
    if host_budget is None:
        available = available_memory()
        need = layout.nbytes + (arena if backend.arena_on_host else 0)
        if available is not None and need > available:
            raise HostBudgetError(
                f"the plan needs {format_bytes(need)} ({need} bytes) of host memory – "
                f"{format_bytes(layout.nbytes)} of host storage"
                + (f" and a {format_bytes(arena)} arena" if backend.arena_on_host else "")
                + f" – and {format_bytes(available)} is available: "
                + (
                    "the NumPy backend's arena is host memory as large as the plan's device "
                    "memory, so plan with a smaller budget, or free memory"
                    if backend.arena_on_host and arena > layout.nbytes
                    else "free memory, or plan with a larger budget (fewer offloads)"
                )
            )
        return
    limit = parse_bytes(host_budget)
    if layout.nbytes > limit:
        kind = "pinned host" if backend.host_staging else "host"
        raise HostBudgetError(
            f"the plan needs {format_bytes(layout.nbytes)} ({layout.nbytes} bytes) of {kind} "
            f"memory, over the host budget of {format_bytes(limit)} ({limit} bytes): "
            f"{len(layout.storages)} host storages, {len(layout.inputs)} staged inputs, "
            f"{len(layout.outputs)} staged outputs; raise host_budget, or plan with a "
            "larger device budget (fewer offloads)"
        )


class Session:
    """A MemGraph ready to run many times on one backend (see the module docstring).

    Parameters: `backend` ("auto", "numpy", "cupy" or a `Backend`), `mode`
    ("sequential", "streams" a.k.a. "threaded", "random"; default: the backend's),
    `poison` (fill freed and unwritten memory with 0xFF bytes so that a missing
    dependency reads NaNs; default: on in random mode), `unsafe_skip_verify` (run
    without `memgraph.verify`; for tests that break plans on purpose), `host_budget`
    (bytes or a size string: the most host memory the session may allocate – pinned
    memory on a GPU, `pinned_bytes(mg)` – refused up front with `HostBudgetError` when
    the plan needs more), and backend options (NumPy: `timeout`; CuPy: `scratch`,
    `device`).

    Setting up takes a few steps (`_check_plan`, `_open_backend`, `_plan_memory`,
    `_allocate`, `_open_streams`, `_start`), each registering the release of what it
    acquired on one `ExitStack`: when a step fails, what the earlier ones acquired is
    released before the error propagates, and `close()` releases the same way.

    >>> with Session(mg, "numpy") as s:                          # doctest: +SKIP
    ...     s.stage({"w": w})
    ...     ys = [s.run({"x": x})["y"] for x in batches]
    """

    def __init__(
        self,
        mg: MemGraph,
        backend: str | Backend = "auto",
        *,
        mode: str | None = None,
        poison: bool | None = None,
        unsafe_skip_verify: bool = False,
        host_budget: int | str | None = None,
        **options: Any,
    ):
        self._closed = True  # until every step below succeeded: close() has nothing to do
        expect_graph(mg, MemGraph, "runtime.Session", PLAN_FIRST)
        self.mg = mg
        self.tg = mg.taskgraph
        self._check_plan(unsafe_skip_verify)
        with contextlib.ExitStack() as acquired:
            self._open_backend(backend, options, acquired)
            self._plan_memory(mode, poison, host_budget)
            self._allocate(acquired)
            self._open_streams(acquired)
            self._start()
            self._release = acquired.pop_all()  # on success, close() releases it all
        self._closed = False

    # -- setting up (in this order; see the class docstring) ----------------------

    def _check_plan(self, unsafe_skip_verify: bool) -> None:
        """The plan passes `memgraph.verify` (or, unverified, its dependencies point back)."""
        if unsafe_skip_verify:
            check_dependencies(self.mg)
        else:
            verified(self.mg)

    def _open_backend(
        self, backend: str | Backend, options: dict[str, Any], acquired: contextlib.ExitStack
    ) -> None:
        """The backend, closed on release when the session made it; refuses a plan holding
        a dtype the backend cannot run."""
        dtypes = {task.dtype for task in self.tg.tasks}  # "auto" picks one that runs them
        self.backend = get_backend(backend, dtypes=dtypes, **options)
        if not isinstance(backend, Backend):  # made here: the session owns it
            acquired.callback(self.backend.close)
        refuse_unsupported(self.mg, self.backend)
        self.backend.check_plan(self.mg)

    def _plan_memory(self, mode: str | None, poison: bool | None, host_budget: Any) -> None:
        """The mode, the schedule and the host layout; refuses a plan needing more host
        memory than `host_budget` (or than is available) before anything is allocated."""
        self.mode = resolve_mode(mode, self.backend.default_mode)
        self.poison = self.mode == "random" if poison is None else bool(poison)
        self.schedule = Schedule.build(self.mg, self.mode, self.poison)
        self.layout = HostLayout.of(self.mg, self.backend.host_staging)
        check_host_budget(self.layout, host_budget, self.backend, arena_bytes(self.mg))

    def _allocate(self, acquired: contextlib.ExitStack) -> None:
        """The arena and the host buffer, dropped on release (the interpreter with them)."""
        self.arena: Any = None
        self.host: np.ndarray | None = None
        self.interpreter: Interpreter | None = None
        acquired.callback(self._drop_buffers)
        self.arena = self.backend.allocate_arena(arena_bytes(self.mg))
        self.host = self.backend.allocate_host(self.layout.nbytes)
        if self.poison:
            self.host.fill(POISON_BYTE)

    def _drop_buffers(self) -> None:
        self.interpreter = None
        self.arena = self.host = None

    def _open_streams(self, acquired: contextlib.ExitStack) -> None:
        """One stream per stream of the schedule, each closed on release."""
        concurrent = self.mode == "streams"
        self.streams: dict[str, Stream] = {}
        for name in self.schedule.streams:
            stream = self.backend.stream(name, concurrent)
            acquired.callback(stream.close)
            self.streams[name] = stream

    def _start(self) -> None:
        """The interpreter over the buffers, and what `stage` and `run` look up."""
        self.interpreter = Interpreter(
            self.mg, self.backend, self.arena, self.host, self.layout, self.poison
        )
        self._input_nodes = {n.name: n for n in self.mg.nodes if n.kind is NodeKind.INPUT}
        self._output_nodes = {n.name: n for n in self.mg.nodes if n.kind is NodeKind.OUTPUT}
        input_storages = {n.storage for n in self._input_nodes.values()}
        self._scratch_storages = sorted(set(self.layout.storages) - input_storages)
        self._staged: dict[str, Any] = {}
        self.last: RunReport | None = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"staged={sorted(self._staged)}"
        return (
            f"<Session {self.tg.name!r} backend={self.backend.name} mode={self.mode} "
            f"budget={format_bytes(self.mg.budget)} {state}>"
        )

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """Stop the streams, drop the arena and host memory, and close the backend if the
        session made it (what a failed set-up releases, in the same way)."""
        if self._closed:
            return
        self._closed = True
        self._release.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("this Session is closed")

    # -- inputs ------------------------------------------------------------------

    def stage(self, arrays: Mapping[str, Any]) -> None:
        """Place inputs (typically weights) once; later runs use them unless given again.

        The data is copied: changing the arrays afterwards does not change the session.
        """
        self._check_open()
        arrays = _conform_partial(self.mg, arrays)
        for name, value in arrays.items():
            self._staged[name] = self._place(name, value, persist=True)

    @property
    def staged(self) -> tuple[str, ...]:
        """Names of the staged inputs."""
        return tuple(self._staged)

    def _place(self, name: str, value: Any, persist: bool) -> Any:
        """Put input `name` where its input node expects it; return what now holds it."""
        node = self._input_nodes.get(name)
        if node is None:  # an unverified plan that never reads this input
            return np.asarray(value)
        interp = self.interpreter
        if node.storage in self.layout.aliased:  # read in place: no copy unless kept
            held = np.array(value, order="C", copy=True) if persist else np.ascontiguousarray(value)
            held = held.reshape(self.mg.storages[node.storage].shape)  # 0-d stays 0-d
            interp.bind_host(node.storage, held)
            return held
        if node.storage is not None:
            slot = interp.host_view(node.storage)
            np.copyto(slot, value)
            return slot
        if self.backend.host_staging:
            slot = self.layout.inputs[name].of(self.host)
            np.copyto(slot, value)
            interp.sources[name] = slot
            return slot
        source = np.array(value, order="C", copy=True) if persist else np.ascontiguousarray(value)
        interp.sources[name] = source
        return source

    # -- running -----------------------------------------------------------------

    def run(
        self,
        inputs: Mapping[str, Any] | None = None,
        *,
        seed: int = 0,
        trace: bool = False,
        progress: Tick | None = None,
    ) -> dict[str, np.ndarray]:
        """Run the plan on `inputs` (plus the staged ones); return the outputs on the host.

        An input given here that was staged replaces the staged value (for later runs
        too). `seed` orders the random mode; `trace=True` records a timing trace
        (`self.last.trace`); `progress` is called as `progress(nodes issued, nodes)`
        about a hundred times, and `(nodes, nodes)` once every stream is done.
        """
        self._check_open()
        inputs = {} if inputs is None else inputs
        if not isinstance(inputs, Mapping):
            raise InputError(
                f"inputs must be a mapping of name to array, got {type(inputs).__name__}"
            )
        _reject_device_arrays(inputs)
        conformed = self.tg.conform_inputs({**self._staged, **inputs})
        inputs = {name: conformed[name] for name in inputs}
        started = time.perf_counter()
        for name, value in inputs.items():
            placed = self._place(name, value, persist=name in self._staged)
            if name in self._staged:
                self._staged[name] = placed
        self.interpreter.results = self._result_buffers()
        timing = self._execute(seed, trace, progress)
        outputs = self._collect()
        seconds = time.perf_counter() - started
        arena = self.interpreter.arena_bytes
        memory = {**self.backend.memory_report(arena), "host_bytes": self.layout.nbytes}
        self.last = RunReport(
            backend=self.backend.name,
            mode=self.mode,
            seconds=seconds,
            nodes=len(self.mg.nodes),
            seed=seed if self.mode == "random" else None,
            trace=timing,
            memory=memory,
            counters=self.backend.counters(),
        )
        return outputs

    def _result_buffers(self) -> dict[str, np.ndarray]:
        buffers = {}
        for name, node in self._output_nodes.items():
            if node.region is None:
                continue
            if self.backend.host_staging:
                buffers[name] = self.layout.outputs[name].of(self.host)
            else:
                task = self.tg[self.tg.outputs[name]]
                buffers[name] = np.empty(task.shape, dtype=task.dtype)
        return buffers

    def _collect(self) -> dict[str, np.ndarray]:
        outputs = {}
        results = self.interpreter.results
        for name, task_id in self.tg.outputs.items():
            node = self._output_nodes.get(name)
            task = self.tg[task_id]
            if node is None:
                raise BackendError(f"the plan never produces output {name!r}")
            if node.storage is not None:
                value = self.interpreter.host_view(node.storage).reshape(task.shape)
                outputs[name] = np.array(value, copy=True)
            elif self.backend.host_staging:
                outputs[name] = np.array(results[name], copy=True)
            else:
                outputs[name] = results[name]
        return outputs

    def _execute(self, seed: int, tracing: bool, progress: Tick | None = None) -> Trace | None:
        """Issue every node in the mode's order, synchronize, and raise the first failure."""
        timing: list[tuple[MemNode, str, Event, Event]] | None = [] if tracing else None
        origin: Event | None = None
        failure: BaseException | None = None
        with self.backend.running():
            try:
                if self.poison:
                    self._poison_scratch()
                if self.poison or tracing:
                    origin = self._barrier()
                tick = _every(progress, len(self.mg.nodes))
                if self.schedule.mode == "random":
                    self._issue_random(seed, timing, tick)
                else:
                    self._issue_in_order(timing, tick)
            except BaseException as err:
                failure = err
            for stream in self.streams.values():  # drain every stream, even after a failure
                try:
                    stream.synchronize()
                except BaseException as err:
                    failure = failure or err
            if failure is not None:
                raise _public_error(failure) from (
                    failure.error if isinstance(failure, NodeFailure) else failure
                )
        if progress is not None:
            progress(len(self.mg.nodes), len(self.mg.nodes))
        if timing is None:
            return None
        return self._trace(timing, origin)

    def _poison_scratch(self) -> None:
        stream = self.streams[self.schedule.streams[0]]
        stream.context = "poisoning the arena"
        whole = self.backend.view(self.arena, 0, (self.interpreter.arena_bytes,), "uint8")
        self.backend.fill_bytes(whole, POISON_BYTE, stream)
        for storage in self._scratch_storages:
            slot = self.layout.storages[storage]
            self.host[slot.offset : slot.offset + slot.nbytes] = POISON_BYTE

    def _barrier(self) -> Event:
        """An event on the first stream that every other stream waits for: the poisoning
        is done before any node's work, and the trace's times are measured from it."""
        first, *others = self.schedule.streams
        origin = self.streams[first].record(timing=True)
        for name in others:
            self.streams[name].wait(origin)
        return origin

    def _issue_in_order(self, timing: list | None, tick: Callable[[int], None]) -> None:
        schedule, streams, issue = self.schedule, self.streams, self.interpreter.issue
        stream_of, waits, recorded = schedule.stream_of, schedule.waits, schedule.recorded
        events: dict[int, Event] = {}
        node = None
        try:
            for node in self.mg.nodes:
                tick(node.id)
                name = stream_of[node.id]
                if name is None:
                    issue(node, None)
                    continue
                stream = streams[name]
                for dep in waits[node.id]:
                    stream.wait(events[dep])
                stream.context = node
                if timing is None:
                    issue(node, stream)
                    if node.id in recorded:
                        events[node.id] = stream.record()
                else:
                    start = stream.record(timing=True)
                    issue(node, stream)
                    end = events[node.id] = stream.record(timing=True)
                    timing.append((node, name, start, end))
        except NodeFailure:
            raise
        except Exception as err:
            raise NodeFailure(err, node, stream_of[node.id] or "host") from err

    def _issue_random(self, seed: int, timing: list | None, tick: Callable[[int], None]) -> None:
        streams, issue, stream_of = self.streams, self.interpreter.issue, self.schedule.stream_of
        nodes = self.mg.nodes
        node = None
        try:
            for issued, node_id in enumerate(random_order(self.mg, seed)):
                tick(issued)
                node = nodes[node_id]
                name = stream_of[node_id]
                if name is None:
                    issue(node, None)
                    continue
                stream = streams[name]
                stream.context = node
                start = stream.record(timing=True) if timing is not None else None
                issue(node, stream)
                if timing is not None:
                    timing.append((node, name, start, stream.record(timing=True)))
                stream.synchronize()
        except NodeFailure:
            raise
        except Exception as err:
            where = stream_of[node.id] if node is not None else None
            raise NodeFailure(err, node, where or "host") from err

    def _trace(self, timing: list[tuple[MemNode, str, Event, Event]], origin: Event) -> Trace:
        spans = [  # named as the simulator names them (`memgraph.trace.node_event`)
            node_event(self.mg, node, name, start.seconds_since(origin), end.seconds_since(origin))
            for node, name, start, end in timing
        ]
        title = f"einpage {self.tg.name} ({self.backend.name}, {self.mode})"
        return Trace(
            spans, clock=self.backend.clock, title=title, metadata={"budget": self.mg.budget}
        )


def _every(progress: Tick | None, total: int) -> Callable[[int], None]:
    """`tick(issued)`: calls `progress(issued, total)` every `ticks(total)` nodes."""
    if progress is None:
        return lambda issued: None
    every = ticks(total)

    def tick(issued: int) -> None:
        if issued % every == 0:
            progress(issued, total)

    return tick


def _public_error(failure: BaseException) -> BaseException:
    """The error a user sees for a failure during a run: einpage errors pass through (with a
    note naming the node), anything else becomes a `BackendError` naming the node."""
    if not isinstance(failure, NodeFailure):
        if isinstance(failure, EinpageError) or not isinstance(failure, Exception):
            return failure
        return BackendError(f"the run failed: {type(failure).__name__}: {failure}")
    error, node = failure.error, failure.context
    where = f"n{node.id} ({node.describe()})" if isinstance(node, MemNode) else str(node)
    if isinstance(error, EinpageError):
        return _naming(error, f"while running {where} on stream {failure.stream!r}")
    return BackendError(
        f"{where} failed on stream {failure.stream!r}: {type(error).__name__}: {error}"
    )


def _naming(error: EinpageError, where: str) -> EinpageError:
    """`error`, its type and attributes kept, with a line saying `where` it happened added
    to its message: `str(error)` (what the CLI prints) says it on every Python, where
    `add_note` (3.11+) shows only in a traceback."""
    message = f"{error}\n{where}"
    error.args = (message,)
    if isinstance(error, ImportError):  # its str() is `msg`, not `args`
        error.msg = message
    return error


def run(
    mg: MemGraph,
    inputs: Mapping[str, Any],
    backend: str | Backend = "auto",
    *,
    mode: str | None = None,
    seed: int = 0,
    trace: str | os.PathLike[str] | None = None,
    poison: bool | None = None,
    unsafe_skip_verify: bool = False,
    **options: Any,
) -> dict[str, np.ndarray]:
    """Execute the plan `mg` on `inputs` (name -> NumPy array); return its outputs.

    Inputs are checked first (names, shapes, dtypes: `InputError`; an array of another
    float or integer type is converted to the input's: `TaskGraph.conform_inputs`), then the plan
    (`memgraph.verify`, once per plan: `VerificationError`). `backend` is "auto"
    (CuPy when a GPU is usable, else NumPy), "numpy" or "cupy"; `mode` is
    "sequential", "streams" (alias "threaded") or "random" (ordered by `seed`);
    `trace` is a path to write a Chrome trace of the run to. Other keywords go to
    `Session` and the backend (see `Session`). Each call allocates the plan's buffers
    and releases them before returning: run a plan many times in a `Session`.

    >>> out = runtime.run(mg, {"x": xs, "w": ws}, backend="numpy")   # doctest: +SKIP
    """
    expect_graph(mg, MemGraph, "runtime.run", PLAN_FIRST)
    inputs = mg.taskgraph.conform_inputs(inputs)
    with Session(
        mg,
        backend,
        mode=mode,
        poison=poison,
        unsafe_skip_verify=unsafe_skip_verify,
        **options,
    ) as session:
        outputs = session.run(inputs, seed=seed, trace=trace is not None)
        if trace is not None:
            session.last.trace.write(trace)
    return outputs
