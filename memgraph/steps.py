"""What the planner walks: storage roots, the Slices made by sliced reloads, and the steps.

Only compute tasks are *steps* (they get an apply); inputs are placed up front and
views occupy no memory (a view's readers read its base's region, its *storage root*).

Sliced reloads
--------------
A Slice that reads an input held in host storage (`sliced_reloads` says which) is not
computed on the device. Like a weight, it is a tensor with a host copy from the start –
a box of the input's storage: whenever a reader needs it, a *sliced reload* copies just
that box, and evicting it is a drop. So an input larger than the arena (a weight that a
partitioned graph reads block by block, see `taskgraph.partition`) is streamed in
slices and never resident whole, and `min_budget` counts a slice's readers with the
slice alone. A device-located input read only through such slices starts on the host.
A slice that nothing reads is made once, by a sliced reload at its place in the order,
and freed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from taskgraph.graph import TaskGraph

__all__ = ["Step", "storage_roots", "sliced_reloads", "plan_steps"]


@dataclass(frozen=True, slots=True)
class Step:
    """One compute task of the order: its id, distinct operand roots, and reads.

    `sliced`: a Slice that nothing reads, produced by a sliced reload (and then freed)
    instead of an apply, so that it is computed at all.
    """

    task: int
    roots: tuple[int, ...]
    reads: tuple[int, ...]  # the storage root of each operand, in operand order
    sliced: bool = False


def storage_roots(tg: TaskGraph) -> list[int]:
    """`tg.storage_root` of every task, in one pass (a view's input comes before it)."""
    root = list(range(len(tg)))
    for task in tg:
        if task.op.aliases_input:
            root[task.id] = root[task.inputs[0]]
    return root


def sliced_reloads(tg: TaskGraph, inputs: str = "auto") -> dict[int, int]:
    """The Slice tasks a plan produces by *sliced reloads*: slice id -> the input it reads.

    A Slice that reads an Input directly qualifies when that input starts on the host –
    a host-located input, any input with `inputs="host"`, or a device-located one read
    only by qualifying Slices (the planner then leaves it on the host) – unless the
    slice holds a program output (an output needs a host copy of its own). Such a slice
    is never computed from its input: each time a reader needs it, the planner copies
    just its box from the input's host storage (see the module docstring), so the input
    need never be on the device whole.

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> w = prog.input("w", (64, 8), role="weight")
    >>> prog.output(ep.exp(prog.slice(w, (16, 0), (8, 8))), "y")
    >>> sliced_reloads(prog.build())
    {1: 0}
    """
    root = storage_roots(tg)
    outputs = {root[t] for t in tg.outputs.values()}
    candidates = {t.id: t.inputs[0] for t in tg if tg.is_input_slice(t.id) and t.id not in outputs}
    slices_of: dict[int, list[int]] = {}
    for s, i in candidates.items():
        slices_of.setdefault(i, []).append(s)
    sliced: dict[int, int] = {}
    for i, slices in slices_of.items():
        op = tg[i].op
        on_host = (
            inputs == "host"
            or op.location == "host"
            or all(c in candidates for c in tg.consumers[i])
        )
        if on_host:
            sliced.update((s, i) for s in slices)
    return sliced


def plan_steps(
    tg: TaskGraph,
    order: Sequence[int],
    root: Sequence[int],
    sliced: Collection[int],
    on_host: Collection[int],
) -> list[Step]:
    """The steps of `order`: its compute tasks, except the Slices made by sliced reloads
    (`sliced`; one that nothing reads stays, as a `sliced` step) and the Concats of
    outputs assembled on the host (`on_host`, see `memgraph.host_assembly`)."""
    compute = [t for t in order if tg[t].is_compute and t not in on_host]
    read = {root[i] for t in compute for i in tg[t].inputs}
    steps: list[Step] = []
    for t in compute:
        if t in sliced:
            if t not in read:
                steps.append(Step(t, (), (), sliced=True))
            continue
        reads = tuple([root[i] for i in tg[t].inputs])
        steps.append(Step(t, tuple(dict.fromkeys(reads)), reads))
    return steps
