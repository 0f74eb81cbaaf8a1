"""The cost model: how long a task or a transfer takes on a machine, for planning and simulation.

A task takes a fixed launch latency plus the larger of its compute time (FLOPs at
`flops_per_s`) and its device-memory time (operand and output bytes at
`device_bytes_per_s`) – a roofline, so that elementwise ops and softmax pieces are
charged for the memory they stream. A transfer takes a latency plus its bytes at the
bandwidth of its direction.

>>> h100 = PRESETS["h100-pcie5"]
>>> round(h100.transfer_seconds(2**30, "h2d") * 1e3, 1)  # ms for 1 GiB host -> device
21.5

Several devices: `CostModel.topology` (a `Topology`) says how many devices the machine
has, how many of them share one host link, and how fast a direct copy between two
devices goes. A plan's links say how each tensor travels (`memgraph.multi.Link.path`):
staged through host memory (a device-to-host copy on the sender, then a host-to-device
copy on the receiver) or direct (one copy between the arenas: over the peer link, or
PCIe peer-to-peer through the host links where the machine has none). The rates above
are each device's. `memgraph.simulate_multi` reads it; a single-device plan never does.

>>> PRESETS["8xh100-sxm"].topology.describe()
'8 devices, 1 per host link; direct sends over a 450 GB/s peer link'

Machines are found by name in `PRESETS`; `register_cost_model(name, model)` adds one,
so that `memgraph.simulate(mg, name)`, the planner's `cost_model=` and the CLI's
`--cost-model` (choices read at startup) know it.
"""

from __future__ import annotations

from dataclasses import dataclass

from einpage_core.errors import EinpageError
from taskgraph.graph import TaskGraph

__all__ = [
    "CostModel",
    "Topology",
    "PRESETS",
    "get_cost_model",
    "register_cost_model",
    "rebuild_bytes",
]


@dataclass(frozen=True, slots=True)
class Topology:
    """How the devices of a machine connect to the host and to each other.

    * `devices`: how many devices the machine has (None: as many as a plan uses);
    * `devices_per_host_link`: how many devices share one host link (a PCIe root port or
      switch uplink): devices `k * n .. k * n + n - 1` share link `k`. Devices on one link
      share its bandwidth in each direction (`memgraph.simulate_multi` says how);
    * `staged_through_host`: tensors can travel between devices through pinned host
      memory (a device-to-host copy on the sender, then a host-to-device copy on the
      receiver over the host links): the path of every link a plan does not send direct
      (`memgraph.multi.Link.path == "host"`, as `plan_devices` plans every link first), so
      it must be True;
    * `peer_bytes_per_s`: the bandwidth of a direct device-to-device link per direction
      (NVLink through NVSwitch: ~450 GB/s on H100 SXM), or None. `memgraph.simulate_multi`
      times a direct link's copy (`Link.path == "peer"`, a send and its receive) at this
      bandwidth, each device with one such lane out and one in; with None, a direct copy
      is PCIe peer-to-peer through the two devices' host links, at the slower of their
      d2h and h2d bandwidths. Plans do not read it: whether a link goes direct is the
      plan's choice (`plan_devices(sends=...)`);
    * `device_memory_bytes`: each device's memory (None: unstated), a ceiling for
      per-device budgets.
    """

    devices: int | None = None
    devices_per_host_link: int = 1
    staged_through_host: bool = True
    peer_bytes_per_s: float | None = None
    device_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.devices is not None and (
            not isinstance(self.devices, int) or isinstance(self.devices, bool)
            or self.devices < 1
        ):  # fmt: skip
            raise EinpageError(
                f"topology: devices must be a positive int or None, got {self.devices!r}"
            )
        per_link = self.devices_per_host_link
        if not isinstance(per_link, int) or isinstance(per_link, bool) or per_link < 1:
            raise EinpageError(
                f"topology: devices_per_host_link must be a positive int, got {per_link!r}"
            )
        if not self.staged_through_host:
            raise EinpageError(
                "topology: staged_through_host=False (a machine whose devices cannot stage "
                "tensors through host memory) is not built: every link a plan does not send "
                "direct is staged through the host (memgraph.multi: plan_devices(sends=))"
            )
        if self.peer_bytes_per_s is not None and not self.peer_bytes_per_s > 0:
            raise EinpageError(
                f"topology: peer_bytes_per_s must be positive or None, "
                f"got {self.peer_bytes_per_s!r}"
            )
        if self.device_memory_bytes is not None and not self.device_memory_bytes > 0:
            raise EinpageError(
                f"topology: device_memory_bytes must be positive or None, "
                f"got {self.device_memory_bytes!r}"
            )

    def host_link(self, device: int) -> int:
        """The host link device `device` sits on (`device // devices_per_host_link`).

        >>> Topology(devices=4, devices_per_host_link=2).host_link(3)
        1
        """
        return device // self.devices_per_host_link

    def describe(self) -> str:
        """One line: `4 devices, 2 per host link; direct sends PCIe peer-to-peer over the
        host links`, or where the machine has a peer link `...; direct sends over a 450
        GB/s peer link` (links not sent direct are staged through the host)."""
        count = "any number of devices" if self.devices is None else f"{self.devices} devices"
        text = f"{count}, {self.devices_per_host_link} per host link; direct sends "
        if self.peer_bytes_per_s is not None:
            return text + f"over a {self.peer_bytes_per_s / 1e9:.0f} GB/s peer link"
        return text + "PCIe peer-to-peer over the host links"


