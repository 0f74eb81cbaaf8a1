"""Small plans for several devices built by hand (no placement pass), for the simulator's
tests: each device's TaskGraph is an `einpage.Program`; a tensor sent from device A to
device B is an output `send:%k` of A's program and an input `recv:%k` of B's
(`Input(role="activation", location="host")`), tied by a `Link`; each device is planned
with `memgraph.plan(tg, budget, outputs="host")`, as `memgraph.multi` says devices are.

`origin` follows `DevicePart`: for each task of a device's TaskGraph, the task of the
original (unsplit) program it stands for, which each builder states in its docstring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import einpage as ep
import memgraph
from memgraph.multi import DevicePart, DevicePlan, Link, MultiPlan, PlacedGraph

BUDGET = 1 << 20
"""Enough for every plan below: nothing is evicted, so the timings are easy to follow."""


def send(task: int) -> str:
    return f"send:%{task}"


def recv(task: int) -> str:
    return f"recv:%{task}"


def link(task: int, source: int, target: int, n: int) -> Link:
    """Original task `task`, a float32 vector of `n`, sent from `source` to `target`."""
    return Link(task, source, target, send(task), recv(task), (n,), "float32", 4 * n)


def multi_plan(
    parts: Sequence[tuple[object, Sequence[int]]],
    links: Sequence[Link],
    outputs: Mapping[str, tuple[int, str]],
    budget: int = BUDGET,
) -> MultiPlan:
    """Plan each (TaskGraph, origin) in `parts` on its device (`outputs="host"`), and tie
    the plans with `links`."""
    placed = PlacedGraph(
        devices=len(parts),
        parts=tuple(DevicePart(d, tg, tuple(origin)) for d, (tg, origin) in enumerate(parts)),
        links=tuple(links),
        outputs=dict(outputs),
    )
    plans = tuple(
        DevicePlan(d, memgraph.plan(tg, budget, outputs="host"), budget)
        for d, (tg, _) in enumerate(parts)
    )
    return MultiPlan(placed, plans)


def single(tg, budget: int | str = BUDGET, **options) -> MultiPlan:
    """`tg` alone on one device: a MultiPlan of one plan and no links."""
    mg = memgraph.plan(tg, budget, **options)
    placed = PlacedGraph(
        1, (DevicePart(0, tg, tuple(range(len(tg)))),), (), {n: (0, n) for n in tg.outputs}
    )
    return MultiPlan(placed, (DevicePlan(0, mg, mg.budget),))


def chain(n: int = 256, weight: bool = False) -> MultiPlan:
    """x -> a = exp(x) on device 0 -> b = exp(a) on device 1 (times w, a weight of device 1,
    when `weight`), output "y".

    Original tasks: %0 x (host), [%1 w], then a, then exp(a) [, then times w]. Device 0:
    x, a (sent). Device 1: recv(a), exp(a) [, w, times w]."""
    w_task = 1 if weight else None
    a_task = 2 if weight else 1
    d0 = ep.Program("chain.0")
    d0.output(ep.exp(d0.input("x", (n,), location="host")), send(a_task))
    d1 = ep.Program("chain.1")
    got = d1.input(recv(a_task), (n,), location="host")
    b = ep.exp(got)
    if weight:
        b = b * d1.input("w", (n,), role="weight")
    d1.output(b, "y")
    b_task = a_task + 1
    origin1 = (a_task, b_task, w_task, b_task + 1) if weight else (a_task, b_task)
    return multi_plan(
        [(d0.build(), (0, a_task)), (d1.build(), origin1)],
        [link(a_task, 0, 1, n)],
        {"y": (1, "y")},
    )


def independent(sizes: Sequence[int] = (256, 256)) -> MultiPlan:
    """Device d loads its own weight w{d} (float32, `sizes[d]` long) and outputs y{d} =
    exp(w{d}); no links. Original tasks: the weights, then the exps, in device order."""
    parts = []
    devices = len(sizes)
    for d, n in enumerate(sizes):
        prog = ep.Program(f"independent.{d}")
        prog.output(ep.exp(prog.input(f"w{d}", (n,), role="weight")), f"y{d}")
        parts.append((prog.build(), (d, devices + d)))
    return multi_plan(parts, [], {f"y{d}": (d, f"y{d}") for d in range(devices)})


def two_loads_and_one(n: int = 256) -> MultiPlan:
    """Device 0 loads two weights, u and v, and outputs y0 = exp(u) * v; device 1 loads one,
    w, and outputs y1 = exp(w); no links. Original tasks: %0 u, %1 v, %2 w, %3 exp(u),
    %4 exp(u) * v, %5 exp(w)."""
    d0 = ep.Program("two_loads.0")
    u, v = (d0.input(name, (n,), role="weight") for name in ("u", "v"))
    d0.output(ep.exp(u) * v, "y0")
    d1 = ep.Program("two_loads.1")
    d1.output(ep.exp(d1.input("w", (n,), role="weight")), "y1")
    return multi_plan(
        [(d0.build(), (0, 1, 3, 4)), (d1.build(), (2, 5))],
        [],
        {"y0": (0, "y0"), "y1": (1, "y1")},
    )


def round_trip(n: int = 256) -> MultiPlan:
    """Device 0 -> device 1 -> device 0: x, a = exp(x) on 0; b = exp(a) on 1; c = exp(b) on
    0, output "y". Original tasks %0 x, %1 a, %2 b, %3 c. Device 0: x, a (sent), recv(b),
    c; device 1: recv(a), b (sent). The devices wait on each other, the nodes do not."""
    d0 = ep.Program("round_trip.0")
    d0.output(ep.exp(d0.input("x", (n,), location="host")), send(1))
    d0.output(ep.exp(d0.input(recv(2), (n,), location="host")), "y")
    d1 = ep.Program("round_trip.1")
    d1.output(ep.exp(d1.input(recv(1), (n,), location="host")), send(2))
    return multi_plan(
        [(d0.build(), (0, 1, 2, 3)), (d1.build(), (1, 2))],
        [link(1, 0, 1, n), link(2, 1, 0, n)],
        {"y": (0, "y")},
    )


def round_trip_out_of_order(n: int = 256) -> MultiPlan:
    """`round_trip`, device 0's plan written by hand so that its compute stream runs c,
    which reads the tensor coming back from device 1, *before* a, which device 1 needs:
    in stream order device 0 waits for b before computing a, which b needs – a deadlock
    of in-order streams, though no dependency or link makes a cycle (a dependency-driven
    executor computes a first). Its h2d stream also queues the received tensor's reload
    before x's."""
    mp = round_trip(n)
    tg0 = mp.placed.parts[0].tg
    x, a, got, c = (tg0.inputs["x"], tg0.outputs[send(1)], tg0.inputs[recv(2)], tg0.outputs["y"])
    size = 4 * n
    b = memgraph.MemGraphBuilder(tg0, budget=4 * size)
    regions = {t: memgraph.Region(k * size, size) for k, t in enumerate((got, x, a, c))}
    in_x = b.input("x", x, storage=0)
    in_got = b.input(recv(2), got, storage=1)
    load_got = b.reload(got, 1, regions[got], deps=[in_got, b.alloc(got, regions[got])])
    load_x = b.reload(x, 0, regions[x], deps=[in_x, b.alloc(x, regions[x])])
    make_c = b.apply(c, [regions[got]], regions[c], deps=[load_got, b.alloc(c, regions[c])])
    b.free(got, regions[got], deps=[make_c])
    out_c = b.offload(c, regions[c], 3, deps=[make_c])
    b.free(c, regions[c], deps=[out_c])
    make_a = b.apply(a, [regions[x]], regions[a], deps=[load_x, b.alloc(a, regions[a])])
    b.free(x, regions[x], deps=[make_a])
    out_a = b.offload(a, regions[a], 2, deps=[make_a])
    b.free(a, regions[a], deps=[out_a])
    b.output(send(1), a, storage=2, deps=[out_a])
    b.output("y", c, storage=3, deps=[out_c])
    mg0 = b.build()
    plans = (DevicePlan(0, mg0, mg0.budget), mp.plans[1])
    return MultiPlan(mp.placed, plans)


