"""Direct disk transfers (`O_DIRECT`) for a plan with a host tier: `direct_io=True` runs
equal the buffered runs and the reference in every mode; every direct transfer is
block-aligned (offset, length, buffer address); a file system that refuses `O_DIRECT`
falls back to buffered transfers per file; the spill file still leaves nothing behind;
a checkpoint that changes during the run is still an error; `einpage run --direct-io`.

Skipped where the temporary folder's file system refuses `O_DIRECT` (except the fallback
tests, which make it refuse)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import run_tier_plans
from cli_runner import cli
from plans import reference_plan
from run_tier_plans import tier_plan, write_checkpoint

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.cli.commands import EXIT_OK
from einpage.models import llama
from einpage.weight_files import read_header, save_weights
from einpage_core.errors import DiskError, HostBudgetPlanError, InputError
from memgraph.nodes import DiskFile, HostTier
from memgraph.tiers import CheckpointPlace, place_host
from runtime import diskio
from runtime.diskio import DIRECT_ALIGNMENT, DiskFiles

MODES = ["sequential", "streams", "random"]
O_DIRECT = getattr(os, "O_DIRECT", 0)


def direct_refused(folder: Path) -> str | None:
    """Why `folder`'s file system takes no `O_DIRECT` file (None when it takes one)."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    probe = folder / "o_direct_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | O_DIRECT, 0o600)
    except OSError as err:
        return f"the file system of {folder} refuses O_DIRECT: {err}"
    finally:
        if probe.exists():
            probe.unlink()
    os.close(fd)
    return None


@pytest.fixture
def folder(tmp_path):
    """`tmp_path`, where its file system takes `O_DIRECT`; else the test is skipped."""
    reason = direct_refused(tmp_path)
    if reason is not None:
        pytest.skip(reason)
    return tmp_path


@pytest.fixture
def small_bounce(monkeypatch):
    """Bounce buffers of two blocks: a read of a few KiB takes several chunks."""
    monkeypatch.setattr(diskio, "DIRECT_BOUNCE", 2 * DIRECT_ALIGNMENT)


# -- two plans that read a checkpoint, spill and read back ---------------------------------


def mlp_case(folder, monkeypatch):
    """The hand-made MLP plan (`run_tier_plans.tier_plan`): both weights read from a
    checkpoint at unaligned offsets, its hidden layer spilled and read back; its spill
    places at multiples of 4096 bytes, as `memgraph.tiers` places them."""
    monkeypatch.setattr(run_tier_plans, "ALIGN", DIRECT_ALIGNMENT)
    prog = ep.Program("mlp")
    x = prog.input("x", (4, 8))
    w1 = prog.input("w1", (8, 16), role="weight")
    w2 = prog.input("w2", (16, 8), role="weight")
    prog.output(ep.softmax(ep.gelu(x @ w1) @ w2 + x), "y")
    tg = prog.build()
    rng = np.random.default_rng(0)
    weights = {
        n: rng.standard_normal(tg[tg.inputs[n]].shape).astype("float32") for n in ("w1", "w2")
    }
    xs = {"x": rng.standard_normal((4, 8)).astype("float32")}
    path = folder / "model.safetensors"
    offsets = write_checkpoint(path, weights)
    base = reference_plan(tg, offload=frozenset({4}), outputs_to_host=True)
    return tier_plan(base, path, offsets), weights, xs


ROWS, COLS = 32, 48


def transposed_case(folder, monkeypatch):
    """A plan of the pass (`place_host`, its smallest host budget): w1 read as it is, w2
    read from its transpose in the checkpoint (a Hugging Face `down_proj`), in blocks of
    3 rows; an offloaded tensor spilled."""
    prog = ep.Program("down_proj")
    x = prog.input("x", (4, ROWS))
    w1 = prog.input("w1", (ROWS, COLS), role="weight")
    w2 = prog.input("w2", (COLS, ROWS), role="weight")
    y1 = ep.gelu(x @ w1) @ w2 + x
    prog.output(ep.gelu(y1 @ w1) @ w2, "y")
    tg = prog.build()
    rng = np.random.default_rng(1)
    values = {
        n: (rng.standard_normal(tg[t].shape) / 4).astype("float32") for n, t in tg.inputs.items()
    }
    weights = {"w1": values["w1"], "w2": values["w2"]}
    stored = {"w1": weights["w1"], "w2": np.ascontiguousarray(weights["w2"].T)}
    path = save_weights(stored, folder / "model.safetensors")
    tensors, size = read_header(path)
    places = {
        "w1": CheckpointPlace(str(path), size, tensors["w1"][2]),
        "w2": CheckpointPlace(str(path), size, tensors["w2"][2], transposed=(ROWS, COLS)),
    }
    device = memgraph.plan(tg, memgraph.min_budget(tg)[0], inputs="host")
    budget = DIRECT_ALIGNMENT
    while True:
        try:
            mg = place_host(device, budget, places)
            break
        except HostBudgetPlanError:
            budget *= 2
    monkeypatch.setattr(diskio, "TRANSPOSE_SCRATCH", 3 * COLS * 4)
    return mg, weights, {"x": values["x"]}


