"""The MemGraph (a memory plan), its builder, and the statistics it reports.

A MemGraph pairs a TaskGraph with the nodes that execute it inside a device arena
of `budget` bytes, and with the table of its host storages (`storages`: the shape,
dtype and size of each). It is immutable; planners make one with `MemGraphBuilder`,
which also works out each host storage and the box of each sliced copy as nodes are
added. Its insertion order is a valid sequential schedule, and its dependencies are
enough for concurrent execution on separate streams (`memgraph.verify` checks both).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from einpage_core.errors import GraphError, VerificationError
from einpage_core.units import format_bytes
from memgraph.nodes import HostBox, HostStorage, HostTier, MemNode, NodeKind, Region
from memgraph.residency import Residencies, analyze
from taskgraph.assembly import assembly_pieces
from taskgraph.graph import TaskGraph
from taskgraph.nodes import Slice

if TYPE_CHECKING:
    from memgraph.verify import VerifyReport

__all__ = ["MemGraph", "MemGraphBuilder", "PlanStats", "HostFacts"]


@dataclass(frozen=True, slots=True)
class PlanStats:
    """What a plan does, in numbers (bytes unless said otherwise).

    `peak_bytes` is the most bytes allocated at once; `high_water` the highest arena
    offset used. A *drop* frees a tensor that is needed again later without copying
    it out, because a host copy already exists (a weight, or an earlier offload).
    `fragmentation_events` and `block_limit` are reported by the planner. The offloads
    include *sliced offloads* (blocks copied into their box of a program output
    assembled on the host), also counted on their own in `sliced_offload_*`. The
    reloads include *first loads* (`first_load_*`): a tensor's first arrival on the
    device, from the host storage it starts in (a weight); every other reload brings
    back something that was on the device before. A *recompute* is an apply that computes
    a task again, its output having been dropped with no copy out instead of offloaded
    (`recompute_count`; `recompute_flops` the work they repeat, `recompute_bytes` what
    they write); `discard_bytes` are the bytes so dropped, counted once per drop
    (`apply_count` counts recomputes too). A bound on the bytes a plan that never
    recomputes must offload (reload) bounds `offload_bytes + discard_bytes`
    (`reload_bytes + recompute_bytes`) of any plan: make each discard an offload and each
    recompute a reload, and the plan still holds, moving no more.

    A plan with a host tier (`MemGraph.tier`) also has its host arena's `host_budget` and
    `host_peak_bytes`, what its reads bring from disk (`disk_read_*`; of it,
    `checkpoint_read_bytes` from checkpoint files, the rest from the spill file) and its
    writes put there (`disk_write_*`), and the size of its spill file (`spill_file_bytes`).
    `tier_rows` says what each tier needs; `rows` and `MemGraph.__str__` print its rows.
    """

    budget: int
    peak_bytes: int
    high_water: int
    offload_bytes: int
    offload_count: int
    reload_bytes: int
    reload_count: int
    drop_bytes: int
    drop_count: int
    node_count: int
    apply_count: int
    fragmentation_events: int = 0
    block_limit: int | None = None
    sliced_offload_bytes: int = 0
    sliced_offload_count: int = 0
    first_load_bytes: int = 0
    first_load_count: int = 0
    recompute_count: int = 0
    recompute_flops: int = 0
    recompute_bytes: int = 0
    discard_bytes: int = 0
    discard_count: int = 0
    host_budget: int | None = None
    host_peak_bytes: int = 0
    disk_read_bytes: int = 0
    disk_read_count: int = 0
    disk_write_bytes: int = 0
    disk_write_count: int = 0
    checkpoint_read_bytes: int = 0
    spill_file_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """(label, human-readable value) pairs, for tables."""
        pct = 100.0 * self.peak_bytes / self.budget if self.budget else 0.0
        rows = [
            ("budget", format_bytes(self.budget)),
            ("peak allocated", f"{format_bytes(self.peak_bytes)} ({pct:.1f}% of budget)"),
            ("arena high-water", format_bytes(self.high_water)),
            ("offloaded", f"{format_bytes(self.offload_bytes)} in {self.offload_count}"),
            ("reloaded", self._reloaded()),
            ("dropped (host copy kept)", f"{format_bytes(self.drop_bytes)} in {self.drop_count}"),
            ("nodes", f"{self.node_count} ({self.apply_count} applies)"),
            ("fragmentation events", str(self.fragmentation_events)),
        ]
        if self.sliced_offload_count:
            rows.insert(
                4,
                (
                    "  into outputs on host",
                    f"{format_bytes(self.sliced_offload_bytes)} in {self.sliced_offload_count}",
                ),
            )
        if self.recompute_count or self.discard_count:
            rows.insert(
                -2,
                (
                    "discarded, recomputed",
                    f"{format_bytes(self.discard_bytes)} in {self.discard_count}; "
                    f"{self.recompute_count} recomputes ({self.recompute_flops:.3g} flops)",
                ),
            )
        if self.block_limit is not None:
            rows.append(("block limit", format_bytes(self.block_limit)))
        return rows + self.tier_rows()

    def tier_rows(self) -> list[tuple[str, str]]:
        """What a plan's host tier and disk need (no rows without a tier): the host arena's
        budget and peak; the bytes read from disk, of them from checkpoints and from the
        spill file; the bytes written; the spill file's size. `rows` ends with them and
        `MemGraph.__str__` says them in its header (`einpage.compile`'s host row sums
        them up in a line of its own).

        >>> stats = PlanStats(4096, 3072, 3072, 0, 0, 0, 0, 0, 0, 9, 2, host_budget=2048,
        ...                   host_peak_bytes=1024, disk_read_bytes=2048, disk_read_count=2,
        ...                   checkpoint_read_bytes=1024, disk_write_bytes=1024,
        ...                   disk_write_count=1, spill_file_bytes=1024)
        >>> for label, value in stats.tier_rows():
        ...     print(f"{label:<22}{value}")
        host budget           2.0 KiB
        host peak             1.0 KiB (50.0% of budget)
        read from disk        2.0 KiB in 2
          from checkpoints    1.0 KiB
          from the spill file 1.0 KiB
        written to disk       1.0 KiB in 1
        spill file            1.0 KiB
        """
        if self.host_budget is None:
            return []
        pct = 100.0 * self.host_peak_bytes / self.host_budget if self.host_budget else 0.0
        spilled = self.disk_read_bytes - self.checkpoint_read_bytes
        read = f"{format_bytes(self.disk_read_bytes)} in {self.disk_read_count}"
        written = f"{format_bytes(self.disk_write_bytes)} in {self.disk_write_count}"
        return [
            ("host budget", format_bytes(self.host_budget)),
            ("host peak", f"{format_bytes(self.host_peak_bytes)} ({pct:.1f}% of budget)"),
            ("read from disk", read),
            ("  from checkpoints", format_bytes(self.checkpoint_read_bytes)),
            ("  from the spill file", format_bytes(spilled)),
            ("written to disk", written),
            ("spill file", format_bytes(self.spill_file_bytes)),
        ]

    def _reloaded(self) -> str:
        text = f"{format_bytes(self.reload_bytes)} in {self.reload_count}"
        if not self.reload_count:
            return text
        if self.first_load_count == self.reload_count:
            return f"{text} (all first loads: nothing came back)"
        return (
            f"{text} ({format_bytes(self.first_load_bytes)} in {self.first_load_count} first loads)"
        )

    def __str__(self) -> str:
        width = max(len(label) for label, _ in self.rows())
        return "\n".join(f"{label:<{width}}  {value}" for label, value in self.rows())


@dataclass(frozen=True, eq=False)
class MemGraph:
    """A memory plan: `nodes` executing `taskgraph` within `budget` bytes of device memory.

    `alignment` is the arena alignment the plan was made with; `info` holds what the
    planner chose to record (options, order, counters), JSON-ready. `storages` is the
    plan's host storages by id (`HostStorage`: shape, dtype, bytes, what each holds);
    when not given, it is worked out from the nodes as `MemGraphBuilder` does
    (`HostFacts`), so a MemGraph remade from another's nodes keeps its table.
    `tier` is set on a plan whose host memory is planned too (`memgraph.tiers`): the
    host arena's budget and the disk files below it.
    """

    taskgraph: TaskGraph
    nodes: tuple[MemNode, ...]
    budget: int
    alignment: int = 256
    info: Mapping[str, Any] = field(default_factory=dict)
    storages: Mapping[int, HostStorage] | None = None
    tier: HostTier | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "info", MappingProxyType(dict(self.info)))
        storages = self.storages
        if storages is None:
            facts = HostFacts(self.taskgraph)
            for node in self.nodes:
                facts.see(node.kind, node.tensor, node.storage, node.into)
            storages = facts.storages
        table = {sid: storages[sid] for sid in sorted(storages)}
        object.__setattr__(self, "storages", MappingProxyType(table))

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[MemNode]:
        return iter(self.nodes)

    def __getitem__(self, node_id: int) -> MemNode:
        return self.nodes[node_id]

    def of_kind(self, kind: NodeKind) -> list[MemNode]:
        """The nodes of one kind, in order."""
        return [n for n in self.nodes if n.kind is kind]

    @property
    def host_bytes(self) -> int:
        """Bytes of all host storages together (what a runtime keeps in host memory for
        the plan, besides the caller's arrays)."""
        return sum(s.nbytes for s in self.storages.values())

    @cached_property
    def residencies(self) -> Residencies:
        """Every stay of a tensor on the device (`memgraph.residency.analyze`)."""
        return analyze(self)

    @cached_property
    def stats(self) -> PlanStats:
        """Statistics computed from the nodes (plus the planner's recorded counters)."""
        tg = self.taskgraph
        stays = self.residencies
        offloads = self.of_kind(NodeKind.OFFLOAD)
        reloads = self.of_kind(NodeKind.RELOAD)
        sliced = [n for n in offloads if n.into is not None]
        dropped = stays.dropped()
        discarded = [s for s in stays.stays if s.departure == "discarded"]
        recomputes = [n for n in self.nodes if n.recompute]
        first = _first_loads(self.nodes)
        reads = self.of_kind(NodeKind.READ)
        writes = self.of_kind(NodeKind.WRITE)
        from_checkpoints = [n for n in reads if self._on_checkpoint(n.storage)]
        return PlanStats(
            budget=self.budget,
            peak_bytes=stays.peak_bytes,
            high_water=stays.high_water,
            offload_bytes=sum(tg[n.tensor].nbytes for n in offloads),
            offload_count=len(offloads),
            reload_bytes=sum(tg[n.tensor].nbytes for n in reloads),
            reload_count=len(reloads),
            drop_bytes=sum(tg[s.tensor].nbytes for s in dropped),
            drop_count=len(dropped),
            node_count=len(self.nodes),
            apply_count=len(self.of_kind(NodeKind.APPLY)),
            fragmentation_events=int(self.info.get("fragmentation_events", 0)),
            block_limit=self.info.get("block_limit"),
            sliced_offload_bytes=sum(tg[n.tensor].nbytes for n in sliced),
            sliced_offload_count=len(sliced),
            first_load_bytes=sum(tg[n.tensor].nbytes for n in first),
            first_load_count=len(first),
            recompute_count=len(recomputes),
            recompute_flops=sum(tg[n.tensor].flops for n in recomputes),
            recompute_bytes=sum(tg[n.tensor].nbytes for n in recomputes),
            discard_bytes=sum(tg[s.tensor].nbytes for s in discarded),
            discard_count=len(discarded),
            host_budget=None if self.tier is None else self.tier.budget,
            host_peak_bytes=_host_peak(self.nodes),
            disk_read_bytes=sum(self.storages[n.storage].nbytes for n in reads),
            disk_read_count=len(reads),
            disk_write_bytes=sum(self.storages[n.storage].nbytes for n in writes),
            disk_write_count=len(writes),
            checkpoint_read_bytes=sum(self.storages[n.storage].nbytes for n in from_checkpoints),
            spill_file_bytes=0 if self.tier is None else self.tier.spill_bytes,
        )

    def _on_checkpoint(self, storage: int) -> bool:
        """Whether host storage `storage` is read from a checkpoint file of the tier."""
        place = self.storages[storage].disk
        files = () if self.tier is None else self.tier.files
        return (
            place is not None
            and 0 <= place.file < len(files)
            and files[place.file].kind == "checkpoint"
        )

    # -- verification ------------------------------------------------------------

    def verified(self) -> VerifyReport:
        """The report of `memgraph.verify(self)`, verified on the first call only.

        A plan is immutable, so its verdict never changes: the outcome is remembered on
        the plan, failures too, and a later call returns the same report or raises a
        `VerificationError` naming the same violation. This is how a runtime checks a
        plan before every session at no further cost; `memgraph.verify` itself always
        verifies afresh (and reports progress).
        """
        outcome = self._verdict
        if isinstance(outcome, VerificationError):
            raise VerificationError(str(outcome), outcome.node)  # a fresh error each call
        return outcome

    @cached_property
    def _verdict(self) -> VerifyReport | VerificationError:
        """What `memgraph.verify(self)` gave: its report, or the error it raised."""
        from memgraph.verify import verify  # memgraph.verify imports this module

        try:
            return verify(self)
        except VerificationError as err:  # kept without the verifier's frames
            return err.with_traceback(None)

    # -- printing ----------------------------------------------------------------

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"<MemGraph {self.taskgraph.name!r} nodes={len(self.nodes)} "
            f"peak={format_bytes(s.peak_bytes)} budget={format_bytes(self.budget)} "
            f"offload={format_bytes(s.offload_bytes)} reload={format_bytes(s.reload_bytes)}>"
        )

    def lines(self) -> list[str]:
        """One line per node."""
        return [f"  {node.line()}" for node in self.nodes]

    def __str__(self) -> str:
        s = self.stats
        header = (
            f"MemGraph {self.taskgraph.name!r}: {len(self.nodes)} nodes, budget "
            f"{format_bytes(self.budget)}, peak {format_bytes(s.peak_bytes)}, offloaded "
            f"{format_bytes(s.offload_bytes)} ({s.offload_count}), reloaded "
            f"{format_bytes(s.reload_bytes)} ({s.reload_count})"
        )
        if self.tier is not None:
            tiers = ", ".join(f"{label.strip()} {value}" for label, value in s.tier_rows())
            header += f"; {self.tier}; {tiers}"
        return "\n".join([header, *self.lines()])

    # -- pictures (memgraph.render, memgraph.plots) ---------------------------------

    def to_dot(self, **options: Any) -> str:
        """The plan as DOT text; options as `memgraph.render.memgraph_dot`."""
        from memgraph.render import memgraph_dot

        return memgraph_dot(self, **options)

    def render(self, path: str | os.PathLike[str], **options: Any) -> Path:
        """Draw the plan to `path` (svg, png, pdf or dot by suffix); see `memgraph.render`."""
        from memgraph.render import render_memgraph

        return render_memgraph(self, path, **options)

    def _repr_svg_(self) -> str | None:
        from memgraph.render import memgraph_repr_svg

        return memgraph_repr_svg(self)

    def memory_map(self, path: str | os.PathLike[str] | None = None, **options: Any) -> Any:
        """The memory map figure (`memgraph.plots.memory_map`), saved to `path` if given."""
        from memgraph.plots import memory_map

        return memory_map(self, path, **options)

    def live_bytes_timeline(
        self, path: str | os.PathLike[str] | None = None, **options: Any
    ) -> Any:
        """Live device bytes against step (`memgraph.plots.live_bytes_timeline`)."""
        from memgraph.plots import live_bytes_timeline

        return live_bytes_timeline(self, path, **options)

    # -- serialization -----------------------------------------------------------

    def to_json(self, indent: int | None = None) -> str:
        """The plan as JSON, with its TaskGraph (schema in `memgraph.serialize`)."""
        from memgraph.serialize import memgraph_to_json

        return memgraph_to_json(self, indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> MemGraph:
        """Load and validate a plan written by `to_json`; raises `SerializationError`."""
        from memgraph.serialize import memgraph_from_json

        return memgraph_from_json(text)


class HostFacts:
    """Host storages and the boxes of sliced copies, learnt node by node.

    A storage holds what the first node that names it puts there: an input node's
    input, an offload's tensor, or, for a sliced offload (`into`), the whole output
    assembly `into` (kind "assembly"). A sliced offload copies its tensor into the box
    that tensor's leaf holds in the assembly's tree of output Concats
    (`taskgraph.assembly`); a reload of a Slice of the input a storage holds copies the
    slice's box. Anything else copies a whole storage (no box). Nodes that name no valid
    task are skipped (the verifier reports them).
    """

    def __init__(self, taskgraph: TaskGraph):
        self.taskgraph = taskgraph
        self.storages: dict[int, HostStorage] = {}
        self._pieces: dict[int, dict[int, tuple[tuple[int, int], ...]]] = {}

    def _task(self, task_id: int | None) -> Any:
        tg = self.taskgraph
        return tg[task_id] if task_id is not None and 0 <= task_id < len(tg) else None

    def see(
        self, kind: NodeKind, tensor: int | None, storage: int | None, into: int | None
    ) -> None:
        """Register the storage a node writes, if it is the first to name it."""
        if storage is None or storage in self.storages:
            return
        if kind is NodeKind.OFFLOAD and into is not None:
            held, what = self._task(into), "assembly"
        elif kind in (NodeKind.INPUT, NodeKind.OFFLOAD):
            held, what = self._task(tensor), "input" if kind is NodeKind.INPUT else "offload"
        else:
            return
        if held is not None:
            self.storages[storage] = HostStorage.of(storage, held.shape, held.dtype, held.id, what)

    def box(
        self, kind: NodeKind, tensor: int | None, storage: int | None, into: int | None
    ) -> HostBox | None:
        """The box of `storage` that a node copies, or None for a whole copy (or none)."""
        held = self.storages.get(storage) if storage is not None else None
        task = self._task(tensor)
        if held is None or task is None:
            return None
        if kind is NodeKind.OFFLOAD and into is not None:
            if into not in self._pieces and self._task(into) is not None:
                pieces = assembly_pieces(self.taskgraph, into)[1]
                self._pieces[into] = {p.base: p.box for p in pieces}
            found = self._pieces.get(into, {}).get(tensor)
            if found is None:
                return None
            starts, sizes = zip(*found, strict=True) if found else ((), ())
            return HostBox(held.shape, held.dtype, tuple(starts), tuple(sizes))
        sliced = isinstance(task.op, Slice) and task.inputs[0] == held.tensor
        if kind is NodeKind.RELOAD and held.tensor != tensor and sliced:
            return HostBox(held.shape, held.dtype, tuple(task.op.starts), tuple(task.shape))
        return None


class MemGraphBuilder:
    """Appends MemGraph nodes in schedule order; `build()` returns the MemGraph.

    The builder checks only structure (dependencies point to earlier nodes); the
    meaning of a plan is checked by `memgraph.verify`. It records the plan's host
    storages and gives each sliced offload or reload its box (`HostFacts`), so callers
    name only the storage (and, for a sliced offload, the output assembly `into`).
    """

    def __init__(self, taskgraph: TaskGraph, budget: int, alignment: int = 256):
        self.taskgraph = taskgraph
        self.budget = budget
        self.alignment = alignment
        self.nodes: list[MemNode] = []
        self.host = HostFacts(taskgraph)

    def add(
        self,
        kind: NodeKind,
        deps: Iterable[int] = (),
        tensor: int | None = None,
        region: Region | None = None,
        storage: int | None = None,
        reads: Iterable[Region] = (),
        name: str = "",
        into: int | None = None,
        box: HostBox | None = None,
        workspace: Region | None = None,
        recompute: bool = False,
    ) -> int:
        """Append a node and return its id; `deps` are sorted and deduplicated.

        A node that first names a host storage records it; an offload or reload without
        a `box` gets the one `HostFacts.box` finds (None for a whole copy)."""
        node_id = len(self.nodes)
        kind = NodeKind(kind)
        ordered = tuple(sorted(set(deps)))
        if ordered and not (ordered[0] >= 0 and ordered[-1] < node_id):
            raise GraphError(f"n{node_id} ({kind}): dependencies {ordered} must be earlier nodes")
        self.host.see(kind, tensor, storage, into)
        if box is None and kind in (NodeKind.OFFLOAD, NodeKind.RELOAD):
            box = self.host.box(kind, tensor, storage, into)
        node = MemNode(
            node_id,
            kind,
            ordered,
            tensor,
            region,
            storage,
            tuple(reads),
            name,
            into,
            box,
            workspace,
            recompute,
        )
        self.nodes.append(node)
        return node_id

    def alloc(self, tensor: int, region: Region, deps: Iterable[int] = ()) -> int:
        return self.add(NodeKind.ALLOC, deps, tensor, region)

    def input(
        self,
        name: str,
        tensor: int,
        *,
        storage: int | None = None,
        region: Region | None = None,
        deps: Iterable[int] = (),
    ) -> int:
        return self.add(NodeKind.INPUT, deps, tensor, region, storage, name=name)

    def apply(
        self,
        task: int,
        reads: Iterable[Region],
        region: Region,
        deps: Iterable[int] = (),
        workspace: Region | None = None,
        recompute: bool = False,
    ) -> int:
        """An apply; `workspace` is the region of its kernel's workspace, if it has one
        (transient: held for this apply only); `recompute`: it computes its task again."""
        return self.add(
            NodeKind.APPLY,
            deps,
            task,
            region,
            reads=reads,
            workspace=workspace,
            recompute=recompute,
        )

    def offload(
        self,
        tensor: int,
        region: Region,
        storage: int,
        deps: Iterable[int] = (),
        into: int | None = None,
    ) -> int:
        """An offload; with `into`, a sliced offload into that output assembly's storage."""
        return self.add(NodeKind.OFFLOAD, deps, tensor, region, storage, into=into)

    def reload(self, tensor: int, storage: int, region: Region, deps: Iterable[int] = ()) -> int:
        return self.add(NodeKind.RELOAD, deps, tensor, region, storage)

    def free(self, tensor: int, region: Region, deps: Iterable[int] = ()) -> int:
        return self.add(NodeKind.FREE, deps, tensor, region)

    def output(
        self,
        name: str,
        tensor: int,
        *,
        region: Region | None = None,
        storage: int | None = None,
        deps: Iterable[int] = (),
    ) -> int:
        return self.add(NodeKind.OUTPUT, deps, tensor, region, storage, name=name)

    @property
    def storages(self) -> dict[int, HostStorage]:
        """The host storages named so far, by id."""
        return self.host.storages

    def build(self, info: Mapping[str, Any] | None = None) -> MemGraph:
        return MemGraph(
            self.taskgraph,
            tuple(self.nodes),
            self.budget,
            self.alignment,
            info or {},
            dict(self.host.storages),
        )


def _host_peak(nodes: Sequence[MemNode]) -> int:
    """The most host-arena bytes held at once in node order: a slot is held from the node
    that first names it (a read, or an offload into it) until its release (to the end
    when never released)."""
    held: dict[tuple[int, int], int] = {}
    live = peak = 0
    for node in nodes:
        if node.slot is None:
            continue
        key = (node.slot.offset, node.slot.size)
        if node.kind is NodeKind.RELEASE:
            if held.pop(key, None) is not None:
                live -= node.slot.size
        elif key not in held:
            held[key] = node.id
            live += node.slot.size
            peak = max(peak, live)
    return peak


def _first_loads(nodes: Sequence[MemNode]) -> list[MemNode]:
    """The reloads that bring a tensor to the device for the first time (it was never
    computed there, never an input placed there, never reloaded before)."""
    seen: set[int] = set()
    first = []
    for node in nodes:
        if node.kind is NodeKind.RELOAD and node.tensor not in seen:
            first.append(node)
        if node.kind in (NodeKind.RELOAD, NodeKind.APPLY) or (
            node.kind is NodeKind.INPUT and node.region is not None
        ):
            seen.add(node.tensor)
    return first
