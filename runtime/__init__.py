"""runtime: executing MemGraphs on a NumPy arena (CPU) or a CuPy arena (GPU).

`run(mg, inputs, backend=...)` executes a plan once; a `Session` keeps the arena,
host storage and staged inputs (weights) alive across runs – of one plan, or of several
that share them (a generation's step plans: one arena, one host buffer, the weights
staged once; `runtime.hostmem`, `pinned_bytes(plans)`). One backend-neutral
interpreter (`runtime.interpreter`) issues every node on a backend's streams, in
the order of a mode (`runtime.schedule`): sequential, streams (threaded on the CPU)
or random. Runs can record a timing trace in Chrome's format (`runtime.trace`).
Backends copy boxes of host arrays with one strided primitive (`Backend.copy_box`,
`runtime.boxcopy`); `register_backend(name, factory)` adds a backend by name.
`declare_workspaces(tg)` states the device memory each GPU kernel needs besides its
operands and output, for the planner to place (`runtime.workspace`).

A plan with a host tier (`memgraph.tiers`) runs alone, with `run(mg, inputs, spill=FOLDER)`
or `Session(mg, spill=FOLDER)`: its weights are read from their checkpoint (not passed),
what it spills goes to a spill file in FOLDER, removed when the run ends, and its host
storages live in one host arena (`runtime.tiers`, `runtime.diskio`); `direct_io=True`
moves its disk bytes with `O_DIRECT` where the file system allows, bypassing the page cache.

A plan for several devices (`memgraph.multi.MultiPlan`) runs in one process with
`run_devices(mp, inputs)` (a thread and an arena per device, links between them,
`runtime.multi`), or on Ray with `run_on_ray(mp, inputs)` / `RayDevices(mp)` (an actor
per device running the same per-device executor, `DeviceRunner`; `runtime.ray_cluster`,
the `cluster` extra). `LocalDevices` and `RayDevices` also hold several MultiPlans over
the same devices (a generation's step plans), staging inputs once for all of them.
"""

from runtime.backend import (
    BACKEND_NAMES,
    BACKENDS,
    Backend,
    Event,
    Stream,
    backend_names,
    cupy_usable,
    get_backend,
    register_backend,
)
from runtime.hostmem import SharedHost
from runtime.interpreter import HostLayout, Interpreter
from runtime.multi import DeviceRunner, LocalDevices, run_devices
from runtime.ray_cluster import RayDevices, run_on_ray
from runtime.schedule import MODES, Schedule, random_order
from runtime.session import (
    SYNC_VARIABLE,
    ContextLostError,
    HostBudgetError,
    RunReport,
    Session,
    pinned_bytes,
    run,
    verified,
)
from runtime.trace import Trace
from runtime.workspace import declare_workspaces, kernel_workspace

__all__ = [
    "HostBudgetError",
    "ContextLostError",
    "SYNC_VARIABLE",
    "SharedHost",
    "pinned_bytes",
    "run",
    "Session",
    "RunReport",
    "Trace",
    "Backend",
    "Stream",
    "Event",
    "BACKENDS",
    "BACKEND_NAMES",
    "MODES",
    "Schedule",
    "Interpreter",
    "HostLayout",
    "get_backend",
    "register_backend",
    "backend_names",
    "cupy_usable",
    "random_order",
    "verified",
    "declare_workspaces",
    "kernel_workspace",
    "run_devices",
    "DeviceRunner",
    "LocalDevices",
    "run_on_ray",
    "RayDevices",
]
