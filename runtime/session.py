"""Running plans: `run` for one call, `Session` to keep the arena and staged inputs alive.

A `Session` holds one plan or several that run one at a time (a generation's prefill
and decode plans). It verifies each MemGraph (once per plan: `MemGraph.verified`
remembers the verdict on the plan), allocates the device arena once (the bytes the
largest plan uses, at most its budget: `runtime.interpreter.arena_bytes`) and one host
buffer for all of them (`runtime.hostmem`), and creates the streams of its mode.
`stage(weights)` places inputs once, for every plan; each `run(activations, plan=key)`
then places only the inputs it is given, issues every node of that plan in the mode's
order, synchronizes, and returns the outputs as fresh host NumPy arrays.
`session.last` is a `RunReport` (timings, the trace when asked for, memory and kernel
counters). Closing it (or leaving its `with` block) stops the streams, unregisters
host memory read in place, drops the buffers and closes a backend it made.

Errors name the node they happened at. A kernel on a GPU runs after it is issued, so
its failure surfaces at a later call: in debug mode (`debug=True`, `EINPAGE_SYNC=1`,
`einpage run --sync`) the session synchronizes after each node, and the error names
the node that failed, its line; otherwise a sticky CUDA error (the device context is
lost) raises `ContextLostError` listing the nodes in flight.

A plan with a host tier (`MemGraph.tier`, `runtime.tiers`) runs alone in its session
(a session of several plans refuses one with a tier: a generation's step plans with
tiers are not supported yet). Its disk files are opened when the session opens, before
anything is allocated (`runtime.diskio.DiskFiles`: checkpoints checked, the spill file
created in the folder `spill=` names, which a plan with a spill file requires; with
`direct_io=True` each file also opened with `O_DIRECT` where its file system allows), and
closed – the spill file removed – when it closes; its host arena is allocated once
with the other buffers. Its runs take only the inputs that are not on disk: a weight
the plan reads from its checkpoint, given anyway, is refused (`InputError`).

`run` makes a session per call and closes it before returning: nothing of a run
outlives it, in this module or elsewhere. Fresh buffers cost their first-touch page
faults on every call (on a 122 MiB NumPy arena, about 180 ms against 90 ms of compute:
`benchmarks/runtime_bench.py`), so repeated runs of one plan belong in a `Session`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
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
from runtime.diskio import DiskFiles
from runtime.hostmem import HomeKey, HostLayout, HostSlot, Registrations, SharedHost, aligned
from runtime.interpreter import POISON_BYTE, Interpreter, arena_bytes
from runtime.schedule import Schedule, check_dependencies, random_order, resolve_mode
from runtime.tiers import DiskPort, disk_inputs, refuse_disk_inputs
from runtime.trace import Trace

__all__ = [
    "run",
    "Session",
    "RunReport",
    "verified",
    "pinned_bytes",
    "HostBudgetError",
    "ContextLostError",
    "SYNC_VARIABLE",
]

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
    the host. `memory` (bytes): `arena_bytes` (what this plan uses of the arena),
    `arena_allocated_bytes` (the session's arena: its largest plan's), `device_peak_bytes`
    (the arena plus any other device memory the run allocated, on CuPy from its memory
    pool's high-water mark), on CuPy `scratch_peak_bytes` and `scratch_limit`; and the
    host memory: `host_bytes` (allocated: the session's buffer and any pinned copies of
    weights that could not be read in place), `host_in_place_bytes` (the inputs read
    where the caller holds them, as `pinned_bytes` counts them) and
    `host_registered_bytes` (the whole pages registered for them).
    `counters` says how kernels ran (e.g. `cublas`, `einsum_fallback`). `disk_direct`
    says, for each disk file of a plan with a host tier (`HostTier.files`), whether its
    transfers were direct (`O_DIRECT`) rather than through the page cache (empty without
    a tier).
    """

    backend: str
    mode: str
    seconds: float
    nodes: int
    seed: int | None
    trace: Trace | None = None
    memory: dict[str, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    disk_direct: tuple[bool, ...] = ()

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


def conform_caller_inputs(mg: MemGraph, inputs: Any, key: Any = None) -> dict[str, Any]:
    """`TaskGraph.conform_inputs` of the inputs a caller passes: every input but those the
    plan reads from disk itself (`runtime.tiers.disk_inputs`), which are refused."""
    on_disk = disk_inputs(mg)
    if not on_disk:
        return mg.taskgraph.conform_inputs(inputs)
    if not isinstance(inputs, Mapping):
        raise InputError(f"inputs must be a mapping of name to array, got {type(inputs).__name__}")
    refuse_disk_inputs(mg, inputs, key)
    conformed = mg.taskgraph.conform_inputs({**disk_stand_ins(mg), **inputs})
    return {name: value for name, value in conformed.items() if name not in on_disk}


def disk_stand_ins(mg: MemGraph) -> dict[str, Any]:
    """Stand-ins (the shape and dtype, no data) for the inputs `mg` reads from disk itself,
    so that what a caller passes is checked with the graph's own checks."""
    on_disk = disk_inputs(mg)
    return {name: v for name, v in _placeholders(mg, {}).items() if name in on_disk}


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


def refuse_tier_plans(plans: Mapping[Any, MemGraph], carries_peers: bool) -> None:
    """`BackendError` naming the plan when a session cannot run a plan with a host tier:
    one of several plans (generation step plans with tiers are not supported), or a
    device's share of a plan for several devices."""
    tiered = [key for key, mg in plans.items() if mg.tier is not None]
    if not tiered:
        return
    mg = plans[tiered[0]]
    name = f"{mg.taskgraph.name!r}" + (f" (plan {tiered[0]!r})" if len(plans) > 1 else "")
    if carries_peers:
        raise BackendError(
            f"{name} has a host tier ({mg.tier}): a plan for several devices with host "
            "tiers cannot run (runtime.run_devices, LocalDevices, RayDevices refuse them)"
        )
    if len(plans) > 1:
        raise BackendError(
            f"{name} has a host tier ({mg.tier}), and a session of several plans cannot "
            f"run plans with host tiers ({len(tiered)} of its {len(plans)} plans have one): "
            "run it alone, in runtime.run or a Session of that plan"
        )


def refuse_peer_nodes(mg: MemGraph, key: Any = None) -> None:
    """`BackendError` when `mg` (plan `key` of a session, if given) has `send` or `recv`
    nodes: a device's share of a plan for several devices with direct links runs only
    with its other devices, before anything is allocated."""
    peer = [n for n in mg.nodes if n.kind in (NodeKind.SEND, NodeKind.RECV)]
    if peer:
        which = f"plan {key!r} " if key is not None else ""
        raise BackendError(
            f"{which}{mg.taskgraph.name!r} has {len(peer)} send/recv node(s) copying "
            f"between devices (first: n{peer[0].id} ({peer[0].describe()})): a device's "
            "plan with direct sends runs only with its other devices (runtime.run_devices, "
            "runtime.multi.LocalDevices, runtime.ray_cluster.RayDevices on the MultiPlan)"
        )


class HostBudgetError(BackendError):
    """The plan needs more host (pinned) memory than the session's `host_budget`."""


class ContextLostError(BackendError):
    """The device can run nothing more: a sticky CUDA error (an illegal address, a
    kernel fault) lost the context. `in_flight` are the nodes that were issued since the
    last completed synchronization, among which is the one that faulted."""

    def __init__(self, message: str, in_flight: tuple[int, ...] = ()):
        super().__init__(message)
        self.in_flight = in_flight


SYNC_VARIABLE = "EINPAGE_SYNC"
"""The environment variable that turns on the synchronous debug mode of every session
(`Session(..., debug=True)`): "1", "true", "yes" or "on"."""


def _debug_from_environment() -> bool:
    return os.environ.get(SYNC_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


Plans = MemGraph | Mapping[Any, MemGraph] | Sequence[MemGraph]
"""What a session holds: one plan, plans by key, or a list of plans (keyed 0, 1, ...)."""


def _keyed(plans: Any, where: str) -> dict[Any, MemGraph]:
    """`plans` by key: a single plan's key is 0, a list's its positions."""
    if isinstance(plans, MemGraph):
        return {0: plans}
    if isinstance(plans, Mapping):
        keyed = dict(plans)
    elif isinstance(plans, Sequence) and not isinstance(plans, str | bytes):
        keyed = dict(enumerate(plans))
    else:
        expect_graph(plans, MemGraph, where, PLAN_FIRST)
        raise AssertionError("unreachable")  # expect_graph raised
    if not keyed:
        raise BackendError(f"{where} needs at least one plan, got none")
    for plan in keyed.values():
        expect_graph(plan, MemGraph, where, PLAN_FIRST)
    return keyed


def pinned_bytes(plans: Plans) -> int:
    """The bytes of host memory a staging backend (CuPy: page-locked memory) pins for
    a session over `plans` (one plan, or all the plans of a generation), once: a home
    for every input (a host storage the plan reloads from, or the staging slot of a
    device-side input; plans that read the same input share it), and the largest plan's
    scratch (its offloaded tensors, outputs assembled on the host and the staging slots
    of device-side outputs), each rounded up to 256 B. Nothing else is pinned: sliced
    reloads and host-assembled outputs copy boxes of these slots.

    On CuPy a large weight's home is the caller's array, registered in place
    (`runtime.hostmem`): its bytes are pinned where the caller holds them, not
    allocated; the figure counts them either way."""
    keyed = _keyed(plans, "runtime.pinned_bytes")
    return SharedHost.of(list(keyed.values()), True, None).promise


def check_host_budget(
    shared: SharedHost, host_budget: int | str | None, backend: Backend, arena: int = 0
) -> None:
    """`HostBudgetError` when the session's host memory (`shared.promise`) is more than
    `host_budget` bytes – or, without one, when it and an `arena` of host memory
    (NumPy's) need more than the host memory available now
    (`einpage_core.host.available_memory`), before anything is allocated."""
    host = shared.promise
    if host_budget is None:
        available = available_memory()
        need = host + (arena if backend.arena_on_host else 0)
        if available is not None and need > available:
            raise HostBudgetError(
                f"the plan needs {format_bytes(need)} ({need} bytes) of host memory – "
                f"{format_bytes(host)} of host storage"
                + (f" and a {format_bytes(arena)} arena" if backend.arena_on_host else "")
                + f" – and {format_bytes(available)} is available: "
                + (
                    "the NumPy backend's arena is host memory as large as the plan's device "
                    "memory, so plan with a smaller budget, or free memory"
                    if backend.arena_on_host and arena > host
                    else "free memory, or plan with a larger budget (fewer offloads)"
                )
            )
        return
    limit = parse_bytes(host_budget)
    if host > limit:
        kind = "pinned host" if backend.host_staging else "host"
        homes = len(shared.homes)
        scratch = max(len(p.storages) + len(p.outputs) for p in shared.plans)
        raise HostBudgetError(
            f"the plan needs {format_bytes(host)} ({host} bytes) of {kind} memory, over the "
            f"host budget of {format_bytes(limit)} ({limit} bytes): {homes} inputs' homes "
            f"({len(shared.in_place)} read in place) and up to {scratch} host storages and "
            "staged outputs of a run; raise host_budget, or plan with a larger device budget "
            "(fewer offloads)"
        )


@dataclass
class _Plan:
    """One plan of a session, ready to run: its schedule in the session's mode, its view
    of the host buffer, its interpreter, and what `stage` and `run` look up."""

    key: Any
    mg: MemGraph
    schedule: Schedule
    layout: HostLayout
    interpreter: Interpreter | None = None
    input_nodes: dict[str, MemNode] = field(default_factory=dict)
    output_nodes: dict[str, MemNode] = field(default_factory=dict)
    scratch: list[int] = field(default_factory=list)  # storages poisoned before a run

    @property
    def tg(self) -> Any:
        return self.mg.taskgraph



def check_shared_inputs(plans: Mapping[Any, MemGraph]) -> None:
    """`InputError` when two plans read an input of one name that states different facts
    (page 2 of layer 0's keys in one plan, page 0 of layer 1's values in another): a
    session shares an input by its name, shape and dtype between plans, so one name must
    mean one tensor in all of them."""
    seen: dict[str, tuple[Any, tuple]] = {}
    for key, mg in plans.items():
        tg = mg.taskgraph
        for name, task_id in tg.inputs.items():
            task = tg[task_id]
            first = seen.setdefault(name, (key, task.facts))
            if first[1] != task.facts:
                raise InputError(
                    f"input {name!r} of plan {key!r} states {list(task.facts)} but plan "
                    f"{first[0]!r}'s input of that name states {list(first[1])}: the plans of "
                    "one session share inputs by name, so a name must mean one tensor in every "
                    "plan (rename one of them)"
                )


class Session:
    """Plans ready to run many times on one backend (see the module docstring).

    `plans` is one MemGraph, or several – by key (a mapping) or by position (a list) –
    that run one at a time in one arena (as large as the largest plan's) and one host
    buffer (`runtime.hostmem`: every input's home once, the largest plan's scratch),
    with inputs staged once for all of them: a generation's prefill and decode plans.
    `run(inputs, plan=key)` runs one (default: the first).

    Parameters: `backend` ("auto", "numpy", "cupy" or a `Backend`), `mode`
    ("sequential", "streams" a.k.a. "threaded", "random"; default: the backend's),
    `poison` (fill freed and unwritten memory with 0xFF bytes so that a missing
    dependency reads NaNs; default: on in random mode), `unsafe_skip_verify` (run
    without `memgraph.verify`; for tests that break plans on purpose), `host_budget`
    (bytes or a size string: the most host memory the session may pin –
    `pinned_bytes(plans)` – refused up front with `HostBudgetError` when the plans need
    more), `debug` (synchronize after each node, so that a failure names the node that
    failed, its line; default: on when the environment sets `EINPAGE_SYNC=1`), and
    backend options (NumPy: `timeout`; CuPy: `scratch`, `device`). `spill`: the folder a
    plan with a host tier creates its spill file in (required when it has one);
    `direct_io`: its disk files also opened with `O_DIRECT` where the file system allows
    (`runtime.diskio`), keeping the page cache out of the run's host memory – off by
    default: with free memory a re-read checkpoint is read faster from the page cache.

    Setting up takes a few steps (`_check_plans`, `_open_disk`, `_open_backend`,
    `_plan_memory`, `_allocate`, `_open_streams`, `_start`), each registering the release of what it
    acquired on one `ExitStack`: when a step fails, what the earlier ones acquired is
    released before the error propagates, and `close()` releases the same way – every
    buffer, staged input and registration is dropped then, not when the session is
    collected.

    >>> with Session(mg, "numpy") as s:                          # doctest: +SKIP
    ...     s.stage({"w": w})
    ...     ys = [s.run({"x": x})["y"] for x in batches]
    >>> with Session({"prefill": p, "decode": d}, "cupy") as s:   # doctest: +SKIP
    ...     s.stage(weights)                                     # once, for both plans
    ...     first = s.run(prompt, plan="prefill")
    ...     step = s.run(step_inputs, plan="decode")
    """

    def __init__(
        self,
        plans: Plans,
        backend: str | Backend = "auto",
        *,
        mode: str | None = None,
        poison: bool | None = None,
        unsafe_skip_verify: bool = False,
        host_budget: int | str | None = None,
        debug: bool | None = None,
        spill: str | os.PathLike[str] | None = None,
        direct_io: bool = False,
        **options: Any,
    ):
        self._closed = True  # until every step below succeeded: close() has nothing to do
        self.plans = _keyed(plans, "runtime.Session")
        self.debug = _debug_from_environment() if debug is None else bool(debug)
        self._check_plans(unsafe_skip_verify)
        with contextlib.ExitStack() as acquired:
            self._open_disk(spill, direct_io, acquired)
            self._open_backend(backend, options, acquired)
            self._plan_memory(mode, poison, host_budget)
            self._allocate(acquired)
            self._open_streams(acquired)
            self._start()
            self._release = acquired.pop_all()  # on success, close() releases it all
        self._closed = False

    # -- the plan of the last run (the first, before any) --------------------------

    @property
    def mg(self) -> MemGraph:
        return self._current.mg

    @property
    def tg(self) -> Any:
        return self._current.tg

    @property
    def schedule(self) -> Schedule:
        return self._current.schedule

    @property
    def layout(self) -> HostLayout:
        return self._current.layout

    @property
    def interpreter(self) -> Interpreter | None:
        return self._current.interpreter

    # -- setting up (in this order; see the class docstring) ----------------------

    carries_peers = False
    """Whether runs can carry `send` and `recv` nodes to other devices (a device's runner,
    `runtime.multi.DeviceRunner`); a plain session refuses plans that have them."""

    def _check_plans(self, unsafe_skip_verify: bool) -> None:
        """Each plan passes `memgraph.verify` (or, unverified, its dependencies point back),
        an input name several plans read means one tensor in all of them, and – unless
        the session carries sends to other devices – no plan copies between devices."""
        for mg in self.plans.values():
            if unsafe_skip_verify:
                check_dependencies(mg)
            else:
                verified(mg)
        check_shared_inputs(self.plans)
        refuse_tier_plans(self.plans, self.carries_peers)
        if not self.carries_peers:
            for key, mg in self.plans.items():
                refuse_peer_nodes(mg, key if len(self.plans) > 1 else None)

    def _open_disk(self, spill: Any, direct_io: bool, acquired: contextlib.ExitStack) -> None:
        """The disk files of the plan with a host tier, if any (`runtime.diskio`; with
        `O_DIRECT` where allowed when `direct_io`), closed – the spill file removed – on
        release; before anything is allocated."""
        self.disk_files: DiskFiles | None = None
        tiered = [mg for mg in self.plans.values() if mg.tier is not None]
        if direct_io and not tiered:
            raise InputError(
                "direct_io=True moves a host tier's disk bytes with O_DIRECT, and this plan "
                "has no host tier (no disk files): leave it out"
            )
        if tiered:
            self.disk_files = DiskFiles.open(tiered[0].tier, spill, direct=direct_io)
            acquired.callback(self.disk_files.close)

    def _open_backend(
        self, backend: str | Backend, options: dict[str, Any], acquired: contextlib.ExitStack
    ) -> None:
        """The backend, closed on release when the session made it; refuses a plan holding
        a dtype the backend cannot run."""
        # "auto" picks a backend that runs every plan's dtypes
        dtypes = {task.dtype for mg in self.plans.values() for task in mg.taskgraph.tasks}
        self.backend = get_backend(backend, dtypes=dtypes, **options)
        if not isinstance(backend, Backend):  # made here: the session owns it
            acquired.callback(self.backend.close)
        for mg in self.plans.values():
            refuse_unsupported(mg, self.backend)
            self.backend.check_plan(mg)

    def _plan_memory(self, mode: str | None, poison: bool | None, host_budget: Any) -> None:
        """The mode, each plan's schedule and the host layout; refuses plans needing more
        host memory than `host_budget` (or than is available) before anything is
        allocated."""
        self.mode = resolve_mode(mode, self.backend.default_mode)
        self.poison = self.mode == "random" if poison is None else bool(poison)
        staging = self.backend.host_staging
        in_place = self.backend.in_place_min if staging else None
        mgs = list(self.plans.values())
        self.host_layout = SharedHost.of(mgs, staging, in_place)
        self._plans = {
            key: _Plan(key, mg, Schedule.build(mg, self.mode, self.poison), layout)
            for (key, mg), layout in zip(self.plans.items(), self.host_layout.plans, strict=True)
        }
        self._current = next(iter(self._plans.values()))
        self.arena_nbytes = max(arena_bytes(mg) for mg in mgs)
        check_host_budget(self.host_layout, host_budget, self.backend, self.arena_nbytes)

    def _allocate(self, acquired: contextlib.ExitStack) -> None:
        """The arena and the host buffer (once, for every plan), and the registrations of
        inputs read in place; all dropped on release (the interpreters with them)."""
        self.arena: Any = None
        self.host: np.ndarray | None = None
        self._copies: list[np.ndarray] = []  # pinned copies of inputs not read in place
        self._staged: dict[HomeKey, np.ndarray] = {}
        self._registrations = Registrations(self.backend)
        acquired.callback(self._drop_buffers)
        acquired.callback(self._registrations.close)  # before the buffers are dropped
        self.tier_arena: np.ndarray | None = None
        self.arena = self.backend.allocate_arena(self.arena_nbytes)
        self.host = self.backend.allocate_host(self.host_layout.nbytes)
        if self.disk_files is not None:
            self.tier_arena = self.backend.allocate_host(self.host_layout.tier_bytes)
        if self.poison:
            self.host.fill(POISON_BYTE)
            if self.tier_arena is not None:
                self.tier_arena.fill(POISON_BYTE)

    def _drop_buffers(self) -> None:
        """Drop every reference to device and host memory: the interpreters (their views,
        the arrays bound to their storages), the staged inputs and the copies."""
        for plan in self._plans.values():
            plan.interpreter = None
        self._staged.clear()
        self._copies.clear()
        self.arena = self.host = self.tier_arena = None

    def _open_streams(self, acquired: contextlib.ExitStack) -> None:
        """One stream per stream of the schedules, each closed on release."""
        concurrent = self.mode == "streams"
        self.streams: dict[str, Stream] = {}
        for plan in self._plans.values():
            for name in plan.schedule.streams:
                if name in self.streams:
                    continue
                stream = self.backend.stream(name, concurrent)
                acquired.callback(stream.close)
                self.streams[name] = stream

    def _start(self) -> None:
        """An interpreter per plan over the buffers, and what `stage` and `run` look up."""
        self._uses: dict[HomeKey, list[tuple[_Plan, MemNode]]] = {}
        self._keys_of: dict[str, dict[HomeKey, _Plan]] = {}  # input name -> homes
        for plan in self._plans.values():
            plan.interpreter = Interpreter(
                plan.mg, self.backend, self.arena, self.host, plan.layout, self.poison
            )
            if plan.mg.tier is not None:
                plan.interpreter.tier_arena = self.tier_arena
                plan.interpreter.disk = DiskPort(
                    plan.mg, self.disk_files, self.tier_arena, POISON_BYTE if self.poison else None
                )
            nodes = plan.mg.nodes
            on_disk = disk_inputs(plan.mg)
            plan.input_nodes = {
                n.name: n for n in nodes if n.kind is NodeKind.INPUT and n.name not in on_disk
            }
            plan.output_nodes = {n.name: n for n in nodes if n.kind is NodeKind.OUTPUT}
            homes = {n.storage for n in plan.input_nodes.values()}
            plan.scratch = sorted(set(plan.layout.storages) - homes)
            for name, node in plan.input_nodes.items():
                key = plan.layout.homes[name]
                self._uses.setdefault(key, []).append((plan, node))
                self._keys_of.setdefault(name, {}).setdefault(key, plan)
        self._in_flight: list[MemNode] = []
        self._lost: ContextLostError | None = None
        self.last: RunReport | None = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"staged={self.staged}"
        plans = "" if len(self._plans) == 1 else f" plans={len(self._plans)}"
        return (
            f"<Session {self.tg.name!r}{plans} backend={self.backend.name} mode={self.mode} "
            f"budget={format_bytes(self.mg.budget)} {state}>"
        )

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """Stop the streams, unregister host memory read in place, drop the arena and host
        memory, and close the backend if the session made it (what a failed set-up
        releases, in the same way). After a lost device context what fails to release
        is ignored: nothing can be released on that device any more."""
        if self._closed:
            return
        self._closed = True
        if self._lost is not None:
            with contextlib.suppress(Exception):
                self._release.close()
            return
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
        if self._lost is not None:
            raise BackendError(
                f"this Session cannot run: its device context was lost in an earlier run "
                f"({self._lost.args[0].splitlines()[0]})"
            )

    def _plan(self, key: Any) -> _Plan:
        if key is None:
            return next(iter(self._plans.values()))
        plan = self._plans.get(key)
        if plan is None:
            known = ", ".join(repr(k) for k in self._plans)
            raise InputError(f"this Session has no plan {key!r}; its plans: {known}")
        return plan

    # -- inputs ------------------------------------------------------------------

    def stage(self, arrays: Mapping[str, Any]) -> None:
        """Place inputs (typically weights) once, for every plan that reads them; later
        runs use them unless given again.

        The arrays are read where they are (NumPy; on CuPy, large weights registered in
        place, `runtime.hostmem`) or copied into their homes in the host buffer: do not
        change an array while it is staged (stage it again after changing it). With
        several plans, an input whose shape differs between plans (a rotary table for
        another number of positions) goes to the plans whose shape it has.
        """
        self._check_open()
        if not isinstance(arrays, Mapping):
            raise InputError(
                f"inputs must be a mapping of name to array, got {type(arrays).__name__}"
            )
        _reject_device_arrays(arrays)
        for key, mg in self.plans.items():
            refuse_disk_inputs(mg, arrays, key if len(self.plans) > 1 else None)
        given: dict[Any, dict[str, Any]] = {}  # plan key -> the arrays checked against it
        wanted: list[tuple[HomeKey, Any, str]] = []
        for name, value in arrays.items():
            for key, plan in self._homes_for(name, value).items():
                given.setdefault(plan.key, {})[name] = value
                wanted.append((key, plan.key, name))
        conformed = {k: _conform_partial(self._plans[k].mg, a) for k, a in given.items()}
        values = {key: conformed[plan][name] for key, plan, name in wanted}
        self._staged.update(self._place(values))

    def _homes_for(self, name: str, value: Any) -> dict[HomeKey, _Plan]:
        """The homes of input `name` that `value` is for: its only one, or those of its
        shape; `InputError` for a name no plan has, or a shape none takes."""
        homes = self._keys_of.get(name)
        if homes is None:
            known = ", ".join(repr(n) for n in self._keys_of)
            raise InputError(f"unknown input(s) {name!r}; inputs are {known}")
        if len(homes) == 1:
            return homes  # `_conform_partial` says what is wrong with the value, if anything
        shape = tuple(np.shape(value))
        fitting = {key: plan for key, plan in homes.items() if key[1] == shape}
        if not fitting:
            shapes = ", ".join(f"{list(key[1])} (plan {plan.key!r})" for key, plan in homes.items())
            raise InputError(f"input {name!r} has shape {list(shape)}; the plans take {shapes}")
        return fitting

    @property
    def staged(self) -> tuple[str, ...]:
        """Names of the staged inputs."""
        return tuple(dict.fromkeys(key[0] for key in self._staged))

    def _place(self, values: Mapping[HomeKey, Any]) -> dict[HomeKey, np.ndarray]:
        """Put each value in its home and point every plan that reads the home at it;
        return what now holds each. Homes in the host buffer get a copy; a weight read in
        place is registered where it is (or, when that cannot be done, copied into pinned
        memory allocated now); on NumPy, an input without a home is read where it is."""
        layout = self.host_layout
        placed: dict[HomeKey, np.ndarray] = {}
        in_place = {}
        for key, value in values.items():
            array = np.asarray(value).reshape(key[1])  # 0-d stays 0-d
            if key in layout.in_place:
                in_place[key] = np.ascontiguousarray(array)
                continue
            slot = layout.homes.get(key)
            if slot is None:
                placed[key] = np.ascontiguousarray(array)
            else:
                placed[key] = home = slot.of(self.host)
                np.copyto(home, array)
        if in_place:
            read = self._registrations.place(in_place)
            placed.update({key: in_place[key] for key in read})
            placed.update(self._copy_pinned({k: v for k, v in in_place.items() if k not in read}))
        for key, array in placed.items():
            for plan, node in self._uses.get(key, ()):
                interp = plan.interpreter
                if node.storage is None:
                    interp.sources[node.name] = array
                elif node.storage in plan.layout.aliased:
                    interp.bind_host(
                        node.storage, array.reshape(plan.mg.storages[node.storage].shape)
                    )
        return placed

    def _copy_pinned(self, arrays: Mapping[HomeKey, np.ndarray]) -> dict[HomeKey, np.ndarray]:
        """Copies of `arrays` in one pinned allocation, kept until the session closes."""
        if not arrays:
            return {}
        total = sum(aligned(a.nbytes) for a in arrays.values())
        block = self.backend.allocate_host(total)
        self._copies.append(block)
        copies, offset = {}, 0
        for key, array in arrays.items():
            slot = HostSlot(offset, key[1], key[2])
            copies[key] = copy = slot.of(block)
            np.copyto(copy, array)
            offset += aligned(slot.nbytes)
        return copies

    # -- running -----------------------------------------------------------------

    def run(
        self,
        inputs: Mapping[str, Any] | None = None,
        *,
        plan: Any = None,
        seed: int = 0,
        trace: bool = False,
        progress: Tick | None = None,
    ) -> dict[str, np.ndarray]:
        """Run a plan (`plan`: its key; default the first) on `inputs` (plus the staged
        ones); return the outputs on the host.

        An input given here that was staged replaces the staged value (for later runs
        too). `seed` orders the random mode; `trace=True` records a timing trace
        (`self.last.trace`); `progress` is called as `progress(nodes issued, nodes)`
        about a hundred times, and `(nodes, nodes)` once every stream is done.
        """
        self._check_open()
        chosen = self._plan(plan)
        inputs = {} if inputs is None else inputs
        if not isinstance(inputs, Mapping):
            raise InputError(
                f"inputs must be a mapping of name to array, got {type(inputs).__name__}"
            )
        _reject_device_arrays(inputs)
        homes = chosen.layout.homes
        staged = {name: self._staged[k] for name, k in homes.items() if k in self._staged}
        conformed = conform_caller_inputs(chosen.mg, {**staged, **inputs})
        started = time.perf_counter()
        placed = self._place({homes[name]: conformed[name] for name in inputs})
        self._staged.update({key: a for key, a in placed.items() if key in self._staged})
        self._current = chosen
        chosen.interpreter.results = self._result_buffers(chosen)
        timing = self._execute(chosen, seed, trace, progress)
        outputs = self._collect(chosen)
        seconds = time.perf_counter() - started
        self.last = RunReport(
            backend=self.backend.name,
            mode=self.mode,
            seconds=seconds,
            nodes=len(chosen.mg.nodes),
            seed=seed if self.mode == "random" else None,
            trace=timing,
            memory=self._memory(chosen),
            counters=self.backend.counters(),
            disk_direct=self.disk_files.direct if self.disk_files is not None else (),
        )
        return outputs

    def _memory(self, plan: _Plan) -> dict[str, int]:
        """The run's memory report: the backend's (device), and the host memory – the
        buffer and the pinned copies (`host_bytes`), the inputs read in place
        (`host_in_place_bytes`, counted as `pinned_bytes` counts them) and the pages
        registered for them (`host_registered_bytes`)."""
        in_place = {key for key in self._registrations.placed if key in self.host_layout.in_place}
        return {
            **self.backend.memory_report(plan.interpreter.arena_bytes),
            "arena_bytes": plan.interpreter.arena_bytes,
            "arena_allocated_bytes": self.arena_nbytes,
            "host_bytes": self.host_layout.nbytes
            + self.host_layout.tier_bytes
            + sum(c.nbytes for c in self._copies),
            "host_tier_bytes": self.host_layout.tier_bytes,
            "host_in_place_bytes": sum(self.host_layout.in_place[key] for key in in_place),
            "host_registered_bytes": self._registrations.registered_bytes,
        }

    def _result_buffers(self, plan: _Plan) -> dict[str, np.ndarray]:
        buffers = {}
        for name, node in plan.output_nodes.items():
            if node.region is None:
                continue
            if self.backend.host_staging:
                buffers[name] = plan.layout.outputs[name].of(self.host)
            else:
                task = plan.tg[plan.tg.outputs[name]]
                buffers[name] = np.empty(task.shape, dtype=task.dtype)
        return buffers

    def _collect(self, plan: _Plan, skip: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
        """Every output of the plan's TaskGraph, as host arrays of the caller's own, but
        those in `skip` (a device's outputs only sent direct: no output node has them)."""
        outputs = {}
        tg, interp = plan.tg, plan.interpreter
        for name, task_id in tg.outputs.items():
            if name in skip:
                continue
            node = plan.output_nodes.get(name)
            task = tg[task_id]
            if node is None:
                raise BackendError(f"the plan never produces output {name!r}")
            if node.storage is not None:
                value = interp.host_array(node).reshape(task.shape)
                outputs[name] = np.array(value, copy=True)
            elif self.backend.host_staging:
                outputs[name] = np.array(interp.results[name], copy=True)
            else:
                outputs[name] = interp.results[name]
        return outputs

    def _execute(
        self, plan: _Plan, seed: int, tracing: bool, progress: Tick | None = None
    ) -> Trace | None:
        """Issue every node in the mode's order, synchronize, and raise the first failure."""
        timing: list[tuple[MemNode, str, Event, Event]] | None = [] if tracing else None
        origin: Event | None = None
        failure: BaseException | None = None
        total = len(plan.mg.nodes)
        self._in_flight = []
        with self.backend.running():
            try:
                if self.poison:
                    self._poison_scratch(plan)
                if self.poison or tracing:
                    origin = self._barrier(plan)
                tick = _every(progress, total)
                if plan.schedule.mode == "random":
                    self._issue_random(plan, seed, timing, tick)
                else:
                    self._issue_in_order(plan, timing, tick)
            except BaseException as err:
                failure = err
            self._drain(failure)
            self._in_flight = []
        if progress is not None:
            progress(total, total)
        if timing is None:
            return None
        return self._trace(plan, timing, origin)

    def _drain(self, failure: BaseException | None) -> None:
        """Synchronize every stream, even after `failure` (what stopped issuing, or None),
        then raise the first failure as the public error naming its node."""
        for stream in self.streams.values():
            try:
                stream.synchronize()
            except BaseException as err:
                failure = failure or err
        for plan in self._plans.values():  # host work run as CUDA host functions
            disk = plan.interpreter.disk if plan.interpreter is not None else None
            if disk is not None:
                failure = failure or disk.take_failure()
        if failure is not None:
            raise self._failed(failure) from (
                failure.error if isinstance(failure, NodeFailure) else failure
            )

    def _failed(self, failure: BaseException) -> BaseException:
        """The error to raise for `failure`; a lost device context is remembered (the
        session refuses later runs) and named with the nodes that were in flight."""
        error = failure.error if isinstance(failure, NodeFailure) else failure
        lost = self.backend.lost_context(error)
        public = _public_error(failure, lost, tuple(self._in_flight), self.debug)
        if isinstance(public, ContextLostError):
            self._lost = public
        return public

    def _poison_scratch(self, plan: _Plan) -> None:
        stream = self.streams[plan.schedule.streams[0]]
        stream.context = "poisoning the arena"
        whole = self.backend.view(self.arena, 0, (plan.interpreter.arena_bytes,), "uint8")
        self.backend.fill_bytes(whole, POISON_BYTE, stream)
        for storage in plan.scratch:
            slot = plan.layout.storages[storage]
            self.host[slot.offset : slot.offset + slot.nbytes] = POISON_BYTE
        if plan.mg.tier is not None and self.tier_arena is not None:
            self.tier_arena.fill(POISON_BYTE)

    def _barrier(self, plan: _Plan) -> Event:
        """An event on the first stream that every other stream waits for: the poisoning
        is done before any node's work, and the trace's times are measured from it."""
        first, *others = plan.schedule.streams
        origin = self.streams[first].record(timing=True)
        for name in others:
            self.streams[name].wait(origin)
        return origin

    def _settle(self, node: MemNode, name: str, stream: Stream) -> None:
        """Debug mode: wait for `node`'s work, so that a failure is raised at it."""
        try:
            stream.synchronize()
        except NodeFailure:
            raise
        except Exception as err:
            raise NodeFailure(err, node, name) from err
        self._in_flight.clear()

    def _issue_in_order(
        self, plan: _Plan, timing: list | None, tick: Callable[[int], None]
    ) -> None:
        schedule, streams, issue = plan.schedule, self.streams, plan.interpreter.issue
        stream_of, waits, recorded = schedule.stream_of, schedule.waits, schedule.recorded
        events: dict[int, Event] = {}
        in_flight, debug = self._in_flight, self.debug
        node = None
        try:
            for node in plan.mg.nodes:
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
                    in_flight.append(node)
                    if node.id in recorded:
                        events[node.id] = stream.record()
                else:
                    start = stream.record(timing=True)
                    issue(node, stream)
                    in_flight.append(node)
                    end = events[node.id] = stream.record(timing=True)
                    timing.append((node, name, start, end))
                if debug:
                    self._settle(node, name, stream)
        except NodeFailure:
            raise
        except Exception as err:
            raise NodeFailure(err, node, stream_of[node.id] or "host") from err

    def _issue_random(
        self, plan: _Plan, seed: int, timing: list | None, tick: Callable[[int], None]
    ) -> None:
        streams, issue, stream_of = self.streams, plan.interpreter.issue, plan.schedule.stream_of
        nodes = plan.mg.nodes
        node = None
        try:
            for issued, node_id in enumerate(random_order(plan.mg, seed)):
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
                self._in_flight.append(node)
                if timing is not None:
                    timing.append((node, name, start, stream.record(timing=True)))
                self._settle(node, name, stream)  # each node done before the next starts
        except NodeFailure:
            raise
        except Exception as err:
            where = stream_of[node.id] if node is not None else None
            raise NodeFailure(err, node, where or "host") from err

    def _trace(
        self, plan: _Plan, timing: list[tuple[MemNode, str, Event, Event]], origin: Event
    ) -> Trace:
        mg = plan.mg
        spans = [  # named as the simulator names them (`memgraph.trace.node_event`)
            node_event(mg, node, name, start.seconds_since(origin), end.seconds_since(origin))
            for node, name, start, end in timing
        ]
        title = f"einpage {mg.taskgraph.name} ({self.backend.name}, {self.mode})"
        return Trace(spans, clock=self.backend.clock, title=title, metadata={"budget": mg.budget})


def _every(progress: Tick | None, total: int) -> Callable[[int], None]:
    """`tick(issued)`: calls `progress(issued, total)` every `ticks(total)` nodes."""
    if progress is None:
        return lambda issued: None
    every = ticks(total)

    def tick(issued: int) -> None:
        if issued % every == 0:
            progress(issued, total)

    return tick


IN_FLIGHT_SHOWN = 8
"""How many of the nodes in flight a lost-context error lists (the latest ones)."""


def _public_error(
    failure: BaseException,
    lost: str | None = None,
    in_flight: tuple[MemNode, ...] = (),
    debug: bool = False,
) -> BaseException:
    """The error a user sees for a failure during a run: einpage errors pass through (with a
    note naming the node), anything else becomes a `BackendError` naming the node – in
    debug mode with the node's whole line. When the backend says the device context is
    `lost` (a sticky CUDA error), a `ContextLostError`: that the device can run nothing
    more, where the error surfaced, and – outside debug mode, where it surfaced at the
    node that failed – the nodes `in_flight`, one of which faulted."""
    if not isinstance(failure, NodeFailure):
        if lost is not None:
            return _context_lost(lost, f"surfaced ({type(failure).__name__}: {failure})", in_flight)
        if isinstance(failure, EinpageError) or not isinstance(failure, Exception):
            return failure
        return BackendError(f"the run failed: {type(failure).__name__}: {failure}")
    error, node = failure.error, failure.context
    if not isinstance(error, Exception) and lost is None:
        return error  # an interruption (KeyboardInterrupt) in a stream's work stays one
    if isinstance(node, MemNode):
        where = node.line() if debug else f"n{node.id} ({node.describe()})"
    else:
        where = str(node)
    if lost is not None:
        said = f"{type(error).__name__}: {error}"
        if debug:  # synchronized after every node: this node is the one that faulted
            return ContextLostError(
                f"{where} failed on stream {failure.stream!r} and lost the device context "
                f"({lost}: {said}); nothing more can run on this device in this process",
                (node.id,) if isinstance(node, MemNode) else (),
            )
        return _context_lost(
            lost, f"surfaced at {where} on stream {failure.stream!r} ({said})", in_flight
        )
    if isinstance(error, EinpageError):
        return _naming(error, f"while running {where} on stream {failure.stream!r}")
    return BackendError(
        f"{where} failed on stream {failure.stream!r}: {type(error).__name__}: {error}"
    )


def _context_lost(lost: str, surfaced: str, in_flight: tuple[MemNode, ...]) -> ContextLostError:
    """A lost context outside debug mode: the error surfaces at a later call than the
    fault, so the message lists the nodes in flight rather than blaming one."""
    shown = in_flight[-IN_FLIGHT_SHOWN:]
    listed = "; ".join(f"n{n.id} ({n.describe()})" for n in shown)
    more = f" (the last {len(shown)} of {len(in_flight)})" if len(in_flight) > len(shown) else ""
    return ContextLostError(
        f"the device context is lost ({lost}): the error {surfaced}, which is not "
        f"necessarily where it happened. Nodes in flight – issued since the last completed "
        f"synchronization – {len(in_flight)}{more}: {listed or 'none'}. Run again with "
        f"debug=True (EINPAGE_SYNC=1, or einpage run --sync) to synchronize after each node "
        "and name the one that fails; nothing more can run on this device in this process",
        tuple(n.id for n in in_flight),
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
    spill: str | os.PathLike[str] | None = None,
    direct_io: bool = False,
    **options: Any,
) -> dict[str, np.ndarray]:
    """Execute the plan `mg` on `inputs` (name -> NumPy array); return its outputs.

    Inputs are checked first (names, shapes, dtypes: `InputError`; an array of another
    float or integer type is converted to the input's: `TaskGraph.conform_inputs`), then the plan
    (`memgraph.verify`, once per plan: `VerificationError`). `backend` is "auto"
    (CuPy when a GPU is usable, else NumPy), "numpy" or "cupy"; `mode` is
    "sequential", "streams" (alias "threaded") or "random" (ordered by `seed`);
    `trace` is a path to write a Chrome trace of the run to; `spill` the folder a plan
    with a host tier creates its spill file in (required when it has one; a weight the
    plan reads from its checkpoint is not passed in `inputs`); `direct_io` its disk files
    read and written with `O_DIRECT` where the file system allows (default: through the
    page cache, faster for a re-read checkpoint on a machine with free memory). Other
    keywords go to
    `Session` and the backend (see `Session`). Each call allocates the plan's buffers
    and releases them before returning: run a plan many times in a `Session`.

    >>> out = runtime.run(mg, {"x": xs, "w": ws}, backend="numpy")   # doctest: +SKIP
    """
    expect_graph(mg, MemGraph, "runtime.run", PLAN_FIRST)
    refuse_peer_nodes(mg)  # before its inputs: a link's input is never the caller's
    inputs = conform_caller_inputs(mg, inputs)
    with Session(
        mg,
        backend,
        mode=mode,
        poison=poison,
        unsafe_skip_verify=unsafe_skip_verify,
        spill=spill,
        direct_io=direct_io,
        **options,
    ) as session:
        outputs = session.run(inputs, seed=seed, trace=trace is not None)
        if trace is not None:
            session.last.trace.write(trace)
    return outputs