CASES = {"mlp": mlp_case, "transposed": transposed_case}


@pytest.fixture(params=sorted(CASES))
def case(request, folder, monkeypatch, small_bounce):
    """(plan, weights, activations, spill folder) of each case; both read a checkpoint at
    unaligned offsets and write and read a spill file."""
    mg, weights, xs = CASES[request.param](folder, monkeypatch)
    assert [f.kind for f in mg.tier.files] == ["checkpoint", "spill"]
    spill = folder / "spill"
    spill.mkdir()
    return mg, weights, xs, spill


def reference(mg, weights, xs):
    return taskgraph.evaluate(mg.taskgraph, {**weights, **xs})["y"]


def run_direct(mg, xs, spill, mode="sequential", seed=0, direct_io=True):
    """The run's output and `RunReport.disk_direct`."""
    with runtime.Session(mg, "numpy", mode=mode, spill=spill, direct_io=direct_io) as session:
        y = session.run(xs, seed=seed)["y"]
        return y, session.last.disk_direct


# -- runs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_direct_runs_equal_buffered_runs_and_the_reference(case, mode):
    mg, weights, xs, spill = case
    expected = reference(mg, weights, xs)
    for seed in range(3 if mode == "random" else 1):
        buffered, flags = run_direct(mg, xs, spill, mode, seed, direct_io=False)
        assert flags == (False, False)
        direct, flags = run_direct(mg, xs, spill, mode, seed)
        assert flags == (True, True)
        np.testing.assert_array_equal(direct, buffered)
        np.testing.assert_array_equal(direct, expected)
    got = runtime.run(mg, xs, backend="numpy", mode=mode, spill=spill, direct_io=True)
    np.testing.assert_array_equal(got["y"], expected)
    assert os.listdir(spill) == []


def test_every_direct_transfer_is_block_aligned(case, monkeypatch):
    """Offset, length and buffer address of each `preadv`/`pwritev` on a direct descriptor
    are multiples of 4096; the buffered descriptors of direct files move nothing."""
    mg, weights, xs, spill = case
    calls: list[tuple[str, int, int, int, int]] = []  # (what, fd, offset, length, address)
    real_preadv, real_pwritev = os.preadv, os.pwritev

    def address(buffer) -> int:
        return np.frombuffer(buffer, dtype=np.uint8).ctypes.data

    def preadv(fd, buffers, offset):
        calls.append(("read", fd, offset, len(buffers[0]), address(buffers[0])))
        return real_preadv(fd, buffers, offset)

    def pwritev(fd, buffers, offset):
        calls.append(("write", fd, offset, len(buffers[0]), address(buffers[0])))
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pwritev", pwritev)
    with runtime.Session(mg, "numpy", mode="streams", spill=spill, direct_io=True) as session:
        got = session.run(xs)["y"]
        direct = set(session.disk_files.direct_fds)
        buffered = set(session.disk_files.fds)
    np.testing.assert_array_equal(got, reference(mg, weights, xs))
    on_direct = [c for c in calls if c[1] in direct]
    assert {c[0] for c in on_direct} == {"read", "write"}
    assert not [c for c in calls if c[1] in buffered]
    for what, _, offset, length, at in on_direct:
        assert (offset % 4096, length % 4096, at % 4096) == (0, 0, 0), (what, offset, length, at)
    assert max(c[3] for c in on_direct) <= diskio.DIRECT_BOUNCE  # chunks of the bounce buffer


