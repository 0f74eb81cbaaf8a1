"""The planner: `plan(tg, budget) -> MemGraph`, by simulated execution in a bounded arena.

The planner walks a topological order of the TaskGraph (`memgraph.orders`) and
simulates running it in a device arena of `budget` bytes, managed by
`memgraph.allocator.Allocator` (best fit, aligned, with precise free provenance).
Only compute tasks are *steps*; inputs are placed up front and views occupy no
memory (a view's readers read its base's region, and a view keeps its base alive).

Two horizons
------------
* The **execution horizon** `e` is the next step whose apply is emitted.
* The **allocation horizon** `a >= e`: steps `[e, a)` are *prepared* – their output
  is allocated and their operands are resident (host-resident ones reloaded). Before
  each apply the allocation horizon advances greedily, preparing step `a` with
  allocations that must fit **without evicting** (all or nothing, through an
  allocator checkpoint), up to a target:

  - never more than `lookahead` steps ahead of `e` (0: no prefetch at all);
  - `lookahead_seconds="auto"` (the default): far enough to hide the transfers, not
    further. With C(e, t) the estimated compute seconds of steps e..t-1 (the cost
    model's roofline) and H(e, t) the seconds of host-to-device transfers that steps
    e..t need (counting those already issued, as if none had started), the target is
    the furthest t with C(e + 1, t) < H(e, t): t is prepared now if preparing it at
    the next chance, before step e + 1, would leave too little compute to hide its
    transfers behind. A step whose reloads are covered even then can wait, and
    holding its memory early would only crowd out other prefetches. (Comparing with
    C(e, t) instead would wait one step too long: with one large step before t –
    LLaMA's gate projection before the up projection – "later" is already too late.)
    Only steps with pending transfers can be that furthest t, so the scan visits just
    those.
  - `lookahead_seconds=<float>`: the furthest t with C(e, t) below that many seconds;
    `None`: only the step limit.

  With `schedule_transfers=True` a step ahead of `e` that stalls the horizon is prepared
  by evicting when the target says its reloads must start now and the frees before it
  cannot make room: victims with a host copy are dropped for it at once, so its reloads
  overlap the compute before it (`memgraph.transfer_schedule`; off by default).
  With `hide_reloads=True` a window cleared for an allocation avoids, where it can at no
  more offloaded bytes, tensors read within one copy's time, so a reload into it need
  not wait for the read just made (the same module; off by default).

  If step `e` is not prepared when its turn comes (the horizon stalled at it for lack
  of memory), it is prepared *at the execution horizon*, where allocation may evict.
  Then the horizon is empty (a == e), so nothing prefetched for a later step is live:
  the only pinned tensors are step e's own operands and output.

Victim choice
-------------
An allocation that does not fit at the execution horizon asks `memgraph.eviction`
for the best contiguous window of the arena (see there): by default the window whose
soonest-needed occupant is needed furthest in the future (Belady, from next-use
positions precomputed per tensor as sorted lists with a moving pointer), ties to
fewer bytes that need a transfer (a tensor with a valid host copy – a weight, or
anything offloaded before, as tensors are immutable – is dropped with no transfer),
then to fewer bytes evicted. Step e's operands and output are never victims. The
`"lru"` policy uses the same machinery with last-use positions, and so does any policy
added with `memgraph.eviction.register_policy` (it ranks an `EvictionContext`: next and
last use, size, and the bytes evicting the tensor would transfer).

A victim with no host copy is offloaded – or, with `recompute="auto"` (the default),
*discarded* and recomputed when the step that next reads it is prepared, where applying
its task again (its operands all have host copies) costs less than the copy out and
back on the cost model (`memgraph.recompute`). A step's operands moved into one window
(below) may be recomputed there too.

Placement and fragmentation
---------------------------
Allocations without eviction use the allocator's best fit, unless that would leave no
room for the next step that reads the tensor (`placement="room"`, the default): that
step must hold its whole working set at once, so between its tensors already on the
device there must stay one gap as large as the rest of it; otherwise the tensor goes
to the smallest free block, at whichever end, that keeps such a gap (best fit if none
does). A big activation placed mid-arena would otherwise force its reader to move it
through the host.

When a request at the execution horizon fails although enough bytes are free, the
window search handles it (it evicts the cheapest neighbours of free blocks to join
them); such requests are counted in `info["fragmentation_events"]`. If some tensor of
step e finds no window at all (step e's own tensors split the arena), the missing
tensors are packed into one window of their total size, keeping step e's resident
operands in place (`info["packed_steps"]`); failing that, into one window that also
has room for those operands, which may then be moved through the host
(`info["operand_moves"]`). That window always exists when the budget is at least
`min_budget`: everything is evictable then, and the arena holds all of step e's
tensors. There is never a compaction copy (the MemGraph has no copy node).

Lifetimes and ends
------------------
* A tensor is freed as soon as the apply of its last reader is emitted.
* Inputs: weights start in host storage (`Input.location`). Device-located inputs
  are allocated at the start, in id order, while they fit without evicting; the rest
  start on the host (`inputs="host"` puts every input there; an input that nothing
  reads is always left on the host unless it is a device-side output). When the walk
  offloads device inputs (they have no host copy), it is walked again with those
  inputs started on the host, and the run that moves fewer bytes is the plan
  (`info["inputs_on_host_to_move_less"]`): an input that is also an output need not
  cross PCIe twice.
* Outputs (`outputs="device"`, the default) stay resident to the end and get a device
  `output` node (except split outputs assembled on the host, see "Host assembly");
  one evicted on the way is reloaded at the end if it fits without evicting, else it
  is output from its host copy (`info["outputs_on_host"]`). With `outputs="host"`
  each output is offloaded as soon as it is computed (the copy overlaps later
  compute); after its last reader its region stays allocated until the copy has ended
  by the cost model's estimate (or until an allocation finds no other room), so that
  reusing those bytes does not wait for the copy – what a training step's written-back
  weights and optimizer states need.

Sliced reloads
--------------
A Slice that reads an input held in host storage is not computed on the device: each
time a reader needs it, a *sliced reload* copies just its box of the input's host
storage, and evicting it is a drop (see `memgraph.steps`). So an input larger than the
arena (a weight that a partitioned graph reads block by block) is streamed in slices
and never resident whole.

Partitioning
------------
`plan` does not partition: it plans the graph it is given, and when some task cannot
run even alone in the arena (`min_budget` above the budget) it raises
`InfeasibleBudgetError` naming the budget, the bytes needed, the task and its scope,
and the way out: `einpage.compile(program, budget)` (the pipeline: it partitions when
needed, plans and verifies) or `taskgraph.partition_for_budget(tg, budget)`, whose graph
– block tasks whose working sets fit a block limit – plans here like any other, with
the same input and output names.

Host assembly
-------------
A split program output that nothing but its Concats reads is *assembled on the host*:
each piece is copied right after its apply into its box of the output's host storage
by a *sliced offload*, and the Concats are not steps (see `memgraph.host_assembly`).
With `outputs="device"` its name is listed in `info["outputs_on_host"]`.

Speed: everything per step is O(operands) plus O(log n) allocator work, except a
victim search, which activates tensors only until a window forms (see
`memgraph.eviction`), so planning time is linear in the graph's size
(`benchmarks/plan_bench.py` measures it; the README has the figures).

Where things live: `memgraph.options` (`PlanOptions`), `memgraph.budgets` (reading a
budget; its reference points `resident_peak`, `streaming_minimum`, `min_budget`),
`memgraph.steps` (storage roots, sliced reloads, the steps of an order),
`memgraph.horizon` (the walk: `HorizonPlanner`), `memgraph.residents` (tensor state,
victim bookkeeping), `memgraph.host_assembly`, `memgraph.eviction` and
`memgraph.orders` (the registries of policies and orders).
`info` records the options, the budget as asked, `min_budget` and what the walk counts
that the nodes cannot tell (`memgraph.horizon.PlanCounters`); transfers, drops and the
high-water mark are `mg.stats`, counted from the nodes.

Dependencies are exactly the verifier's rules: an alloc waits for the frees of the
bytes it reuses (the allocator's `Block.deps`); a reload for its alloc and for the
node that wrote its host storage; an apply for its output's alloc and for the writer
of each operand; an offload for the writer; a free for every reader and offload of
the residency (which imply the writer and the alloc). Nothing else, so transfers can
overlap compute.

>>> import einpage as ep
>>> prog = ep.Program("drop")
>>> x = prog.input("x", (256, 256))  # 256 KiB each
>>> w = prog.input("w", (256, 256), role="weight")
>>> v = prog.input("v", (256, 256), role="weight")
>>> prog.output((x @ w) @ v @ w, "y")
>>> tg = prog.build()
>>> min_budget(tg)  # three 256 KiB tensors at once, first needed by task %3
(786432, 3)
>>> mg = plan(tg, "768KiB")  # w is dropped for v's step and reloaded for the last
>>> s = mg.stats
>>> s.reload_count, s.drop_count, s.offload_count
(3, 1, 0)
"""

