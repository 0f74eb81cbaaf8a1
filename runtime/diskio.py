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
before the bytes a read wants is a `DiskError`. Transfers go through the page cache:
no `O_DIRECT` (it would need block-aligned offsets, sizes and buffers). A weight a
checkpoint holds transposed (`DiskPlace.transposed`) is read in blocks of rows into a
scratch of at most `TRANSPOSE_SCRATCH` bytes and transposed into the arena
(`DiskFiles.read_transposed`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from einpage_core.errors import DiskError
from einpage_core.units import format_bytes
from memgraph.nodes import DiskFile, HostTier

__all__ = ["DiskFiles", "SPILL_PREFIX", "TRANSPOSE_SCRATCH", "check_spill_folder"]

SPILL_PREFIX = "einpage-spill-"
"""How a spill file's name begins (the rest: the process id and random hex)."""

TRANSPOSE_SCRATCH = 4 << 20
"""The most bytes `DiskFiles.read_transposed` holds besides its destination: it reads a
transposed matrix in blocks of whole rows of at most this many bytes (at least one row)."""


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
    """The open files of a run, by index in `tier.files` (`fds`); `spill_path` is the
    name the spill file was created under, for messages (it is unlinked at once; "" when
    the tier has none)."""

    tier: HostTier
    fds: list[int] = field(default_factory=list)
    spill_path: str = ""
    stamps: dict[int, int] = field(default_factory=dict)  # checkpoint index -> mtime (ns)

    @classmethod
    def open(cls, tier: HostTier, spill_folder: str | os.PathLike[str] | None) -> DiskFiles:
        """Every file of `tier` open (see the module docstring); on any failure – or an
        interruption – what was opened is closed and the spill file removed again."""
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
                fd = files._open_checkpoint(file) if file.kind == "checkpoint" else None
                if fd is None:
                    fd = files._create_spill(folder, file.nbytes)
                else:
                    files.stamps[len(files.fds)] = os.fstat(fd).st_mtime_ns
                files.fds.append(fd)
        except BaseException:
            files.close()
            raise
        return files

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

    def _create_spill(self, folder: str, nbytes: int) -> int:
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
        try:
            os.unlink(path)  # kept open, gone from the folder: nothing outlives the process
            _size(fd, nbytes, path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        """Close every file (the spill file's blocks are freed then; safe to call again)."""
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.spill_path = ""

    def __enter__(self) -> DiskFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transfers ---------------------------------------------------------------

    def read(self, index: int, offset: int, into: np.ndarray) -> None:
        """Fill `into` (contiguous bytes) from file `index` at `offset`."""
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
        done = 0
        while done < len(view):
            try:
                done += os.pwritev(fd, [view[done:]], offset + done)
            except OSError as err:
                raise DiskError(f"writing {_name(file)} at {offset + done} failed: {err}") from err

    def _file(self, index: int) -> tuple[DiskFile, int]:
        if not 0 <= index < len(self.fds):
            raise DiskError(f"file#{index} is not an open file of this run ({len(self.fds)} open)")
        return self.tier.files[index], self.fds[index]


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
