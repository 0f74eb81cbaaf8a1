"""Nothing half-written: every output path is checked before any work, files appear
whole or not at all, one failed picture does not stop the others, and a reader that
closes stdout early (`| head`) neither loses the files nor gets a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import cli

from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_STDOUT_CLOSED
from einpage.cli.files import atomic_output, check_output
from einpage_core.errors import InputError

SMALL_MLP = ["mlp", "--batch", "256"]


@pytest.mark.parametrize(
    "option, name, needle",
    [
        ("-o", "missing/p.json", "does not exist"),
        ("-o", "plan.txt", "unknown format 'txt'"),
        ("--memory-map", "map.dot", "plot is written as"),
        ("--render", "plan.jpeg", "graph picture is written as"),
        ("--memory-snapshot", "snap.json", "snapshot is written as"),
    ],
)
def test_bad_output_paths_are_refused_before_any_work(capsys, tmp_path, option, name, needle):
    code, out, err = cli(
        capsys, "plan", *SMALL_MLP, "--budget", "50%streaming", option, tmp_path / name
    )
    assert code == EXIT_BAD_INPUT and needle in err and option in err
    assert out == ""  # nothing was planned or printed
    assert list(tmp_path.iterdir()) == []


def test_a_folder_is_not_an_output_file(capsys, tmp_path):
    code, out, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "50%streaming", "-o", tmp_path)
    assert code == EXIT_BAD_INPUT and "is a folder; give a file name" in err and out == ""


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_that_takes_no_files_is_refused_before_any_work(capsys):
    """/proc passes `os.access(W_OK)` for root (as CI runs) yet takes no new file: the old
    check let the plan run and then failed writing it; a tried file catches it first."""
    code, out, err = cli(
        capsys, "plan", *SMALL_MLP, "--budget", "50%streaming", "-o", "/proc/p.json"
    )
    assert code == EXIT_BAD_INPUT and out == ""
    assert "-o '/proc/p.json': the folder '/proc' does not take new files" in err


def test_a_failing_picture_leaves_the_others_and_says_which(capsys, tmp_path, monkeypatch):
    import memgraph.graph

    def broken(self, path=None, **options):
        Path(path).write_text("partial")  # a writer dying halfway
        raise InputError("the memory map broke")

    monkeypatch.setattr(memgraph.graph.MemGraph, "memory_map", broken)
    plan, picture, timeline = tmp_path / "p.json", tmp_path / "map.png", tmp_path / "t.png"
    code, out, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "50%streaming", "-o", plan,
                         "--memory-map", picture, "--timeline", timeline)  # fmt: skip
    assert code == EXIT_BAD_INPUT
    assert "--memory-map" in err and "the memory map broke" in err
    assert plan.exists() and timeline.exists() and not picture.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "t.png"]  # no temp left


def test_atomic_output_replaces_whole_or_not_at_all(tmp_path):
    target = tmp_path / "a.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_output(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("died")
    assert target.read_text() == "old" and sorted(tmp_path.iterdir()) == [target]
    with atomic_output(target) as temporary:
        temporary.write_text("new")
    assert target.read_text() == "new" and sorted(tmp_path.iterdir()) == [target]
    assert check_output(target, "JSON file", "-o") == target
    (tmp_path / "d.json").mkdir()
    with pytest.raises(InputError, match="is a folder"):
        check_output(tmp_path / "d.json", "JSON file", "-o")


@pytest.mark.skipif(os.name != "posix", reason="pipes as on Unix")
def test_a_closed_stdout_still_writes_the_plan_quietly(tmp_path):
    plan = tmp_path / "p.json"
    code = (
        "import sys; from einpage.cli.commands import main; "
        f"sys.exit(main(['plan', 'mlp', '--batch', '256', '--budget', '50%', '-o', {str(plan)!r}]))"
    )
    producer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)  # fmt: skip
    producer.stdout.close()  # the reader goes away before the first line is printed
    err = producer.stderr.read().decode()
    assert producer.wait(timeout=120) == EXIT_STDOUT_CLOSED
    assert plan.exists() and plan.read_text().startswith("{")
    assert "Traceback" not in err and "Broken pipe" not in err and "BrokenPipe" not in err


@pytest.fixture
def bad_inputs(tmp_path):
    """Files `--inputs` must refuse with a typed error: (path, words of the message)."""
    import pickle

    import numpy as np

    np.save(tmp_path / "one.npy", np.zeros(3))
    np.save(tmp_path / "renamed.npy", np.zeros(3))
    (tmp_path / "renamed.npy").rename(tmp_path / "renamed.npz")
    (tmp_path / "text.npz").write_text("hello")
    with open(tmp_path / "pickled.npz", "wb") as handle:
        pickle.dump({"x": 1}, handle)
    np.savez(tmp_path / "whole.npz", x=np.zeros(64))
    data = (tmp_path / "whole.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    (tmp_path / "bad.safetensors").write_bytes(b"\x00\x01garbage")
    return [
        (tmp_path / "one.npy", [".npz or .safetensors", "np.savez"]),
        (tmp_path / "renamed.npz", ["one array"]),
        (tmp_path / "text.npz", ["cannot read arrays", ".npz or .safetensors"]),
        (tmp_path / "pickled.npz", ["cannot read arrays"]),
        (tmp_path / "cut.npz", ["cannot read arrays"]),
        (tmp_path / "bad.safetensors", [".safetensors"]),
    ]


def test_inputs_in_a_wrong_or_broken_file_are_typed_errors(bad_inputs):
    from einpage.cli.files import load_inputs

    for path, words in bad_inputs:
        with pytest.raises(InputError) as info:
            load_inputs(path)
        message = str(info.value)
        assert str(path) in message and all(w in message for w in words), message


def test_inputs_from_safetensors_are_read(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    from einpage.cli.files import load_inputs

    save_file({"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(tmp_path / "in.safetensors"))
    arrays = load_inputs(tmp_path / "in.safetensors")
    np.testing.assert_array_equal(arrays["x"], np.arange(6, dtype=np.float32).reshape(2, 3))


def test_documents_are_told_apart_by_their_parsed_top_level(tmp_path):
    """A truncated plan is not called a TaskGraph (every plan embeds one), and a
    TaskGraph without outputs is refused as the Program API refuses it."""
    import json

    import memgraph
    from einpage.cli.files import load_json_graph, load_plan
    from einpage.cli.presets import load_program
    from einpage_core.errors import SerializationError

    tg = load_program("mlp", batch=8, seq=None)
    text = memgraph.plan(tg, memgraph.streaming_minimum(tg)).to_json()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: len(text) // 2])
    with pytest.raises(SerializationError, match="truncated or corrupt") as info:
        load_plan(cut)
    assert "this is a TaskGraph" not in str(info.value)
    graph = tmp_path / "graph.json"
    graph.write_text(tg.to_json())
    with pytest.raises(SerializationError, match="this is a TaskGraph"):
        load_plan(graph)
    data = json.loads(tg.to_json())
    data["outputs"] = {}
    graph.write_text(json.dumps(data))
    with pytest.raises(SerializationError, match=r"outputs.*at least one output"):
        load_json_graph(graph)


def test_run_reports_the_time_of_each_stage(capsys, tmp_path):
    """Not one 'time' for a command that mostly loads, prepares and checks."""
    plan = tmp_path / "p.json"
    assert cli(capsys, "plan", *SMALL_MLP, "--budget", "50%streaming", "-o", plan)[0] == 0
    code, out, _ = cli(capsys, "run", plan, "--check", "--backend", "numpy")
    assert code == 0
    line = next(row for row in out.splitlines() if row.strip().startswith("time"))
    stages = ("loading the plan", "preparing inputs", "staging", "running",
              "evaluating the reference", "comparing")  # fmt: skip
    positions = [line.find(f"{stage} ") for stage in stages]
    assert -1 not in positions and positions == sorted(positions), line
    assert "of which the plan's run" in line


def test_the_check_holds_each_element_to_its_own_precision():
    """The old check (max |out - ref| / max(1, |ref|) <= 1e-4) let 2.5% through on
    probabilities near 0.004; the per-element check does not, and names the element."""
    import numpy as np

    from einpage.cli.checks import compare_outputs, raise_on_mismatch
    from einpage.cli.commands import CheckFailedError

    want = np.full((3, 4), 0.004, np.float32)
    want[0, 0] = 0.9
    got = want.copy()
    got[2, 1] *= 1.025
    (comparison,) = compare_outputs({"p": got}, {"p": want})
    assert not comparison.ok and comparison.index == (2, 1)
    assert comparison.got == pytest.approx(0.0041) and comparison.want == pytest.approx(0.004)
    with pytest.raises(CheckFailedError, match=r"worst at \[2, 1\]"):
        raise_on_mismatch([comparison])
    close = want * (1 + 1e-6)
    assert compare_outputs({"p": close}, {"p": want})[0].ok
    assert compare_outputs({"p": want.astype("float16") * 1.005}, {"p": want.astype("float16")})[
        0
    ].ok


def test_random_inputs_larger_than_memory_are_refused_with_numbers():
    from einpage.cli.presets import available_memory, load_program, random_inputs

    tg = load_program("mlp", batch=8, seq=None)
    with pytest.raises(InputError, match=r"need .* of host memory .* more than the 1\.0 KiB"):
        random_inputs(tg, available=1024)
    assert set(random_inputs(tg, available=1 << 40)) == set(tg.inputs)
    assert available_memory() is None or available_memory() > 0


def test_tables_say_the_dtype(capsys, tmp_path):
    """The presets default to float32 while README figures are float16: every table says."""
    code, out, _ = cli(capsys, "show", "mlp", "--summary", "--dtype", "float16")
    assert code == 0 and "dtypes" in out and "float16 (" in out
    code, out, _ = cli(capsys, "plan", *SMALL_MLP, "--budget", "50%streaming")
    assert code == 0 and re_search(r"program\s+'mlp': .* float32", out)
    plan = tmp_path / "p.json"
    assert (
        cli(capsys, "plan", *SMALL_MLP, "--dtype", "float16", "--budget", "1GiB", "-o", plan)[0]
        == 0
    )
    code, out, _ = cli(capsys, "stats", plan)
    assert code == 0 and "plan of 'mlp' (float16): " in out.splitlines()[0]


def re_search(pattern, text):
    import re

    return re.search(pattern, text)
