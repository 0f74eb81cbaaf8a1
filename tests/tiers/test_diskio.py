"""The disk files of a run (`runtime.diskio`): checkpoints checked, one spill file created,
sized and removed however things end, reads and writes that loop and fail loudly."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from einpage_core.errors import DiskError
from memgraph.nodes import DiskFile, HostTier
from runtime import diskio
from runtime.diskio import SPILL_PREFIX, DiskFiles


def checkpoint(tmp_path, nbytes=1000):
    path = tmp_path / "ckpt.bin"
    path.write_bytes(bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256))
    return path


def tier(*files):
    return HostTier(1 << 16, tuple(files))


@pytest.fixture
def spill_dir(tmp_path):
    folder = tmp_path / "spill"
    folder.mkdir()
    return folder


def test_spill_file_is_created_private_sized_and_unlinked_at_once(tmp_path, spill_dir):
    ckpt = checkpoint(tmp_path)
    t = tier(DiskFile("checkpoint", 1000, str(ckpt)), DiskFile("spill", 8192))
    files = DiskFiles.open(t, spill_dir)
    assert files.direct == (False, False) and not files.bounce  # buffered unless asked
    assert os.listdir(spill_dir) == []  # open by its descriptor only
    assert os.path.dirname(files.spill_path) == str(spill_dir)
    assert os.path.basename(files.spill_path).startswith(SPILL_PREFIX)
    info = os.fstat(files.fds[1])
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_size == 8192 and info.st_nlink == 0
    files.close()
    assert os.listdir(spill_dir) == []
    files.close()  # again: nothing to do


@pytest.mark.parametrize("direct", [False, True])
def test_a_killed_process_leaves_nothing_in_the_spill_folder(spill_dir, direct):
    """`kill -9` runs no cleanup: the spill file was unlinked when it was made (with
    `O_DIRECT`, right after its second descriptor was opened by name)."""
    script = (
        "import sys\n"
        "import numpy as np\n"
        "from memgraph.nodes import DiskFile, HostTier\n"
        "from runtime.diskio import DiskFiles\n"
        "files = DiskFiles.open(HostTier(1 << 20, (DiskFile('spill', 1 << 20),)), sys.argv[1],"
        " direct=sys.argv[2] == 'direct')\n"
        "files.write(0, 8192, np.ones(10000, dtype=np.uint8))\n"
        "print('open', flush=True)\n"
        "sys.stdin.read()\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(spill_dir), "direct" if direct else "buffered"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    assert child.stdout.readline().strip() == "open"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert os.listdir(spill_dir) == []


def test_two_runs_get_two_spill_files(spill_dir):
    t = tier(DiskFile("spill", 4096))
    with DiskFiles.open(t, spill_dir) as a, DiskFiles.open(t, spill_dir) as b:
        assert a.spill_path != b.spill_path
        assert os.fstat(a.fds[0]).st_ino != os.fstat(b.fds[0]).st_ino
    assert os.listdir(spill_dir) == []


def test_reads_and_writes_round_trip_through_the_spill_file(tmp_path, spill_dir):
    ckpt = checkpoint(tmp_path)
    t = tier(DiskFile("checkpoint", 1000, str(ckpt)), DiskFile("spill", 8192))
    with DiskFiles.open(t, spill_dir) as files:
        got = np.zeros(100, dtype=np.uint8)
        files.read(0, 300, got)
        np.testing.assert_array_equal(got, np.frombuffer(ckpt.read_bytes()[300:400], np.uint8))
        data = np.arange(700, dtype=np.uint16).view(np.uint8)[:1400]
        files.write(1, 4096, data)
        back = np.zeros_like(data)
        files.read(1, 4096, back)
        np.testing.assert_array_equal(back, data)


def test_short_reads_and_writes_are_looped_over(tmp_path, spill_dir, monkeypatch):
    real_preadv, real_pwritev = os.preadv, os.pwritev
    calls = {"read": 0, "write": 0}

    def preadv(fd, buffers, offset):
        calls["read"] += 1
        return real_preadv(fd, [memoryview(buffers[0])[:7]], offset)

    def pwritev(fd, buffers, offset):
        calls["write"] += 1
        return real_pwritev(fd, [memoryview(buffers[0])[:5]], offset)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pwritev", pwritev)
    with DiskFiles.open(tier(DiskFile("spill", 4096)), spill_dir) as files:
        data = np.arange(50, dtype=np.uint8)
        files.write(0, 10, data)
        back = np.zeros_like(data)
        files.read(0, 10, back)
    np.testing.assert_array_equal(back, data)
    assert calls == {"read": 8, "write": 10}


def test_end_of_file_during_a_read_is_an_error(spill_dir, monkeypatch):
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)
    files = DiskFiles.open(tier(DiskFile("spill", 4096)), spill_dir)
    with files, pytest.raises(DiskError, match="ended at 16 bytes"):
        files.read(0, 16, np.zeros(8, dtype=np.uint8))


def test_a_read_outside_a_file_and_a_write_into_a_checkpoint_are_refused(tmp_path, spill_dir):
    ckpt = checkpoint(tmp_path)
    t = tier(DiskFile("checkpoint", 1000, str(ckpt)), DiskFile("spill", 4096))
    with DiskFiles.open(t, spill_dir) as files:
        with pytest.raises(DiskError, match="do not lie inside the checkpoint"):
            files.read(0, 990, np.zeros(16, dtype=np.uint8))
        with pytest.raises(DiskError, match="only the spill file is written"):
            files.write(0, 0, np.zeros(16, dtype=np.uint8))
        with pytest.raises(DiskError, match="do not lie inside the spill file"):
            files.write(1, 4090, np.zeros(16, dtype=np.uint8))
    assert ckpt.read_bytes() == checkpoint(tmp_path).read_bytes()


def test_a_checkpoint_that_grows_during_the_run_is_an_error(tmp_path):
    ckpt = checkpoint(tmp_path)
    with DiskFiles.open(tier(DiskFile("checkpoint", 1000, str(ckpt))), None) as files:
        files.read(0, 0, np.zeros(8, dtype=np.uint8))
        with open(ckpt, "ab") as grow:
            grow.write(b"more")
        with pytest.raises(DiskError, match="changed size during the run") as caught:
            files.read(0, 0, np.zeros(8, dtype=np.uint8))
    assert "1004 bytes" in str(caught.value) and "1000" in str(caught.value)


def test_a_checkpoint_written_in_place_during_the_run_is_an_error(tmp_path):
    """Same size, other bytes: its modification time gives it away."""
    ckpt = checkpoint(tmp_path)
    with DiskFiles.open(tier(DiskFile("checkpoint", 1000, str(ckpt))), None) as files:
        files.read(0, 0, np.zeros(8, dtype=np.uint8))
        stamp = os.stat(ckpt).st_mtime_ns
        with open(ckpt, "r+b") as rewrite:
            rewrite.write(b"\xff" * 8)
        os.utime(ckpt, ns=(stamp + 10**9, stamp + 10**9))  # coarse clocks: a second later
        with pytest.raises(DiskError, match="was written to during the run"):
            files.read(0, 0, np.zeros(8, dtype=np.uint8))


# -- refusals, each leaving nothing behind ------------------------------------------------


def test_a_checkpoint_of_another_size_is_refused_naming_both_sizes(tmp_path, spill_dir):
    ckpt = checkpoint(tmp_path, 900)
    t = tier(DiskFile("spill", 4096), DiskFile("checkpoint", 1000, str(ckpt)))
    with pytest.raises(DiskError) as caught:
        DiskFiles.open(t, spill_dir)
    message = str(caught.value)
    assert str(ckpt) in message and "900 bytes" in message and "1000 bytes" in message
    assert os.listdir(spill_dir) == []  # the spill file made before it is gone


def test_a_missing_checkpoint_is_refused_naming_it(tmp_path, spill_dir):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(DiskError, match="nope.safetensors"):
        DiskFiles.open(tier(DiskFile("checkpoint", 10, str(missing))), spill_dir)


def test_a_spill_file_needs_a_spill_folder(tmp_path):
    with pytest.raises(DiskError, match="give a spill folder"):
        DiskFiles.open(tier(DiskFile("spill", 4096)), None)


def test_a_missing_spill_folder_is_refused(tmp_path):
    folder = tmp_path / "absent"
    with pytest.raises(DiskError, match="does not exist") as caught:
        DiskFiles.open(tier(DiskFile("spill", 4096)), folder)
    assert str(folder) in str(caught.value)
    assert os.listdir(tmp_path) == []


def test_a_spill_folder_that_is_a_file_is_refused(tmp_path):
    folder = tmp_path / "file"
    folder.write_text("")
    with pytest.raises(DiskError, match="is not a directory"):
        DiskFiles.open(tier(DiskFile("spill", 4096)), folder)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_spill_folder_is_refused(spill_dir):
    spill_dir.chmod(0o500)
    try:
        with pytest.raises(DiskError, match="is not writable") as caught:
            DiskFiles.open(tier(DiskFile("spill", 4096)), spill_dir)
        assert str(spill_dir) in str(caught.value)
    finally:
        spill_dir.chmod(0o700)
    assert os.listdir(spill_dir) == []


def test_a_folder_the_process_may_not_write_is_refused(spill_dir, monkeypatch):
    """The permission check as any user sees it (root passes os.access everywhere)."""
    real = os.access

    def no_writes(path, mode):
        return False if mode & os.W_OK else real(path, mode)

    monkeypatch.setattr(os, "access", no_writes)
    with pytest.raises(DiskError, match="is not writable") as caught:
        DiskFiles.open(tier(DiskFile("spill", 4096)), spill_dir)
    assert str(spill_dir) in str(caught.value) and os.listdir(spill_dir) == []


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_that_takes_no_files_is_refused_even_for_root(monkeypatch):
    """/proc passes os.access(W_OK) for root (as CI runs) yet takes no new file: creating
    the spill file fails there, and the error names the folder."""
    class Roomy:
        f_bavail, f_frsize = 1 << 40, 1

    monkeypatch.setattr(os, "statvfs", lambda path: Roomy())
    with pytest.raises(DiskError, match="the spill file cannot be created in '/proc'"):
        DiskFiles.open(tier(DiskFile("spill", 4096)), "/proc")


def test_a_spill_folder_without_room_is_refused_with_both_figures(spill_dir, monkeypatch):
    real = os.statvfs

    class Tiny:
        def __init__(self, path):
            self.f_frsize = real(path).f_frsize
            self.f_bavail = 1

    monkeypatch.setattr(os, "statvfs", Tiny)
    with pytest.raises(DiskError, match="free") as caught:
        DiskFiles.open(tier(DiskFile("spill", 1 << 20)), spill_dir)
    assert str(1 << 20) in str(caught.value) and str(Tiny(spill_dir).f_frsize) in str(caught.value)
    assert os.listdir(spill_dir) == []


def test_no_room_when_reserving_is_an_error_and_leaves_nothing(spill_dir, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DiskError, match="cannot get its 4096 bytes"):
        DiskFiles.open(tier(DiskFile("spill", 4096)), spill_dir)
    assert os.listdir(spill_dir) == []


def test_a_file_system_without_fallocate_gets_a_truncated_file(spill_dir, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with DiskFiles.open(tier(DiskFile("spill", 12345)), spill_dir) as files:
        assert os.fstat(files.fds[0]).st_size == 12345


def test_an_interruption_while_opening_leaves_nothing(spill_dir, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "posix_fallocate", interrupted)
    monkeypatch.setattr(diskio.os, "ftruncate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        DiskFiles.open(tier(DiskFile("spill", 4096)), spill_dir)
    assert os.listdir(spill_dir) == []


def test_a_checkpoint_replaced_by_another_of_the_same_size_is_refused(tmp_path):
    """The plan states the SHA-256 of the file's head (its safetensors header): another
    file of the same size but another header is refused before anything is read."""
    import hashlib

    ckpt = checkpoint(tmp_path)
    head = ckpt.read_bytes()[:64]
    digest = hashlib.sha256(head).hexdigest()
    planned = DiskFile("checkpoint", 1000, str(ckpt), 64, digest)
    with DiskFiles.open(tier(planned), None) as files:  # the same file: accepted
        files.read(0, 0, np.zeros(8, dtype=np.uint8))
    ckpt.write_bytes(b"\x01" + ckpt.read_bytes()[1:])  # same size, another head
    with pytest.raises(DiskError, match="not the file the plan was made for"):
        DiskFiles.open(tier(planned), None)
