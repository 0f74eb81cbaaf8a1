"""Placement: which device computes each task of a TaskGraph, and the split into one
TaskGraph per device (`memgraph.multi` holds the types: `PlacedGraph`, `Link`, ...).

A placement is a tuple with one entry per task: the device (0 .. devices-1) that
computes it, or `REPLICATED` (-1) for a task that every device which needs it makes
for itself. A device needs a task that one of its own tasks reads (transitively,
through replicated tasks), or an output it holds. A replicated task reading only
replicated tasks costs no transfer: an `Input` (the driver stages it on each such
device from the same host array), a `Fill`, a View or Slice of an input, the RoPE
tables' arithmetic. A replicated *compute* task reading placed tasks is computed by
every device that needs it, each placed operand linked to each such device from its
own: that is how tensor parallelism's all-reduce is made (each device receives the
other devices' partial sums and adds them itself), and how the residual stream, the
norms and the rest outside the split are computed on every device, as Megatron does.
Two strategies place (`STRATEGIES`): a pipeline and tensor parallelism.

`pipeline_placement(tg, devices)` places by weights (facts, not names: `Input.role`):

* the weights – `Input`s with role "weight" that some compute task reads (directly or
  through Views) – in the order of their first use form *units* (`weight_units`): all
  the weights stating the same `taskgraph.facts.Layer(i)` one unit (a decoder layer,
  as the models state it), each weight stating none a unit of its own; the units are
  cut into `devices` contiguous groups, balanced by bytes (`weight_groups`: the largest
  group's weight bytes is as small as any contiguous cut of the units can make it), so
  a stage holds whole layers and what crosses between stages is the hidden state
  between layers, not a tensor inside one; group g lives on device g. A program whose
  weights state layers needs at least as many layers as devices;
* a compute task that reads a weight goes to that weight's device (the largest weight
  it reads if several, ties to the first read);
* any other task that reads a non-replicated tensor goes to the device of its
  non-replicated operand with the largest task id (so a View goes with its base);
  then, last task first, a compute task that reads no weight moves to its readers'
  device when they all sit on one other device and its operands are sent there
  anyway (`_sink_to_readers`: one link fewer, none more – a layer's RMSNorm statistics
  are computed beside the norm, not sent with the hidden state);
* the rest is replicated.

`tensor_placement(tg, devices)` reads the `taskgraph.facts.TensorPart` facts of a graph
split by `taskgraph.partition.tensor_split(tg, devices)`: a task stating
`TensorPart(d, devices)` goes to device d (its heads, its MLP columns, its partial
sums), every other task is replicated. `place(tg, devices, "tensor")` splits a graph
without such facts first.

`split(tg, placement, devices)` makes the `PlacedGraph`: per device, the tasks placed
there, the replicated tasks they need (transitively), and for each tensor computed on
another device a *link*: an output of the source device's graph (`send:%7`) and an
`Input(role="activation", location="host")` of the reading device's (`recv:%7`). A
View is never linked: a device that reads a View of another device's tensor receives
the View's base and makes the View itself (Views cost nothing), so a link always moves
a whole tensor, as its host storage holds it. Original outputs keep their names, on the
device that computes them (a replicated output: on the first device that has it, else
device 0); original inputs keep theirs, on every device that reads them (an input that
nothing reads is kept on device 0). Each device's graph keeps the original order (a
sub-order of a topological order) and each task's scope, label, block, workspace and
facts (renumbered: `Fact.renumbered`, dropped where their subject is not on the device).
A link's input states no facts: what its tensor is stays stated on its source.

>>> import einpage as ep
>>> prog = ep.Program("two")
>>> x = prog.input("x", (4, 8))
>>> w0 = prog.input("w0", (8, 8), role="weight")
>>> w1 = prog.input("w1", (8, 8), role="weight")
>>> prog.output((x @ w0) @ w1, "y")
>>> tg = prog.build()
>>> pipeline_placement(tg, 2)
(-1, -1, -1, 0, 1)
>>> placed = split(tg, pipeline_placement(tg, 2), 2)
>>> [link.describe() for link in placed.links]
['%3 f32[4,8] 128 B: device 0 "send:%3" -> device 1 "recv:%3"']
>>> placed.outputs["y"]
(1, 'y')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from einpage_core.errors import PlanError, expect_graph
from memgraph.multi import DevicePart, Link, PlacedGraph
from taskgraph.builder import GraphBuilder, fresh_name
from taskgraph.facts import Layer, TensorPart, facts_of
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input, with_blocks
from taskgraph.partition import tensor_split

__all__ = [
    "REPLICATED",
    "STRATEGIES",
    "contiguous_groups",
    "pipeline_placement",
    "tensor_placement",
    "Strategy",
    "weight_groups",
    "weight_units",
    "used_weights",
    "split",
    "place",
]

REPLICATED = -1
"""The placement of a task that every device needing it makes for itself (see the
module docstring)."""


def check_devices(devices: object, where: str) -> int:
    """`devices` as an int >= 1, or a `PlanError` naming `where`."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(f"{where}: devices must be an int >= 1, got {devices!r}")
    return devices


