"""Host memory of a session: one buffer for all of its plans, and inputs read in place.

A `runtime.Session` may hold several plans (a generation's prefill plan and its decode
plans) that run one at a time. Their host memory is laid out once (`SharedHost.of`):

* a **home** per input that needs host memory the runtime owns, keyed by the input's
  name, shape and dtype (`HomeKey`): the plans that read the same weight share its home,
  so it is placed once for all of them. On a staging backend (CuPy: pinned memory) every
  input has one – a host storage the plan reloads from, or the staging slot a
  device-side input is copied from – and on the NumPy backend only an input some plan
  offloads into (the others are read from the caller's array);
* a **scratch** area per plan for what lives only during one of its runs: offloaded
  tensors, outputs assembled on the host, staging slots of device-side outputs. The
  plans' areas overlap (one run at a time), so the buffer holds the largest.

On a backend that reads inputs where the caller holds them (`Backend.in_place_min` is
set: CuPy, through `cudaHostRegister`), a weight of at least that many bytes has no home
in the buffer: when placed, its array is registered (page-locked where it is,
`Registrations`) and read there. Only when that cannot be done – the pages are partly
registered for another array, or the driver refuses – is it copied into pinned memory
allocated then. `SharedHost.promise` counts every home either way: the host bytes a
session pins, allocated or registered, at most (`runtime.pinned_bytes`).

A plan with a host tier (`runtime.tiers`) keeps the storages its tier holds (offloaded
tensors, outputs assembled on the host, weights read from a checkpoint) in its own host
arena, not here: they get no home and no scratch slot, and `SharedHost.tier_bytes`
counts that arena in the session's `promise`.

Offsets are multiples of `HOST_ALIGNMENT` (256 B).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from einpage_core.errors import BackendError
from memgraph.graph import MemGraph
from memgraph.nodes import NodeKind
from runtime.tiers import host_arena_bytes, tier_held
from taskgraph.nodes import Input

__all__ = [
    "HOST_ALIGNMENT",
    "PAGE",
    "HomeKey",
    "HostSlot",
    "HostLayout",
    "SharedHost",
    "Registrations",
    "aligned",
]

HOST_ALIGNMENT = 256
"""Every slot of a host buffer starts at a multiple of this."""

PAGE = mmap.PAGESIZE
"""The host's page: what `cudaHostRegister` locks, whole."""

