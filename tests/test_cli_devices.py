"""The command line for several devices: `einpage plan --devices N`, and `stats` and `run`
of the multi-device plan file it writes; its errors and exit codes. Commands run in
process through `einpage.cli.main`; outputs are checked against `taskgraph.evaluate`
(`run --check`, and directly here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cli import assert_one_error, cli

import einpage as ep
import taskgraph
from einpage.cli.commands import (
    EXIT_BAD_INPUT,
    EXIT_CHECK_FAILED,
    EXIT_INFEASIBLE,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    build_parser,
)
from einpage.cli.files import load_inputs, save_arrays
from einpage.units import format_exact
from memgraph.multi import verify_multi
from memgraph.multi_serialize import FORMAT, read_multi_json

TINY_LLAMA = ["llama:tiny", "--seq", "16"]


@pytest.fixture
def two(tmp_path, capsys) -> Path:
    """The tiny LLaMA planned for 2 devices at 60% of each device's resident peak."""
    path = tmp_path / "two.json"
    code, out, err = cli(capsys, "plan", *TINY_LLAMA, "--devices", 2, "-b", "60%", "-o", path)
    assert code == EXIT_OK, err
    return path


def chain_file(tmp_path: Path, layers: int = 4) -> Path:
    """A chain x @ w0 -> tanh -> @ w1 ... as a TaskGraph JSON file (a PROGRAM)."""
    prog = ep.Program("chain")
    x = prog.input("x", (8, 32))
    for i in range(layers):
        x = ep.tanh(x @ prog.input(f"w{i}", (32, 32), role="weight"))
    prog.output(x, "y")
    path = tmp_path / "chain.json"
    path.write_text(prog.build().to_json(), encoding="utf-8")
    return path


# -- plan, stats, run --------------------------------------------------------------------


def test_plan_prints_a_row_per_device_and_the_simulated_makespan_and_writes_the_file(
    tmp_path, capsys
):
    path = tmp_path / "two.json"
    code, out, err = cli(
        capsys, "plan", *TINY_LLAMA, "--devices", 2, "-b", "60%", "--cost-model", "cpu", "-o", path
    )
    assert code == EXIT_OK, err
    assert "plan for 2 devices" in out and "pipeline on 2 devices" in out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["device", "tasks"])
    assert header.split() == ["device", "tasks", "budget", "peak", "moved", "links", "in", "links",
                              "out"]  # fmt: skip
    loaded = read_multi_json(path.read_text(encoding="utf-8"))
    mp = loaded.plan
    assert mp.devices == 2 and loaded.program is not None
    verify_multi(mp)
    lines = out.splitlines()
    start = lines.index(header)
    for plan, row in zip(mp.plans, lines[start + 1 : start + 3], strict=True):
        cells = row.split()
        assert cells[0] == str(plan.device) and cells[1] == str(len(plan.mg.taskgraph))
        links_out = sum(1 for k in mp.links if k.source == plan.device)
        assert f"{links_out} (" in row
    assert "cpu:" in out and "makespan" in out and "on 2 device(s)" in out


def test_stats_and_run_check_of_a_plan_for_two_devices(two, capsys, tmp_path):
    code, out, err = cli(capsys, "stats", two)
    assert code == EXIT_OK, err
    assert "devices=2" in out and "ok: 2 plans" in out and "acyclic" in out
    code, out, err = cli(capsys, "stats", two, "--json")
    assert code == EXIT_OK, err
    document = json.loads(out)
    assert document["devices"] == 2 and document["verified"] is True
    assert [d["device"] for d in document["per_device"]] == [0, 1]
    assert document["simulated"]["makespan_s"] > 0
    outputs = tmp_path / "out.npz"
    code, out, err = cli(capsys, "run", two, "--check", "--random-inputs", 3, "-o", outputs)
    assert code == EXIT_OK, err
    assert "runner  local" in out and "check against the reference" in out
    loaded = read_multi_json(two.read_text(encoding="utf-8"))
    from einpage.cli.presets import random_inputs

    arrays = random_inputs(loaded.program, 3)
    want = taskgraph.evaluate(loaded.program, arrays)
    got = load_inputs(outputs)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-5)


