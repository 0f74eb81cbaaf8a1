"""The verifier: checks any MemGraph, however it was made, and names the first violation.

It replays the nodes in insertion order, tracking device allocations, tensor
residencies and host storages, and checks:

* structure: ids are positions, dependencies point to earlier nodes, each kind sets
  the fields `memgraph.nodes.NODE_FIELDS` declares for it and no others, regions are
  inside the budget, and each region's offset is a multiple of the plan's alignment
  and of the element size of every tensor seen there (the tensor allocated, and each
  operand an apply reads, a view in its own dtype): a GPU faults on a misaligned load;
* host storages: every storage a node names is in the plan's table
  (`MemGraph.storages`) and holds what is copied into it: an input's or an offloaded
  tensor's shape, dtype and bytes, or for an output assembled on the host the
  output's; the table lists no storage that nothing writes;
* boxes: a box lies inside its storage (whose shape and dtype it repeats); a sliced
  reload's box has the shape and dtype of the reloaded Slice and starts where the
  Slice does; a sliced offload's box holds as many bytes as the offloaded tensor, of
  its dtype;
* residency: every apply's operands are resident, written, and read at the regions
  the plan says; outputs are written into freshly allocated regions; regions live at
  the same time never overlap (so the peak never exceeds the budget); every reload
  reads a storage that an input or an offload wrote; every compute task is applied
  exactly once (a Slice read straight from an input may instead be produced, any
  number of times, by a *sliced reload* of its box from the input's storage) and every
  program output is produced; a *recompute* (an apply with `recompute` set) computes a
  task that an earlier apply computed, whose output is not resident: its operands are
  read, like any apply's, where their data was written, and tensors are immutable, so
  it writes the value the first apply wrote; nothing can read the tensor between its
  free and its recompute (a read needs a resident, written tensor). An apply without the
  mark that computes a task a second time is an error;
* workspaces: an apply holds a workspace region exactly when its task declares one
  (`Task.workspace`), at least that large, aligned, inside the arena; it overlaps no
  live region, comes after the latest free of every byte it takes, counts (with
  everything live) against the budget while the apply runs, and is released by the
  apply: a later alloc of those bytes comes after the apply (as after a free);
* host assembly: a *sliced offload* (`into` set) copies a tensor that is exactly one
  leaf of the tree of output Concats rooted at `into` (Concats whose `Block` kind is
  "output", nested) into that leaf's box of the root's host storage; each leaf is
  written at most once, and a host output of such a storage must come after sliced
  offloads of every leaf. The boxes written into one such storage tile it exactly
  once: no box overlaps one written before it, and together they cover every element.
  Each box is the one its leaf holds in the tree. Such a storage is never reloaded.
  The tree's Concats then count as computed;
* dependencies (so that any execution honouring only the dependencies is safe, not
  just insertion order), where "after" means reachable through `deps` (the model
  below):
  - read-after-write: a writer of a region (apply, reload, device input, receive) comes
    after the region's alloc; a reader (apply, offload, device output, send) comes after the
    writer of the data it reads; a reload comes after the input or offload that
    wrote its storage, as does a host output (after all the sliced offloads that
    fill it, for an output assembled on the host);
  - write-after-read: an alloc comes after the latest free of every byte it
    overlaps; a free comes after its alloc, the writer, every reader and every
    offload of the residency it releases.

* sends and receives (plans for several devices, `memgraph.multi`): a send names an
  output of the TaskGraph, resident and written, and is one of its region's readers (so
  its free waits for it); a receive names an input, seen once, written into the region
  allocated for it (a device input that comes from another device); each link index is
  used by one node of the plan, and an output sent is produced. That a send's link
  ends in a receive on another device, of the same size, is `verify_multi`'s check.

* a host tier (`MemGraph.tier`): after each node's device checks, the host tier's rules
  (`memgraph.verify_tiers`: slots of the host arena, places on disk, and the order of
  reads, writes and releases, through the same "after" as every rule here); a plan
  without a tier has no read, write or release node, no slot and no place on disk.

The live bytes checked against the budget at each alloc are those of the residency
analysis (`memgraph.residency`, `MemGraph.residencies`). This module shares no code
with the planner.

The execution model verified
----------------------------
A node may start as soon as every node it depends on, directly or transitively, has
finished; nothing else orders two nodes – neither their insertion order nor a stream
they share. That is the runtime's `random` mode (`runtime.schedule.random_order`: any
topological order of the dependencies, one node at a time), and it covers the
runtime's other modes, which only add order: `streams` issues each stream's nodes in
insertion order (a CUDA stream, or a worker thread, runs its work in issue order)
and waits, through events, for exactly the dependencies on other streams; `sequential`
runs everything in insertion order. So a plan verified here is safe in every mode,
and a plan that relies on two nodes of one stream running in insertion order is
rejected (its missing dependency is named).

How "after" is decided: the replay asks each question ("must n9 come after n4?") as it
goes. One whose earlier node is a direct dependency – or, for a free, is known to come
before one of the free's direct dependencies (the free's writer and alloc come before
every reader the replay checked earlier) – is settled at once. The others are
collected and answered in one forward sweep over the nodes
(`memgraph.happens_before.waits_for`: reach bitsets over the targets still asked
about), when the replay ends or stops at another violation; the first one that fails,
in the order the replay asked them, is reported (before a later violation). The whole
check is near-linear in the nodes and dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from einpage_core.errors import VerificationError, expect_graph
from einpage_core.progress import Tick, ticks
from memgraph.graph import MemGraph
from memgraph.happens_before import waits_for
from memgraph.nodes import HostBox, HostStorage, MemNode, NodeKind, Region
from memgraph.verify_ranges import LatestFrees, LiveRegions, WrittenBoxes
from memgraph.verify_tiers import HostTierRules, check_no_tier, rule
from taskgraph import dtypes
from taskgraph.nodes import Concat, Input, Slice, Task

__all__ = ["verify", "VerifyReport"]


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What a successful verification saw."""

    nodes: int
    peak_bytes: int
    dependencies_checked: int
    host_peak_bytes: int = 0  # with a host tier: the most host-arena bytes live at once