HomeKey = tuple[str, tuple[int, ...], str]
"""An input's home: its name, shape and dtype. A name with two shapes in two plans (a
prefill's rotary table for its prompt, a decode plan's for every position) has two."""


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to whole `HOST_ALIGNMENT` units (at least one)."""
    return -(-max(nbytes, 1) // HOST_ALIGNMENT) * HOST_ALIGNMENT


@dataclass(frozen=True, slots=True)
class HostSlot:
    """Bytes `[offset, offset + nbytes)` of the host buffer, holding `shape` of `dtype`."""

    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def of(self, buffer: np.ndarray) -> np.ndarray:
        """This slot of `buffer` as an array."""
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).reshape(self.shape)


@dataclass(frozen=True)
class HostLayout:
    """One plan's view of its session's host buffer (`SharedHost`).

    `storages`: the slot of each host storage the buffer holds (an input's home, or a
    slot of this plan's scratch); `inputs`: the home each device-side input is copied
    from (staging backends only); `outputs`: the staging slot of each device-side output
    (staging backends only); `nbytes`: the whole buffer's bytes. `aliased`: storages of
    inputs read from wherever the input was placed (the caller's array on NumPy, or a
    weight read in place), not from the buffer; `homes`: each input's `HomeKey`.
    """

    storages: dict[int, HostSlot]
    inputs: dict[str, HostSlot]
    outputs: dict[str, HostSlot]
    nbytes: int
    aliased: frozenset[int] = frozenset()
    homes: dict[str, HomeKey] = field(default_factory=dict)

    @classmethod
    def of(cls, mg: MemGraph, staging: bool, in_place_min: int | None = None) -> HostLayout:
        """The layout of a session holding `mg` alone."""
        return SharedHost.of([mg], staging, in_place_min).plans[0]


@dataclass
class _Home:
    """What the plans ask of one home (while laying it out)."""

    key: HomeKey
    nbytes: int
    weight: bool
    needed: bool = False  # some plan keeps it in host memory the runtime owns
    written: bool = False  # some plan offloads into its storage: never the caller's array


@dataclass(frozen=True)
class SharedHost:
    """The host memory of a session over several plans (see the module docstring).

    `plans`: each plan's `HostLayout`, in order; `homes`: the slot of each home in the
    buffer, or None for a weight read in place; `nbytes`: the buffer, allocated when the
    session opens; `in_place`: the homes read in place, with the bytes each would take
    if copied (rounded as a slot is); `tier_bytes`: the host arena of a plan with a host
    tier (`runtime.tiers.host_arena_bytes`; 0 without one); `promise`: the buffer, those
    and the host arena, the most host memory the session pins.
    """

    plans: tuple[HostLayout, ...]
    homes: dict[HomeKey, HostSlot | None]
    nbytes: int
    in_place: dict[HomeKey, int]
    tier_bytes: int = 0

    @property
    def promise(self) -> int:
        return self.nbytes + sum(self.in_place.values()) + self.tier_bytes

    @classmethod
    def of(
        cls, plans: Sequence[MemGraph], staging: bool, in_place_min: int | None = None
    ) -> SharedHost:
        homes = _homes_of(plans, staging)
        top = 0
        slots: dict[HomeKey, HostSlot | None] = {}
        in_place: dict[HomeKey, int] = {}
        for key, home in homes.items():
            if not home.needed:
                continue
            reads_in_place = (
                staging
                and in_place_min is not None
                and home.weight
                and not home.written
                and home.nbytes >= in_place_min
            )
            if reads_in_place:
                slots[key] = None
                in_place[key] = aligned(home.nbytes)
            else:
                slots[key] = HostSlot(top, key[1], key[2])
                top += aligned(home.nbytes)
        scratch = [_scratch_of(mg, top, staging) for mg in plans]
        nbytes = max([top, *(end for _, _, end in scratch)])
        layouts = []
        for mg, (storages, outputs, _) in zip(plans, scratch, strict=True):
            layouts.append(_plan_layout(mg, staging, slots, storages, outputs, nbytes))
        tier = max((host_arena_bytes(mg) for mg in plans), default=0)
        return cls(tuple(layouts), slots, nbytes, in_place, tier)


def _homes_of(plans: Sequence[MemGraph], staging: bool) -> dict[HomeKey, _Home]:
    """Every input's home over `plans`, in order of first use, and what the plans ask."""
    homes: dict[HomeKey, _Home] = {}
    for mg in plans:
        tg = mg.taskgraph
        written = {n.storage for n in mg.nodes if n.kind is NodeKind.OFFLOAD}
        held = tier_held(mg)
        for node in mg.nodes:
            if node.kind is not NodeKind.INPUT or node.storage in held:
                continue
            task = tg[node.tensor]
            key = (node.name, tuple(task.shape), task.dtype)
            weight = isinstance(task.op, Input) and task.op.role == "weight"
            home = homes.setdefault(key, _Home(key, task.nbytes, weight))
            if node.storage in written:
                home.written = home.needed = True
            elif staging:
                home.needed = True
    return homes


def _scratch_of(
    mg: MemGraph, base: int, staging: bool
) -> tuple[dict[int, HostSlot], dict[str, HostSlot], int]:
    """`mg`'s scratch slots from offset `base`: storages that are no input's (nor in its
    host tier's arena), then the staging slots of device-side outputs; and the end of
    the area."""
    tg = mg.taskgraph
    top = base
    inputs = {n.storage for n in mg.nodes if n.kind is NodeKind.INPUT} | tier_held(mg)

    def place(shape: tuple[int, ...], dtype: str) -> HostSlot:
        nonlocal top
        slot = HostSlot(top, tuple(shape), dtype)
        top += aligned(slot.nbytes)
        return slot

    storages = {sid: place(s.shape, s.dtype) for sid, s in mg.storages.items() if sid not in inputs}
    outputs: dict[str, HostSlot] = {}
    if staging:
        for node in mg.nodes:
            if node.kind is NodeKind.OUTPUT and node.region is not None:
                task = tg[tg.outputs[node.name]]
                outputs[node.name] = place(task.shape, task.dtype)
    return storages, outputs, top


def _plan_layout(
    mg: MemGraph,
    staging: bool,
    slots: Mapping[HomeKey, HostSlot | None],
    scratch: dict[int, HostSlot],
    outputs: dict[str, HostSlot],
    nbytes: int,
) -> HostLayout:
    tg = mg.taskgraph
    storages = dict(scratch)
    inputs: dict[str, HostSlot] = {}
    aliased: set[int] = set()
    keys: dict[str, HomeKey] = {}
    held = tier_held(mg)
    for node in mg.nodes:
        if node.kind is not NodeKind.INPUT or node.storage in held:
            continue
        task = tg[node.tensor]
        key = keys[node.name] = (node.name, tuple(task.shape), task.dtype)
        slot = slots.get(key)
        if node.storage is not None:
            if slot is None:
                aliased.add(node.storage)
            else:
                storages[node.storage] = slot
        elif staging and slot is not None:
            inputs[node.name] = slot
    return HostLayout(storages, inputs, outputs, nbytes, frozenset(aliased), keys)


# -- reading arrays where they are -------------------------------------------------------


@dataclass
class _Span:
    """Pages `[start, end)` registered with the backend, and the homes that read there."""

    start: int
    end: int
    users: set[HomeKey] = field(default_factory=set)
    arrays: list[np.ndarray] = field(default_factory=list)  # kept alive while registered


class Registrations:
    """Arrays page-locked where the caller holds them (`Backend.register_host`).

    `place(arrays)` registers the pages of the arrays given together, touching or
    overlapping ranges merged into one registration (a checkpoint's tensors lie back to
    back, sharing pages), and says which arrays are now readable in place: one whose
    pages are all registered already is (nothing new); one whose pages are partly
    registered by an earlier call, or that the backend refuses, is not (the caller
    copies it). A range is unregistered when no home reads from it any more, and all of
    them by `close()`. `registered_bytes` is what is locked now (whole pages).
    """

    def __init__(self, backend: Any):
        self.backend = backend
        self.spans: list[_Span] = []
        self.placed: dict[HomeKey, _Span] = {}

    @property
    def registered_bytes(self) -> int:
        return sum(span.end - span.start for span in self.spans)

    def place(self, arrays: Mapping[HomeKey, np.ndarray]) -> set[HomeKey]:
        """Register `arrays` (C-contiguous) where they are; return the keys read in place.
        A home placed again at the same pages (the same weights given to every run) keeps
        its registration: nothing is registered twice."""
        placed: set[HomeKey] = set()
        fresh: dict[HomeKey, np.ndarray] = {}
        for key, array in arrays.items():
            span = self.placed.get(key)
            start, end = _pages(array)
            if span is not None and span.start <= start and end <= span.end:
                if not _held(span, array):
                    span.arrays.append(array)
                placed.add(key)
                continue
            self.release(key)
            fresh[key] = array
        arrays = fresh
        ranges = sorted(
            (_pages(array), key) for key, array in arrays.items() if array.flags.c_contiguous
        )
        for (start, end), group in _merged(ranges):
            span = self._span(start, end, [arrays[k] for k in group])
            if span is None:
                continue
            for key in group:
                span.users.add(key)
                span.arrays.append(arrays[key])
                self.placed[key] = span
                placed.add(key)
        return placed

    def _span(self, start: int, end: int, arrays: list[np.ndarray]) -> _Span | None:
        """The registration covering pages `[start, end)`: an existing one, a new one, or
        None when an existing one covers part of them only, or the backend refuses."""
        for span in self.spans:
            if span.start <= start and end <= span.end:
                return span
            if span.start < end and start < span.end:
                return None
        read_only = any(not array.flags.writeable for array in arrays)
        if not self.backend.register_host(start, end - start, read_only):
            return None
        span = _Span(start, end)
        self.spans.append(span)
        return span

    def release(self, key: HomeKey) -> None:
        """Home `key` no longer reads where it was placed; unregister a range nothing reads."""
        span = self.placed.pop(key, None)
        if span is None:
            return
        span.users.discard(key)
        if not span.users:
            self.spans.remove(span)
            self.backend.unregister_host(span.start)

    def close(self) -> None:
        """Unregister every range (even after a failure of one: the rest are still done)."""
        spans, self.spans, self.placed = self.spans, [], {}
        failure: BaseException | None = None
        for span in spans:
            try:
                self.backend.unregister_host(span.start)
            except Exception as err:  # noqa: BLE001 (raised after the others are done)
                failure = failure or err
        if failure is not None:
            raise BackendError(f"unregistering host memory failed: {failure}") from failure


def _held(span: _Span, array: np.ndarray) -> bool:
    """Whether `span` keeps `array` (the very object) alive already."""
    return any(held is array for held in span.arrays)


def _pages(array: np.ndarray) -> tuple[int, int]:
    """The whole pages `array`'s bytes lie in."""
    start = array.ctypes.data
    end = start + max(array.nbytes, 1)
    return start // PAGE * PAGE, -(-end // PAGE) * PAGE


def _merged(
    ranges: Iterable[tuple[tuple[int, int], HomeKey]],
) -> list[tuple[tuple[int, int], list[HomeKey]]]:
    """Sorted page ranges merged where they touch or overlap, with the keys of each."""
    merged: list[tuple[tuple[int, int], list[HomeKey]]] = []
    for (start, end), key in ranges:
        if merged and start <= merged[-1][0][1]:
            (first, last), keys = merged[-1]
            merged[-1] = ((first, max(last, end)), [*keys, key])
        else:
            merged.append(((start, end), [key]))
    return merged