def test_run_takes_inputs_from_a_file(two, capsys, tmp_path):
    loaded = read_multi_json(two.read_text(encoding="utf-8"))
    from einpage.cli.presets import random_inputs

    arrays = random_inputs(loaded.program, 11)
    inputs = tmp_path / "in.npz"
    save_arrays(inputs, arrays)
    outputs = tmp_path / "out.npz"
    code, out, err = cli(capsys, "run", two, "--inputs", inputs, "--check", "-o", outputs)
    assert code == EXIT_OK, err
    want = taskgraph.evaluate(loaded.program, arrays)
    np.testing.assert_allclose(load_inputs(outputs)["logits"], want["logits"], rtol=1e-4, atol=1e-5)


def test_run_check_fails_when_the_outputs_differ_from_the_program(tmp_path, capsys):
    """The program in the file names as "y" an earlier tensor of the same shape: the run's
    "y" (the last tanh) then differs from it, and --check says so (exit 1)."""
    path = tmp_path / "two.json"
    code, _, err = cli(capsys, "plan", chain_file(tmp_path), "--devices", 2, "-b", "100%",
                       "-o", path)  # fmt: skip
    assert code == EXIT_OK, err
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["format"] == FORMAT
    code, _, err = cli(capsys, "run", path, "--check")
    assert code == EXIT_OK, err
    last = data["program"]["outputs"]["y"]
    data["program"]["outputs"]["y"] = last - 3  # the tanh of the layer before (x, w, @, tanh)
    path.write_text(json.dumps(data), encoding="utf-8")
    code, out, err = cli(capsys, "run", path, "--check")
    assert code == EXIT_CHECK_FAILED, (out, err)
    assert "MISMATCH" in out and "shapes differ" not in out
    assert_one_error(err, "output 'y' differs from the reference")


def test_per_device_budgets_and_an_explicit_partition(tmp_path, capsys):
    path = tmp_path / "two.json"
    code, out, err = cli(capsys, "plan", chain_file(tmp_path), "--devices", 2, "-b",
                         "9KiB,10KiB", "-o", path)  # fmt: skip
    assert code == EXIT_OK, err
    mp = read_multi_json(path.read_text(encoding="utf-8")).plan
    assert [p.budget for p in mp.plans] == [9 * 1024, 10 * 1024]
    mlp = tmp_path / "mlp.json"
    argv = ["plan", "mlp", "--batch", 256, "--devices", 2, "-b", "2MiB", "-o", mlp]
    code, _, err = cli(capsys, *argv, "--partition", "off")
    assert code == EXIT_INFEASIBLE
    assert_one_error(err, "device ", "--partition SIZE")
    code, out, err = cli(capsys, *argv, "-b", "384KiB")  # the last --budget counts
    assert code == EXIT_INFEASIBLE
    assert_one_error(err, "--partition auto split the program at a block limit of 96.0 KiB")
    assert "a block size of your own (--partition SIZE)" in err
    code, out, err = cli(capsys, *argv, "--partition", "256KiB")
    assert code == EXIT_OK, err
    assert "block limit 256.0 KiB" in out
    code, out, err = cli(capsys, "run", mlp, "--check")
    assert code == EXIT_OK, err


def test_devices_1_writes_the_plan_it_always_wrote(tmp_path, capsys):
    before, after = tmp_path / "a.json", tmp_path / "b.json"
    code, _, err = cli(capsys, "plan", *TINY_LLAMA, "-b", "60%", "-o", before)
    assert code == EXIT_OK, err
    code, _, err = cli(capsys, "plan", *TINY_LLAMA, "-b", "60%", "--devices", 1, "-o", after)
    assert code == EXIT_OK, err
    assert before.read_bytes() == after.read_bytes()
    assert json.loads(after.read_text())["format"] == "einpage.memgraph"


# -- errors ----------------------------------------------------------------------------


def test_more_devices_than_the_pipeline_can_fill(capsys):
    code, _, err = cli(capsys, "plan", *TINY_LLAMA, "--devices", 99, "-b", "60%")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "needs at least 99 layers; this program has 2", "Use at most 2")