SINGLE_DEVICE = Topology()
"""The topology of a cost model that states none: any number of devices, each on a host
link of its own, transfers between devices staged through the host."""


@dataclass(frozen=True, slots=True)
class CostModel:
    """Rates of one machine. Bandwidths in bytes/s, compute in FLOP/s, latencies in s.

    The rates are one device's; `topology` says how several devices connect (read only
    by `memgraph.simulate_multi`)."""

    name: str
    flops_per_s: float
    device_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    kernel_latency_s: float = 0.0
    transfer_latency_s: float = 0.0
    topology: Topology = SINGLE_DEVICE

    def __post_init__(self) -> None:
        for field_name in (
            "flops_per_s",
            "device_bytes_per_s",
            "h2d_bytes_per_s",
            "d2h_bytes_per_s",
        ):
            if not getattr(self, field_name) > 0:
                raise EinpageError(f"cost model {self.name!r}: {field_name} must be positive")
        if not isinstance(self.topology, Topology):
            raise EinpageError(
                f"cost model {self.name!r}: topology must be a Topology, "
                f"got {type(self.topology).__name__}"
            )

    def task_seconds(self, tg: TaskGraph, task_id: int) -> float:
        """Time of one task's apply: latency + max(FLOPs / rate, bytes touched / bandwidth).

        Inputs and views cost nothing (they move no data on the device).
        """
        task = tg[task_id]
        if not task.is_compute:
            return 0.0
        touched = task.nbytes + sum(tg[i].nbytes for i in dict.fromkeys(task.inputs))
        return self.kernel_latency_s + max(
            task.flops / self.flops_per_s, touched / self.device_bytes_per_s
        )

    def transfer_seconds(self, nbytes: int, direction: str) -> float:
        """Time to copy `nbytes` in `direction` ("h2d" or "d2h")."""
        rate = {"h2d": self.h2d_bytes_per_s, "d2h": self.d2h_bytes_per_s}.get(direction)
        if rate is None:
            raise EinpageError(f"transfer direction must be 'h2d' or 'd2h', got {direction!r}")
        return self.transfer_latency_s + nbytes / rate