@pytest.mark.parametrize("refuse", ["every file", "the checkpoint"])
def test_a_file_system_that_refuses_o_direct_falls_back_to_buffered(tmp_path, monkeypatch, refuse):
    """`open` raising EINVAL for O_DIRECT (as tmpfs may): that file is buffered, the run
    still equals the reference, and the report says which files were direct."""
    if not O_DIRECT:
        pytest.skip("this platform has no O_DIRECT")
    mg, weights, xs = mlp_case(tmp_path, monkeypatch)
    spill = tmp_path / "spill"
    spill.mkdir()
    checkpoint = mg.tier.files[0].path
    real_open = os.open

    def open_refusing(path, flags, *args, **kwargs):
        if flags & O_DIRECT and (refuse == "every file" or os.fspath(path) == checkpoint):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_refusing)
    if refuse == "the checkpoint" and direct_refused(spill) is not None:
        pytest.skip(direct_refused(spill))
    expected_flags = (False, False) if refuse == "every file" else (False, True)
    for mode in MODES:
        got, flags = run_direct(mg, xs, spill, mode)
        assert flags == expected_flags
        np.testing.assert_array_equal(got, reference(mg, weights, xs))
    assert os.listdir(spill) == []
    files = DiskFiles.open(mg.tier, spill, direct=True)
    with files:
        assert files.direct == expected_flags
        assert ("read" in files.bounce) == any(expected_flags)  # no buffer when none is direct
        assert ("write" in files.bounce) == expected_flags[1]


# -- the spill file, and checkpoints that change -------------------------------------------


def test_a_direct_spill_file_is_unlinked_at_once_and_sized_to_whole_blocks(folder):
    spill = folder / "spill"
    spill.mkdir()
    with DiskFiles.open(HostTier(1 << 20, (DiskFile("spill", 5000),)), spill, direct=True) as f:
        assert f.direct == (True,) and os.listdir(spill) == []
        (buffered,), (direct,) = f.fds, f.direct_fds
        for fd in (buffered, direct):
            info = os.fstat(fd)
            assert info.st_nlink == 0 and info.st_size == 8192  # 5000 up to whole blocks
        assert os.fstat(buffered).st_ino == os.fstat(direct).st_ino  # one file
        assert fcntl.fcntl(direct, fcntl.F_GETFL) & O_DIRECT
        assert not fcntl.fcntl(buffered, fcntl.F_GETFL) & O_DIRECT
    assert os.listdir(spill) == []


@pytest.mark.parametrize("failure", [KeyboardInterrupt, OSError(errno.EACCES, "Permission denied")])
def test_a_failure_opening_the_direct_descriptor_leaves_nothing(folder, monkeypatch, failure):
    """The spill file's O_DIRECT descriptor is opened by name before the name is unlinked:
    an interruption or an error there still removes it (an error other than EINVAL is a
    `DiskError`, not a fallback)."""
    spill = folder / "spill"
    spill.mkdir()
    real_open = os.open

    def failing(path, flags, *args, **kwargs):
        if flags & O_DIRECT:
            raise failure
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing)
    expected = KeyboardInterrupt if failure is KeyboardInterrupt else DiskError
    with pytest.raises(expected):
        DiskFiles.open(HostTier(1 << 20, (DiskFile("spill", 4096),)), spill, direct=True)
    assert os.listdir(spill) == []


# -- DiskFiles' direct transfers, byte by byte -----------------------------------------------


def test_direct_reads_of_any_window_equal_the_file(folder, small_bounce):
    """Unaligned offsets and lengths, windows across chunks, up to the file's unaligned end."""
    data = np.random.default_rng(2).integers(0, 256, 3 * DIRECT_ALIGNMENT + 77, dtype=np.uint8)
    path = folder / "ckpt.bin"
    path.write_bytes(data.tobytes())
    tier = HostTier(1 << 20, (DiskFile("checkpoint", data.nbytes, str(path)),))
    with DiskFiles.open(tier, None, direct=True) as files:
        assert files.direct == (True,)
        for offset, nbytes in [(0, 0), (5, 0), (0, 1), (4095, 2), (4096, 4096), (100, 9000),
                               (0, data.nbytes), (data.nbytes - 1, 1), (8191, 4173)]:  # fmt: skip
            into = np.zeros(nbytes, dtype=np.uint8)
            files.read(0, offset, into)
            np.testing.assert_array_equal(into, data[offset : offset + nbytes])