def test_a_device_budget_too_small_names_the_device_and_its_smallest_budget(capsys):
    from einpage.cli.presets import load_program
    from memgraph import min_budget
    from memgraph.placement import place
    from runtime.workspace import declare_workspaces

    tg = declare_workspaces(load_program("llama:tiny", seq=16))
    needed = min_budget(place(tg, 2).parts[1].tg)[0]
    argv = ["--devices", 2, "-b", f"1MiB,{needed - 256}", "--partition", "off"]
    code, _, err = cli(capsys, "plan", *TINY_LLAMA, *argv)
    assert code == EXIT_INFEASIBLE
    assert_one_error(err, "device 1:", f"Give device 1 at least {format_exact(needed)}")
    assert f"hint: the smallest budget that works on device 1 is {format_exact(needed)}" in err
    assert "partition=" not in err and "taskgraph.partition_for_budget" not in err  # CLI words


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["-b", "60%,60%,60%"], ["3 budgets given for 2 devices"]),
        (["-b", "60%", "--render", "x.svg"], ["--render draws the plan of one device"]),
        (["-b", "60%", "--timeline", "x.png"], ["--timeline draws the plan of one device"]),
    ],
)
def test_bad_plan_arguments_for_several_devices(tmp_path, capsys, monkeypatch, argv, needles):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "plan", *TINY_LLAMA, "--devices", 2, *argv)
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, *needles)


def test_devices_must_be_positive(capsys):
    code, _, err = cli(capsys, "plan", *TINY_LLAMA, "--devices", 0, "-b", "60%")
    assert code == EXIT_BAD_INPUT and "--devices" in err


def test_ray_without_ray_installed_names_the_extra(two, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code, _, err = cli(capsys, "run", two)
    assert code == EXIT_OK, err  # the local runner needs no Ray
    code, _, err = cli(capsys, "run", two, "--ray")
    assert code == EXIT_UNAVAILABLE
    assert_one_error(err, "ray is not installed", "pip install 'einpage[cluster]'")


def test_run_refusals_for_a_plan_for_several_devices(two, tmp_path, capsys):
    code, _, err = cli(capsys, "run", two, "--trace", tmp_path / "t.json")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "--trace applies to a plan for one device")
    code, _, err = cli(capsys, "run", two, "--mode", "streams")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "--mode applies to a plan for one device")
    data = json.loads(two.read_text(encoding="utf-8"))
    del data["program"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data), encoding="utf-8")
    code, _, err = cli(capsys, "run", bare)
    assert code == EXIT_OK, err  # inputs drawn from the devices' graphs
    code, _, err = cli(capsys, "run", bare, "--check")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "holds no program to check against")
    code, _, err = cli(capsys, "render", two, "-o", tmp_path / "x.dot")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "a plan for several devices")


def test_ray_on_a_plan_for_one_device_is_refused(tmp_path, capsys):
    path = tmp_path / "one.json"
    code, _, err = cli(capsys, "plan", *TINY_LLAMA, "-b", "60%", "-o", path)
    assert code == EXIT_OK, err
    code, _, err = cli(capsys, "run", path, "--ray")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "--ray runs a plan for several devices")


def test_a_corrupted_or_unverifiable_multi_plan_file(two, tmp_path, capsys):
    data = json.loads(two.read_text(encoding="utf-8"))
    data["links"][0]["target"] = 7
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data), encoding="utf-8")
    for command in ("stats", "run"):
        code, _, err = cli(capsys, command, bad)
        assert code == EXIT_BAD_INPUT
        assert_one_error(err, "$.links[0].target: device 7 is not one of the plan's devices 0..1")
    truncated = tmp_path / "truncated.json"
    truncated.write_text(two.read_text(encoding="utf-8")[:5000], encoding="utf-8")
    code, _, err = cli(capsys, "stats", truncated)
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "truncated or corrupt")
    data = json.loads(two.read_text(encoding="utf-8"))
    data["links"][0]["nbytes"] += 4
    resized = tmp_path / "resized.json"
    resized.write_text(json.dumps(data), encoding="utf-8")
    for command in ("stats", "run"):
        code, _, err = cli(capsys, command, resized)
        assert code == EXIT_CHECK_FAILED, (command, err)
        assert "but the link carries" in err