_TIER_KINDS = (NodeKind.READ, NodeKind.WRITE, NodeKind.RELEASE)  # refused by `on_tier` then


@dataclass(frozen=True, slots=True)
class _Question:
    """A dependency the replay could not settle at once: node `source` must come after
    node `target` (`what` says why)."""

    source: int
    target: int
    what: str  # a `str.format` template of `args`
    args: tuple


@dataclass
class _Residency:
    """A tensor's stay on the device: from its alloc to its free."""

    alloc: int
    region: Region
    writer: int | None = None
    users: list[int] = field(default_factory=list)  # readers and offloads


@dataclass
class _Assembly:
    """A host storage filled by sliced offloads: output assembly `root`, the storage
    root of each leaf of its tree (with the Concats in `concats`), and which are written."""

    root: int
    leaves: dict[int, tuple[tuple[int, int], ...]]  # leaf's storage root -> box in root
    concats: list[int]
    filled: dict[int, int] = field(default_factory=dict)  # leaf's storage root -> offload
    boxes: WrittenBoxes = field(default_factory=WrittenBoxes)
    covered: int = 0  # elements the written boxes hold


def verify(mg: MemGraph, progress: Tick | None = None) -> VerifyReport:
    """Check every invariant of `mg`; raise `VerificationError` naming the first violation.
    `progress`, if given, is called as `progress(nodes checked, nodes)` now and then."""
    expect_graph(mg, MemGraph, "memgraph.verify")
    return _Verifier(mg).run(progress)


