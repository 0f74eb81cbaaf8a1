"""Plans for several devices: one TaskGraph and one MemGraph per device, and the links
that carry tensors between them.

A placement (`memgraph.placement`) gives every task of a TaskGraph a device; splitting
it makes one TaskGraph per device. A tensor computed on device A and read on device B
becomes a *link*: an output of A's TaskGraph (`Link.output`, offloaded to host memory as
soon as it is computed: devices are planned with `outputs="host"`) and an input of B's
TaskGraph (`Link.input`, an `Input` that starts on the host, reloaded when B needs it).
So a transfer between devices is staged through pinned host memory: a device-to-host
copy on A, then a host-to-device copy on B – the path of GPUs without peer-to-peer
access. Direct sends (NVLink, NCCL) are not built.

The link is the fact, typed: the names that `split` gives the outputs and inputs it
adds are labels for people, and nothing reads them back. Each device's MemGraph is an
ordinary plan (planned, verified, run and simulated like any other); what ties them
together is `MultiPlan.links`, which `verify_multi` checks: each link's output exists on
its source device and its input on its destination, with the same shape and dtype, on
the host; every input of a device plan is fed once, by the driver or by a link; and the
union of the plans' dependencies and the links has no cycle, so that executing every
node once its dependencies and its link have arrived cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from memgraph.graph import MemGraph

__all__ = ["Link", "DevicePart", "PlacedGraph", "DevicePlan", "MultiPlan"]


@dataclass(frozen=True, slots=True)
class Link:
    """Tensor `task` of the original TaskGraph, computed on device `source` and read on
    device `target`: output `output` of the source's TaskGraph feeds input `input` of the
    target's. `shape`, `dtype` and `nbytes` are the tensor's."""

    task: int
    source: int
    target: int
    output: str
    input: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def describe(self) -> str:
        """`%12 f32[2,64] 512 B: device 0 "send:%12" -> device 1 "recv:%12"`."""
        from einpage_core.units import format_bytes

        dims = ",".join(map(str, self.shape))
        return (
            f"%{self.task} {self.dtype}[{dims}] {format_bytes(self.nbytes)}: "
            f'device {self.source} "{self.output}" -> device {self.target} "{self.input}"'
        )


@dataclass(frozen=True)
class DevicePart:
    """Device `device`'s share of a placed TaskGraph: its own TaskGraph `tg`, and
    `origin`, for each of its task ids, the task of the original graph it stands for
    (a replicated input or fill stands for the same original task on every device; a
    link's input stands for the linked task)."""

    device: int
    tg: Any  # taskgraph.TaskGraph (memgraph reads TaskGraphs; it does not build them)
    origin: tuple[int, ...]


@dataclass(frozen=True)
class PlacedGraph:
    """A TaskGraph split over `devices` devices: one `DevicePart` each, the links
    between them, and where each original output ends (`outputs`: output name ->
    (device, that device's output name))."""

    devices: int
    parts: tuple[DevicePart, ...]
    links: tuple[Link, ...]
    outputs: Mapping[str, tuple[int, str]]
    strategy: str = "pipeline"


@dataclass(frozen=True)
class DevicePlan:
    """Device `device`'s plan: its MemGraph `mg`, planned under `budget` bytes."""

    device: int
    mg: MemGraph
    budget: int


@dataclass(frozen=True)
class MultiPlan:
    """One plan for several devices: a MemGraph per device and the links between them.

    The driver stages each original input on every device whose TaskGraph has an input
    of that name (inputs are replicated, not linked: they start on the host), and reads
    each original output from `outputs` (output name -> (device, that device's output
    name)).
    """

    placed: PlacedGraph
    plans: tuple[DevicePlan, ...]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def devices(self) -> int:
        return self.placed.devices

    @property
    def links(self) -> tuple[Link, ...]:
        return self.placed.links

    @property
    def outputs(self) -> Mapping[str, tuple[int, str]]:
        return self.placed.outputs