@pytest.mark.xdist_group("ray")  # it starts Ray: on the Ray tests' worker (tests/multi/conftest.py)
def test_run_on_a_local_ray_instance(two, capsys):
    pytest.importorskip("ray")
    code, out, err = cli(capsys, "run", two, "--ray", "--check")
    assert code == EXIT_OK, err
    assert "runner  ray" in out and "ok" in out


def test_plan_with_strategy_auto_prints_each_strategy_s_time_and_writes_the_fastest(
    tmp_path, capsys
):
    path = tmp_path / "auto.json"
    code, out, err = cli(
        capsys, "plan", *TINY_LLAMA, "--devices", 2, "-b", "60%", "--strategy", "auto",
        "--cost-model", "cpu", "-o", path,
    )  # fmt: skip
    assert code == EXIT_OK, err
    line = next(line for line in out.splitlines() if line.split()[:1] == ["strategy"])
    assert "auto on cpu:" in line and "(chosen)" in line
    chosen = line.split("auto on cpu:")[1].split(" (chosen)")[0].split(";")[-1].split()[0]
    mp = read_multi_json(path.read_text(encoding="utf-8")).plan
    assert mp.placed.strategy == chosen
    verify_multi(mp)


def test_plan_with_strategy_tensor_writes_the_split_program_and_run_check_passes(
    tmp_path, capsys
):
    path = tmp_path / "tensor.json"
    code, out, err = cli(
        capsys, "plan", *TINY_LLAMA, "--devices", 2, "-b", "60%", "--strategy", "tensor",
        "-o", path,
    )  # fmt: skip
    assert code == EXIT_OK, err
    assert "tensor on 2 devices" in out
    loaded = read_multi_json(path.read_text(encoding="utf-8"))
    assert loaded.plan.placed.strategy == "tensor"
    assert len(loaded.program) > len(ep.models.llama.prefill_program(
        ep.models.llama.PRESETS["tiny"], 1, 16).build())  # the split program is saved
    code, out, err = cli(capsys, "run", path, "--check")
    assert code == EXIT_OK, err
    assert "ok" in out


def test_strategy_tensor_on_a_program_without_shard_facts(tmp_path, capsys):
    code, out, err = cli(
        capsys, "plan", chain_file(tmp_path), "--devices", 2, "-b", "1MiB", "--strategy", "tensor"
    )
    assert code != EXIT_OK
    assert_one_error(err, "states none; use pipeline")


# -- --sends direct ------------------------------------------------------------------------


def test_plan_sends_direct_writes_links_that_say_direct_and_run_check_passes(tmp_path, capsys):
    path = tmp_path / "direct.json"
    code, out, err = cli(
        capsys, "plan", chain_file(tmp_path), "--devices", 2, "-b", "100%", "--sends", "direct",
        "-o", path,
    )  # fmt: skip
    assert code == EXIT_OK, err
    assert "sends      direct: 1 of 1 links device to device" in out and "1 direct" in out
    data = json.loads(path.read_text(encoding="utf-8"))
    assert [k.get("path") for k in data["links"]] == ["peer"]
    loaded = read_multi_json(path.read_text(encoding="utf-8")).plan
    assert [k.path for k in loaded.links] == ["peer"] and verify_multi(loaded).links == 1
    code, out, err = cli(capsys, "run", path, "--check")
    assert code == EXIT_OK, err


def test_sends_without_devices_or_of_an_unknown_kind_is_refused(tmp_path, capsys):
    code, out, err = cli(capsys, "plan", chain_file(tmp_path), "-b", "100%", "--sends", "direct")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "--sends direct sends tensors between devices: give --devices N")
    code, out, err = cli(
        capsys, "plan", chain_file(tmp_path), "--devices", 2, "-b", "1MiB", "--sends", "nvlink"
    )
    assert code != EXIT_OK and "invalid choice: 'nvlink'" in err


def test_generate_sends_reaches_the_planning():
    """`einpage generate --devices 2 --sends direct` plans with Planning(sends="direct")."""
    from einpage.cli.generate import _planning

    parser = build_parser()
    argv = ["generate", "llama:tiny", "-b", "100%", "--devices", "2"]
    assert _planning(parser.parse_args([*argv, "--sends", "direct"]), None).sends == "direct"
    assert _planning(parser.parse_args(argv), None).sends == "host"
