"""Weights read where they are in safetensors files (`einpage.weight_files`) and the host
tier through `einpage.compile`: `save_weights` writes what the `safetensors` library reads
back, `weight_places` finds each input's bytes (checked against the file's raw bytes),
every malformed header is a `CheckpointError` naming the file and what is wrong, and
`compile(..., host_budget=, checkpoint=, spill=)` plans the host within the budget."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import safetensors.numpy

import einpage as ep
import memgraph
from einpage.errors import CheckpointError, HostBudgetPlanError, InputError
from einpage.models import llama
from einpage.weight_files import read_header, save_weights, weight_places


def weights_of(tg, seed=0):
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(tg[t].shape).astype(tg[t].dtype)
        for name, t in tg.inputs.items()
        if tg[t].op.role == "weight"
    }


def test_saved_weights_read_back_by_safetensors_and_found_in_place(tmp_path):
    tg = llama.prefill_program(llama.PRESETS["tiny"], 1, 8, "float32").build()
    weights = weights_of(tg)
    path = save_weights(weights, tmp_path / "model.safetensors")
    back = safetensors.numpy.load_file(path)
    assert set(back) == set(weights)
    for name, array in weights.items():
        np.testing.assert_array_equal(back[name], array)
    places = weight_places(path, tg)
    assert set(places) == set(weights)
    raw = path.read_bytes()
    for name, place in places.items():
        array = weights[name]
        assert place.file_nbytes == len(raw) == os.path.getsize(path)
        got = np.frombuffer(raw, array.dtype, array.size, place.offset).reshape(array.shape)
        np.testing.assert_array_equal(got, array)
    assert not list(tmp_path.glob("*.partial"))


def test_bfloat16_weights_are_written_and_placed(tmp_path):
    prog = ep.Program("bf")
    x = prog.input("x", (2, 4), dtype="bfloat16")
    w = prog.input("w", (4, 4), dtype="bfloat16", role="weight")
    prog.output(x @ w, "y")
    tg = prog.build()
    array = np.arange(16, dtype=np.float32).reshape(4, 4)
    import ml_dtypes

    path = save_weights({"w": array.astype(ml_dtypes.bfloat16)}, tmp_path / "w.safetensors")
    tensors, _ = read_header(path)
    assert tensors["w"][:2] == ("bfloat16", (4, 4))
    assert set(weight_places(path, tg)) == {"w"}


def _file(tmp_path, header, data=b"", length=None):
    text = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    size = len(text) if length is None else length
    path.write_bytes(size.to_bytes(8, "little") + text + data)
    return path


@pytest.mark.parametrize(
    "header, data, length, message",
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"", None, "past the end"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8, None, "span 4"),
        ({"w": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, None, "dtype"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "shape"),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, None, "offsets"),
        ({"w": [1, 2]}, b"", None, "malformed"),
        (
            {
                "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            b"\0" * 8,
            None,
            "overlap",
        ),
        ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, 10**9, "length"),
        ([1, 2], b"", None, "not a JSON object"),
    ],
)
def test_a_malformed_header_is_a_checkpoint_error(tmp_path, header, data, length, message):
    path = _file(tmp_path, header, data, length)
    with pytest.raises(CheckpointError, match=message):
        read_header(path)


def test_not_json_and_too_short_files_are_checkpoint_errors(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match="under 8 bytes"):
        read_header(path)
    path.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    with pytest.raises(CheckpointError, match="not JSON"):
        read_header(path)


def test_a_weight_of_another_shape_or_dtype_than_the_program_is_refused(tmp_path):
    tg = llama.prefill_program(llama.PRESETS["tiny"], 1, 8, "float32").build()
    weights = weights_of(tg)
    name = sorted(weights)[0]
    weights[name] = weights[name].astype(np.float16)
    path = save_weights(weights, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match=f"'{name}' is float16"):
        weight_places(path, tg)
    path = save_weights({"other": np.ones(3, np.float32)}, tmp_path / "o.safetensors")
    with pytest.raises(CheckpointError, match="holds none of the program's inputs"):
        weight_places(path, tg)


def test_compile_plans_the_host_within_its_budget(tmp_path):
    prog = llama.generation_program(llama.PRESETS["tiny"], 1, 8, 4, "float32")
    tg = prog.build()
    path = save_weights(weights_of(tg), tmp_path / "m.safetensors")
    budget = memgraph.min_budget(tg)[0]
    whole = ep.compile(prog, budget, checkpoint=path)
    assert whole.plan.tier is not None and whole.plan.info["tier"]["streamed_weights"] == 0
    small = ep.compile(prog, budget, host_budget="30%", checkpoint=path, spill=tmp_path)
    mg = small.plan
    assert mg.stats.host_peak_bytes <= mg.tier.budget < whole.plan.tier.budget
    assert mg.stats.disk_read_bytes > whole.plan.stats.disk_read_bytes
    assert small.spill == os.fspath(tmp_path)
    assert small.report is not None  # verified
    row = dict(small.rows())["host"]
    assert row.startswith(f"budget {ep.units.format_bytes(mg.tier.budget)}, peak ")
    assert "planning the host" in small.timings
    assert ep.compile(prog, budget).plan.tier is None  # no tier unless asked


def test_compile_refuses_a_spill_folder_that_is_not_one_and_a_budget_that_must_spill(tmp_path):
    prog = llama.generation_program(llama.PRESETS["tiny"], 1, 16, 6, "float32")
    tg = prog.build()
    path = save_weights(weights_of(tg), tmp_path / "m.safetensors")
    with pytest.raises(InputError, match="is not a folder"):
        ep.compile(prog, "60%", host_budget="50%", spill=tmp_path / "missing")
    with pytest.raises(HostBudgetPlanError, match="give a spill folder"):
        ep.compile(prog, memgraph.min_budget(tg)[0], host_budget="14%", checkpoint=path)


@pytest.mark.parametrize(
    "head, message",
    [([0, "0" * 64], r"head\[0\]"), ([8, "xyz"], "64 lowercase hex"), ("nope", "bytes, sha256")],
)
def test_a_malformed_head_in_a_plan_file_is_refused(tmp_path, head, message):
    from memgraph.serialize import memgraph_from_json

    tg = llama.prefill_program(llama.PRESETS["tiny"], 1, 8, "float32").build()
    path = save_weights(weights_of(tg), tmp_path / "m.safetensors")
    mg = ep.compile(tg, "60%", checkpoint=path).plan
    document = json.loads(mg.to_json())
    assert memgraph_from_json(json.dumps(document)).tier == mg.tier  # as written, it loads
    document["tier"]["files"][0]["head"] = head
    with pytest.raises(ep.errors.SerializationError, match=message):
        memgraph_from_json(json.dumps(document))