def used_weights(tg: TaskGraph) -> list[int]:
    """The task ids of `tg`'s weights (`Input` role "weight") that some compute task reads
    (directly or through Views), in the order of their first use."""
    order: dict[int, None] = {}
    for task in tg:
        if not task.is_compute:
            continue
        for operand in task.inputs:
            root = tg[tg.storage_root(operand)]
            if isinstance(root.op, Input) and root.op.role == "weight":
                order.setdefault(root.id, None)
    return list(order)


def weight_units(tg: TaskGraph) -> list[tuple[int, ...]]:
    """`tg`'s used weights (`used_weights`) as the units a pipeline keeps whole, in the
    order of their first weight's first use: the weights stating the same
    `Layer(index)` fact one unit (in first-use order), each weight stating none a unit
    of its own. Raises `PlanError` for a weight stating two layers.

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (1, 4))
    >>> x = x @ prog.input("embed", (4, 4), role="weight")
    >>> for i in range(2):
    ...     with prog.layer(i):
    ...         x = (x @ prog.input(f"a{i}", (4, 4), role="weight")) @ prog.input(
    ...             f"b{i}", (4, 4), role="weight")
    >>> prog.output(x, "y")
    >>> tg = prog.build()
    >>> [[tg[w].op.name for w in unit] for unit in weight_units(tg)]
    [['embed'], ['a0', 'b0'], ['a1', 'b1']]
    """
    units: dict[object, list[int]] = {}
    for w in used_weights(tg):
        layers = facts_of(tg[w], Layer)
        if len(layers) > 1:
            raise PlanError(
                f"weight {tg[w].op.name!r} (%{w}) states layers "
                f"{', '.join(str(f.index) for f in layers)}; a weight belongs to one layer"
            )
        key: object = ("layer", layers[0].index) if layers else ("weight", w)
        units.setdefault(key, []).append(w)
    return [tuple(unit) for unit in units.values()]


def layer_count(tg: TaskGraph) -> int:
    """How many layers (`Layer` facts, distinct indices) `tg`'s used weights state."""
    return len({f.index for w in used_weights(tg) for f in facts_of(tg[w], Layer)})


