"""MultiPlans made by hand, for the multi-device runners' tests (no placement pass).

Each case is a few TaskGraphs built with `einpage.Program`, one per device, where a
tensor computed on one device is an output `send:%k` of its TaskGraph and an input
`recv:%k` (an activation that starts on the host) of each TaskGraph that reads it; the
`Link`s say so. Each device's TaskGraph is planned with `memgraph.plan(tg, budget,
outputs="host")`, under its resident peak (`"100%"`, nothing moves) or under a budget
that forces offloads. `reference(case, inputs)` composes `taskgraph.evaluate` of the
parts in the order the links need, independently of the runners.

Cases:

* `chain`: device 0 computes `a` from `x`, device 1 computes `y` from `a`;
* `fanout`: device 0 computes `a`, which devices 1 and 2 both read (one output, two
  links);
* `cycle`: device 0 computes `a`, device 1 computes `b` from it, device 0 computes `c`
  from `b` (and `x` again): a link each way, as a pipeline's backward pass or a
  generation step makes.

`split_program(head, fraction)` splits a random program (`tests/strategies.py`) at two
links: device 0 runs it, devices 1 and 2 a short chain after it.

`cross_wired()` is a broken MultiPlan: two devices that each wait for the other's link
before computing what they send (a cycle between devices: a deadlock).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import einpage as ep
import memgraph
import taskgraph
from memgraph.multi import DevicePart, DevicePlan, Link, MultiPlan, PlacedGraph
from taskgraph.builder import GraphBuilder
from taskgraph.einsum import EinsumSpec
from taskgraph.nodes import Einsum

__all__ = [
    "Case",
    "CASES",
    "make_case",
    "plan_case",
    "case_inputs",
    "reference",
    "BUDGETS",
    "cross_wired",
    "Split",
    "split_program",
    "split_inputs",
    "split_reference",
]

N = 48
"""Rows and columns of every matrix: 9 KiB in float32, so a few matrices fill a budget."""

LAYERS = 3
"""Matmuls per stage: each reads its own weight, so a tight budget streams weights."""

BUDGETS = ("100%", "tight")
"""Budgets each case is planned under: the resident peak (nothing moves), and the
smallest budget a device's plan is feasible at (`memgraph.min_budget`), which moves
weights and activations."""


@dataclass(frozen=True)
class Case:
    """A hand-made placement: the devices' TaskGraphs, the links, where the original
    outputs are, and `steps`: the order in which a reference evaluates the parts (device
    ids; a device appears once per stage it computes, the cycle's device 0 twice)."""

    name: str
    tgs: tuple[taskgraph.TaskGraph, ...]
    links: tuple[Link, ...]
    outputs: dict[str, tuple[int, str]]


def _stage(prog: ep.Program, h, prefix: str, join: str | None = None):
    """`LAYERS` matmuls of `h`, each with its own weight `prefix.w{i}`, the join in
    between, and the first layer's result added at the end: a residual that a tight
    budget offloads while the other layers run."""
    first = None
    for i in range(LAYERS):
        w = prog.input(f"{prefix}.w{i}", (N, N), "float32", role="weight")
        h = prog.einsum("bd,df->bf", h, w)
        if join is not None:
            h = prog.einsum("bf->bf", h, join=join)
        first = h if first is None else first
    return prog.einsum("bf,bf->bf", h, first, join="a + b")


def _recv(prog: ep.Program, task: int) -> ep.program.program.Tensor:
    return prog.input(f"recv:%{task}", (N, N), "float32", role="activation", location="host")


def _link(task: int, source: int, target: int) -> Link:
    return Link(
        task=task,
        source=source,
        target=target,
        output=f"send:%{task}",
        input=f"recv:%{task}",
        shape=(N, N),
        dtype="float32",
        nbytes=N * N * 4,
    )


# Task ids of the original program the links stand for (hand-made: any distinct ids).
A, B = 10, 20


def _chain() -> Case:
    p0 = ep.Program("chain.dev0")
    x = p0.input("x", (N, N), "float32")
    p0.output(_stage(p0, x, "l0", "tanh(a)"), f"send:%{A}")
    p1 = ep.Program("chain.dev1")
    p1.output(_stage(p1, _recv(p1, A), "l1", "relu(a)"), "y")
    return Case("chain", (p0.build(), p1.build()), (_link(A, 0, 1),), {"y": (1, "y")})


def _fanout() -> Case:
    p0 = ep.Program("fanout.dev0")
    x = p0.input("x", (N, N), "float32")
    a = _stage(p0, x, "l0", "tanh(a)")
    p0.output(a, f"send:%{A}")
    p0.output(p0.einsum("bf->b", a, agg="max"), "amax")  # an original output of device 0
    p1 = ep.Program("fanout.dev1")
    p1.output(_stage(p1, _recv(p1, A), "l1", "relu(a)"), "y1")
    p2 = ep.Program("fanout.dev2")
    r = _recv(p2, A)
    bias = p2.input("bias", (N,), "float32")  # an input of device 2 only
    h = p2.einsum("bf,f->bf", _stage(p2, r, "l2", "tanh(a)"), bias, join="a + b")
    p2.output(h, "y2")
    links = (_link(A, 0, 1), _link(A, 0, 2))
    outputs = {"amax": (0, "amax"), "y1": (1, "y1"), "y2": (2, "y2")}
    return Case("fanout", (p0.build(), p1.build(), p2.build()), links, outputs)


def _cycle() -> Case:
    p0 = ep.Program("cycle.dev0")
    x = p0.input("x", (N, N), "float32")
    p0.output(_stage(p0, x, "l0", "tanh(a)"), f"send:%{A}")
    b = _recv(p0, B)
    c = p0.einsum("bf,bf->bf", _stage(p0, b, "l2", "tanh(a)"), x, join="a + b")
    p0.output(c, "c")
    p1 = ep.Program("cycle.dev1")
    p1.output(_stage(p1, _recv(p1, A), "l1", "relu(a)"), f"send:%{B}")
    links = (_link(A, 0, 1), _link(B, 1, 0))
    return Case("cycle", (p0.build(), p1.build()), links, {"c": (0, "c")})


def driver_inputs(tgs, links) -> tuple[str, ...]:
    """The inputs of the device graphs `tgs` that no link feeds: what the driver stages."""
    linked = {(link.target, link.input) for link in links}
    names = {name for d, tg in enumerate(tgs) for name in tg.inputs if (d, name) not in linked}
    return tuple(sorted(names))


CASES: dict[str, Callable[[], Case]] = {"chain": _chain, "fanout": _fanout, "cycle": _cycle}


def make_case(name: str) -> Case:
    return CASES[name]()


def plan_case(case: Case, budget: str = "100%", **options) -> MultiPlan:
    """The case's MultiPlan: each device's TaskGraph planned with `outputs="host"` under
    `budget` ("tight": the device's `memgraph.min_budget`)."""
    parts = tuple(
        DevicePart(device, tg, tuple(range(len(tg.tasks)))) for device, tg in enumerate(case.tgs)
    )
    placed = PlacedGraph(
        len(case.tgs),
        parts,
        case.links,
        case.outputs,
        strategy="handmade",
        inputs=driver_inputs(case.tgs, case.links),
    )
    plans = []
    for part in parts:
        nbytes = memgraph.min_budget(part.tg)[0] if budget == "tight" else budget
        mg = memgraph.plan(part.tg, nbytes, outputs="host", **options)
        plans.append(DevicePlan(part.device, mg, mg.budget))
    return MultiPlan(placed, tuple(plans))


def case_inputs(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """Arrays for every original input (the devices' inputs that no link feeds)."""
    rng = np.random.default_rng(seed)
    linked = {link.input for link in case.links}
    arrays = {}
    for tg in case.tgs:
        for name, task_id in tg.inputs.items():
            if name not in linked and name not in arrays:
                task = tg[task_id]
                arrays[name] = (rng.standard_normal(task.shape) / np.sqrt(N)).astype(task.dtype)
    return arrays


def reference(case: Case, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The original outputs, from `taskgraph.evaluate` of each device's TaskGraph, run
    whenever all of its inputs are known (the links' values added as they are computed);
    a device whose inputs wait on itself (the cycle's device 0) is evaluated by its
    parts: this helper evaluates a device once every input it reads is known, and the
    cycle's device 0 needs `b`, which needs its own `a`: so `a` is computed first by
    evaluating device 0 with a stand-in for `b`, whose value does not reach `a`."""
    known = dict(inputs)
    results: dict[int, dict[str, np.ndarray]] = {}
    pending = list(range(len(case.tgs)))
    while pending:
        progressed = False
        for device in list(pending):
            tg = case.tgs[device]
            if all(name in known for name in tg.inputs):
                results[device] = taskgraph.evaluate(tg, {n: known[n] for n in tg.inputs})
                pending.remove(device)
                progressed = True
                for link in case.links:
                    if link.source == device:
                        known[link.input] = results[device][link.output]
        if progressed:
            continue
        # A cycle: evaluate the first pending device with zeros for what it lacks, and
        # pass on only the links whose values do not depend on the stand-ins.
        device = pending[0]
        tg = case.tgs[device]
        stand_in = {
            n: known[n] if n in known else np.zeros(tg[i].shape, tg[i].dtype)
            for n, i in tg.inputs.items()
        }
        partial = taskgraph.evaluate(tg, stand_in)
        lacking = {tg.inputs[n] for n in tg.inputs if n not in known}
        for link in case.links:
            if link.source == device and not _reads_any(tg, tg.outputs[link.output], lacking):
                known[link.input] = partial[link.output]
    return {name: results[device][out] for name, (device, out) in case.outputs.items()}


def _reads_any(tg: taskgraph.TaskGraph, task_id: int, sources: set[int]) -> bool:
    """Whether task `task_id` of `tg` depends (transitively) on any task in `sources`."""
    stack, seen = [task_id], set()
    while stack:
        t = stack.pop()
        if t in sources:
            return True
        if t not in seen:
            seen.add(t)
            stack.extend(tg[t].inputs)
    return False


def cross_wired() -> MultiPlan:
    """Two devices that each wait for the other's link before computing what they send:
    a cycle between devices in the union of the plans and the links (a deadlock)."""
    tgs = []
    for device, (mine, theirs) in enumerate(((1, 2), (2, 1))):
        prog = ep.Program(f"deadlock.dev{device}")
        r = prog.input(f"recv:%{theirs}", (4, 4), "float32", location="host")
        w = prog.input(f"w{device}", (4, 4), "float32", role="weight")
        prog.output(prog.einsum("ij,jk->ik", r, w), f"send:%{mine}")
        tgs.append(prog.build())
    links = tuple(
        Link(mine, device, 1 - device, f"send:%{mine}", f"recv:%{mine}", (4, 4), "float32", 64)
        for device, mine in ((0, 1), (1, 2))
    )
    parts = tuple(DevicePart(d, tg, tuple(range(len(tg.tasks)))) for d, tg in enumerate(tgs))
    placed = PlacedGraph(2, parts, links, {"a": (0, "send:%1")}, inputs=driver_inputs(tgs, links))
    mgs = [memgraph.plan(tg, "100%", outputs="host") for tg in tgs]
    return MultiPlan(placed, tuple(DevicePlan(d, mg, mg.budget) for d, mg in enumerate(mgs)))


# -- a random program split at links ------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """A program `head` on device 0 whose output `out` is sent to device 1 (`tail`: it
    reads a weight of its own, outputs `y` and sends a result on) and from there to
    device 2 (`back`: outputs `z`); the head's other outputs stay original outputs."""

    head: taskgraph.TaskGraph
    tgs: tuple[taskgraph.TaskGraph, ...]
    mp: MultiPlan

    @property
    def dtype(self) -> str:
        return self.head[self.head.outputs["out"]].dtype


def _tail(shape: tuple[int, ...], dtype: str) -> taskgraph.TaskGraph:
    idx = "abcdefgh"[: len(shape)]
    prog = ep.Program("tail")
    r = prog.input("recv:%0", shape, dtype, location="host")
    w = prog.input("w.tail", shape, dtype, role="weight")
    prog.output(prog.einsum(f"{idx},{idx}->{idx}", r, w, join="tanh(a) * b"), "y")
    prog.output(prog.einsum(f"{idx}->{idx}", r, join="a * 0.5 + 1.0"), "send:%1")
    return prog.build()


def _back(shape: tuple[int, ...], dtype: str) -> taskgraph.TaskGraph:
    idx = "abcdefgh"[: len(shape)]
    prog = ep.Program("back")
    r = prog.input("recv:%1", shape, dtype, location="host")
    prog.output(prog.einsum(f"{idx}->{idx}", r, join="exp(tanh(a))"), "z")
    return prog.build()


def split_program(head: taskgraph.TaskGraph, fraction: float) -> Split:
    """`head` (a random program with an output `out`) split as `Split` says, each device
    planned at `fraction` of the way from its smallest budget to its resident peak."""
    out = head[head.outputs["out"]]
    builder = GraphBuilder("head")
    for task in head.tasks:
        builder.add(task.op, task.inputs, task.shape, task.dtype)
    sent = out.id
    if head.storage_root(out.id) != out.id or not out.is_compute:
        # A link carries a computed tensor as its host storage holds it (memgraph.multi):
        # an input or a View of another tensor is sent as a copy made on device 0.
        idx = "abcdefgh"[: len(out.shape)]
        sent = builder.add(Einsum(EinsumSpec.parse(f"{idx}->{idx}")), (out.id,))
    for name, task_id in head.outputs.items():
        if name != "out":
            builder.output(task_id, name)
    builder.output(sent, "send:%0")
    tgs = (builder.build(), _tail(out.shape, out.dtype), _back(out.shape, out.dtype))
    links = (
        Link(0, 0, 1, "send:%0", "recv:%0", out.shape, out.dtype, out.nbytes),
        Link(1, 1, 2, "send:%1", "recv:%1", out.shape, out.dtype, out.nbytes),
    )
    outputs = {"y": (1, "y"), "z": (2, "z")}
    outputs.update({name: (0, name) for name in head.outputs if name != "out"})
    parts = tuple(DevicePart(d, tg, tuple(range(len(tg.tasks)))) for d, tg in enumerate(tgs))
    plans = []
    for device, tg in enumerate(tgs):
        low, high = memgraph.min_budget(tg)[0], memgraph.resident_peak(tg)
        budget = max(low, int(low + fraction * (high - low)))
        plans.append(DevicePlan(device, memgraph.plan(tg, budget, outputs="host"), budget))
    placed = PlacedGraph(3, parts, links, outputs, inputs=driver_inputs(tgs, links))
    mp = MultiPlan(placed, tuple(plans))
    return Split(head, tgs, mp)


def split_inputs(split: Split, seed: int) -> dict[str, np.ndarray]:
    """Standard-normal arrays for the head's inputs and the tail's weight."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for tg in split.tgs:
        for name, task_id in tg.inputs.items():
            if not name.startswith("recv:"):
                task = tg[task_id]
                arrays[name] = rng.standard_normal(task.shape).astype(task.dtype)
    return arrays


def split_reference(split: Split, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`taskgraph.evaluate` of the original head, then of the tail and of the back."""
    head, tail, back = split.head, split.tgs[1], split.tgs[2]
    first = taskgraph.evaluate(head, {n: inputs[n] for n in head.inputs})
    second = taskgraph.evaluate(tail, {"recv:%0": first["out"], "w.tail": inputs["w.tail"]})
    third = taskgraph.evaluate(back, {"recv:%1": second["send:%1"]})
    want = {"y": second["y"], "z": third["z"]}
    want.update({name: first[name] for name in head.outputs if name != "out"})
    return want