from __future__ import annotations

from typing import Any

from einpage_core.errors import PlanError, expect_graph
from einpage_core.progress import Tick
from memgraph.budgets import (
    BudgetReading,
    check_budget,
    min_budget,
    read_budget,
    resident_peak,
    resident_run,
    resolve_budget,
    streaming_minimum,
)
from memgraph.graph import MemGraph
from memgraph.horizon import HorizonPlanner
from memgraph.options import INPUTS, OUTPUTS, PLACEMENTS, RECOMPUTES, PlanOptions
from memgraph.steps import sliced_reloads, storage_roots
from taskgraph.graph import TaskGraph

__all__ = [
    "PlanOptions",
    "plan",
    "min_budget",
    "resident_peak",
    "streaming_minimum",
    "resolve_budget",
    "storage_roots",
    "sliced_reloads",
    "OUTPUTS",
    "INPUTS",
    "PLACEMENTS",
    "RECOMPUTES",
]


def plan(
    tg: TaskGraph,
    budget: int | str | BudgetReading,
    *,
    progress: Tick | None = None,
    **options: Any,
) -> MemGraph:
    """Plan `tg` to run in a device arena of `budget` bytes; returns the MemGraph.

    `budget`: bytes (int), a size string (`"8GiB"`), a percentage of the resident peak
    (`"50%"`, `"50%resident"`) or of the streaming minimum (`"150%streaming"`; see
    `memgraph.budgets`), or a `memgraph.budgets.BudgetReading`. A budget that holds the
    resident peak moves nothing: when the planner's own run would (its prefetching and
    placement differ), the resident run's plan is returned (`info["resident_run"]`).

    Options (all keyword):

    * `order`: a name in `memgraph.orders.ORDERS` ("program", "memory"), or a
      topological order as a sequence of task ids;
    * `eviction`: a name in `memgraph.eviction.POLICIES` ("belady", "lru");
    * `lookahead`: the most steps the allocation horizon runs ahead (default 64);
    * `lookahead_seconds`: "auto" (hide the pending transfers, the default), seconds
      of estimated compute, or None (only `lookahead` limits prefetching);
    * `cost_model`: a `memgraph.cost.PRESETS` name or a `CostModel` (for the lookahead);
    * `alignment`: arena alignment in bytes (default 256);
    * `outputs`: "device" (the default) or "host"; `inputs`: "auto" or "host";
    * `placement`: "room" (the default), "best_fit" or "lifetime" (next to the neighbour
      freed nearest in time: fewer holes where small long-lived tensors sit between
      large ones; `HorizonPlanner.fit_by_lifetime`);
    * `schedule_transfers`: prepare a step ahead of the execution horizon by evicting
      (drops only) when its reloads' deadline comes, so they overlap the compute before
      it (`memgraph.transfer_schedule`; default False).
    * `hide_reloads`: evict, where possible, tensors whose last read ended at least one
      copy's time ago, so reloads overlap compute on cyclic reuse; may move more bytes
      (`memgraph.transfer_schedule`; default False).
    * `recompute`: "auto" (the default: an evicted tensor is recomputed where that is
      cheaper than offloading and reloading it, see `memgraph.recompute`) or "never".

    `progress`, if given, is called as `progress(steps done, steps)` about a hundred
    times while the planner walks (`einpage.compile(..., progress=)` turns it into
    `Progress` events). Raises `InfeasibleBudgetError` when the budget is below
    `min_budget` (its message names the task and the way out: partitioning, see
    "Partitioning" above), `BudgetFormatError` for a malformed budget, `PlanError` for a
    bad option.
    """
    expect_graph(
        tg, TaskGraph, "memgraph.plan", ": build a Program with .build(), load a preset "
        "with einpage.cli.presets.load_program(name), or use einpage.compile(program, budget)",
    )  # fmt: skip
    if "partition" in options:
        raise PlanError(
            "memgraph.plan does not partition: use einpage.compile(tg, budget, "
            "partition=...), or plan taskgraph.partition(tg, limit)"
        )
    opts = PlanOptions.from_keywords(options, "memgraph.plan", ("budget", "progress"))
    reading = read_budget(tg, budget, opts)
    needed = check_budget(tg, reading, opts)
    planner = HorizonPlanner(tg, reading.nbytes, opts, progress=progress)
    planner.run()
    planner = _inputs_on_host_instead(tg, reading.nbytes, opts, planner)
    resident = _resident_instead(tg, reading.nbytes, opts, planner)
    request = reading.request
    info = {
        "planner": "memgraph.planner",
        **opts.info(),
        "budget_request": request if isinstance(request, int) else str(request),
        "min_budget": needed,
        **(resident or planner).info(),
    }
    if resident is not None:
        info["resident_run"] = True
    return (resident or planner).builder.build(info)


