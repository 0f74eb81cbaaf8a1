"""Weights a checkpoint holds transposed, read in place (`DiskPlace.transposed`): as a
Hugging Face checkpoint stores `o_proj` and `down_proj`, the file holds a (rows, cols)
matrix whose transpose, in C order, is the weight's bytes.

`DiskFiles.read_transposed` is held to NumPy's transpose, block by block; plans of the
pass with such a weight, streamed and kept, run to the reference evaluated on the
untransposed weights in every mode, float32 and bfloat16, with a scratch of a few rows;
plan files write a transposed place as `[file, offset, [rows, cols]]` and an untransposed
one as before; `planned_weights` gives the program's weight back.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.errors import SerializationError
from einpage.weight_files import planned_weights, read_header, save_weights
from einpage_core.errors import DiskError, HostBudgetPlanError
from memgraph import MemGraph, NodeKind
from memgraph.nodes import DiskFile, DiskPlace, HostStorage, HostTier
from memgraph.tiers import CheckpointPlace, place_host
from runtime import diskio
from runtime.diskio import DiskFiles

MODES = ["sequential", "streams", "random"]
ROWS, COLS = 32, 48  # w2 (48, 32) is stored as its transpose: a (32, 48) matrix


# -- DiskFiles.read_transposed against NumPy ------------------------------------------------


def matrix_file(tmp_path, matrix: np.ndarray, lead: int = 24) -> tuple[DiskFiles, int]:
    """`matrix`'s bytes at offset `lead` of a checkpoint file, opened."""
    path = tmp_path / "matrix.bin"
    path.write_bytes(b"\xee" * lead + matrix.tobytes() + b"\xee" * 8)
    tier = HostTier(1 << 20, (DiskFile("checkpoint", path.stat().st_size, str(path)),))
    return DiskFiles.open(tier, None), lead


@pytest.mark.parametrize(
    "dtype, rows, cols, block_rows",
    [
        ("float32", 10, 7, 3),  # 3 + 3 + 3 + 1: a last short block
        ("float32", 9, 7, 3),  # blocks divide the rows
        ("uint8", 5, 11, 2),
        ("float64", 1, 6, 4),  # one row, fewer than a block
        ("bfloat16", 17, 5, 4),
        ("float16", 6, 1, 100),  # one column; the whole matrix in one block
        ("int32", 4, 9, 0),  # a scratch smaller than a row: one row at a time
    ],
)
def test_read_transposed_is_numpys_transpose(tmp_path, monkeypatch, dtype, rows, cols, block_rows):
    numpy_dtype = taskgraph.dtypes.numpy_dtype(dtype)
    matrix = (np.arange(rows * cols) % 251 - 125).astype(numpy_dtype).reshape(rows, cols)
    itemsize = matrix.itemsize
    monkeypatch.setattr(diskio, "TRANSPOSE_SCRATCH", block_rows * cols * itemsize)
    files, offset = matrix_file(tmp_path, matrix)
    reads: list[tuple[int, int]] = []
    real_read = files.read

    def read(index, at, into):
        reads.append((at, into.nbytes))
        real_read(index, at, into)

    monkeypatch.setattr(files, "read", read)
    into = np.full(matrix.nbytes, 0xAB, dtype=np.uint8)
    with files:
        files.read_transposed(0, offset, rows, cols, itemsize, into)
    assert into.tobytes() == np.ascontiguousarray(matrix.T).tobytes()
    block = max(1, min(rows, block_rows)) * cols * itemsize
    assert all(nbytes <= block and nbytes % (cols * itemsize) == 0 for _, nbytes in reads)
    assert [at for at, _ in reads] == list(range(offset, offset + matrix.nbytes, block))
    assert sum(nbytes for _, nbytes in reads) == matrix.nbytes


def test_read_transposed_refuses_a_destination_of_other_bytes_and_odd_elements(tmp_path):
    files, offset = matrix_file(tmp_path, np.zeros((3, 4), np.float32))
    with files:
        with pytest.raises(DiskError, match="its destination has 40"):
            files.read_transposed(0, offset, 3, 4, 4, np.zeros(40, np.uint8))
        with pytest.raises(DiskError, match="1, 2, 4 or 8 bytes"):
            files.read_transposed(0, offset, 3, 4, 3, np.zeros(36, np.uint8))
        with pytest.raises(DiskError, match="do not lie inside"):
            files.read_transposed(0, offset + 16, 3, 4, 4, np.zeros(48, np.uint8))


def test_a_transposed_read_checks_the_checkpoint_on_every_block(tmp_path, monkeypatch):
    """The blocks go through `read`: a checkpoint that grows between two blocks is caught."""
    matrix = np.ones((6, 4), np.float32)
    monkeypatch.setattr(diskio, "TRANSPOSE_SCRATCH", 2 * 4 * 4)
    files, offset = matrix_file(tmp_path, matrix)
    real = os.preadv

    def preadv_then_grow(fd, buffers, at):
        got = real(fd, buffers, at)
        with open(tmp_path / "matrix.bin", "ab") as grow:
            grow.write(b"x")
        return got

    monkeypatch.setattr(os, "preadv", preadv_then_grow)
    with files, pytest.raises(DiskError, match="changed size during the run"):
        files.read_transposed(0, offset, 6, 4, 4, np.zeros(matrix.nbytes, np.uint8))


