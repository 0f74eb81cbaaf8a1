"""Topological orders the planner can walk, in a registry looked up by name.

An order is a function `order(tg) -> list[int]`: every task id of `tg` once, each
after the tasks it reads. The planner simulates execution in that order; only
compute tasks (not inputs or views) become steps, so where an order puts inputs and
views does not matter as long as it is topological.

* `"program"`: insertion order (task ids), the order the program was written in.
* `"memory"`: greedy memory-aware order. Among the ready compute tasks it runs the
  one with the smallest *memory delta*, the bytes that running it allocates minus
  the bytes it frees, ties by task id (so it stays close to program order):

      delta(t) = bytes(t's output, if anything reads it or it is a program output)
               + bytes of host-resident inputs t is the first to read (they arrive)
               - bytes of the operands t is the last reader of (they are freed;
                 program outputs never are)

  Deltas only decrease as other tasks run (an operand's last reader becomes known,
  an input arrives), so a heap with a version number per task gives O(E log V):
  every decrease pushes a fresh entry and stale ones are skipped when popped.

Inputs come first (in id order); a view is placed right before the first compute
task that needs it, and views that no compute task reads go last.

>>> import einpage as ep
>>> prog = ep.Program()
>>> x = prog.input("x", (4,))
>>> a, b = ep.exp(x), ep.relu(x)
>>> prog.output(a + b, "y")
>>> get_order("program")(prog.build())
[0, 1, 2, 3]
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from einpage_core.errors import PlanError
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Input

__all__ = [
    "ORDERS",
    "OrderFn",
    "get_order",
    "check_order",
    "program_order",
    "memory_order",
    "register_order",
]

OrderFn = Callable[[TaskGraph], list[int]]


def is_compute(tg: TaskGraph, task_id: int) -> bool:
    """Whether a task is a step of the plan (it has an apply): not an input, not a view."""
    return tg[task_id].is_compute


def program_order(tg: TaskGraph) -> list[int]:
    """Task ids in insertion order (always topological for a TaskGraph)."""
    return list(range(len(tg)))


def memory_order(tg: TaskGraph) -> list[int]:
    """The greedy smallest-memory-delta order (see the module docstring)."""
    root = [tg.storage_root(t.id) for t in tg]
    roots_of = [tuple(dict.fromkeys(root[i] for i in t.inputs)) for t in tg]
    readers: list[list[int]] = [[] for _ in tg]  # compute readers of each storage root
    waiting = [0] * len(tg)  # unfinished compute producers of each compute task
    users: list[list[int]] = [[] for _ in tg]  # compute tasks waiting on a compute root
    compute = [t.id for t in tg if is_compute(tg, t.id)]
    for t in compute:
        for r in roots_of[t]:
            readers[r].append(t)
            if is_compute(tg, r):
                waiting[t] += 1
                users[r].append(t)
    left = [len(r) for r in readers]  # readers of each root that have not run
    outputs = {root[t] for t in tg.outputs.values()}
    arrived = [not _on_host(tg, t) for t in range(len(tg))]

    def delta(t: int) -> int:
        grow = tg[t].nbytes if readers[t] or t in outputs else 0
        for r in roots_of[t]:
            if not arrived[r]:
                grow += tg[r].nbytes
            if left[r] == 1 and r not in outputs:
                grow -= tg[r].nbytes
        return grow

    version = [0] * len(tg)
    ready = [(delta(t), t, 0) for t in compute if waiting[t] == 0]
    heapq.heapify(ready)
    done = [False] * len(tg)

    def refresh(t: int) -> None:
        if waiting[t] == 0 and not done[t]:
            version[t] += 1
            heapq.heappush(ready, (delta(t), t, version[t]))

    chosen: list[int] = []
    while ready:
        _, t, v = heapq.heappop(ready)
        if v != version[t] or done[t]:
            continue
        done[t] = True
        chosen.append(t)
        for r in roots_of[t]:
            left[r] -= 1
            if not arrived[r]:
                arrived[r] = True
                for other in readers[r]:
                    refresh(other)
            elif left[r] == 1:
                for other in readers[r]:
                    refresh(other)
        for u in users[t]:
            waiting[u] -= 1
            refresh(u)
    if len(chosen) != len(compute):  # pragma: no cover - a TaskGraph is acyclic
        raise PlanError("memory order: the task graph has a cycle")
    return with_structural_tasks(tg, chosen)


def _on_host(tg: TaskGraph, task_id: int) -> bool:
    op = tg[task_id].op
    return isinstance(op, Input) and op.location == "host"


def with_structural_tasks(tg: TaskGraph, compute_order: Sequence[int]) -> list[int]:
    """A full topological order from an order of the compute tasks: inputs first, each
    view right before the first compute task that reads it, the remaining views last."""
    order = [t.id for t in tg if isinstance(t.op, Input)]
    placed = [isinstance(t.op, Input) for t in tg]

    def place_views(task_id: int) -> None:
        for i in tg[task_id].inputs:
            if not placed[i] and tg[i].op.aliases_input:
                place_views(i)
                placed[i] = True
                order.append(i)

    for t in compute_order:
        place_views(t)
        placed[t] = True
        order.append(t)
    order.extend(t.id for t in tg if not placed[t.id])
    return order


ORDERS: dict[str, OrderFn] = {
    "program": program_order,
    "memory": memory_order,
}
"""Topological orders by name: function(tg) -> list of task ids (add one with
`register_order`)."""


def register_order(name: str, order: OrderFn) -> None:
    """Make `order` available as `plan(..., order=name)`.

    An order maps a TaskGraph to all its task ids, each after the tasks it reads; the
    planner checks what it returns (`check_order`). A name already registered to another
    function is refused (`PlanError`).
    """
    if not isinstance(name, str) or not name:
        raise PlanError(f"an order name must be a non-empty string, got {name!r}")
    if not callable(order):
        raise PlanError(f"order {name!r} must be a function of a TaskGraph")
    known = ORDERS.get(name)
    if known is not None and known is not order:
        raise PlanError(f"order {name!r} is already registered ({known!r})")
    ORDERS[name] = order


def get_order(name: str) -> OrderFn:
    """The order registered under `name`; an unknown name lists the valid ones."""
    try:
        return ORDERS[name]
    except (KeyError, TypeError):
        valid = ", ".join(repr(known) for known in ORDERS)
        raise PlanError(f"unknown order {name!r}; valid orders: {valid}") from None


def check_order(tg: TaskGraph, order: Sequence[int]) -> list[int]:
    """Return `order` as a list after checking it is a topological order of all of `tg`'s
    tasks (each exactly once, after its inputs); raise `PlanError` naming the problem."""
    order = list(order)
    seen = [False] * len(tg)
    for position, task_id in enumerate(order):
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            raise PlanError(f"order position {position}: {task_id!r} is not a task id")
        if not 0 <= task_id < len(tg):
            raise PlanError(f"order position {position}: %{task_id} is not a task of the graph")
        if seen[task_id]:
            raise PlanError(f"order position {position}: %{task_id} appears twice")
        for i in tg[task_id].inputs:
            if not seen[i]:
                raise PlanError(
                    f"order position {position}: %{task_id} comes before its input %{i}"
                )
        seen[task_id] = True
    if len(order) != len(tg):
        missing = [t for t in range(len(tg)) if not seen[t]][:5]
        raise PlanError(
            f"order has {len(order)} tasks, the graph {len(tg)}; missing e.g. "
            f"{', '.join(f'%{t}' for t in missing)}"
        )
    return order