def weight_groups(tg: TaskGraph, devices: int) -> tuple[tuple[int, ...], ...]:
    """`tg`'s used weights cut into `devices` non-empty contiguous groups of whole units
    (`weight_units`: a layer's weights, or a weight without a layer): the cut of the
    units whose largest group has the fewest bytes (the bottleneck device's weight
    bytes, a pipeline's slowest stage when weights dominate; `contiguous_groups`). Each
    group lists its weights unit by unit.

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (1, 4))
    >>> for i, n in enumerate([4, 4, 4, 12]):  # 64, 64, 64 and 192 bytes
    ...     prog.output(x @ prog.input(f"w{i}", (4, n), role="weight"), f"y{i}")
    >>> tg = prog.build()
    >>> [[tg[w].op.name for w in group] for group in weight_groups(tg, 2)]
    [['w0', 'w1', 'w2'], ['w3']]

    Raises `PlanError` when, with more than one device, there are fewer layers than
    devices (a program whose weights state `Layer` facts: each device holds at least one
    whole layer) or fewer used weights than devices (one without: each device needs a
    weight to anchor its stage).
    """
    check_devices(devices, "weight_groups")
    weights = used_weights(tg)
    if devices > 1 and not weights:
        raise PlanError(
            f"pipeline placement of {devices} devices needs weights to place (inputs with "
            f"role 'weight' that tasks read); this program reads none. Plan it on one device"
        )
    units = weight_units(tg)
    if devices == 1:
        return (tuple(w for unit in units for w in unit),)
    layers = layer_count(tg)
    if layers and devices > layers:
        raise PlanError(
            f"pipeline placement of {devices} devices needs at least {devices} layers; this "
            f"program has {layers}. Use at most {layers} devices"
        )
    if devices > len(weights):
        raise PlanError(
            f"pipeline placement of {devices} devices needs at least {devices} weights; this "
            f"program has {len(weights)}. Use at most {len(weights)} devices"
        )
    sizes = [sum(tg[w].nbytes for w in unit) for unit in units]
    lengths = contiguous_groups(sizes, devices)
    groups, start = [], 0
    for length in lengths:
        groups.append(tuple(w for unit in units[start : start + length] for w in unit))
        start += length
    return tuple(groups)


def contiguous_groups(sizes: Sequence[int], groups: int) -> list[int]:
    """The lengths of `groups` non-empty contiguous groups of `sizes` (at least `groups`
    of them) whose largest sum is as small as any such cut's: the smallest bound whose
    greedy cut needs at most `groups` groups (binary search), then at that bound each
    group takes items while they fit and enough are left for the groups after it.

    >>> contiguous_groups([64, 64, 64, 192], 2), contiguous_groups([5, 1, 1, 1], 3)
    ([3, 1], [1, 2, 1])
    """
    if not 1 <= groups <= len(sizes):
        raise PlanError(f"cannot cut {len(sizes)} items into {groups} non-empty groups")
    low, high = max(sizes), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        if _groups_needed(sizes, middle) <= groups:
            high = middle
        else:
            low = middle + 1
    lengths: list[int] = []
    start = 0
    for g in range(groups):
        later = groups - 1 - g  # groups after this one, each needing an item
        end, held = start + 1, sizes[start]
        while end < len(sizes) - later and (g == groups - 1 or held + sizes[end] <= low):
            held += sizes[end]
            end += 1
        lengths.append(end - start)
        start = end
    return lengths


def _groups_needed(sizes: Sequence[int], bound: int) -> int:
    """How many contiguous groups of at most `bound` bytes a greedy cut of `sizes` makes."""
    groups, held = 1, 0
    for size in sizes:
        if held + size > bound:
            groups, held = groups + 1, 0
        held += size
    return groups


def pipeline_placement(tg: TaskGraph, devices: int) -> tuple[int, ...]:
    """The device of every task of `tg` in a pipeline over `devices` devices
    (`REPLICATED` for tasks every device makes for itself); see the module docstring.
    Raises `PlanError` for devices < 1 and for fewer layers (or, without `Layer` facts,
    weights) than devices."""
    expect_graph(tg, TaskGraph, "memgraph.placement.pipeline_placement")
    check_devices(devices, "pipeline_placement")
    groups = weight_groups(tg, devices)
    weight_device = {w: g for g, group in enumerate(groups) for w in group}
    device_of = [REPLICATED] * len(tg)
    for task in tg:
        if task.is_compute:
            read = [tg.storage_root(i) for i in task.inputs]
            weights = [w for w in read if w in weight_device]
            if weights:
                largest = weights[0]
                for w in weights[1:]:
                    if tg[w].nbytes > tg[largest].nbytes:
                        largest = w
                device_of[task.id] = weight_device[largest]
                continue
        placed = [i for i in task.inputs if device_of[i] != REPLICATED]
        if placed:
            device_of[task.id] = device_of[max(placed)]
    _sink_to_readers(tg, device_of)
    return tuple(device_of)


