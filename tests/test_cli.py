"""The `einpage` command line: every subcommand, its output, its files and its exit codes.

Commands run in-process through `einpage.cli.main` (the `einpage` console script of a
shared virtual environment may point at another checkout); one test runs
`python -m einpage.cli` as a subprocess.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from cli_runner import cli

import einpage as ep
import memgraph
import runtime
import taskgraph
from einpage.cli.checks import compare_outputs
from einpage.cli.commands import (
    EXIT_BAD_INPUT,
    EXIT_CHECK_FAILED,
    EXIT_INFEASIBLE,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    Console,
    main,
)
from einpage.cli.files import load_inputs, save_arrays
from einpage.cli.presets import load_program, random_inputs
from einpage.units import format_bytes, format_exact
from runtime.session import Session
from taskgraph.dot import find_dot

ROOT = Path(__file__).resolve().parents[1]
needs_dot = pytest.mark.skipif(find_dot() is None, reason="Graphviz's dot is not installed")

SMALL_MLP = ["mlp", "--batch", "256"]  # 2.2 MiB streaming minimum: plans and runs in ms
TINY_LLAMA = ["llama:tiny", "--seq", "64"]


def assert_one_error(err: str, *needles: str) -> None:
    """stderr holds an `einpage: error:` line with `needles` and no traceback."""
    assert "Traceback" not in err
    assert err.startswith("einpage: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture
def plan_file(tmp_path, capsys) -> Path:
    """A plan of the tiny LLaMA at 60% of its streaming minimum (it offloads)."""
    path = tmp_path / "plan.json"
    code, _, err = cli(capsys, "plan", *TINY_LLAMA, "--budget", "60%streaming", "-o", path)
    assert code == EXIT_OK, err
    return path


# -- usage ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, code",
    [
        ([], EXIT_BAD_INPUT),
        (["frobnicate"], EXIT_BAD_INPUT),
        (["plan", "mlp"], EXIT_BAD_INPUT),  # --budget is required
        (["plan", "mlp", "--budget", "1GiB", "--order", "random"], EXIT_BAD_INPUT),
        (["plan", "mlp", "--budget", "1GiB", "--eviction", "fifo"], EXIT_BAD_INPUT),
        (["plan", "mlp", "--budget", "1GiB", "--batch", "0"], EXIT_BAD_INPUT),
        (["run", "p.json", "--inputs", "a.npz", "--random-inputs", "1"], EXIT_BAD_INPUT),
        (["--help"], EXIT_OK),
        (["plan", "--help"], EXIT_OK),
        (["--version"], EXIT_OK),
    ],
)
def test_usage_exit_codes(capsys, argv, code):
    assert main(argv) == code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    if code == EXIT_BAD_INPUT:
        assert "usage: einpage" in captured.err


def test_help_documents_programs_budgets_and_exit_codes(capsys):
    main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("preset", "Python", "executed", "50%", "8GiB", "--partition", "auto|off|SIZE"):
        assert needle in text
    main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "2 bad input, 3 infeasible budget" in text


def test_module_entry_point_runs_as_a_subprocess():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "einpage.cli", "presets"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "llama:7b" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "einpage.cli", "plan", "mlp", "--budget", "lots"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert bad.returncode == EXIT_BAD_INPUT
    assert_one_error(bad.stderr, "'lots'")


def test_console_script_points_at_main():
    scripts = [e for e in metadata.entry_points(group="console_scripts") if e.name == "einpage"]
    if not scripts:
        pytest.skip("einpage is not installed in this environment")
    assert scripts[0].value == "einpage.cli:main"


# -- presets and show ------------------------------------------------------------------------


def test_presets_lists_every_model_size(capsys):
    from einpage.models import gpt2, llama

    code, out, _ = cli(capsys, "presets")
    assert code == EXIT_OK
    for size in llama.PRESETS:
        assert f"llama:{size}" in out
    for size in gpt2.PRESETS:
        assert f"gpt2:{size}" in out
    assert re.search(r"^\s+mlp\s+the demo MLP", out, re.M)


def test_show_prints_the_listing_and_memory_needs(capsys):
    code, out, _ = cli(capsys, "show", *TINY_LLAMA)
    assert code == EXIT_OK
    tg = load_program("llama:tiny", seq=64)
    assert out.startswith(str(tg).splitlines()[0])
    assert str(tg[5].line()) in out
    resident = format_bytes(memgraph.resident_peak(tg))
    assert f"resident peak      {resident} (all weights stay; = 100%)" in out
    streaming = format_bytes(memgraph.streaming_minimum(tg))
    assert f"streaming minimum  {streaming} (weights streamed; = 100%streaming)" in out
    needed, task = memgraph.min_budget(tg)
    assert f"{format_bytes(needed)} (task %{task}" in out


def test_show_summary_json_and_picture(capsys, tmp_path):
    graph, picture = tmp_path / "graph.json", tmp_path / "graph.dot"
    code, out, _ = cli(capsys, "show", *SMALL_MLP, "--summary", "-o", graph, "--render", picture)
    assert code == EXIT_OK
    assert "%0 :" not in out  # no listing
    loaded = taskgraph.TaskGraph.from_json(graph.read_text())
    assert loaded.to_json() == load_program("mlp", batch=256).to_json()
    assert picture.read_text().startswith("digraph")
    # a saved TaskGraph is itself a PROGRAM
    code, out, _ = cli(capsys, "plan", graph, "--budget", "75%streaming")
    assert code == EXIT_OK
    assert "offloads" in out


def test_show_partitioned(capsys):
    code, out, _ = cli(capsys, "show", *SMALL_MLP, "--summary", "--partition", "256KiB")
    assert code == EXIT_OK
    tasks = int(re.search(r"tasks\s+(\d+)", out).group(1))
    assert tasks > len(load_program("mlp", batch=256))


# -- plan -----------------------------------------------------------------------------------


def test_plan_prints_stats_simulation_and_writes_a_valid_plan(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "75%streaming", "-o", path)
    assert code == EXIT_OK, err
    mg = memgraph.MemGraph.from_json(path.read_text())
    memgraph.verify(mg)
    s = mg.stats
    assert s.offload_count > 0 and s.reload_count > 0
    expected = ep.compile(load_program("mlp", batch=256), "75%streaming").plan
    assert mg.to_json() == expected.to_json()  # plans are deterministic
    for label, value in s.rows():
        assert re.search(rf"{re.escape(label)}\s+{re.escape(value)}", out), label
    sim = memgraph.simulate(mg)
    assert f"makespan              {sim.makespan * 1e3:.3f} ms" in out
    assert mg.info["budget_request"] == "75%streaming"
    assert f"wrote plan: {path}" in out


def test_plan_prints_the_budget_reference_points_and_100_percent_moves_nothing(capsys):
    code, out, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "100%")
    assert code == EXIT_OK, err
    tg = load_program("mlp", batch=256)
    refs = memgraph.budget_references(tg)
    assert "budget reference points" in out
    for label, value in refs.rows():
        assert re.search(rf"{re.escape(label)}\s+{re.escape(value)}", out), label
    assert f"100% of the resident peak {format_bytes(refs.resident_peak)}" in out
    assert re.search(r"offloaded\s+0 B in 0", out) and re.search(r"dropped.*\s+0 B in 0", out)
    weights = sum(t.nbytes for t in tg if t.op.kind == "input" and t.op.location == "host")
    assert re.search(rf"reloaded\s+{re.escape(format_bytes(weights))} in", out)  # each once
    code, _, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "50%peak")
    assert code == 2 and "'50%resident'" in err and "'50%streaming'" in err


def test_plan_options_reach_the_planner(capsys, tmp_path):
    path = tmp_path / "plan.json"
    argv = ["--order", "memory", "--eviction", "lru", "--cost-model", "cpu"]
    code, out, _ = cli(capsys, "plan", *SMALL_MLP, "--budget", "80%streaming", *argv, "-o", path)
    assert code == EXIT_OK
    info = memgraph.MemGraph.from_json(path.read_text()).info
    assert (info["order"], info["eviction"], info["cost_model"]) == ("memory", "lru", "cpu")
    assert "simulated on cpu" in out


def test_plan_partitions_automatically_when_the_budget_needs_it(capsys, tmp_path):
    path = tmp_path / "plan.json"
    tg = load_program("mlp", batch=256)
    budget = ep.compile(tg, "40%streaming").budget.nbytes
    assert budget < memgraph.min_budget(tg)[0]
    code, out, _ = cli(capsys, "plan", *SMALL_MLP, "--budget", "40%streaming", "-o", path)
    assert code == EXIT_OK
    mg = memgraph.MemGraph.from_json(path.read_text())
    assert len(mg.taskgraph) > len(tg)
    assert mg.stats.block_limit == mg.info["block_limit"]
    assert f"partition  {len(tg)} -> {len(mg.taskgraph)} tasks" in out


def test_plan_with_an_explicit_block_size(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, _, _ = cli(
        capsys, "plan", *SMALL_MLP, "--budget", "100%streaming", "--partition", "128KiB", "-o", path
    )
    assert code == EXIT_OK
    assert memgraph.MemGraph.from_json(path.read_text()).info["block_limit"] == 128 * 1024


def test_zero_zero_percent_and_a_hundred_bytes_are_one_error_with_one_minimum(capsys):
    """The issue: 0 and 100 B named two different minimums and 0% another exit code."""
    hints = set()
    for budget in ("0", "0%", "100B"):
        code, _, err = cli(capsys, "plan", "mlp", "--budget", budget)
        assert code == EXIT_INFEASIBLE, (budget, err)
        hints.add(err.splitlines()[-1])
    assert len(hints) == 1 and "the smallest budget that works is" in hints.pop()


@pytest.mark.parametrize(
    "budget, needle",
    [("8XB", "'8XB'"), ("lots", "'lots'"), ("50 %%", "50 %%"), ("=-1GiB", "-1GiB"),
     ("=-5%", "-5%")],
)  # fmt: skip
def test_plan_rejects_malformed_budgets(capsys, budget, needle):
    code, _, err = cli(
        capsys, "plan", *SMALL_MLP, f"--budget{budget if budget[0] == '=' else '=' + budget}"
    )
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, needle)
    assert "einpage: hint: sizes look like 8GiB" in err


def test_plan_rejects_a_bad_partition_value(capsys):
    code, _, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "1GiB", "--partition", "sometimes")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "--partition must be auto, off or a block size")


def test_infeasible_budget_exits_3_with_the_smallest_that_works(capsys):
    tg = load_program("mlp", batch=256)
    needed, task = memgraph.min_budget(tg)
    code, _, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "256KiB", "--partition", "off")
    assert code == EXIT_INFEASIBLE
    assert_one_error(err, "below the smallest feasible budget", f"task %{task}")
    assert f"hint: the smallest budget that works is {format_exact(needed)}" in err
    assert "--partition auto" in err
    code, out, _ = cli(capsys, "plan", *SMALL_MLP, "--budget", str(needed), "--partition", "off")
    assert code == EXIT_OK
    printed = format_exact(needed).split(" (")[0].replace(" ", "")  # 2.3MiB, rounded up
    assert cli(capsys, "plan", *SMALL_MLP, "--budget", printed, "--partition", "off")[0] == 0


def read_output_program(path: Path, batch: int) -> Path:
    """A TaskGraph file: probs = softmax(x @ w) ([batch, 256]) and its row maxima, both
    outputs. The blocks of probs are read by the maxima too, so once split, probs cannot be
    assembled on the host: a Concat must hold its blocks and all of it on the device."""
    prog = ep.Program("read-output")
    x = prog.input("x", (batch, 256))
    w = prog.input("w", (256, 256), role="weight")
    probs = ep.softmax(x @ w)
    prog.output(probs, "probs")
    prog.output(probs.max(axis=-1), "top")
    path.write_text(prog.build().to_json())
    return path


def test_infeasible_even_when_partitioned_exits_3(capsys, tmp_path):
    program = read_output_program(tmp_path / "read.json", batch=256)  # probs: 256 KiB
    code, _, err = cli(capsys, "plan", program, "--budget", "256KiB")
    assert code == EXIT_INFEASIBLE
    assert_one_error(err, "below the smallest feasible budget", "logits are the last position's")
    assert "hint: the smallest budget that works is 512.0 KiB" in err
    code, _, _ = cli(capsys, "plan", program, "--budget", "512KiB")
    assert code == EXIT_OK


def test_a_split_output_nothing_else_reads_is_assembled_on_the_host(capsys):
    # probs (256 KiB) is split; its blocks go straight to its host array
    code, out, _ = cli(capsys, "plan", *SMALL_MLP, "--budget", "256KiB")
    assert code == EXIT_OK
    assert "outputs probs assembled on the host from" in out


def test_auto_partition_refuses_to_make_millions_of_blocks(capsys):
    code, _, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "1KiB")
    assert code == EXIT_INFEASIBLE
    assert_one_error(err, "blocks of at most 1.0 KiB", "--partition auto stops at 100,000")
    needed = re.search(r"above it that compiles is [0-9.]+ \w+ \(([0-9]+) B\)", err).group(1)
    assert "hint" not in err
    assert int(needed) > 1024


def test_the_block_cap_is_an_option(capsys):
    """`--max-blocks` sets the cap the refusal names: lower, a budget that plans under the
    default cap is refused with the smallest budget under the new one (which plans);
    higher, the refused budget plans."""
    code, out, _ = cli(capsys, "plan", *SMALL_MLP, "--budget", "1MiB")
    assert code == EXIT_OK
    tasks = int(re.search(r"partition +\d+ -> (\d+) tasks", out).group(1))
    code, _, err = cli(
        capsys, "plan", *SMALL_MLP, "--budget", "1MiB", "--max-blocks", str(tasks // 4)
    )
    assert code == EXIT_INFEASIBLE
    assert_one_error(err, f"stops at {tasks // 4:,}", "raise the cap (--max-blocks)")
    needed = re.search(r"above it that compiles is [0-9.]+ \w+ \(([0-9]+) B\)", err).group(1)
    code, out, _ = cli(
        capsys, "plan", *SMALL_MLP, "--budget", needed, "--max-blocks", str(tasks // 4)
    )
    assert code == EXIT_OK, needed
    assert int(needed) > 1024 * 1024
    planned = int(re.search(r"nodes, (\d+) tasks", out).group(1))
    assert planned <= 2 * (tasks // 4)  # materializing stops past twice the cap
    for cap in (str(tasks), "none"):
        assert cli(capsys, "plan", *SMALL_MLP, "--budget", "1MiB", "--max-blocks", cap)[0] == 0
    code, _, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "1KiB", "--max-blocks", "0")
    assert code == EXIT_BAD_INPUT and "expected a count >= 1 or 'none', got '0'" in err


def test_long_error_lines_lose_their_middle(capsys, tmp_path):
    # the split output is rebuilt by a concat of many blocks: its message lists them all
    program = read_output_program(tmp_path / "read.json", batch=4096)
    code, _, err = cli(capsys, "plan", program, "--budget", "1MiB")
    assert code == EXIT_INFEASIBLE
    first = err.splitlines()[0]
    assert len(first) <= 620 and " … " in first


@needs_dot
def test_plan_pictures(capsys, tmp_path):
    svg, png, streams = tmp_path / "plan.svg", tmp_path / "map.png", tmp_path / "streams.png"
    code, out, _ = cli(
        capsys,
        "plan",
        *SMALL_MLP,
        "--budget",
        "75%streaming",
        "--render",
        svg,
        "--memory-map",
        png,
        "--timeline",
        streams,
        "--max-nodes",
        "3",
    )
    assert code == EXIT_OK
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
    text = svg.read_text()
    assert "more node(s) not shown" in text and "layers folded into one box each" in text
    for path in (png, streams):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(path) in out


def test_quiet_prints_nothing_but_still_writes(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "75%streaming", "-o", path, "-q")
    assert (code, out, err) == (EXIT_OK, "", "")
    assert path.exists()


def test_writing_to_a_missing_directory_is_bad_input(capsys, tmp_path):
    code, _, err = cli(
        capsys, "plan", *SMALL_MLP, "--budget", "75%streaming", "-o", tmp_path / "no" / "plan.json"
    )
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "No such file or directory", "plan.json")


# -- stats ----------------------------------------------------------------------------------


def test_stats_table_and_json(capsys, plan_file):
    mg = memgraph.MemGraph.from_json(plan_file.read_text())
    code, out, _ = cli(capsys, "stats", plan_file)
    assert code == EXIT_OK
    for label, value in mg.stats.rows():
        assert re.search(rf"{re.escape(label)}\s+{re.escape(value)}", out), label
    report = memgraph.verify(mg)
    assert f"verify  ok: {report.nodes} nodes, {report.dependencies_checked} dependencies" in out
    assert "simulated on h100-pcie5" in out

    code, out, _ = cli(capsys, "stats", plan_file, "--json", "--cost-model", "cpu")
    document = json.loads(out)
    assert document["stats"] == mg.stats.as_dict()
    assert document["verified"] is True
    sim = memgraph.simulate(mg, "cpu")
    assert document["simulated"]["makespan_s"] == pytest.approx(sim.makespan)


def test_stats_of_a_plan_that_fails_verification_exits_1(capsys, plan_file, tmp_path):
    data = json.loads(plan_file.read_text())
    apply = next(n for n in data["nodes"] if n["kind"] == "apply" and n["deps"])
    apply["deps"] = []  # the apply no longer waits for its operands
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    code, out, err = cli(capsys, "stats", broken)
    assert code == EXIT_CHECK_FAILED
    assert "memory" in out  # the numbers are still shown
    assert_one_error(err, f"n{apply['id']}")
    assert "hint: the plan breaks an invariant" in err
    code, _, err = cli(capsys, "run", broken)
    assert code == EXIT_CHECK_FAILED
    assert_one_error(err, "refusing to run a plan that fails verification")


@pytest.mark.parametrize(
    "content, needle",
    [
        ("nonsense{", "not valid JSON"),
        ('{"format": "einpage.memgraph", "version": 1, "budget": 5}', "$.alignment"),
        ('{"format": "something"}', "$.format"),
        ("[1, 2]", "$: expected an object"),
    ],
)
def test_stats_rejects_corrupted_plans(capsys, tmp_path, content, needle):
    path = tmp_path / "plan.json"
    path.write_text(content)
    code, _, err = cli(capsys, "stats", path)
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, str(path), needle)


def test_truncated_plan_is_bad_input(capsys, plan_file):
    text = plan_file.read_text()
    plan_file.write_text(text[: len(text) // 2])
    for command in ("stats", "run", "render"):
        extra = ["-o", str(plan_file.with_suffix(".svg"))] if command == "render" else []
        code, _, err = cli(capsys, command, plan_file, *extra)
        assert code == EXIT_BAD_INPUT, command
        assert_one_error(err, "not valid JSON")


def test_stats_of_missing_files_and_directories(capsys, tmp_path):
    code, _, err = cli(capsys, "stats", tmp_path / "nope.json")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "no such file", "nope.json")
    code, _, err = cli(capsys, "stats", tmp_path)
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "is a directory")


def test_stats_of_a_taskgraph_says_to_plan_it(capsys, tmp_path):
    path = tmp_path / "graph.json"
    path.write_text(load_program(*TINY_LLAMA[:1], seq=16).to_json())
    code, _, err = cli(capsys, "stats", path)
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "this is a TaskGraph", "einpage plan")


# -- run ------------------------------------------------------------------------------------


def test_run_checks_against_the_reference_and_writes_outputs(capsys, plan_file, tmp_path):
    outputs, trace = tmp_path / "out.npz", tmp_path / "trace.json"
    code, out, err = cli(
        capsys, "run", plan_file, "--check", "--backend", "numpy", "-o", outputs, "--trace", trace
    )
    assert code == EXIT_OK, err
    # the check's row (per element: worst element and its share of the tolerance)
    assert re.search(
        r"logits\s+float32\[1,64,256\]\s+(worst at \[.*\]: \S+ vs \S+|equal)"
        r" \(\S+ of the tolerance\)\s+ok",
        out,
    )
    mg = memgraph.MemGraph.from_json(plan_file.read_text())
    reference = taskgraph.evaluate(mg.taskgraph, random_inputs(mg.taskgraph, 0))
    written = load_inputs(outputs)
    assert set(written) == {"logits"}
    np.testing.assert_allclose(written["logits"], reference["logits"], rtol=1e-4, atol=1e-5)
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "apply" for e in events)


def test_run_with_an_inputs_file_and_seeds(capsys, plan_file, tmp_path):
    mg = memgraph.MemGraph.from_json(plan_file.read_text())
    arrays = random_inputs(mg.taskgraph, 7)
    inputs, a, b = tmp_path / "in.npz", tmp_path / "a.npz", tmp_path / "b.npz"
    save_arrays(inputs, arrays)
    assert cli(capsys, "run", plan_file, "--inputs", inputs, "-o", a)[0] == EXIT_OK
    assert cli(capsys, "run", plan_file, "--random-inputs", "7", "-o", b)[0] == EXIT_OK
    code, out, _ = cli(capsys, "run", plan_file, "--random-inputs", "8", "-o", b.with_name("c.npz"))
    assert code == EXIT_OK and "random (seed 8)" in out
    np.testing.assert_array_equal(load_inputs(a)["logits"], load_inputs(b)["logits"])
    assert not np.array_equal(load_inputs(a)["logits"], load_inputs(b.with_name("c.npz"))["logits"])
    reference = taskgraph.evaluate(mg.taskgraph, arrays)["logits"]
    np.testing.assert_allclose(load_inputs(a)["logits"], reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("how", ["--sync", "EINPAGE_SYNC=1"])
def test_run_sync_names_the_failing_node_by_its_line(capsys, plan_file, how, monkeypatch):
    """`einpage run --sync` (or EINPAGE_SYNC=1) runs in the session's debug mode: it
    synchronizes after each node and the error names the node that failed, its line."""
    import runtime.numpy_backend as numpy_backend

    mg = memgraph.MemGraph.from_json(plan_file.read_text())
    failing = mg.of_kind(memgraph.NodeKind.APPLY)[2]
    real = numpy_backend.evaluate_task

    def broken(task, operands, out):
        if task.id == failing.tensor:
            raise ValueError("exploded")
        return real(task, operands, out=out)

    monkeypatch.setattr(numpy_backend, "evaluate_task", broken)
    made = []
    monkeypatch.setattr(runtime, "Session", lambda *a, **k: made.append(k) or Session(*a, **k))
    argv = ["run", plan_file, "--backend", "numpy", "--mode", "streams"]
    if how == "--sync":
        argv.append("--sync")
    else:
        monkeypatch.setenv("EINPAGE_SYNC", "1")
    code, _, err = cli(capsys, *argv)
    assert code != EXIT_OK
    assert_one_error(err, f"{failing.line()} failed on stream 'compute': ValueError: exploded")
    assert made[0]["debug"] is (True if how == "--sync" else None)  # None: the variable


def test_run_rejects_inputs_that_do_not_fit(capsys, plan_file, tmp_path):
    mg = memgraph.MemGraph.from_json(plan_file.read_text())
    arrays = random_inputs(mg.taskgraph, 0)
    arrays["tokens"] = arrays["tokens"][:, :4]
    wrong = tmp_path / "wrong.npz"
    save_arrays(wrong, arrays)
    code, _, err = cli(capsys, "run", plan_file, "--inputs", wrong, "--check")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "input 'tokens': expected shape (1, 64)")

    del arrays["tokens"]
    save_arrays(wrong, arrays)
    code, _, err = cli(capsys, "run", plan_file, "--inputs", wrong)
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "missing input(s): 'tokens'")

    not_npz = tmp_path / "inputs.npz"
    not_npz.write_text("hello")
    code, _, err = cli(capsys, "run", plan_file, "--inputs", not_npz)
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "cannot read arrays")
    code, _, err = cli(capsys, "run", plan_file, "--inputs", tmp_path / "missing.npz")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "no such inputs file")


def test_a_failed_check_exits_1(capsys, plan_file, monkeypatch):
    """A runtime bug (simulated: every output off by 0.5) fails --check with exit code 1."""

    class Broken(runtime.Session):
        def run(self, *args, **kwargs):
            return {name: value + 0.5 for name, value in super().run(*args, **kwargs).items()}

    monkeypatch.setattr(runtime, "Session", Broken)
    code, out, err = cli(capsys, "run", plan_file, "--check")
    assert code == EXIT_CHECK_FAILED
    assert "MISMATCH" in out
    assert_one_error(err, "check failed: output 'logits' differs from the reference")
    code, _, _ = cli(capsys, "run", plan_file)  # without --check nothing is compared
    assert code == EXIT_OK


@pytest.mark.skipif(runtime.cupy_usable(), reason="CuPy and a GPU are usable here")
def test_run_on_cupy_without_a_gpu_exits_4(capsys, plan_file):
    """Without CuPy the error says how to install it; with CuPy (the test extras bring
    it for the NVRTC tier) but no GPU, it says that no GPU is usable."""
    code, _, err = cli(capsys, "run", plan_file, "--backend", "cupy")
    assert code == EXIT_UNAVAILABLE
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert_one_error(err, "pip install")
    else:
        assert_one_error(err, "no CUDA GPU is usable here")


# -- render ---------------------------------------------------------------------------------


@needs_dot
def test_render_plans_and_graphs(capsys, plan_file, tmp_path):
    svg = tmp_path / "plan.svg"
    code, out, _ = cli(capsys, "render", plan_file, "-o", svg, "--collapse", "--scope", "layers.1")
    assert code == EXIT_OK and f"wrote picture: {svg}" in out
    text = svg.read_text()
    assert "<svg" in text and "layers.1" in text and "layers.0.attn" not in text

    graph = tmp_path / "graph.json"
    graph.write_text(load_program("llama:tiny", seq=16).to_json())
    code, _, _ = cli(capsys, "render", graph, "-o", tmp_path / "graph.svg", "--max-nodes", "10")
    assert code == EXIT_OK
    assert "more task(s) not shown" in (tmp_path / "graph.svg").read_text()


def test_render_to_dot_text_needs_no_graphviz(capsys, plan_file, tmp_path):
    code, _, _ = cli(capsys, "render", plan_file, "-o", tmp_path / "plan.dot", "--max-nodes", "0")
    assert code == EXIT_OK
    assert (tmp_path / "plan.dot").read_text().startswith("digraph")


def test_render_folds_the_layers_of_a_whole_plan_unless_unfolded(capsys, plan_file, tmp_path):
    folded, unfolded = tmp_path / "folded.dot", tmp_path / "unfolded.dot"
    assert cli(capsys, "render", plan_file, "-o", folded, "--max-nodes", "0")[0] == EXIT_OK
    text = folded.read_text()
    assert ">layers.0<" in text and ">layers.1<" in text  # each layer one box, titled
    assert "layers folded into one box each" in text
    argv = ["render", plan_file, "-o", unfolded, "--max-nodes", "0", "--unfold"]
    assert cli(capsys, *argv)[0] == EXIT_OK
    assert "box3d" not in unfolded.read_text() and len(unfolded.read_text()) > len(text)
    graph = tmp_path / "graph.json"
    graph.write_text(load_program("llama:tiny", seq=16).to_json())
    code, _, err = cli(capsys, "render", graph, "-o", tmp_path / "g.dot", "--unfold")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "--unfold applies to plans")


def test_render_errors(capsys, plan_file, tmp_path):
    code, _, err = cli(capsys, "render", plan_file, "-o", tmp_path / "plan.gif")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "unknown format 'gif'")
    graph = tmp_path / "graph.json"
    graph.write_text(load_program("llama:tiny", seq=16).to_json())
    code, _, err = cli(capsys, "render", graph, "-o", tmp_path / "g.svg", "--collapse")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "--collapse applies to plans")


def test_render_without_graphviz_exits_4_and_keeps_the_dot_source(capsys, plan_file, monkeypatch):
    import einpage_core.dot

    monkeypatch.setattr(einpage_core.dot, "find_dot", lambda: None)
    svg = plan_file.with_name("plan.svg")
    code, _, err = cli(capsys, "render", plan_file, "-o", svg)
    assert code == EXIT_UNAVAILABLE
    assert_one_error(err, "Graphviz's `dot` program is not on PATH", "apt-get install graphviz")
    assert plan_file.with_name("plan.dot").read_text().startswith("digraph")
    assert not svg.exists()


# -- the demo -------------------------------------------------------------------------------


def _number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match, pattern
    return int(match.group(1))


def test_demo_plans_offloads_runs_checks_and_draws(capsys, tmp_path):
    code, out, err = cli(capsys, "demo", "--out", tmp_path, "--backend", "numpy")
    assert code == EXIT_OK, err
    # the numbers are the plan's: recompute it independently
    mg = ep.compile(load_program("mlp"), "50%").plan
    s = mg.stats
    assert _number(r"offloads\s+(\d+) \(", out) == s.offload_count > 0
    assert _number(r"reloads\s+(\d+) \(", out) == s.reload_count > 0
    assert f"{len(mg)} nodes" in out
    assert re.search(
        r"probs\s+float32\[4096,256\]\s+(worst at \[.*\]: \S+ vs \S+|equal)"
        r" \(\S+ of the tolerance\)\s+ok",
        out,
    )
    assert "simulated on h100-pcie5" in out and "stall from transfers" in out
    pictures = re.findall(rf"({re.escape(str(tmp_path))}\S+)", out)
    assert {Path(p).name for p in pictures} >= {"memory_map.png", "streams.png"}
    for picture in pictures:
        assert Path(picture).stat().st_size > 1000, picture
    if find_dot() is not None:
        assert {Path(p).name for p in pictures} >= {"plan.svg", "plan_layers.0.svg"}


def test_demo_numbers_follow_the_budget(capsys, tmp_path):
    code, out, _ = cli(
        capsys, "demo", "--out", tmp_path, "--budget", "80%streaming", "--backend", "numpy"
    )
    assert code == EXIT_OK
    mg = ep.compile(load_program("mlp"), "80%streaming").plan
    assert "partition" not in out.split("run\n")[0].split("plan\n")[1]  # it fits unsplit
    assert _number(r"offloads\s+(\d+) \(", out) == mg.stats.offload_count


def test_demo_fails_its_check_when_the_runtime_is_wrong(capsys, tmp_path, monkeypatch):
    class Broken(runtime.Session):
        def run(self, *args, **kwargs):
            return {name: value * 2 for name, value in super().run(*args, **kwargs).items()}

    monkeypatch.setattr(runtime, "Session", Broken)
    code, out, err = cli(capsys, "demo", "--out", tmp_path, "--backend", "numpy")
    assert code == EXIT_CHECK_FAILED
    assert "MISMATCH" in out
    assert_one_error(err, "check failed")


# -- building blocks ------------------------------------------------------------------------


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_terminals_and_never_when_quiet():
    assert not Console(out=io.StringIO(), err=io.StringIO()).progress
    assert not Console(out=io.StringIO(), err=_TTY()).progress  # stdout piped
    assert Console(out=_TTY(), err=_TTY()).progress
    assert not Console(quiet=True, out=_TTY(), err=_TTY()).progress
    err = _TTY()
    console = Console(out=_TTY(), err=err)
    with console.stages(2):
        with console.stage("planning"):
            pass
        with console.stage("verifying"):
            pass
    assert "planning" in err.getvalue() and "stages" in err.getvalue()
    assert set(console.timings) == {"planning", "verifying"}


def test_compare_outputs_tolerances_nans_and_shapes():
    ref = {"y": np.array([1.0, np.nan, -4.0], "float32")}
    # a reference that is not finite vouches for nothing, even for the same NaN
    same_nan = compare_outputs({"y": np.array([1.0, np.nan, -4.0001], "float32")}, ref)[0]
    assert not same_nan.ok and not same_nan.reference_finite
    finite = {"y": np.array([1.0, 2.0, -4.0], "float32")}
    assert compare_outputs({"y": np.array([1.0, 2.0, -4.0001], "float32")}, finite)[0].ok
    assert not compare_outputs({"y": np.array([1.0, 0.0, -4.0], "float32")}, ref)[0].ok
    assert not compare_outputs({"y": np.zeros(2, "float32")}, ref)[0].ok
    ints = {"i": np.array([1, 2])}
    assert compare_outputs({"i": np.array([1, 2])}, ints)[0].ok
    assert not compare_outputs({"i": np.array([1, 3])}, ints)[0].ok
    half = {"h": np.array([100.0], "float16")}
    assert compare_outputs({"h": np.array([100.5], "float16")}, half)[0].ok


def test_show_rejects_a_bad_block_size(capsys):
    code, _, err = cli(capsys, "show", *SMALL_MLP, "--partition", "auto")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "--partition must be a block size such as 64MiB, got 'auto'")


# -- the front door (issue 21) ----------------------------------------------------------------

PYTHON_SPELLINGS = re.compile(
    r"\b[a-z_]+=(?:'|\)|None|True|SIZE|\.\.\.)|einpage\.compile\(|taskgraph\.partition"
)
"""How the library's advice names Python keywords and calls (`max_blocks=`,
`partition='auto'`, `backend='numpy'`, `taskgraph.partition_for_budget(...)`): never on
the terminal."""


def test_a_negative_budget_is_refused_for_its_sign(capsys):
    code, _, err = cli(capsys, "plan", *SMALL_MLP, "--budget=-5GiB")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "budget '-5GiB' is negative", "such as '5GiB'")
    assert "a number and a unit" not in err


def test_errors_name_the_command_line_flags_not_python_keywords(capsys):
    """The library's messages keep their Python advice (`max_blocks=`, `partition='auto'`,
    ...); the CLI words it as its own flags."""
    code, _, err = cli(capsys, "plan", *SMALL_MLP, "--budget", "256KiB", "--partition", "off")
    assert code == EXIT_INFEASIBLE
    assert_one_error(err, "--partition auto (the default) does it when needed", "--partition SIZE")
    assert not PYTHON_SPELLINGS.search(err), err
    code, _, err = cli(capsys, "plan", "mlp", "--batch", "64", "--budget", "16KiB",
                       "--max-blocks", "500")  # fmt: skip
    assert code == EXIT_INFEASIBLE
    assert_one_error(err, "--partition auto stops at 500", "raise the cap (--max-blocks)")
    assert "split explicitly with a block limit (--partition SIZE)" in err
    assert not PYTHON_SPELLINGS.search(err), err
    with pytest.raises(ep.TooManyBlocksError, match=r"max_blocks=\)"):  # Python keeps its own
        ep.compile(load_program("mlp", batch=64), "16KiB", max_blocks=500)


@pytest.mark.skipif(runtime.cupy_usable(), reason="CuPy and a GPU are usable here")
def test_a_backend_that_cannot_run_names_the_backend_flag(capsys, plan_file):
    code, _, err = cli(capsys, "run", plan_file, "--backend", "cupy")
    assert code == EXIT_UNAVAILABLE
    assert_one_error(err, "--backend numpy")
    assert not PYTHON_SPELLINGS.search(err), err


def test_every_python_spelling_the_cli_rewords_is_a_library_message(monkeypatch):
    """Each phrase of `CLI_SPELLINGS` occurs in a library message (so a reworded message
    shows here, not as Python advice on a terminal), and its CLI wording has none."""
    import subprocess as subprocess_module
    import types

    import einpage.pipeline.search as pipeline
    import einpage_core.dot as dot
    from einpage.cli.commands import CLI_SPELLINGS, cli_words
    from memgraph.budgets import WAY_OUT
    from runtime.cupy_backend import _unsupported_dtypes, import_cupy

    def too_slow(*args, **kwargs):
        raise subprocess_module.TimeoutExpired("dot", 1)

    def no_devices():  # CuPy installed, no GPU
        return types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 0))

    monkeypatch.setattr(dot, "find_dot", lambda: "dot")
    monkeypatch.setattr(dot.subprocess, "run", too_slow)
    monkeypatch.setattr(pipeline, "MAX_AUTO_BLOCKS", 500)  # the search without a cap
    tg = load_program("mlp", batch=64)
    calls = [
        lambda: dot._run_dot("digraph {}", "svg", 1.0),
        lambda: ep.compile(tg, "16KiB", max_blocks=500),
        lambda: ep.compile(tg, 0, max_blocks=None),
        lambda: ep.compile(read_output_program_graph(256), "256KiB"),
        lambda: ep.compile_devices(tg, "256KiB", 2),  # a device's budget, after "auto" split
        import_cupy,  # with CuPy missing, then without a GPU
        import_cupy,
    ]
    lost = runtime.session._context_lost("CUDA error 700", "surfaced at n3", ())
    messages = [WAY_OUT, _unsupported_dtypes("2.0.2")["bfloat16"], str(lost)]  # CuPy 14, old NumPy
    for k, call in enumerate(calls):
        if call is import_cupy:
            fake = (
                None if k == calls.index(import_cupy) else types.SimpleNamespace(cuda=no_devices())
            )
            monkeypatch.setitem(sys.modules, "cupy", fake)
        with pytest.raises(ep.EinpageError) as caught:
            call()
        messages.append(str(caught.value))
    for python, words in CLI_SPELLINGS:
        assert any(python in message for message in messages), python
        assert not PYTHON_SPELLINGS.search(words), words
    for message in messages:
        assert not PYTHON_SPELLINGS.search(cli_words(message)), cli_words(message)


def read_output_program_graph(batch: int) -> taskgraph.TaskGraph:
    """`read_output_program`'s TaskGraph, in memory."""
    prog = ep.Program("read-output")
    x = prog.input("x", (batch, 256))
    w = prog.input("w", (256, 256), role="weight")
    probs = ep.softmax(x @ w)
    prog.output(probs, "probs")
    prog.output(probs.max(axis=-1), "top")
    return prog.build()