def rebuild_bytes(cost: CostModel, tg: TaskGraph, task_id: int, operands: int) -> int:
    """A recompute of task `task_id` (reading `operands` distinct storage roots) priced in
    bytes, the unit of bytes moved: what it adds, in seconds on `cost`, to the transfers
    it stands for, at the host-to-device bandwidth (floored, at least 0).

    The planner rebuilds a tensor instead of moving it out and back when, on the cost
    model, `task_seconds + sum(latency + operand / bandwidth) < 2 * (latency + nbytes /
    bandwidth)` (`memgraph.recompute`: every operand reloaded, the worst case). At equal
    bandwidths in both directions (every preset) that reads, in bytes,
    `(task_seconds + (operands - 2) * latency) * bandwidth + sum(operand bytes) < 2 *
    nbytes`: the first term is this price. The exact optimum with recompute
    (`memgraph.optimal`) minimizes bytes moved plus this price for each recompute
    (`memgraph.optimal.plan_rebuild_bytes` of a plan), so both weigh a recompute alike."""
    seconds = cost.task_seconds(tg, task_id) + (operands - 2) * cost.transfer_latency_s
    return max(0, int(seconds * cost.h2d_bytes_per_s))


PRESETS: dict[str, CostModel] = {
    # H100 PCIe with a PCIe Gen5 x16 link: dense fp16 tensor-core throughput derated to
    # a sustained 400 TFLOP/s (of ~756 peak), 2.0 TB/s HBM2e, ~50 GB/s per direction
    # with pinned host memory (64 GB/s theoretical).
    "h100-pcie5": CostModel("h100-pcie5", 400e12, 2.0e12, 50e9, 50e9, 5e-6, 10e-6),
    # A many-core CPU running the NumPy backend: transfers are memcpy within RAM.
    "cpu": CostModel("cpu", 200e9, 20e9, 10e9, 10e9, 0.0, 0.0),
    # 8 H100 SXM5 80 GB on an HGX/DGX H100 board (NVIDIA H100 datasheet,
    # nvidia.com/en-us/data-center/h100: 989 TFLOP/s dense fp16 tensor, 3.35 TB/s HBM3,
    # NVLink 900 GB/s bidirectional = 450 GB/s per direction, PCIe Gen5 x16 host link).
    # Compute derated as on "h100-pcie5" (sustained ~53% of dense peak: 520 TFLOP/s);
    # the host link as there (~50 GB/s per direction pinned, of 64). Host links: the
    # DGX H100 user guide (network modules) pairs each GPU with its own ConnectX-7,
    # whose integrated PCIe Gen5 switch gives each GPU its own x16 path to a CPU, so one
    # GPU per host link (DGX A100 had two GPUs behind each PCIe Gen4 switch: 2).
    "8xh100-sxm": CostModel(
        "8xh100-sxm", 520e12, 3.35e12, 50e9, 50e9, 5e-6, 10e-6,
        topology=Topology(devices=8, devices_per_host_link=1, peer_bytes_per_s=450e9,
                          device_memory_bytes=80 * 10**9),
    ),  # fmt: skip
}
"""Machines by name."""


def get_cost_model(model: str | CostModel) -> CostModel:
    """A cost model given by name (from `PRESETS`) or as a `CostModel`."""
    if isinstance(model, CostModel):
        return model
    if model not in PRESETS:
        raise EinpageError(f"unknown cost model {model!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[model]


def register_cost_model(name: str, model: CostModel) -> None:
    """Make `model` available by `name` wherever a cost model is named (`PRESETS`).

    Names are unique: registering a name again raises `EinpageError`.

    >>> register_cost_model("a100-pcie4", CostModel("a100-pcie4", 250e12, 1.5e12, 25e9, 25e9))
    >>> get_cost_model("a100-pcie4").h2d_bytes_per_s
    25000000000.0
    >>> del PRESETS["a100-pcie4"]
    """
    if not isinstance(name, str) or not name:
        raise EinpageError(f"a cost model name must be a non-empty string, got {name!r}")
    if not isinstance(model, CostModel):
        raise EinpageError(f"cost model {name!r}: expected a CostModel, got {type(model).__name__}")
    if name in PRESETS:
        raise EinpageError(
            f"cost model {name!r} is already registered; registered: {', '.join(PRESETS)}"
        )
    PRESETS[name] = model