class _Verifier:
    def __init__(self, mg: MemGraph):
        self.mg = mg
        self.tg = mg.taskgraph
        self.node: MemNode | None = None
        self.live: dict[int, _Residency] = {}  # tensor -> residency
        self.regions = LiveRegions()
        self.live_bytes = mg.residencies.live_bytes  # after each node
        self.peak = 0
        self.freed = LatestFrees()
        self.storage_tensor: dict[int, int] = {}
        self.storage_writer: dict[int, int] = {}
        self.assemblies: dict[int, _Assembly] = {}  # storage -> what sliced offloads put there
        self.applied: set[int] = set()
        self.inputs_seen: set[str] = set()
        self.outputs_seen: set[str] = set()
        self.sent: set[str] = set()  # outputs sent to another device (`send`)
        self.links_seen: dict[int, int] = {}  # link -> the send or receive that uses it
        self.checked = 0
        self.deps: frozenset[int] | tuple[int, ...] = ()  # the current node's dependencies
        self.open: list[_Question] = []  # asked, not settled yet
        self.views = [task.op.aliases_input for task in self.tg]
        self.roots = list(range(len(self.tg)))  # each task's storage root (views: the base)
        for task in self.tg:
            if task.op.aliases_input:
                self.roots[task.id] = self.roots[task.inputs[0]]
        self.field_problems: dict[tuple, str | None] = {}
        self.tiers = None if mg.tier is None else HostTierRules(mg.tier, mg.storages, self)

    # -- reporting ---------------------------------------------------------------

    def fail(self, message: str, node: MemNode | None = None) -> VerificationError:
        """The error naming `node` (default: the current one), with its context lines."""
        node = node if node is not None else self.node
        if node is None:
            return VerificationError(message)
        lo, hi = max(0, node.id - 2), min(len(self.mg.nodes), node.id + 3)
        context = "\n".join(
            f"{'>' if n.id == node.id else ' '} {n.line()}" for n in self.mg.nodes[lo:hi]
        )
        return VerificationError(f"n{node.id} ({node.kind}): {message}\n{context}", node.id)

    def after(self, earlier: int | None, what: str, *args: object, via: Iterable[int] = ()) -> None:
        """Require the current node to come after node `earlier` through dependencies;
        `what.format(*args)` says why (formatted only if it fails).

        Settled at once when `earlier` is a direct dependency, or when one of `via` is
        (each node of `via` is already checked to come after `earlier`); otherwise asked
        of the sweep (`settle`).
        """
        if earlier is None:
            return
        self.checked += 1
        deps = self.deps
        if earlier in deps:
            return
        for w in via:
            if w in deps:
                return
        self.open.append(_Question(self.node.id, earlier, what, args))

    def settle(self) -> None:
        """Answer the open questions; raise the first that fails, in the order asked."""
        questions, self.open = self.open, []
        if not questions:
            return
        deps = [node.deps for node in self.mg.nodes]
        answers = waits_for(deps, [(q.source, q.target) for q in questions])
        for question, holds in zip(questions, answers, strict=True):
            if not holds:
                node = self.mg.nodes[question.source]
                what = question.what.format(*question.args)
                raise self.fail(f"missing dependency on n{question.target} ({what})", node)

    # -- the replay --------------------------------------------------------------

    def run(self, progress: Tick | None = None) -> VerifyReport:
        handlers = {
            NodeKind.INPUT: self.on_input,
            NodeKind.ALLOC: self.on_alloc,
            NodeKind.APPLY: self.on_apply,
            NodeKind.OFFLOAD: self.on_offload,
            NodeKind.RELOAD: self.on_reload,
            NodeKind.FREE: self.on_free,
            NodeKind.OUTPUT: self.on_output,
            NodeKind.SEND: self.on_send,
            NodeKind.RECV: self.on_recv,
            NodeKind.READ: self.on_tier,
            NodeKind.WRITE: self.on_tier,
            NodeKind.RELEASE: self.on_tier,
        }
        total, every = len(self.mg.nodes), ticks(len(self.mg.nodes))
        tiers = self.tiers
        try:
            if tiers is None:
                check_no_tier(self.mg.storages, self)
            else:
                tiers.check_table()
            for position, node in enumerate(self.mg.nodes):
                if progress is not None and position % every == 0:
                    progress(position, total)
                self.node = node
                self.check_structure(node, position)
                deps = node.deps
                self.deps = frozenset(deps) if len(deps) > 8 else deps
                handlers[node.kind](node)
                if tiers is not None:
                    tiers.see(node)  # the host tier's rules (`memgraph.verify_tiers`)
        except VerificationError:
            self.settle()  # a missing dependency asked before this violation comes first
            raise
        self.settle()
        self.node = None
        self.check_complete()
        if progress is not None:
            progress(total, total)
        host_peak = 0 if tiers is None else tiers.peak
        return VerifyReport(len(self.mg.nodes), self.peak, self.checked, host_peak)

    def check_structure(self, node: MemNode, position: int) -> None:
        if node.id != position:
            raise self.fail(f"id {node.id} does not match its position {position}")
        deps = node.deps
        if deps and (min(deps) < 0 or max(deps) >= node.id):
            raise self.fail(f"dependencies {list(node.deps)} must be earlier nodes")
        if node.tensor is None or not 0 <= node.tensor < len(self.tg):
            raise self.fail(f"tensor %{node.tensor} is not a task of the TaskGraph")
        if self.views[node.tensor]:
            raise self.fail(f"%{node.tensor} is a view; nodes name the viewed base tensor")
        budget = self.mg.budget
        regions = (node.region, *node.reads) if node.reads else (node.region,)
        if node.workspace is not None:
            regions = (*regions, node.workspace)
        for region in regions:
            if region is None:
                continue
            if region.offset < 0 or region.size <= 0 or region.offset + region.size > budget:
                raise self.fail(f"region {region} is outside the arena of {budget} bytes")
        problem = self.field_problem(node)
        if problem is not None:
            raise self.fail(problem)
        if node.slot is not None and self.tiers is None and node.kind not in _TIER_KINDS:
            raise self.fail(
                f"names host slot {node.slot} in a plan without a host tier" + rule("no tier")
            )

    def field_problem(self, node: MemNode) -> str | None:
        """`MemNode.field_problem`, remembered per kind and set of fields set (which is all
        it depends on)."""
        key = (
            node.kind,
            node.region is None,
            node.storage is None,
            not node.reads,
            not node.name,
            node.into is None,
            node.box is None,
            node.workspace is None,
            node.recompute,
            node.link is None,
            node.slot is None,
        )
        if key not in self.field_problems:
            self.field_problems[key] = node.field_problem()
        return self.field_problems[key]

    def resident(self, tensor: int, region: Region | None, what: str, *args: object) -> _Residency:
        """The live, written residency of `tensor`, which must be at `region`;
        `what.format(*args)` names it in an error."""
        residency = self.live.get(tensor)
        if residency is None:
            raise self.fail(f"{what.format(*args)} is not resident on the device")
        if residency.writer is None:
            raise self.fail(f"{what.format(*args)} is allocated but its data was never written")
        if region is not None and region != residency.region:
            raise self.fail(f"{what.format(*args)} is resident at {residency.region}, not {region}")
        return residency

    def write(self, tensor: int, region: Region, what: str) -> None:
        """The current node writes `tensor` into its freshly allocated `region`."""
        residency = self.live.get(tensor)
        if residency is None or residency.region != region:
            raise self.fail(f"{what} %{tensor} into {region}, which is not allocated for it")
        if residency.writer is not None:
            raise self.fail(f"%{tensor} at {region} was already written by n{residency.writer}")
        self.after(residency.alloc, "the alloc of {}", region)
        residency.writer = self.node.id

    def on_input(self, node: MemNode) -> None:
        task = self.tg[node.tensor]
        if not isinstance(task.op, Input) or task.op.name != node.name:
            raise self.fail(f'%{node.tensor} is not the input named "{node.name}"')
        if node.name in self.inputs_seen:
            raise self.fail(f'input "{node.name}" appears twice')
        self.inputs_seen.add(node.name)
        if node.storage is not None:
            self.bind_storage(node.storage, node.tensor)
            self.holds(node.storage, "input", task)
            self.storage_writer[node.storage] = node.id
        else:
            self.write(node.tensor, node.region, "input")

    def bind_storage(self, storage: int, tensor: int) -> None:
        owner = self.storage_tensor.setdefault(storage, tensor)
        if owner != tensor:
            raise self.fail(f"host#{storage} holds %{owner}, not %{tensor}")

    def listed(self, storage: int) -> HostStorage:
        """Host storage `storage` from the plan's table."""
        entry = self.mg.storages.get(storage)
        if entry is None:
            raise self.fail(f"host#{storage} is not in the plan's table of host storages")
        return entry

    def holds(self, storage: int, kind: str, task: Task) -> HostStorage:
        """The table says `storage` is filled as `kind` says and holds `task`, and its size
        is that of `task` (what is copied into it)."""
        entry = self.listed(storage)
        want = f"{kind} %{task.id}: {task.dtype}[{','.join(map(str, task.shape))}]"
        if (entry.kind, entry.tensor, entry.shape, entry.dtype) != (
            kind,
            task.id,
            task.shape,
            task.dtype,
        ):
            raise self.fail(f"the storage table has {entry}, but it holds {want}")
        if entry.nbytes != task.nbytes:
            raise self.fail(
                f"the storage table has {entry} ({entry.nbytes} bytes), but it holds {want}, "
                f"{task.nbytes} bytes"
            )
        return entry

    def box_inside(self, box: HostBox, entry: HostStorage) -> None:
        """`box` is a box of storage `entry`'s array and lies inside it."""
        if (box.shape, box.dtype) != (entry.shape, entry.dtype):
            dims = ",".join(map(str, box.shape))
            raise self.fail(f"box {box} is of a {box.dtype}[{dims}] array, not of {entry}")
        if not box.inside():
            raise self.fail(f"box {box} does not lie inside {entry}")

    def on_alloc(self, node: MemNode) -> None:
        region, tensor = node.region, node.tensor
        if region.offset % self.mg.alignment:
            raise self.fail(f"offset {region.offset:#x} is not aligned to {self.mg.alignment}")
        self.element_aligned(region, tensor)
        if region.size < self.tg[tensor].nbytes:
            raise self.fail(
                f"region of {region.size} bytes is smaller than %{tensor} "
                f"({self.tg[tensor].nbytes} bytes)"
            )
        if tensor in self.live:
            raise self.fail(f"%{tensor} is already resident at {self.live[tensor].region}")
        hit = self.regions.overlapping(region)
        if hit is not None:
            other, held = hit
            raise self.fail(f"{region} overlaps %{other} at {held}")
        for free_node in self.freed.overlapping(region):
            self.after(free_node, "the free of bytes it reuses, at n{}", free_node)
        self.regions.add(region, tensor)
        self.live[tensor] = _Residency(node.id, region)
        live = self.live_bytes[node.id]
        self.peak = max(self.peak, live)
        if live > self.mg.budget:
            raise self.fail(f"{live} bytes live exceed the budget of {self.mg.budget}")

    def element_aligned(self, region: Region, tensor: int) -> None:
        """Task `tensor` seen at `region` starts at a multiple of its element size."""
        task = self.tg[tensor]
        size = dtypes.itemsize(task.dtype)
        if region.offset % size:
            raise self.fail(
                f"%{tensor} ({task.dtype}) at offset {region.offset:#x}, which is not a "
                f"multiple of its element size ({size} B): a GPU faults on such a load"
            )

    def on_apply(self, node: MemNode) -> None:
        task = self.tg[node.tensor]
        if isinstance(task.op, Input):
            raise self.fail(f"%{node.tensor} is an input; inputs are not computed")
        if node.recompute:
            if node.tensor not in self.applied:
                raise self.fail(
                    f"recomputes %{node.tensor}, which no earlier apply computed (only a "
                    f"task computed before can be computed again)"
                )
        elif node.tensor in self.applied and not (
            task.inputs and self.is_input_slice(node.tensor, task.inputs[0])
        ):
            raise self.fail(
                f"%{node.tensor} is computed a second time (an apply that computes a "
                f"dropped tensor again must be marked as a recompute)"
            )
        if len(node.reads) != len(task.inputs):
            raise self.fail(
                f"reads {len(node.reads)} regions but task %{task.id} has "
                f"{len(task.inputs)} operand(s)"
            )
        for operand, region in zip(task.inputs, node.reads, strict=True):
            base = self.roots[operand]
            what = "operand %{}" if base == operand else "operand %{} (a view of %{})"
            residency = self.resident(base, region, what, operand, base)
            self.element_aligned(region, operand)
            self.after(residency.writer, "the write of %{}", base)
            residency.users.append(node.id)
        self.write(node.tensor, node.region, "apply writes")
        self.hold_workspace(node, task)
        self.applied.add(node.tensor)

    def hold_workspace(self, node: MemNode, task: Task) -> None:
        """The apply's workspace: there exactly when its task declares one, as large,
        aligned, on bytes nothing holds, after their latest free, within the budget with
        everything live; then released by the apply itself (later allocs wait for it)."""
        region, declared = node.workspace, task.workspace
        if region is None:
            if declared:
                raise self.fail(
                    f"task %{task.id} needs a workspace of {declared} bytes, but its apply "
                    f"holds none"
                )
            return
        if not declared:
            raise self.fail(f"holds a workspace {region}, but task %{task.id} declares none")
        if region.size < declared:
            raise self.fail(
                f"workspace of {region.size} bytes is smaller than task %{task.id}'s "
                f"({declared} bytes)"
            )
        if region.offset % self.mg.alignment:
            raise self.fail(
                f"workspace offset {region.offset:#x} is not aligned to {self.mg.alignment}"
            )
        hit = self.regions.overlapping(region)
        if hit is not None:
            other, held = hit
            raise self.fail(f"workspace {region} overlaps %{other} at {held}")
        for free_node in self.freed.overlapping(region):
            self.after(free_node, "the free of bytes its workspace takes, at n{}", free_node)
        live = self.live_bytes[node.id]
        self.peak = max(self.peak, live)
        if live > self.mg.budget:
            raise self.fail(
                f"{live} bytes live with its workspace exceed the budget of {self.mg.budget}"
            )
        self.freed.record(region, node.id)

    def on_offload(self, node: MemNode) -> None:
        residency = self.resident(node.tensor, node.region, "offloaded %{}", node.tensor)
        self.after(residency.writer, "the write of %{}", node.tensor)
        residency.users.append(node.id)
        if node.into is None:
            if node.box is not None:
                raise self.fail(f"box {node.box}: only a sliced offload ('into') copies a box")
            self.bind_storage(node.storage, node.tensor)
            self.holds(node.storage, "offload", self.tg[node.tensor])
            self.storage_writer[node.storage] = node.id
            return
        self.bind_storage(node.storage, node.into)
        assembly = self.assemblies.get(node.storage)
        if assembly is None:
            assembly = self.assemblies[node.storage] = self.assembly_of(node.into)
        entry = self.holds(node.storage, "assembly", self.tg[node.into])
        self.fill_box(node, assembly, entry)

    def fill_box(self, node: MemNode, assembly: _Assembly, entry: HostStorage) -> None:
        """A sliced offload writes its box: inside the storage, as many bytes as its
        tensor, overlapping no box written before, and the box its leaf holds."""
        box, task = node.box, self.tg[node.tensor]
        if box is None:
            raise self.fail(f"a sliced offload into host#{node.storage} carries no box")
        self.box_inside(box, entry)
        if box.nbytes != task.nbytes or box.dtype != task.dtype:
            raise self.fail(
                f"box {box} of host#{node.storage} holds {box.nbytes} bytes of {box.dtype}, "
                f"but %{task.id} has {task.nbytes} bytes of {task.dtype}"
            )
        hit = assembly.boxes.overlapping(box)
        if hit is not None:
            raise self.fail(
                f"the box {box} of host#{node.storage} was already written by "
                f"n{assembly.boxes.writers[hit]} (in whole or in part: it wrote "
                f"{assembly.boxes.boxes[hit]})"
            )
        if node.tensor not in assembly.leaves:
            raise self.fail(
                f"%{node.tensor} is not one of the pieces that output assembly %{node.into} "
                f"joins (its leaves: {['%' + str(t) for t in list(assembly.leaves)[:8]]})"
            )
        place = assembly.leaves[node.tensor]
        if tuple(zip(box.starts, box.sizes, strict=True)) != place:
            where = "[" + ", ".join(f"{s}:{s + n}" for s, n in place) + "]"
            raise self.fail(
                f"writes %{node.tensor} into box {box} of host#{node.storage}, but its box "
                f"in output assembly %{node.into} is {where}"
            )
        assembly.filled[node.tensor] = node.id
        assembly.boxes.add(box, node.id)
        assembly.covered += box.size

    def assembly_of(self, root: int) -> _Assembly:
        """The tree of output Concats rooted at task `root`: its leaves' boxes, by the
        storage root of each leaf (which a sliced offload names)."""
        if not self.is_output_concat(root):
            raise self.fail(f"%{root} is not a Concat that assembles a program output")
        leaves: dict[int, tuple[tuple[int, int], ...]] = {}
        concats: list[int] = []
        stack = [(root, (0,) * len(self.tg[root].shape))]
        while stack:
            task_id, starts = stack.pop()
            task = self.tg[task_id]
            if self.is_output_concat(task_id):
                concats.append(task_id)
                axis = task.op.axis % len(task.shape)
                for operand in task.inputs:
                    stack.append((operand, starts))
                    shift = self.tg[operand].shape[axis]
                    starts = starts[:axis] + (starts[axis] + shift,) + starts[axis + 1 :]
                continue
            base = self.tg.storage_root(task_id)
            if base in leaves:
                raise self.fail(
                    f"%{base} fills two boxes of output assembly %{root}: a sliced offload "
                    f"of it would be ambiguous"
                )
            leaves[base] = tuple(zip(starts, task.shape, strict=True))
        return _Assembly(root, leaves, concats)

    def is_output_concat(self, task_id: int) -> bool:
        task = self.tg[task_id]
        return (
            isinstance(task.op, Concat) and task.block is not None and task.block.kind == "output"
        )

    def on_reload(self, node: MemNode) -> None:
        if node.storage in self.assemblies:
            raise self.fail(
                f"host#{node.storage} is output %{self.assemblies[node.storage].root}, "
                f"assembled on the host by sliced offloads; it is never reloaded"
            )
        writer = self.storage_writer.get(node.storage)
        if writer is None:
            raise self.fail(f"host#{node.storage} holds no data yet (no input or offload wrote it)")
        held = self.storage_tensor[node.storage]
        if held != node.tensor and not self.is_input_slice(node.tensor, held):
            raise self.fail(
                f"host#{node.storage} holds %{held}, not %{node.tensor} (nor an "
                f"input that %{node.tensor} slices)"
            )
        self.reload_box(node, held)
        self.after(writer, "the write of host#{}", node.storage)
        self.write(node.tensor, node.region, "reload")
        if held != node.tensor:
            self.applied.add(node.tensor)  # a sliced reload computes the slice

    def reload_box(self, node: MemNode, held: int) -> None:
        """A whole reload carries no box; a sliced one the box of its Slice: inside the
        storage, of the Slice's shape and dtype, starting where the Slice starts."""
        task, box = self.tg[node.tensor], node.box
        if held == node.tensor:
            if box is not None:
                raise self.fail(f"reloads all of host#{node.storage}, yet carries box {box}")
            return
        if box is None:
            raise self.fail(
                f"a sliced reload of %{node.tensor} from host#{node.storage} carries no box"
            )
        self.box_inside(box, self.listed(node.storage))
        if (box.sizes, box.dtype) != (task.shape, task.dtype):
            dims = ",".join(map(str, box.sizes))
            raise self.fail(
                f"box {box} of host#{node.storage} is {box.dtype}[{dims}], but the reloaded "
                f"%{task.id} is {task.dtype}[{','.join(map(str, task.shape))}]"
            )
        if box.starts != tuple(task.op.starts):
            raise self.fail(
                f"box {box} of host#{node.storage} starts at {list(box.starts)}, but "
                f"%{task.id} slices %{held} from {list(task.op.starts)}"
            )

    def is_input_slice(self, tensor: int, source: int) -> bool:
        """Whether task `tensor` is a Slice read straight from the input task `source`."""
        task = self.tg[tensor]
        return (
            isinstance(task.op, Slice)
            and task.inputs[0] == source
            and isinstance(self.tg[source].op, Input)
        )

    def on_free(self, node: MemNode) -> None:
        residency = self.live.get(node.tensor)
        if residency is None or residency.region != node.region:
            raise self.fail(f"frees {node.region}, which does not hold %{node.tensor}")
        # Every user was checked to come after the writer, and the writer after the alloc.
        users = residency.users
        writer = () if residency.writer is None else (residency.writer,)
        self.after(residency.alloc, "the alloc it releases", via=(*reversed(users), *writer))
        self.after(residency.writer, "the write of %{}", node.tensor, via=reversed(users))
        for user in users:
            self.after(user, "n{}, which reads %{} there", user, node.tensor)
        del self.live[node.tensor]
        self.regions.remove(node.region)
        self.freed.record(node.region, node.id)

    def on_output(self, node: MemNode) -> None:
        if node.name not in self.tg.outputs:
            raise self.fail(f'"{node.name}" is not an output of the TaskGraph')
        if node.name in self.outputs_seen:
            raise self.fail(f'output "{node.name}" appears twice')
        self.outputs_seen.add(node.name)
        base = self.roots[self.tg.outputs[node.name]]
        if node.tensor != base:
            raise self.fail(f'output "{node.name}" is stored in %{base}, not %{node.tensor}')
        if node.region is not None:
            residency = self.resident(base, node.region, 'output "{}" (%{})', node.name, base)
            self.after(residency.writer, "the write of %{}", base)
            residency.users.append(node.id)
            return
        assembly = self.assemblies.get(node.storage)
        if assembly is not None and assembly.root == base:
            missing = [leaf for leaf in assembly.leaves if leaf not in assembly.filled]
            total = math.prod(self.listed(node.storage).shape)
            if missing or assembly.covered != total:
                raise self.fail(
                    f"host#{node.storage} (output %{base} assembled on the host) misses the "
                    f"box(es) of {['%' + str(t) for t in missing[:5]]}: no sliced offload "
                    f"wrote them (its boxes cover {assembly.covered} of {total} elements)"
                )
            for leaf, writer in assembly.filled.items():
                self.after(writer, "the sliced offload of %{} into host#{}", leaf, node.storage)
            self.applied.update(assembly.concats)
            return
        if self.storage_tensor.get(node.storage) != base or node.storage not in self.storage_writer:
            raise self.fail(f"host#{node.storage} does not hold %{base}")
        self.after(self.storage_writer[node.storage], "the write of host#{}", node.storage)

    def on_send(self, node: MemNode) -> None:
        """Output `name`, resident in `region`, leaves for another device: it is read like
        an output on the device (after its write; whatever frees it waits for the send)."""
        if node.name not in self.tg.outputs:
            raise self.fail(f'sends "{node.name}", which is not an output of the TaskGraph')
        base = self.roots[self.tg.outputs[node.name]]
        if node.tensor != base:
            raise self.fail(f'output "{node.name}" is stored in %{base}, not %{node.tensor}')
        self.use_link(node)
        residency = self.resident(base, node.region, 'sent output "{}" (%{})', node.name, base)
        self.after(residency.writer, "the write of %{}", base)
        residency.users.append(node.id)
        self.sent.add(node.name)

    def on_recv(self, node: MemNode) -> None:
        """Input `name` arrives from another device into its allocated `region`."""
        task = self.tg[node.tensor]
        if not isinstance(task.op, Input) or task.op.name != node.name:
            raise self.fail(f'%{node.tensor} is not the input named "{node.name}"')
        if node.name in self.inputs_seen:
            raise self.fail(f'input "{node.name}" appears twice')
        self.use_link(node)
        self.inputs_seen.add(node.name)
        self.write(node.tensor, node.region, "receives")

    def use_link(self, node: MemNode) -> None:
        """A link is one copy: used by one send or one receive of a device's plan."""
        earlier = self.links_seen.setdefault(node.link, node.id)
        if earlier != node.id:
            raise self.fail(f"link#{node.link} is already used by n{earlier}")

    def on_tier(self, node: MemNode) -> None:
        """A move between disk and the host arena: only a plan with a host tier has one."""
        if self.mg.tier is None:
            raise self.fail(f"a {node.kind} node in a plan without a host tier", node)

    def check_complete(self) -> None:
        missing_inputs = [name for name in self.tg.inputs if name not in self.inputs_seen]
        if missing_inputs:
            raise self.fail(f"input(s) {missing_inputs} never appear")
        computed = [t.id for t in self.tg if t.is_compute]
        missing = [t for t in computed if t not in self.applied]
        if missing:
            raise self.fail(f"task(s) {['%' + str(t) for t in missing[:5]]} are never computed")
        missing_outputs = [
            name
            for name in self.tg.outputs
            if name not in self.outputs_seen and name not in self.sent
        ]
        if missing_outputs:
            raise self.fail(f"output(s) {missing_outputs} are never produced")
        unwritten = [
            str(s) for sid, s in self.mg.storages.items() if sid not in self.storage_tensor
        ]
        if unwritten:
            raise self.fail(f"the storage table lists {unwritten[:3]}, which no node writes")