def test_generate_without_a_model_says_to_give_one(capsys):
    code, _, err = cli(capsys, "generate", "--budget", "1MiB")
    assert code == EXIT_BAD_INPUT
    assert_one_error(err, "give the model: a MODEL preset", "--checkpoint DIR", "or --gguf FILE")
    assert "not both" not in err


def test_python_dash_m_einpage_runs_the_command_line():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "einpage", "presets"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "llama:7b" in done.stdout


def test_help_explains_budgets_and_shows_defaults(capsys):
    assert main(["--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("1073741824 bytes", "8GiB, 512MiB", "KiB, MiB, GiB, TiB are powers of 1024",
                   "50% a percentage of the program's resident peak", "100% moves nothing",
                   "150%streaming a percentage of the program's streaming minimum",
                   "weights loaded just in time", "2 bad input, 3 infeasible budget"):  # fmt: skip
        assert needle in text, needle
    assert main(["plan", "--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("task order (default: program)", "victim choice (default: belady)",
                   "most nodes drawn (0: all) (default: 400)", "150%streaming a percentage",
                   "what the simulator times (default: h100-pcie5)"):  # fmt: skip
        assert needle in text, needle
    for command in ("stats", "generate"):  # every --cost-model says what it is
        assert main([command, "--help"]) == EXIT_OK
        text = " ".join(capsys.readouterr().out.split())
        assert re.search(r"--cost-model \{[a-z0-9,-]+\} the machine's cost model", text), text


def test_render_says_how_many_nodes_it_draws_and_how_to_draw_fewer(capsys, plan_file, tmp_path):
    """`einpage render --unfold` of a 7B plan drew 400 of its nodes and said nothing."""
    nodes = len(memgraph.MemGraph.from_json(plan_file.read_text()))
    argv = ["render", plan_file, "-o", tmp_path / "p.dot", "--unfold"]
    code, out, _ = cli(capsys, *argv, "--max-nodes", "100")
    assert code == EXIT_OK
    assert f"drew 100 of the plan's {nodes:,} nodes; {nodes - 100:,} more are left out" in out
    assert "--max-nodes N draws N (0: all)" in out and "--scope layers.3 draws one layer" in out
    assert f"{nodes - 100} more node(s) not shown" in (tmp_path / "p.dot").read_text()
    code, out, _ = cli(capsys, *argv)  # the default cap, 400
    assert code == EXIT_OK and f"drew {min(nodes, 400)} of the plan's {nodes:,} nodes" in out
    argv = ["render", plan_file, "-o", tmp_path / "p.dot", "--scope", "layers.1"]
    code, out, _ = cli(capsys, *argv, "--max-nodes", "0")
    assert code == EXIT_OK and "left out" not in out
    drawn = int(re.search(r"drew (\d+) of the plan's", out).group(1))
    assert 0 < drawn < nodes and "(scope 'layers.1')" in out
    graph = tmp_path / "graph.json"
    graph.write_text(load_program("llama:tiny", seq=16).to_json())
    code, out, _ = cli(capsys, "render", graph, "-o", tmp_path / "g.dot", "--max-nodes", "10")
    assert code == EXIT_OK
    assert re.search(r"drew 10 of the graph's \d+ tasks; \d+ more are left out", out), out