def deadlock(n: int = 256) -> MultiPlan:
    """Each device computes what it sends from what it receives: a true cycle. Device 0:
    recv(%1) -> %0 = exp (sent); device 1: recv(%0) -> %1 = exp (sent)."""
    d0 = ep.Program("deadlock.0")
    d0.output(ep.exp(d0.input(recv(1), (n,), location="host")), send(0))
    d1 = ep.Program("deadlock.1")
    d1.output(ep.exp(d1.input(recv(0), (n,), location="host")), send(1))
    return multi_plan(
        [(d0.build(), (1, 0)), (d1.build(), (0, 1))],
        [link(0, 0, 1, n), link(1, 1, 0, n)],
        {},
    )


def pipeline(devices: int, batch: int, width: int, layers: int, budget_share: float) -> MultiPlan:
    """A stack of `devices * layers` layers h = tanh(h @ W) (float32, `batch` x `width`, each
    W a `width` x `width` weight), `layers` consecutive layers per device; device d sends
    its last h to device d + 1 (a link); the last device outputs "y". Each device is
    planned under `budget_share` of the way from its smallest budget to its resident peak
    (0: the smallest, so weights are reloaded just in time and activations may be
    offloaded).

    Original tasks: %0 x (host), then per layer its weight, its matmul and its tanh; a
    device's first input stands for x or for the previous device's last tanh."""
    from memgraph.planner import min_budget, resident_peak

    parts, links = [], []
    previous = 0  # the original task the device's first input stands for
    for d in range(devices):
        prog = ep.Program(f"pipeline.{d}")
        first = "x" if d == 0 else recv(previous)
        h = prog.input(first, (batch, width), location="host")
        origin = [previous]
        for layer in range(d * layers, (d + 1) * layers):
            w = prog.input(f"w{layer}", (width, width), role="weight")
            h = ep.tanh(h @ w)
            base = 1 + 3 * layer
            origin += [base, base + 1, base + 2]
        previous = origin[-1]
        last = d == devices - 1
        prog.output(h, "y" if last else send(previous))
        if not last:
            links.append(
                Link(previous, d, d + 1, send(previous), recv(previous), (batch, width),
                     "float32", 4 * batch * width)
            )  # fmt: skip
        parts.append((prog.build(), tuple(origin)))
    budgets = []
    for tg, _ in parts:
        low, _ = min_budget(tg, 256)
        high = resident_peak(tg)
        budgets.append(int(low + budget_share * (high - low)))
    placed = PlacedGraph(
        devices,
        tuple(DevicePart(d, tg, origin) for d, (tg, origin) in enumerate(parts)),
        tuple(links),
        {"y": (devices - 1, "y")},
    )
    plans = tuple(
        DevicePlan(d, memgraph.plan(tg, budget, outputs="host"), budget)
        for d, ((tg, _), budget) in enumerate(zip(parts, budgets, strict=True))
    )
    return MultiPlan(placed, plans)
