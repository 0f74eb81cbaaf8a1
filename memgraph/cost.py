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

The disk below a host tier (`memgraph.tiers`): `disk_read_bytes_per_s` and
`disk_write_bytes_per_s`, both set or both None (a machine that states no disk: every
preset above, whose results they never change, as only a plan with a host tier reads or
writes disk). Drives are presets of their own (`DISKS`), put under any machine with
`get_cost_model(machine, disk=name)` or `CostModel.with_disk`: the model is named
`machine+disk`, and that name finds it again. A read or a write takes its bytes at the
drive's bandwidth (no latency: the copies are long sequential runs).

>>> both = get_cost_model("h100-pcie5", disk="nvme-pcie4")
>>> both.name, both.disk_seconds(7 * 10**9, "read")
('h100-pcie5+nvme-pcie4', 1.0)
>>> get_cost_model("h100-pcie5+nvme-pcie4") == both
True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from einpage_core.errors import EinpageError
from taskgraph.graph import TaskGraph

__all__ = [
    "CostModel",
    "Topology",
    "Disk",
    "PRESETS",
    "DISKS",
    "DEFAULT_DISK",
    "get_cost_model",
    "get_disk",
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
    by `memgraph.simulate_multi`); the disk rates are the drive below a host tier (None:
    none stated; `memgraph.simulate` then assumes `DEFAULT_DISK` for a plan with a tier)."""

    name: str
    flops_per_s: float
    device_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    kernel_latency_s: float = 0.0
    transfer_latency_s: float = 0.0
    topology: Topology = SINGLE_DEVICE
    disk_read_bytes_per_s: float | None = None
    disk_write_bytes_per_s: float | None = None

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
        rates = (self.disk_read_bytes_per_s, self.disk_write_bytes_per_s)
        if (rates[0] is None) != (rates[1] is None):
            raise EinpageError(
                f"cost model {self.name!r}: give disk_read_bytes_per_s and "
                f"disk_write_bytes_per_s together (a drive has both), got {rates}"
            )
        if rates[0] is not None and not (rates[0] > 0 and rates[1] > 0):
            raise EinpageError(
                f"cost model {self.name!r}: disk rates must be positive, got read "
                f"{rates[0]!r}, write {rates[1]!r}"
            )

    @property
    def has_disk(self) -> bool:
        """Whether the model states a disk (`disk_read_bytes_per_s` and the write rate)."""
        return self.disk_read_bytes_per_s is not None

    def with_disk(self, disk: str | Disk) -> CostModel:
        """This machine over `disk` (a `DISKS` name or a `Disk`), named `machine+disk`.

        >>> PRESETS["cpu"].with_disk("nvme-pcie4").disk_write_bytes_per_s
        5000000000.0
        """
        drive = get_disk(disk)
        base = self.name.split("+")[0] if self.has_disk else self.name
        return dataclasses.replace(
            self,
            name=f"{base}+{drive.name}",
            disk_read_bytes_per_s=drive.read_bytes_per_s,
            disk_write_bytes_per_s=drive.write_bytes_per_s,
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

    def disk_seconds(self, nbytes: int, direction: str) -> float:
        """Time to "read" `nbytes` from disk into host memory, or to "write" them to disk."""
        rates = {"read": self.disk_read_bytes_per_s, "write": self.disk_write_bytes_per_s}
        if direction not in rates:
            raise EinpageError(f"disk direction must be 'read' or 'write', got {direction!r}")
        rate = rates[direction]
        if rate is None:
            raise EinpageError(
                f"cost model {self.name!r} states no disk: give it one "
                f"(get_cost_model({self.name!r}, disk=...); disks: {', '.join(DISKS)})"
            )
        return nbytes / rate


@dataclass(frozen=True, slots=True)
class Disk:
    """A drive below a host tier: `name`, sequential read and write bandwidths in bytes/s."""

    name: str
    read_bytes_per_s: float
    write_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.read_bytes_per_s > 0 and self.write_bytes_per_s > 0):
            raise EinpageError(f"disk {self.name!r}: bandwidths must be positive")


DISKS: dict[str, Disk] = {
    # A PCIe 4.0 x4 NVMe SSD. Samsung 990 PRO datasheet (semiconductor.samsung.com,
    # 990 PRO): sequential read up to 7,450 MB/s, write up to 6,900 MB/s, near the
    # ~7.9 GB/s a PCIe 4.0 x4 link carries; drives of this class quote 7.0-7.4 GB/s read
    # and 5-7 GB/s write. Taken as ~7 GB/s read and ~5 GB/s write: a spill file is
    # written in long runs, which burst figures (into the drive's SLC cache) overstate.
    "nvme-pcie4": Disk("nvme-pcie4", 7e9, 5e9),
}
"""Drives by name, for `get_cost_model(machine, disk=name)` and `CostModel.with_disk`."""

DEFAULT_DISK = "nvme-pcie4"
"""The drive `memgraph.simulate` assumes below a plan's host tier when the cost model
states none."""


def get_disk(disk: str | Disk) -> Disk:
    """A drive given by name (from `DISKS`) or as a `Disk`."""
    if isinstance(disk, Disk):
        return disk
    if disk not in DISKS:
        raise EinpageError(f"unknown disk {disk!r}; disks: {', '.join(DISKS)}")
    return DISKS[disk]


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


def get_cost_model(model: str | CostModel, disk: str | Disk | None = None) -> CostModel:
    """A cost model given by name (from `PRESETS`, or `machine+disk`: a preset over a
    `DISKS` drive) or as a `CostModel`; with `disk`, over that drive (`with_disk`)."""
    if isinstance(model, CostModel):
        found = model
    elif model in PRESETS:
        found = PRESETS[model]
    elif isinstance(model, str) and model.count("+") == 1 and model.split("+")[0] in PRESETS:
        machine, drive = model.split("+")
        if drive not in DISKS:
            raise EinpageError(
                f"unknown disk {drive!r} in cost model {model!r}; disks: {', '.join(DISKS)}"
            )
        found = PRESETS[machine].with_disk(drive)
    else:
        raise EinpageError(
            f"unknown cost model {model!r}; presets: {', '.join(PRESETS)} (each may be "
            f"followed by +DISK, disks: {', '.join(DISKS)})"
        )
    return found if disk is None else found.with_disk(disk)


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