def _inputs_on_host_instead(
    tg: TaskGraph, budget: int, opts: PlanOptions, planner: HorizonPlanner
) -> HorizonPlanner:
    """A run that starts on the host the device inputs `planner`'s run offloaded, when it
    moves fewer bytes; else `planner`.

    A device input has no host copy, so evicting one costs an offload; started in host
    storage (free: the caller hands the input over), it costs a reload at its first use
    instead, holds no memory until then, and needs no offload to be an output read from
    the host. An input that is also an output and that nothing reads, started on the
    device and offloaded when the arena fills, moves bytes for nothing (the optimum of
    `memgraph.optimal` moves none). Which run moves less depends on what else the plan
    must move, so both are planned and the bytes decide (ties keep the inputs on the
    device, where no first-use reload waits); the choice is listed in
    `info["inputs_on_host_to_move_less"]`."""
    if not planner.offloaded_inputs:
        return planner
    retry = HorizonPlanner(tg, budget, opts, host_inputs=frozenset(planner.offloaded_inputs))
    retry.run()
    return retry if retry.moved_bytes() < planner.moved_bytes() else planner


def _resident_instead(
    tg: TaskGraph, budget: int, opts: PlanOptions, planner: HorizonPlanner
) -> HorizonPlanner | None:
    """A resident run, when `planner`'s run moved something although the budget holds the
    resident peak (what was prepared early crowds the arena), so that such a budget never
    moves anything: the prefetching resident run if it fits, else the one that prepares
    nothing early (its high-water mark is the resident peak). None otherwise; resident
    runs are only made when the budget holds the most bytes live at one step."""
    usable = budget // opts.alignment * opts.alignment
    if not planner.moved() or usable < planner.live_bound():
        return None
    for prefetch in (True, False):
        resident = resident_run(tg, budget, opts, prefetch)
        if resident.high_water <= usable:
            return resident
    return None
