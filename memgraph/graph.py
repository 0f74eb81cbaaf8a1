"""The MemGraph (a memory plan), its builder, and the statistics it reports.

A MemGraph pairs a TaskGraph with the nodes that execute it inside a device arena
of `budget` bytes. It is immutable; planners make one with `MemGraphBuilder`. Its
insertion order is a valid sequential schedule, and its dependencies are enough for
concurrent execution on separate streams (`memgraph.verify` checks both).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

from einpage_core.errors import GraphError
from einpage_core.units import format_bytes
from memgraph.nodes import MemNode, NodeKind, Region
from taskgraph.graph import TaskGraph

__all__ = ["MemGraph", "MemGraphBuilder", "PlanStats"]


@dataclass(frozen=True, slots=True)
class PlanStats:
    """What a plan does, in numbers (bytes unless said otherwise).

    `peak_bytes` is the most bytes allocated at once; `high_water` the highest arena
    offset used. A *drop* frees a tensor that is needed again later without copying
    it out, because a host copy already exists (a weight, or an earlier offload).
    `fragmentation_events` and `block_limit` are reported by the planner. The offloads
    include *sliced offloads* (blocks copied into their box of a program output
    assembled on the host), also counted on their own in `sliced_offload_*`.
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
            ("reloaded", f"{format_bytes(self.reload_bytes)} in {self.reload_count}"),
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
        if self.block_limit is not None:
            rows.append(("block limit", format_bytes(self.block_limit)))
        return rows

    def __str__(self) -> str:
        width = max(len(label) for label, _ in self.rows())
        return "\n".join(f"{label:<{width}}  {value}" for label, value in self.rows())


@dataclass(frozen=True, eq=False)
class MemGraph:
    """A memory plan: `nodes` executing `taskgraph` within `budget` bytes of device memory.

    `alignment` is the arena alignment the plan was made with; `info` holds what the
    planner chose to record (options, order, counters), JSON-ready.
    """

    taskgraph: TaskGraph
    nodes: tuple[MemNode, ...]
    budget: int
    alignment: int = 256
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "info", MappingProxyType(dict(self.info)))

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[MemNode]:
        return iter(self.nodes)

    def __getitem__(self, node_id: int) -> MemNode:
        return self.nodes[node_id]

    def of_kind(self, kind: NodeKind) -> list[MemNode]:
        """The nodes of one kind, in order."""
        return [n for n in self.nodes if n.kind is kind]

    @cached_property
    def stats(self) -> PlanStats:
        """Statistics computed from the nodes (plus the planner's recorded counters)."""
        live = peak = high = 0
        offload_bytes = offload_count = reload_bytes = reload_count = 0
        last_reload = {n.tensor: n.id for n in self.nodes if n.kind is NodeKind.RELOAD}
        offloaded_in_residency: set[int] = set()
        drop_bytes = drop_count = sliced_bytes = sliced_count = 0
        for node in self.nodes:
            kind = node.kind
            if kind is NodeKind.ALLOC:
                live += node.region.size
                peak = max(peak, live)
                high = max(high, node.region.end)
                offloaded_in_residency.discard(node.tensor)
            elif kind is NodeKind.FREE:
                live -= node.region.size
                reloaded_later = last_reload.get(node.tensor, -1) > node.id
                if reloaded_later and node.tensor not in offloaded_in_residency:
                    drop_bytes += self.taskgraph[node.tensor].nbytes
                    drop_count += 1
            elif kind is NodeKind.OFFLOAD:
                offload_bytes += self.taskgraph[node.tensor].nbytes
                offload_count += 1
                if node.into is not None:  # a block into its box of a host output
                    sliced_bytes += self.taskgraph[node.tensor].nbytes
                    sliced_count += 1
                else:
                    offloaded_in_residency.add(node.tensor)
            elif kind is NodeKind.RELOAD:
                reload_bytes += self.taskgraph[node.tensor].nbytes
                reload_count += 1
        return PlanStats(
            budget=self.budget,
            peak_bytes=peak,
            high_water=high,
            offload_bytes=offload_bytes,
            offload_count=offload_count,
            reload_bytes=reload_bytes,
            reload_count=reload_count,
            drop_bytes=drop_bytes,
            drop_count=drop_count,
            node_count=len(self.nodes),
            apply_count=sum(1 for n in self.nodes if n.kind is NodeKind.APPLY),
            fragmentation_events=int(self.info.get("fragmentation_events", 0)),
            block_limit=self.info.get("block_limit"),
            sliced_offload_bytes=sliced_bytes,
            sliced_offload_count=sliced_count,
        )

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


class MemGraphBuilder:
    """Appends MemGraph nodes in schedule order; `build()` returns the MemGraph.

    The builder checks only structure (dependencies point to earlier nodes); the
    meaning of a plan is checked by `memgraph.verify`.
    """

    def __init__(self, taskgraph: TaskGraph, budget: int, alignment: int = 256):
        self.taskgraph = taskgraph
        self.budget = budget
        self.alignment = alignment
        self.nodes: list[MemNode] = []

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
    ) -> int:
        """Append a node and return its id; `deps` are sorted and deduplicated."""
        node_id = len(self.nodes)
        ordered = tuple(sorted(set(deps)))
        if ordered and not (ordered[0] >= 0 and ordered[-1] < node_id):
            raise GraphError(f"n{node_id} ({kind}): dependencies {ordered} must be earlier nodes")
        node = MemNode(
            node_id, NodeKind(kind), ordered, tensor, region, storage, tuple(reads), name, into
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
        self, task: int, reads: Iterable[Region], region: Region, deps: Iterable[int] = ()
    ) -> int:
        return self.add(NodeKind.APPLY, deps, task, region, reads=reads)

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

    def build(self, info: Mapping[str, Any] | None = None) -> MemGraph:
        return MemGraph(self.taskgraph, tuple(self.nodes), self.budget, self.alignment, info or {})
