"""The disk files of a run of a plan with a host tier: checkpoints read in place, one spill file.

`DiskFiles.open(tier, spill_folder)` opens every file of `HostTier.files` before a run
allocates anything, and `close()` (or leaving its `with` block) closes them:

* a **checkpoint** is opened read-only, and refused (`DiskError`) unless its size is the
  one the plan was made for (`DiskFile.nbytes`). Before each read its size and its
  modification time are looked at again (`os.fstat`): a file written to during the run
  is an error, not a silent wrong answer. When the plan states the SHA-256 of the file's
  head (`DiskFile.head_sha256`: a safetensors header, which says where every tensor is),
  it is checked when the file is opened: a file replaced by another of the same size is
  refused too.
* the **spill file** is created in `spill_folder` (which must exist, be a writable
  directory and have room for it: `os.statvfs`) under a fresh name (`einpage-spill-...`,
  `O_CREAT | O_EXCL`, mode 0o600), sized up front (`os.posix_fallocate` where the file
  system can, else `ftruncate`). It is unlinked the moment it is created, before it is
  sized: the run reads and writes it by its open descriptor, and the system frees its
  blocks when that closes – however the process ends after that moment, a success, a
  failure, an interruption or a `kill -9`, nothing is left in the folder. Nothing is
  written outside the spill folder.

Reads (`os.preadv`) and writes (`os.pwritev`) go straight between a file and bytes of
the host arena (a NumPy `uint8` array), looping over short transfers; end of file
before the bytes a read wants is a `DiskError`. By default transfers go through the page
cache: a machine with free memory can read a re-read checkpoint faster from it.
`DiskFiles.open(..., direct=True)` also opens each file with `O_DIRECT`, so that the run's
transfers do not fill the page cache with the checkpoint's pages (`benchmarks/tiers.py
direct` measures it); a file whose file system refuses it (`EINVAL`) stays
buffered, and `DiskFiles.direct` says which are direct. A direct transfer moves whole
blocks of `DIRECT_ALIGNMENT` bytes at aligned offsets through an aligned bounce buffer of
at most `DIRECT_BOUNCE` bytes (one per direction): a read reads the aligned window around
the wanted bytes and copies them out; a write copies the data in, zero-pads it to a whole
block and needs an aligned offset (the spill places `memgraph.tiers` makes are), the
spill file being sized to whole blocks. A weight a checkpoint holds transposed
(`DiskPlace.transposed`) is read in blocks of rows into a scratch of at most
`TRANSPOSE_SCRATCH` bytes and transposed into the arena (`DiskFiles.read_transposed`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from einpage_core.errors import DiskError
from einpage_core.units import format_bytes
from memgraph.nodes import DiskFile, HostTier

__all__ = [
    "DIRECT_ALIGNMENT",
    "DIRECT_BOUNCE",
    "DiskFiles",
    "SPILL_PREFIX",
    "TRANSPOSE_SCRATCH",
    "check_spill_folder",
]

SPILL_PREFIX = "einpage-spill-"
"""How a spill file's name begins (the rest: the process id and random hex)."""

TRANSPOSE_SCRATCH = 4 << 20
"""The most bytes `DiskFiles.read_transposed` holds besides its destination: it reads a
transposed matrix in blocks of whole rows of at most this many bytes (at least one row)."""

DIRECT_ALIGNMENT = 4096
"""What an `O_DIRECT` transfer's file offset, length and buffer address are multiples of
(the logical block size of common disks and file systems; 4096 covers 512 too)."""

DIRECT_BOUNCE = 4 << 20
"""The most bytes of each of a `DiskFiles`'s two aligned bounce buffers (reads, writes:
they run on different streams), through which its direct transfers go in chunks."""