def test_a_direct_read_ending_before_the_wanted_bytes_is_an_error(folder, monkeypatch):
    """Short reads are looped over; a read whose file ends (a read of 0 bytes) before the
    wanted bytes came is a `DiskError` naming where it ended."""
    path = folder / "ckpt.bin"
    data = np.arange(10000, dtype=np.uint16).astype(np.uint8)
    path.write_bytes(data.tobytes())
    tier = HostTier(1 << 20, (DiskFile("checkpoint", 10000, str(path)),))
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, b, at: min(real(fd, b, at), 4096))
    with DiskFiles.open(tier, None, direct=True) as files:
        into = np.zeros(6000, dtype=np.uint8)
        files.read(0, 4000, into)  # three short reads of a block each, the last to the end
        np.testing.assert_array_equal(into, data[4000:])
        monkeypatch.setattr(
            os, "preadv", lambda fd, b, at: 0 if at >= 4096 else min(real(fd, b, at), 4096)
        )
        with pytest.raises(DiskError, match="ended at 4096 bytes, before the 1000 bytes at 4000"):
            files.read(0, 4000, np.zeros(1000, dtype=np.uint8))


def test_a_padded_direct_write_keeps_the_next_place(folder):
    """A write of 5000 bytes at 0 pads to 8192: the place at 8192 keeps its bytes; a
    write at an unaligned offset is refused."""
    spill = folder / "spill"
    spill.mkdir()
    with DiskFiles.open(HostTier(1 << 20, (DiskFile("spill", 12000),)), spill, direct=True) as f:
        nxt = np.full(3000, 7, dtype=np.uint8)
        f.write(0, 8192, nxt)
        first = np.arange(5000, dtype=np.uint32).astype(np.uint8)
        f.write(0, 0, first)
        for offset, want in ((0, first), (8192, nxt)):
            back = np.zeros_like(want)
            f.read(0, offset, back)
            np.testing.assert_array_equal(back, want)
        with pytest.raises(DiskError, match="multiples of 4096 bytes"):
            f.write(0, 256, nxt[:10])


# -- the command line ---------------------------------------------------------------------------


def test_einpage_run_with_direct_io_checks_ok(capsys, folder):
    """A generation of `llama:tiny` at its smallest budget, weights read from a checkpoint,
    KV pages spilled: both files direct, the outputs equal to the reference."""
    tg = llama.generation_program(llama.PRESETS["tiny"], 1, 16, 6, "float32").build()
    rng = np.random.default_rng(0)
    weights = {
        name: (0.1 * rng.standard_normal(tg[t].shape)).astype(tg[t].dtype)
        for name, t in tg.inputs.items()
        if tg[t].op.role == "weight"
    }
    checkpoint = save_weights(weights, folder / "tiny.safetensors")
    program = folder / "generate.json"
    program.write_text(tg.to_json())
    spill = folder / "spill"
    spill.mkdir()
    plan = folder / "plan.json"
    code, out, err = cli(
        capsys, "plan", program, "--budget", memgraph.min_budget(tg)[0], "--host-budget", "18%",
        "--checkpoint", checkpoint, "--spill", spill, "-o", plan,
    )  # fmt: skip
    assert code == EXIT_OK, err
    kinds = [f["kind"] for f in json.loads(plan.read_text())["tier"]["files"]]
    assert kinds == ["checkpoint", "spill"]
    code, out, err = cli(
        capsys, "run", plan, "--check", "--spill", spill, "--direct-io", "--mode", "streams"
    )
    assert code == EXIT_OK, err
    assert "O_DIRECT for 2 of 2 files" in out and not re.search(r" 0 B written", out)
    assert " ok" in out.split("check against the reference")[1]
    assert list(spill.iterdir()) == []


def test_direct_io_on_a_plan_without_a_host_tier_is_refused():
    """Nothing to move with O_DIRECT: said, not silently ignored."""
    prog = ep.Program("plain")
    x = prog.input("x", (4, 4))
    prog.output(x @ x, "y")
    mg = memgraph.plan(prog.build(), 1 << 20)
    with pytest.raises(InputError, match="no host tier"):
        runtime.run(mg, {"x": np.ones((4, 4), np.float32)}, backend="numpy", direct_io=True)