# -- plans of the pass with a transposed weight -------------------------------------------


def program(dtype: str):
    """y = gelu(y1 @ w1) @ w2 where y1 = gelu(x @ w1) @ w2 + x: each weight used twice, so
    a small host budget streams them (reads each more than once)."""
    prog = ep.Program("down_proj")
    x = prog.input("x", (4, ROWS), dtype=dtype)
    w1 = prog.input("w1", (ROWS, COLS), dtype=dtype, role="weight")
    w2 = prog.input("w2", (COLS, ROWS), dtype=dtype, role="weight")
    y1 = ep.gelu(x @ w1) @ w2 + x
    prog.output(ep.gelu(y1 @ w1) @ w2, "y")
    return prog.build()


def arrays(tg, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in tg.inputs.items():
        values = rng.standard_normal(tg[t].shape) / 4
        out[name] = values.astype(taskgraph.dtypes.numpy_dtype(tg[t].dtype))
    return out


def checkpoint(folder, weights) -> dict[str, CheckpointPlace]:
    """w1 as it is, w2 transposed (its (COLS, ROWS) array saved as the (ROWS, COLS) matrix
    w2.T), in one safetensors file; their places, w2's transposed."""
    stored = {"w1": weights["w1"], "w2": np.ascontiguousarray(weights["w2"].T)}
    path = save_weights(stored, folder / "model.safetensors")
    tensors, size = read_header(path)
    assert tensors["w2"][1] == (ROWS, COLS)
    return {
        "w1": CheckpointPlace(str(path), size, tensors["w1"][2]),
        "w2": CheckpointPlace(str(path), size, tensors["w2"][2], transposed=(ROWS, COLS)),
    }


def tier_plans(tg, places) -> dict[str, MemGraph]:
    """The device plan at its smallest budget, its host planned at the smallest host budget
    of a few tried ("streamed") and at one that keeps everything ("kept")."""
    device = memgraph.plan(tg, memgraph.min_budget(tg)[0], inputs="host")
    budget = 4096
    while True:
        try:
            streamed = place_host(device, budget, places)
            break
        except HostBudgetPlanError:
            budget *= 2
            assert budget < 1 << 20
    return {"streamed": streamed, "kept": place_host(device, "100%", places)}


def storage_of(mg: MemGraph, name: str) -> HostStorage:
    """The host storage input `name` is reloaded from."""
    (node,) = [n for n in mg.nodes if n.kind is NodeKind.INPUT and n.name == name]
    return mg.storages[node.storage]


def reads_of(mg: MemGraph, name: str) -> int:
    """How many times the plan reads input `name` from its checkpoint."""
    storage = storage_of(mg, name)
    assert storage.disk.transposed == ((ROWS, COLS) if name == "w2" else None)
    return sum(1 for n in mg.nodes if n.kind is NodeKind.READ and n.storage == storage.id)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_transposed_weight_runs_to_the_reference_streamed_and_kept(tmp_path, monkeypatch, dtype):
    """Every mode, a scratch of 3 rows (w2's 32 rows: ten blocks of 3 and one of 2)."""
    tg = program(dtype)
    values = arrays(tg)
    weights = {k: values[k] for k in ("w1", "w2")}
    plans = tier_plans(tg, checkpoint(tmp_path, weights))
    assert reads_of(plans["streamed"], "w2") > 1 and reads_of(plans["kept"], "w2") == 1
    itemsize = values["w2"].itemsize
    monkeypatch.setattr(diskio, "TRANSPOSE_SCRATCH", 3 * COLS * itemsize)
    w2 = storage_of(plans["kept"], "w2")  # the same place in both plans
    blocks = []  # the bytes of each read of w2's matrix
    real = DiskFiles.read

    def counting_read(self, index, offset, into):
        if index == 0 and w2.disk.offset <= offset < w2.disk.offset + w2.nbytes:
            blocks.append(into.nbytes)
        real(self, index, offset, into)

    monkeypatch.setattr(DiskFiles, "read", counting_read)
    expected = taskgraph.evaluate(tg, values)["y"]
    for budget, mg in plans.items():
        mg.verified()
        for mode in MODES:
            for seed in range(3 if mode == "random" else 1):
                blocks.clear()
                got = runtime.run(
                    mg, {"x": values["x"]}, backend="numpy", mode=mode, seed=seed, spill=tmp_path
                )
                np.testing.assert_array_equal(got["y"], expected, err_msg=f"{budget} {mode}")
                row = COLS * itemsize
                assert blocks.count(3 * row) == 10 * reads_of(mg, "w2")
                assert blocks.count(2 * row) == reads_of(mg, "w2")
    assert not [f for f in os.listdir(tmp_path) if f.startswith(diskio.SPILL_PREFIX)]


def test_planned_weights_gives_the_untransposed_weight(tmp_path):
    tg = program("bfloat16")
    values = arrays(tg)
    weights = {k: values[k] for k in ("w1", "w2")}
    mg = tier_plans(tg, checkpoint(tmp_path, weights))["streamed"]
    got = planned_weights(mg)
    assert set(got) == {"w1", "w2"}
    for name, array in weights.items():
        assert got[name].dtype == ml_dtypes.bfloat16 and got[name].shape == array.shape
        assert got[name].tobytes() == array.tobytes()


def test_a_transposed_weight_of_more_than_two_axes_is_reshaped(tmp_path):
    """A (2, 3, 4) weight stored as the (4, 6) transpose of its (6, 4) reshape."""
    prog = ep.Program("three_axes")
    x = prog.input("x", (5, 2))
    w = prog.input("w", (2, 3, 4), role="weight")
    prog.output(prog.einsum("bi,ijk->bjk", x, w), "y")
    tg = prog.build()
    weight = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    path = save_weights({"w": np.ascontiguousarray(weight.reshape(6, 4).T)}, tmp_path / "w.st")
    tensors, size = read_header(path)
    places = {"w": CheckpointPlace(str(path), size, tensors["w"][2], transposed=(4, 6))}
    device = memgraph.plan(tg, memgraph.min_budget(tg)[0], inputs="host")
    mg = place_host(device, "100%", places)
    np.testing.assert_array_equal(planned_weights(mg)["w"], weight)
    xs = {"x": np.linspace(-1, 1, 10, dtype=np.float32).reshape(5, 2)}
    expected = taskgraph.evaluate(tg, {**xs, "w": weight})["y"]
    for mode in MODES:
        got = runtime.run(mg, xs, backend="numpy", mode=mode)
        np.testing.assert_array_equal(got["y"], expected)


# -- plan files -----------------------------------------------------------------------------


def test_a_transposed_place_round_trips_through_a_plan_file(tmp_path):
    tg = program("float32")
    mg = tier_plans(tg, checkpoint(tmp_path, arrays(tg)))["kept"]
    text = mg.to_json()
    disks = {s["tensor"]: s["disk"] for s in json.loads(text)["storages"] if "disk" in s}
    w1, w2 = tg.inputs["w1"], tg.inputs["w2"]
    assert len(disks[w1]) == 2 and disks[w2][2] == [ROWS, COLS]
    again = MemGraph.from_json(text)
    assert again.storages == mg.storages and again.to_json() == text
    (storage,) = [s for s in again.storages.values() if s.tensor == w2]
    assert storage.disk.transposed == (ROWS, COLS) and "T(32x48)" in str(storage)


def test_an_untransposed_place_is_written_as_before(tmp_path):
    """No transposed place: every "disk" is [file, offset], as plan files were before."""
    tg = program("float32")
    places = {
        name: CheckpointPlace(place.path, place.file_nbytes, place.offset)
        for name, place in checkpoint(tmp_path, arrays(tg)).items()
    }
    mg = tier_plans(tg, places)["streamed"]
    document = json.loads(mg.to_json())
    disks = [s["disk"] for s in document["storages"] if "disk" in s]
    assert disks and all(len(d) == 2 and all(type(v) is int for v in d) for d in disks)
    for entry in document["storages"]:
        if "disk" in entry:
            storage = mg.storages[entry["id"]]
            assert entry["disk"] == [storage.disk.file, storage.disk.offset]
    assert MemGraph.from_json(mg.to_json()).to_json() == mg.to_json()


@pytest.mark.parametrize(
    "disk, message",
    [
        ([0, 8, [3]], r"disk\[2\]: expected \[rows, cols\]"),
        ([0, 8, [3, 0]], r"disk\[2\]\[1\]: expected an integer >= 1"),
        ([0, 8, "3x4"], r"disk\[2\]: expected \[rows, cols\]"),
        ([0, 8, [3, 4], 1], r"expected \[file, offset\] or \[file, offset, \[rows, cols\]\]"),
        ([0, "+", [ROWS, COLS]], r"disk\[1\]: expected an integer"),
        (None, r"transposed \(32, 47\) matrix of float32 is 6016 bytes, the storage 6144"),
    ],
)
def test_a_malformed_transposed_place_in_a_plan_file_is_refused(tmp_path, disk, message):
    tg = program("float32")
    mg = tier_plans(tg, checkpoint(tmp_path, arrays(tg)))["kept"]
    document = json.loads(mg.to_json())
    (entry,) = [s for s in document["storages"] if len(s.get("disk", ())) == 3]
    entry["disk"] = [entry["disk"][0], entry["disk"][1], [ROWS, COLS - 1]] if disk is None else disk
    with pytest.raises(SerializationError, match=message):
        MemGraph.from_json(json.dumps(document))


def test_the_place_prints_its_transpose():
    assert str(DiskPlace(0, 4096, (64, 128))) == "file#0@4096 T(64x128)"
    assert str(DiskPlace(1, 0)) == "file#1@0"