def check_spill_folder(folder: str | os.PathLike[str], nbytes: int) -> str:
    """`folder` as a string, when it is an existing, writable directory with room for
    `nbytes` bytes; else a `DiskError` naming it (and, for room, both figures)."""
    path = os.fspath(folder)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DiskError(f"the spill folder {path!r} does not exist") from None
    except OSError as err:
        raise DiskError(f"the spill folder {path!r} cannot be looked at: {err}") from err
    if not stat.S_ISDIR(mode):
        raise DiskError(f"the spill folder {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise DiskError(f"the spill folder {path!r} is not writable")
    fs = os.statvfs(path)
    free = fs.f_bavail * fs.f_frsize
    if free < nbytes:
        raise DiskError(
            f"the spill folder {path!r} has {format_bytes(free)} ({free} bytes) free, and "
            f"the plan's spill file needs {format_bytes(nbytes)} ({nbytes} bytes)"
        )
    return path


@dataclass
class DiskFiles:
    """The open files of a run, by index in `tier.files` (`fds`: buffered descriptors;
    `direct_fds`: the `O_DIRECT` descriptor of each file, or None where it is buffered);
    `spill_path` is the name the spill file was created under, for messages (it is
    unlinked at once; "" when the tier has none)."""

    tier: HostTier
    fds: list[int] = field(default_factory=list)
    spill_path: str = ""
    stamps: dict[int, int] = field(default_factory=dict)  # checkpoint index -> mtime (ns)
    direct_fds: list[int | None] = field(default_factory=list)
    bounce: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # "read", "write"
    locks: dict[str, threading.Lock] = field(default_factory=dict, repr=False)

    @classmethod
    def open(
        cls,
        tier: HostTier,
        spill_folder: str | os.PathLike[str] | None,
        direct: bool = False,
    ) -> DiskFiles:
        """Every file of `tier` open (see the module docstring); with `direct`, each also
        with `O_DIRECT` where its file system allows. On any failure – or an interruption –
        what was opened is closed and the spill file removed again."""
        files = cls(tier)
        try:
            folder = ""
            if any(f.kind == "spill" for f in tier.files):
                if spill_folder is None:
                    raise DiskError(
                        f"the plan spills up to {format_bytes(tier.spill_bytes)} to disk: give "
                        "a spill folder (spill=FOLDER, or --spill FOLDER) for its spill file"
                    )
                folder = check_spill_folder(spill_folder, tier.spill_bytes)
            for file in tier.files:
                if file.kind == "checkpoint":
                    fd = files._open_checkpoint(file)
                    files.stamps[len(files.fds)] = os.fstat(fd).st_mtime_ns
                    files.fds.append(fd)
                    files.direct_fds.append(None)
                    if direct:
                        files.direct_fds[-1] = _open_direct(file.path, os.O_RDONLY, fd, file)
                else:
                    fd, direct_fd = files._create_spill(folder, file.nbytes, direct)
                    files.fds.append(fd)
                    files.direct_fds.append(direct_fd)
            files._make_bounce()
        except BaseException:
            files.close()
            raise
        return files

    @property
    def direct(self) -> tuple[bool, ...]:
        """Whether each file (by index in `tier.files`) is read and written with `O_DIRECT`."""
        return tuple(fd is not None for fd in self.direct_fds)

    def _make_bounce(self) -> None:
        """The aligned bounce buffers direct transfers need: one for reads when any file is
        direct, one for writes when the spill file is; each at most `DIRECT_BOUNCE` bytes
        (whole blocks), and no larger than the largest direct file."""
        limit = max(DIRECT_ALIGNMENT, DIRECT_BOUNCE - DIRECT_BOUNCE % DIRECT_ALIGNMENT)
        largest = {"read": 0, "write": 0}
        for file, direct_fd in zip(self.tier.files, self.direct_fds, strict=True):
            if direct_fd is not None:
                largest["read"] = max(largest["read"], file.nbytes)
                if file.kind == "spill":
                    largest["write"] = file.nbytes
        for direction, nbytes in largest.items():
            if nbytes:
                self.bounce[direction] = _aligned_buffer(min(limit, _blocks(nbytes)))
                self.locks[direction] = threading.Lock()

    def _open_checkpoint(self, file: DiskFile) -> int:
        try:
            fd = os.open(file.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as err:
            raise DiskError(f"the checkpoint {file.path!r} cannot be opened: {err}") from err
        try:
            actual = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        if actual != file.nbytes:
            os.close(fd)
            raise DiskError(
                f"the checkpoint {file.path!r} has {actual} bytes, but the plan was made for "
                f"{file.nbytes} bytes: plan again for this file"
            )
        if file.head and hashlib.sha256(os.pread(fd, file.head, 0)).hexdigest() != file.head_sha256:
            os.close(fd)
            raise DiskError(
                f"the checkpoint {file.path!r} is not the file the plan was made for: its first "
                f"{file.head} bytes (its header) differ; plan again for this file"
            )
        return fd

    def _create_spill(self, folder: str, nbytes: int, direct: bool) -> tuple[int, int | None]:
        """The spill file's descriptor and, with `direct`, its `O_DIRECT` one (None where
        the file system refuses it), opened by name before the name is unlinked – at once
        after; a direct spill file is sized to whole blocks, for padded writes."""
        if self.spill_path:
            raise DiskError("a plan has one spill file, this one lists two")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        while True:
            path = os.path.join(folder, f"{SPILL_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
            try:
                fd = os.open(path, flags, 0o600)
            except FileExistsError:
                continue
            except OSError as err:
                raise DiskError(f"the spill file cannot be created in {folder!r}: {err}") from err
            break
        self.spill_path = path
        direct_fd: int | None = None
        try:
            try:
                if direct:
                    direct_fd = _open_direct(path, os.O_RDWR, fd, DiskFile("spill", nbytes))
            finally:
                os.unlink(path)  # kept open, gone from the folder: nothing outlives the process
            _size(fd, nbytes if direct_fd is None else _blocks(nbytes), path)
        except BaseException:
            os.close(fd)
            if direct_fd is not None:
                os.close(direct_fd)
            raise
        return fd, direct_fd

    def close(self) -> None:
        """Close every file (the spill file's blocks are freed then; safe to call again)."""
        fds, self.fds = self.fds, []
        direct_fds, self.direct_fds = self.direct_fds, []
        for fd in [*fds, *direct_fds]:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.spill_path = ""

    def __enter__(self) -> DiskFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transfers ---------------------------------------------------------------

    def read(self, index: int, offset: int, into: np.ndarray) -> None:
        """Fill `into` (contiguous bytes) from file `index` at `offset` (a checkpoint's
        size and modification time looked at first)."""
        file, fd = self._file(index)
        if file.kind == "checkpoint":
            now = os.fstat(fd)
            if now.st_size != file.nbytes:
                raise DiskError(
                    f"the checkpoint {file.path!r} changed size during the run: it has "
                    f"{now.st_size} bytes, the plan was made for {file.nbytes}"
                )
            if now.st_mtime_ns != self.stamps[index]:
                raise DiskError(
                    f"the checkpoint {file.path!r} was written to during the run (its "
                    f"modification time changed): its weights may not be the ones planned"
                )
        _check_span(file, offset, into.nbytes)
        view = memoryview(into).cast("B")
        direct_fd = self.direct_fds[index]
        if direct_fd is not None:
            self._read_direct(file, direct_fd, offset, view)
            return
        done = 0
        while done < len(view):
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as err:
                raise DiskError(f"reading {_name(file)} at {offset + done} failed: {err}") from err
            if got == 0:
                raise DiskError(
                    f"{_name(file)} ended at {offset + done} bytes, before the "
                    f"{into.nbytes} bytes at {offset} a read wants"
                )
            done += got

    def read_transposed(
        self, index: int, offset: int, rows: int, cols: int, itemsize: int, into: np.ndarray
    ) -> None:
        """Fill `into` (contiguous, `rows * cols * itemsize` bytes) with the transpose of
        the C-contiguous (rows, cols) matrix of `itemsize`-byte elements at `offset` of
        file `index`: blocks of whole rows, at most `TRANSPOSE_SCRATCH` bytes (at least
        one row), each read with `read` (its checks, its loop over short reads) into a
        scratch and its transpose written into the matching columns of `into` seen as a
        (cols, rows) matrix of unsigned integers of `itemsize` bytes (any dtype, bfloat16
        too: only bits move)."""
        if itemsize not in (1, 2, 4, 8) or rows < 1 or cols < 1:
            raise DiskError(
                f"a transposed read of a ({rows}, {cols}) matrix of {itemsize}-byte elements: "
                "rows and cols must be >= 1, elements of 1, 2, 4 or 8 bytes"
            )
        if into.nbytes != rows * cols * itemsize:
            raise DiskError(
                f"a transposed ({rows}, {cols}) matrix of {itemsize}-byte elements is "
                f"{rows * cols * itemsize} bytes, but its destination has {into.nbytes}"
            )
        word = np.dtype(f"u{itemsize}")
        target = into.reshape(-1).view(np.uint8).view(word).reshape(cols, rows)
        row_bytes = cols * itemsize
        block = max(1, min(rows, TRANSPOSE_SCRATCH // row_bytes))
        scratch = np.empty(block * row_bytes, dtype=np.uint8)
        for first in range(0, rows, block):
            count = min(block, rows - first)
            part = scratch[: count * row_bytes]
            self.read(index, offset + first * row_bytes, part)
            target[:, first : first + count] = part.view(word).reshape(count, cols).T

    def write(self, index: int, offset: int, data: np.ndarray) -> None:
        """Write `data` (contiguous bytes) to the spill file `index` at `offset`."""
        file, fd = self._file(index)
        if file.kind != "spill":
            raise DiskError(f"a write into {_name(file)}: only the spill file is written")
        _check_span(file, offset, data.nbytes)
        view = memoryview(data).cast("B")
        direct_fd = self.direct_fds[index]
        if direct_fd is not None:
            self._write_direct(file, direct_fd, offset, view)
            return
        _write_all(file, fd, offset, view)

    def _read_direct(self, file: DiskFile, fd: int, offset: int, view: memoryview) -> None:
        """`view` from `fd` (`O_DIRECT`) at `offset`: the aligned window around it read in
        chunks of the read bounce buffer, the wanted bytes of each copied out. A read that
        stops short at the file's end is fine once the wanted bytes came."""
        end = offset + len(view)
        if end == offset:
            return
        with self.locks["read"]:
            bounce = memoryview(self.bounce["read"])
            at = offset - offset % DIRECT_ALIGNMENT
            while at < end:
                want = min(len(bounce), _blocks(end) - at)
                filled = 0
                while filled < want:
                    try:
                        got = os.preadv(fd, [bounce[filled:want]], at + filled)
                    except OSError as err:
                        raise DiskError(
                            f"reading {_name(file)} at {at + filled} failed (O_DIRECT): {err}"
                        ) from err
                    filled += got
                    if got == 0 or filled % DIRECT_ALIGNMENT:
                        break  # the file's end: what follows would not be aligned
                low, high = max(at, offset), min(at + filled, end)
                if high < min(at + want, end):
                    raise DiskError(
                        f"{_name(file)} ended at {at + filled} bytes, before the "
                        f"{len(view)} bytes at {offset} a read wants"
                    )
                view[low - offset : high - offset] = bounce[low - at : high - at]
                at += want

    def _write_direct(self, file: DiskFile, fd: int, offset: int, view: memoryview) -> None:
        """`view` to `fd` (`O_DIRECT`) at `offset`, which must be aligned: in chunks of the
        write bounce buffer, the last zero-padded to whole blocks (the padding stays inside
        the place's last block, which no other place shares)."""
        if offset % DIRECT_ALIGNMENT:
            raise DiskError(
                f"a direct write of {len(view)} bytes at {offset} of {_name(file)}: direct "
                f"writes go to places at multiples of {DIRECT_ALIGNMENT} bytes (as "
                "memgraph.tiers places them); run this plan without direct I/O"
            )
        if not len(view):
            return
        with self.locks["write"]:
            bounce = self.bounce["write"]
            chunk = len(bounce)
            for start in range(0, len(view), chunk):
                part = view[start : start + chunk]
                padded = _blocks(len(part))
                memoryview(bounce)[: len(part)] = part
                bounce[len(part) : padded] = 0
                _write_all(file, fd, offset + start, memoryview(bounce)[:padded], " (O_DIRECT)")

    def _file(self, index: int) -> tuple[DiskFile, int]:
        if not 0 <= index < len(self.fds):
            raise DiskError(f"file#{index} is not an open file of this run ({len(self.fds)} open)")
        return self.tier.files[index], self.fds[index]


def _write_all(file: DiskFile, fd: int, offset: int, view: memoryview, how: str = "") -> None:
    """All of `view` to `fd` at `offset`, looping over short writes; a failure is a
    `DiskError` naming the file, the offset and `how` it was written."""
    done = 0
    while done < len(view):
        try:
            done += os.pwritev(fd, [view[done:]], offset + done)
        except OSError as err:
            raise DiskError(
                f"writing {_name(file)} at {offset + done} failed{how}: {err}"
            ) from err


def _open_direct(path: str, flags: int, buffered: int, file: DiskFile) -> int | None:
    """A second descriptor of the file open as `buffered`, with `O_DIRECT`; None where
    the platform or the file system refuses it (`EINVAL`, as tmpfs may)."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if not o_direct:
        return None
    try:
        fd = os.open(path, flags | o_direct | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        if err.errno == errno.EINVAL:
            return None
        raise DiskError(f"{_name(file)} cannot be opened with O_DIRECT: {err}") from err
    try:
        same = _identity(os.fstat(fd)) == _identity(os.fstat(buffered))
    except BaseException:
        os.close(fd)
        raise
    if not same:
        os.close(fd)
        raise DiskError(f"{_name(file)} was replaced by another file while it was opened")
    return fd


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _blocks(nbytes: int) -> int:
    """`nbytes` rounded up to whole blocks of `DIRECT_ALIGNMENT` bytes."""
    return -(-nbytes // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT


def _aligned_buffer(nbytes: int) -> np.ndarray:
    """`nbytes` bytes whose address is a multiple of `DIRECT_ALIGNMENT`: a view of a
    slightly larger array (which it keeps alive)."""
    raw = np.empty(nbytes + DIRECT_ALIGNMENT, dtype=np.uint8)
    skip = -raw.ctypes.data % DIRECT_ALIGNMENT
    return raw[skip : skip + nbytes]


def _size(fd: int, nbytes: int, path: str) -> None:
    """Give the new file `nbytes` bytes: reserved blocks where the file system can, else
    a sparse file of that size (`ENOSPC` surfaces at a write)."""
    if nbytes <= 0:
        return
    fallocate: Any = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        try:
            fallocate(fd, 0, nbytes)
            return
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise DiskError(
                    f"the spill file {path!r} cannot get its {nbytes} bytes: {err}"
                ) from err
    try:
        os.ftruncate(fd, nbytes)
    except OSError as err:
        raise DiskError(f"the spill file {path!r} cannot get its {nbytes} bytes: {err}") from err


def _check_span(file: DiskFile, offset: int, nbytes: int) -> None:
    if offset < 0 or offset + nbytes > file.nbytes:
        raise DiskError(
            f"{nbytes} bytes at {offset} do not lie inside {_name(file)} ({file.nbytes} bytes)"
        )


def _name(file: DiskFile) -> str:
    return f"the checkpoint {file.path!r}" if file.kind == "checkpoint" else "the spill file"