def _sink_to_readers(tg: TaskGraph, device_of: list[int]) -> None:
    """Move, in place, each compute task that reads no weight to the device of its
    readers when they all sit on one other device and what it reads is sent there
    anyway (its placed operands' bases are read there by another task): the link of its
    own tensor goes and none comes. Last task first, so a chain of such tasks moves
    whole. (The statistics a layer's first norm takes of the hidden state it receives,
    e.g. RMSNorm's mean square, are then computed beside the norm, not sent with the
    hidden state.)"""
    readers_on: dict[tuple[int, int], set[int]] = {}  # (base, device) -> tasks reading it
    for task in tg:
        if device_of[task.id] != REPLICATED and not task.op.aliases_input:
            for operand in task.inputs:
                base = tg.storage_root(operand)
                readers_on.setdefault((base, device_of[task.id]), set()).add(task.id)
    for task in reversed(tg.tasks):
        here = device_of[task.id]
        readers = tg.consumers[task.id]
        if here == REPLICATED or not task.is_compute or not readers:
            continue
        if any(tg[r].op.aliases_input for r in readers):  # a View goes with its base
            continue
        there = {device_of[r] for r in readers}
        if len(there) != 1 or here in there:
            continue
        (target,) = there
        bases = {tg.storage_root(i) for i in task.inputs}
        if any(isinstance(tg[b].op, Input) and tg[b].op.role == "weight" for b in bases):
            continue
        if all(
            device_of[b] in (REPLICATED, target) or readers_on.get((b, target), set()) - {task.id}
            for b in bases
        ):
            device_of[task.id] = target
            for b in bases:
                readers_on.setdefault((b, target), set()).add(task.id)
                readers_on.get((b, here), set()).discard(task.id)


def tensor_placement(tg: TaskGraph, devices: int) -> tuple[int, ...]:
    """The device of every task of `tg`, a graph split by `tensor_split(tg, devices)`: a
    task stating `TensorPart(d, devices)` goes to device d, every other task is
    `REPLICATED` (see the module docstring). Raises `PlanError` for devices < 1, a graph
    without `TensorPart` facts, and one split for another count of devices.

    >>> import einpage as ep
    >>> from taskgraph.facts import Shard
    >>> from taskgraph.partition import tensor_split
    >>> prog = ep.Program("mlp")
    >>> x = prog.input("x", (2, 4))
    >>> w1 = prog.fact(prog.input("w1", (8, 4), role="weight"), Shard(0))
    >>> w2 = prog.fact(prog.input("w2", (8, 4), role="weight"), Shard(0))
    >>> prog.output(prog.einsum("bm,md->bd", prog.einsum("bd,md->bm", x, w1), w2), "y")
    >>> tg = tensor_split(prog.build(), 2)
    >>> [d for t, d in zip(tg, tensor_placement(tg, 2)) if t.kind == "einsum"]
    [0, 1, 0, 1, -1]
    >>> [link.describe() for link in split(tg, tensor_placement(tg, 2), 2).links]
    ['%10 f32[2,4] 32 B: device 1 "send:%10" -> device 0 "recv:%10"']
    """
    expect_graph(tg, TaskGraph, "memgraph.placement.tensor_placement")
    check_devices(devices, "tensor_placement")
    device_of = [REPLICATED] * len(tg)
    counts: set[int] = set()
    for task in tg:
        for fact in facts_of(task, TensorPart):
            counts.add(fact.count)
            device_of[task.id] = fact.index
    if not counts:
        raise PlanError(
            f"tensor placement of {tg.name!r} needs a graph split by "
            f"taskgraph.partition.tensor_split (tasks stating TensorPart facts); it states "
            f"none: place it with place(tg, {devices}, 'tensor'), which splits it first"
        )
    if counts != {devices}:
        raise PlanError(
            f"graph {tg.name!r} is split for {' and '.join(map(str, sorted(counts)))} "
            f"devices (TensorPart facts), not {devices}: split the unsplit graph for {devices}"
        )
    return tuple(device_of)


