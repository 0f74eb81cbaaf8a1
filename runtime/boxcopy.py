"""Strided copies: a box of a C-contiguous host array as a few 2D copies of contiguous runs.

A box (one start and one size per axis) of a C-contiguous array is, in memory, a set of
equally long contiguous byte *runs*: the innermost axes that the box covers whole merge
with the first partial axis into one run, and the axes outside it repeat the run at
fixed strides. Outer axes merge too where the inner one is whole, and axes of size 1
only move the start. What remains is a list of *planes*, each one 2D copy (`rows` runs
of `run` bytes, `pitch` bytes apart in the host array, back to back on the device), the
shape of `cudaMemcpy2DAsync`. A box of a matrix's rows is one plane of one row (a plain
memcpy); a box of its columns one plane of many rows.

`BoxRuns.of` works this out from shapes alone; `issue_box_copy` issues the planes with a
CUDA-runtime-like module (`memcpyAsync`, `memcpy2DAsync`), so the CuPy backend copies a
box between pinned host memory and the arena without a contiguous host copy of it.

>>> runs = BoxRuns.of((64, 8), 4, (16, 0), (8, 8))       # rows 16..23 of a float32 matrix
>>> runs.run, [(p.host, p.rows, p.pitch) for p in runs.planes]
(256, [(512, 1, 256)])
>>> runs = BoxRuns.of((64, 8), 4, (0, 2), (64, 4))       # columns 2..5
>>> runs.run, [(p.host, p.rows, p.pitch) for p in runs.planes]
(16, [(8, 64, 32)])
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from einpage_core.errors import BackendError

__all__ = ["Plane", "BoxRuns", "issue_box_copy", "DIRECTIONS"]

DIRECTIONS = ("h2d", "d2h")
"""Copy directions: host to device, device to host."""


@dataclass(frozen=True, slots=True)
class Plane:
    """One 2D copy: `rows` runs, the first at byte `host` of the host array and each next
    one `pitch` bytes further, to or from bytes `device` onward of the device array, back
    to back."""

    host: int
    device: int
    rows: int
    pitch: int


@dataclass(frozen=True, slots=True)
class _Axis:
    count: int
    stride: int  # bytes between consecutive runs along the axis, in the host array


@dataclass(frozen=True, slots=True)
class BoxRuns:
    """A box of a C-contiguous host array as planes of `run`-byte contiguous runs."""

    run: int
    planes: tuple[Plane, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.rows for p in self.planes) * self.run

    @classmethod
    def of(
        cls, shape: Sequence[int], itemsize: int, starts: Sequence[int], sizes: Sequence[int]
    ) -> BoxRuns:
        """The runs of the box `starts`/`sizes` of an array of `shape` (`itemsize` bytes
        per element); the box must lie inside the array."""
        rank = len(shape)
        if not len(starts) == len(sizes) == rank or any(
            s < 0 or n < 0 or s + n > d for s, n, d in zip(starts, sizes, shape, strict=True)
        ):
            raise BackendError(
                f"box starts={list(starts)} sizes={list(sizes)} is not a box of an array "
                f"of shape {list(shape)}"
            )
        strides = [itemsize * math.prod(shape[k + 1 :]) for k in range(rank)]
        offset = sum(s * t for s, t in zip(starts, strides, strict=True))
        inner = rank  # axes inner..rank-1 are whole: they join the run
        while inner > 0 and sizes[inner - 1] == shape[inner - 1]:
            inner -= 1
        if inner == 0:  # the whole array
            whole = math.prod(sizes) * itemsize
            return cls(whole, (Plane(offset, 0, 1, whole),))
        run = sizes[inner - 1] * strides[inner - 1]
        outer: list[_Axis] = []
        for k in range(inner - 1):
            if sizes[k] == 1:
                continue
            if outer and outer[-1].stride == sizes[k] * strides[k] and sizes[k] == shape[k]:
                outer[-1] = _Axis(outer[-1].count * sizes[k], strides[k])  # a whole axis merges
            else:
                outer.append(_Axis(sizes[k], strides[k]))
        return cls(run, tuple(_planes(offset, run, outer)))


def _planes(offset: int, run: int, outer: list[_Axis]) -> list[Plane]:
    """The innermost outer axis is each plane's rows; the others enumerate planes."""
    if not outer:
        return [Plane(offset, 0, 1, run)]
    rows = outer[-1]
    planes = []
    for device, index in enumerate(itertools.product(*(range(a.count) for a in outer[:-1]))):
        host = offset + sum(i * a.stride for i, a in zip(index, outer, strict=False))
        planes.append(Plane(host, device * rows.count * run, rows.count, rows.stride))
    return planes


def issue_box_copy(
    cuda_runtime: Any,
    runs: BoxRuns,
    host_pointer: int,
    device_pointer: int,
    direction: str,
    stream_pointer: int,
) -> int:
    """Issue `runs` between host memory at `host_pointer` and device memory at
    `device_pointer` (to the device for "h2d", to the host for "d2h") on a stream, with
    `cuda_runtime.memcpyAsync` for a single run and `memcpy2DAsync` for a plane of
    several (CuPy's `cupy.cuda.runtime`, or a stand-in); returns the copies issued."""
    if direction not in DIRECTIONS:
        raise BackendError(f"copy direction must be 'h2d' or 'd2h', got {direction!r}")
    to_device = direction == "h2d"
    kind = cuda_runtime.memcpyHostToDevice if to_device else cuda_runtime.memcpyDeviceToHost
    issued = 0
    for plane in runs.planes:
        host, device = host_pointer + plane.host, device_pointer + plane.device
        src, dst = (host, device) if to_device else (device, host)
        if runs.run == 0:
            continue
        if plane.rows == 1:
            cuda_runtime.memcpyAsync(dst, src, runs.run, kind, stream_pointer)
        else:
            spitch, dpitch = (plane.pitch, runs.run) if to_device else (runs.run, plane.pitch)
            cuda_runtime.memcpy2DAsync(
                dst, dpitch, src, spitch, runs.run, plane.rows, kind, stream_pointer
            )
        issued += 1
    return issued
