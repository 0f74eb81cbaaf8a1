"""The host tier from the command line: `einpage plan --host-budget --checkpoint --spill`
plans it and writes it, `einpage run PLAN --spill DIR --check` runs it with its weights
read from the checkpoint and equals the reference, and what is wrong is an error naming
it – with nothing left in the spill folder."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest
from cli_runner import cli

import memgraph
from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_OK
from einpage.models import llama
from einpage.weight_files import save_weights


@pytest.fixture
def checkpoint(tmp_path):
    """The weights of `llama:tiny`'s default prefill, by input name, in a safetensors file."""
    tg = llama.prefill_program(llama.PRESETS["tiny"], 1, 128, "float32").build()
    rng = np.random.default_rng(0)
    weights = {
        name: (0.1 * rng.standard_normal(tg[t].shape)).astype(tg[t].dtype)
        for name, t in tg.inputs.items()
        if tg[t].op.role == "weight"
    }
    return save_weights(weights, tmp_path / "tiny.safetensors")


@pytest.mark.parametrize("mode", ["sequential", "streams", "random"])
def test_plan_then_run_with_a_host_budget_equals_the_reference(capsys, tmp_path, checkpoint, mode):
    spill = tmp_path / "spill"
    spill.mkdir()
    plan = tmp_path / "plan.json"
    code, out, err = cli(
        capsys, "plan", "llama:tiny", "--budget", "20%", "--host-budget", "25%",
        "--checkpoint", checkpoint, "--spill", spill, "-o", plan,
    )  # fmt: skip
    assert code == EXIT_OK, err
    assert re.search(r"host +budget", out) and "weights streamed" in out
    assert "disk_read busy" in out  # simulated on the disk's lane too
    document = json.loads(plan.read_text())
    head = 8 + int.from_bytes(checkpoint.read_bytes()[:8], "little")
    assert document["tier"]["files"][0] == {
        "kind": "checkpoint", "nbytes": checkpoint.stat().st_size, "path": str(checkpoint),
        "head": [head, hashlib.sha256(checkpoint.read_bytes()[:head]).hexdigest()],
    }  # fmt: skip
    code, out, err = cli(capsys, "run", plan, "--check", "--spill", spill, "--mode", mode)
    assert code == EXIT_OK, err
    assert "host tier" in out and "inputs read from their checkpoint" in out
    assert " ok" in out.split("check against the reference")[1]
    assert list(spill.iterdir()) == []  # the spill file went with the run


def test_a_plan_that_spills_needs_a_spill_folder_to_plan_and_to_run(capsys, tmp_path):
    tg = llama.generation_program(llama.PRESETS["tiny"], 1, 16, 6, "float32").build()
    program = tmp_path / "generate.json"
    program.write_text(tg.to_json())
    plan = tmp_path / "plan.json"
    budget = memgraph.min_budget(tg)[0]  # KV pages and activations offloaded
    args = ["plan", program, "--budget", budget, "--host-budget", "18%", "-o", plan]
    code, out, err = cli(capsys, *args)
    assert code != EXIT_OK and "give a spill folder" in err and not plan.exists()
    code, out, err = cli(capsys, *args, "--spill", tmp_path)
    assert code == EXIT_OK, err
    assert json.loads(plan.read_text())["tier"]["files"][-1]["kind"] == "spill"
    code, out, err = cli(capsys, "run", plan)
    assert code != EXIT_OK and "spill" in err
    code, out, err = cli(capsys, "run", plan, "--spill", tmp_path / "nowhere")
    assert code != EXIT_OK and "nowhere" in err
    spill = tmp_path / "spill"
    spill.mkdir()
    code, out, err = cli(capsys, "run", plan, "--spill", spill, "--check", "--mode", "streams")
    assert code == EXIT_OK, err
    assert " ok" in out.split("check against the reference")[1]
    assert re.search(r"\d+(\.\d+)? KiB written", out) and list(spill.iterdir()) == []


def test_a_checkpoint_that_changed_is_refused_before_the_run(capsys, tmp_path, checkpoint):
    plan = tmp_path / "plan.json"
    code, _, err = cli(
        capsys, "plan", "llama:tiny", "--budget", "50%", "--checkpoint", checkpoint, "-o", plan
    )
    assert code == EXIT_OK, err
    with open(checkpoint, "ab") as f:
        f.write(b"\0" * 8)
    code, out, err = cli(capsys, "run", plan)
    assert code != EXIT_OK and str(checkpoint) in err and "but the plan was made for" in err


def test_tier_options_are_refused_with_several_devices(capsys, tmp_path):
    code, out, err = cli(
        capsys, "plan", "llama:tiny", "--budget", "50%", "--devices", "2", "--host-budget", "1GiB"
    )
    assert code == EXIT_BAD_INPUT and "--host-budget" in err and "one device" in err


def test_show_says_what_a_program_needs_in_each_tier(capsys):
    code, out, err = cli(capsys, "show", "llama:tiny", "--summary")
    assert code == EXIT_OK, err
    shapes = llama.weight_shapes(llama.PRESETS["tiny"])
    total = sum(4 * int(np.prod(s)) for s in shapes.values())
    largest = max(4 * int(np.prod(s)) for s in shapes.values())
    from einpage_core.units import format_bytes

    assert re.search(rf"host, two tiers +{re.escape(format_bytes(total))}: every weight", out)
    page = -(-largest // 4096) * 4096
    assert f"at least {format_bytes(page)}: the largest weight" in out
    assert re.search(rf"disk +{re.escape(format_bytes(total))} of weights in a checkpoint", out)


def test_a_checkpoint_rewritten_with_another_header_is_refused(capsys, tmp_path, checkpoint):
    plan = tmp_path / "plan.json"
    code, _, err = cli(
        capsys, "plan", "llama:tiny", "--budget", "50%", "--checkpoint", checkpoint, "-o", plan
    )
    assert code == EXIT_OK, err
    head = json.loads(plan.read_text())["tier"]["files"][0]["head"]
    assert head[0] == 8 + int.from_bytes(checkpoint.read_bytes()[:8], "little")
    data = bytearray(checkpoint.read_bytes())
    data[9] = ord(" ") if data[9] != ord(" ") else ord("\n")  # the header's JSON, same size
    checkpoint.write_bytes(bytes(data))
    code, out, err = cli(capsys, "run", plan)
    assert code != EXIT_OK and "not the file the plan was made for" in err