Strategy = Callable[[TaskGraph, int], tuple[TaskGraph, tuple[int, ...]]]
"""A placement strategy: `(tg, devices) -> (graph, placement)`, the graph placed (`tg`
itself, or `tg` rewritten, e.g. split for tensor parallelism) and its placement."""


def _pipeline(tg: TaskGraph, devices: int) -> tuple[TaskGraph, tuple[int, ...]]:
    return tg, pipeline_placement(tg, devices)


def _tensor(tg: TaskGraph, devices: int) -> tuple[TaskGraph, tuple[int, ...]]:
    check_devices(devices, "tensor placement")
    graph = tensor_split(tg, devices)
    return graph, tensor_placement(graph, devices)


STRATEGIES: dict[str, Strategy] = {"pipeline": _pipeline, "tensor": _tensor}
"""Placement strategies by name, each `(tg, devices) -> (graph, placement)` (`Strategy`):
"pipeline" places `tg` itself by layers (`pipeline_placement`), "tensor" splits it for
tensor parallelism (`tensor_split`) unless it is split already, and places that
(`tensor_placement`). (The allocator's `PlanOptions.placement`, where in the arena a
tensor goes, is another matter.)"""


def place(tg: TaskGraph, devices: int, strategy: str = "pipeline") -> PlacedGraph:
    """`tg` placed on `devices` devices by the strategy named `strategy` (`STRATEGIES`)
    and split (`split`); the result's `graph` is the graph placed (for "tensor", `tg`
    split by `tensor_split`), whose task ids its links and `DevicePart.origin` name."""
    if strategy not in STRATEGIES:
        raise PlanError(
            f"unknown placement strategy {strategy!r}; valid: {', '.join(map(repr, STRATEGIES))}"
        )
    expect_graph(tg, TaskGraph, "memgraph.placement.place")
    graph, placement = STRATEGIES[strategy](tg, devices)
    return split(graph, placement, devices, strategy=strategy)


def _check_placement(tg: TaskGraph, placement: Sequence[int], devices: int) -> tuple[int, ...]:
    """`placement` as a tuple, checked: one device (or `REPLICATED`) per task."""
    device_of = tuple(placement)
    if len(device_of) != len(tg):
        raise PlanError(f"a placement names {len(device_of)} devices for {len(tg)} tasks")
    for task, device in zip(tg, device_of, strict=True):
        if isinstance(device, bool) or not isinstance(device, int):
            raise PlanError(f"task %{task.id}: its device must be an int, got {device!r}")
        if not REPLICATED <= device < devices:
            raise PlanError(
                f"task %{task.id}: device {device} is not one of 0..{devices - 1} (or "
                f"{REPLICATED}, replicated)"
            )
    return device_of


def split(
    tg: TaskGraph, placement: Sequence[int], devices: int, *, strategy: str = "pipeline"
) -> PlacedGraph:
    """`tg` split by `placement` (one device or `REPLICATED` per task) over `devices`
    devices: a TaskGraph per device and the links between them (see the module
    docstring). `strategy` is recorded on the result, and `tg` as its `graph`. Raises
    `PlanError` for a placement of the wrong length or an unknown device."""
    expect_graph(tg, TaskGraph, "memgraph.placement.split")
    check_devices(devices, "split")
    device_of = _check_placement(tg, placement, devices)
    needed = [_Needs(tg, device_of, d) for d in range(devices)]
    for d in range(devices):
        needed[d].add(t for t in range(len(tg)) if device_of[t] == d)
    outputs: dict[str, tuple[int, str]] = {}
    output_device: dict[int, int] = {}
    for name, task_id in tg.outputs.items():
        device = device_of[task_id]
        if device == REPLICATED:
            holders = [d for d in range(devices) if task_id in needed[d].local]
            device = output_device.get(task_id, holders[0] if holders else 0)
        output_device[task_id] = device
        outputs[name] = (device, name)
    for task_id, device in output_device.items():
        needed[device].add([task_id])
    for task in tg:  # an input that nothing reads: kept on device 0
        if isinstance(task.op, Input) and not any(task.id in n.local for n in needed):
            needed[0].add([task.id])

    links: list[Link] = []
    taken_inputs, taken_outputs = set(tg.inputs), set(tg.outputs)
    send_name: dict[int, str] = {}
    recv_name: dict[tuple[int, int], str] = {}
    for d in range(devices):
        for task_id in sorted(needed[d].received):
            task = tg[task_id]
            if task_id not in send_name:
                send_name[task_id] = fresh_name(f"send:%{task_id}", taken_outputs)
            recv_name[task_id, d] = fresh_name(f"recv:%{task_id}", taken_inputs)
            links.append(
                Link(
                    task_id,
                    device_of[task_id],
                    d,
                    send_name[task_id],
                    recv_name[task_id, d],
                    task.shape,
                    task.dtype,
                    task.nbytes,
                )
            )
    links.sort(key=lambda link: (link.task, link.target))
    parts = []
    for d in range(devices):
        sends = {t: n for t, n in send_name.items() if device_of[t] == d}
        mine = {name: t for name, t in tg.outputs.items() if outputs[name][0] == d}
        parts.append(_part(tg, d, needed[d], recv_name, sends, mine))
    return PlacedGraph(devices, tuple(parts), tuple(links), outputs, strategy, tuple(tg.inputs), tg)


class _Needs:
    """What device `device` holds of `tg` under a placement: `local` (tasks it makes:
    its own, replicated ones, copies of Views) and `received` (tensors linked in)."""

    def __init__(self, tg: TaskGraph, device_of: tuple[int, ...], device: int):
        self.tg = tg
        self.device_of = device_of
        self.device = device
        self.local: set[int] = set()
        self.received: set[int] = set()

    def add(self, tasks) -> None:
        """Make the device hold `tasks` and, transitively, what they read."""
        stack = list(tasks)
        while stack:
            task_id = stack.pop()
            if task_id in self.local or task_id in self.received:
                continue
            device = self.device_of[task_id]
            task = self.tg[task_id]
            if device in (self.device, REPLICATED) or task.op.aliases_input:
                self.local.add(task_id)
                stack.extend(task.inputs)
            else:
                self.received.add(task_id)


def _part(
    tg: TaskGraph,
    device: int,
    needs: _Needs,
    recv_name: dict[tuple[int, int], str],
    sends: dict[int, str],
    outputs: dict[str, int],
) -> DevicePart:
    """Device `device`'s TaskGraph: its tasks in the original order, a link input in place
    of each tensor it receives, its original outputs and its sends as outputs."""
    builder = GraphBuilder(f"{tg.name}:device{device}")
    origin = sorted(needs.local | needs.received)
    new_id: dict[int, int] = {}
    blocks = []
    for task_id in origin:
        task = tg[task_id]
        if task_id in needs.received:
            op = Input(recv_name[task_id, device], role="activation", location="host")
            new_id[task_id] = builder.add(op, (), task.shape, task.dtype, task.scope, task.label)
            blocks.append(None)
            continue
        facts = [f for f in (fact.renumbered(new_id) for fact in task.facts) if f is not None]
        new_id[task_id] = builder.add(
            task.op,
            [new_id[i] for i in task.inputs],
            task.shape,
            task.dtype,
            task.scope,
            task.label,
            facts,
            task.workspace,
        )
        blocks.append(task.block)
    for name, task_id in outputs.items():
        builder.output(new_id[task_id], name)
    for task_id, name in sorted(sends.items()):
        builder.output(new_id[task_id], name)
    built = builder.build()
    if any(block is not None for block in blocks):
        built = TaskGraph(with_blocks(built.tasks, blocks), built.outputs, built.name)
    return DevicePart(device, built, tuple(origin))
