"""`einpage generate`: plans and stats of a preset, a run printing the tokens, pictures,
and the exit codes of bad input and infeasible budgets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cli_runner import cli

from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_INFEASIBLE, EXIT_OK, main

TINY = ["generate", "llama:tiny", "--batch", "2", "--prompt-len", "9", "--new-tokens", "4"]


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_generate_prints_the_plans_and_the_simulated_tokens_per_second(capsys, way):
    code, out, err = cli(capsys, *TINY, "--budget", "100KiB", "--page-size", "4", "--way", way)
    assert code == EXIT_OK, err
    assert f"generation ({way})" in out and "tokens/s" in out
    assert "KV pages paged" in out and "weights streamed" in out
    assert ("unrolled plan" in out) == (way == "unrolled")
    assert ("decode (pages 3) plan" in out) == (way == "steps")


def test_generate_runs_and_prints_the_tokens(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    picture = tmp_path / "map.png"
    code, out, err = cli(
        capsys, *TINY, "--budget", "100KiB", "--page-size", "4", "--run", "--backend", "numpy",
        "--mode", "random", "--sample", "--top-k", "5", "--memory-map", picture,
    )  # fmt: skip
    assert code == EXIT_OK, err
    assert picture.stat().st_size > 0
    rows = out.split("tokens (prompt | new)")[1].strip().splitlines()
    assert len(rows) == 2 and all(len(row.split()) == 1 + 9 + 1 + 4 for row in rows)
    assert all(row.split()[1 + 9] == "|" for row in rows)  # where the prompt ends
    assert "sampled (temperature 1.0, top-k 5)" in out


@pytest.mark.parametrize(
    "argv, code, words",
    [
        (["--budget", "2KiB"], EXIT_INFEASIBLE, "does not fit the budget at prefill"),
        (["--budget", "1MiB", "--checkpoint", "x"], EXIT_BAD_INPUT, "not both"),
        (["--budget", "1MiB", "--prompt", "hello"], EXIT_BAD_INPUT, "needs a tokenizer"),
        (["--budget", "1MiB", "--sample", "--top-k", "999"], EXIT_BAD_INPUT, "top_k=999"),
    ],
)
def test_generate_errors(capsys, argv, code, words):
    got, _, err = cli(capsys, *TINY, *argv)
    assert got == code and err.startswith("einpage: error: ") and words in err, err


def test_no_model_at_all_asks_for_one(capsys):
    code, _, err = cli(capsys, "generate", "--budget", "1GiB")
    assert code == EXIT_BAD_INPUT and "not both" not in err, err
    assert "give the model: a MODEL preset" in err and "--checkpoint DIR" in err


def test_an_unknown_model_lists_the_presets(capsys):
    code, _, err = cli(capsys, "generate", "llama:huge", "--budget", "1GiB")
    assert code == EXIT_BAD_INPUT and "llama:tiny" in err


def test_generate_checks_its_output_paths_before_planning(capsys, tmp_path, monkeypatch):
    import einpage.cli.generate as cli_generate

    def never(*args, **kwargs):
        raise AssertionError("planned before the output paths were checked")

    monkeypatch.setattr(cli_generate, "generate", never)
    for option, path, words in [
        ("--render", tmp_path / "no" / "plan.svg", "does not exist"),
        ("--memory-map", tmp_path / "map.gif", "gif"),
        ("-o", tmp_path / "no" / "plan.json", "does not exist"),
        ("-o", tmp_path / "plan.txt", "txt"),
    ]:
        code, _, err = cli(capsys, *TINY, "--budget", "100KiB", option, path)
        assert code == EXIT_BAD_INPUT and option in err and words in err, err
        assert not path.exists()


def test_a_failed_picture_leaves_no_file_and_the_other_is_written(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import memgraph

    def broken(self, path, **options):
        Path(path).write_text("half a picture")
        raise memgraph.plots.RenderError("the renderer broke")

    monkeypatch.setattr(memgraph.MemGraph, "render", broken)
    svg, png = tmp_path / "plan.svg", tmp_path / "map.png"
    argv = [*TINY, "--budget", "100KiB", "--render", svg, "--memory-map", png]
    code, out, err = cli(capsys, *argv)
    assert code == EXIT_BAD_INPUT and "the renderer broke" in err and "--render" in err, err
    assert not svg.exists() and list(tmp_path.iterdir()) == [png]  # no temporary left
    assert png.stat().st_size > 0 and f"wrote memory map: {png}" in out


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_generate_says_how_a_percentage_was_read_in_every_table(capsys, way):
    code, out, err = cli(capsys, *TINY, "--budget", "50%", "--page-size", "4", "--way", way)
    assert code == EXIT_OK, err
    budgets = [line.split(None, 1)[1] for line in out.splitlines() if "budget" in line]
    assert len(budgets) == (2 if way == "unrolled" else 3), out  # the generation, each plan
    assert all(b.startswith("50% of the resident peak (the ") for b in budgets), budgets


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_an_infeasible_budget_is_printed_whole(capsys, way):
    """`einpage plan` prints the planner's message whole; so does generate (it used to be
    cut in its middle: the plan and step it names made one line too long)."""
    code, _, err = cli(capsys, *TINY, "--budget", "0", "--page-size", "4", "--way", way)
    assert code == EXIT_INFEASIBLE and " … " not in err, err
    lines = err.splitlines()
    assert lines[0].startswith("einpage: error: the ") and lines[0].endswith(":")
    assert lines[1].startswith("  budget '0' = 0 B is below the smallest budget that compiles")
    assert lines[1].endswith("can work.") and lines[2].startswith("einpage: hint: ")


@pytest.mark.parametrize(
    "flags, how",
    [
        (["--top-k", "5"], "sampled (temperature 1.0, top-k 5)"),
        (["--temperature", "0.5"], "sampled (temperature 0.5, top-k None)"),
        (["--sample"], "sampled (temperature 1.0, top-k None)"),
        ([], "greedy"),
    ],
)
def test_temperature_and_top_k_imply_sampling(capsys, flags, how):
    code, out, err = cli(capsys, *TINY, "--budget", "100%", "--page-size", "4", *flags)
    assert code == EXIT_OK and f"new tokens, {how}, KV pages" in out, err


def test_the_sampling_options_say_what_they_do(capsys):
    assert main(["generate", "--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())
    assert "--temperature T sample from softmax(logits / T)" in text
    assert text.count("implies --sample") == 2


def test_a_checkpoint_that_is_not_there_is_named(capsys, tmp_path):
    missing = tmp_path / "nonexist_dir"
    code, _, err = cli(capsys, "generate", "--checkpoint", missing, "--budget", "1GiB")
    assert code == EXIT_BAD_INPUT and f"the checkpoint '{missing}' does not exist" in err, err
    assert "huggingface-cli download" in err and "save_pretrained" in err
    code, _, err = cli(capsys, "generate", "--checkpoint", tmp_path, "--budget", "1GiB")
    assert code == EXIT_BAD_INPUT and f"no config.json in the folder '{tmp_path}'" in err, err


def test_a_hub_id_is_not_downloaded_and_the_message_says_how_to_get_it(capsys):
    hub = "meta-llama/Llama-2-7b-hf"
    code, _, err = cli(capsys, "generate", "--checkpoint", hub, "--budget", "1GiB")
    assert code == EXIT_BAD_INPUT and f"no folder '{hub}'" in err, err
    assert "does not download" in err and f"huggingface-cli download {hub} --local-dir" in err


def test_a_run_that_needs_more_host_memory_than_there_is_is_refused_first(capsys, monkeypatch):
    """Checked before any weight is drawn (a 7B preset's were drawn for minutes and the
    kernel killed the run), with the numbers; at exactly what it needs it runs."""
    import einpage.cli.generate as cli_generate
    import einpage.workloads.generate as generate_module

    argv = [*TINY, "--budget", "100KiB", "--page-size", "4", "--run", "--backend", "numpy"]
    needs = []
    check = generate_module.check_run_memory
    monkeypatch.setattr(cli_generate, "check_run_memory", lambda *a: needs.append(check(*a)))
    assert cli(capsys, *argv)[0] == EXIT_OK
    monkeypatch.setattr(cli_generate, "check_run_memory", check)

    def never(*args):
        raise AssertionError("weights drawn before the host memory was checked")

    monkeypatch.setattr(generate_module, "available_memory", lambda: needs[0] - 1)
    drawn = cli_generate.random_weights
    monkeypatch.setattr(cli_generate, "random_weights", never)
    code, _, err = cli(capsys, *argv)
    assert code == EXIT_BAD_INPUT and "needs about" in err and f"({needs[0]} B)" in err, err
    assert f"({needs[0] - 1} B) is available" in err and "the weights in float32, drawn" in err
    monkeypatch.setattr(generate_module, "available_memory", lambda: needs[0])
    monkeypatch.setattr(cli_generate, "random_weights", drawn)
    assert cli(capsys, *argv)[0] == EXIT_OK


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_random_weights_are_drawn_in_float32_at_most(dtype):
    """At most one weight's float32 draw besides the weights (float64 draws of every
    weight made a 7B preset's run need 24 GB more than its weights)."""
    import tracemalloc

    from einpage.cli.generate import random_weights
    from einpage.models import llama
    from einpage.workloads.generate import weight_bytes

    cfg = llama.PRESETS["tiny"]
    largest = max(np.prod(s) for s in cfg.weight_shapes().values())
    tracemalloc.start()
    try:
        weights = random_weights(cfg, dtype, seed=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert {w.dtype.name for w in weights.values()} == {dtype}
    assert peak <= weight_bytes(cfg, dtype) + 4 * largest + 16 * 1024


def test_the_unrolled_plan_written_by_o_runs_and_reads_back(capsys, tmp_path):
    path = tmp_path / "gen.json"
    code, out, err = cli(capsys, *TINY, "--budget", "60%", "--page-size", "4", "-o", path)
    assert code == EXIT_OK and f"wrote unrolled plan: {path}" in out, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen.json"]
    code, out, err = cli(
        capsys, "run", path, "--random-inputs", "1", "--backend", "numpy", "--check"
    )
    assert code == EXIT_OK and "ids" in out, err
    assert cli(capsys, "stats", path)[0] == EXIT_OK


def test_step_plans_written_by_o_are_one_file_each(capsys, tmp_path):
    path = tmp_path / "gen.json"
    argv = [*TINY, "--budget", "60%", "--page-size", "4", "--way", "steps", "--chunk-steps", "2"]
    code, out, err = cli(capsys, *argv, "-o", path)
    assert code == EXIT_OK, err
    names = ["gen.decode-pages3-steps2.json", "gen.decode-pages3.json", "gen.prefill.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    assert f"wrote decode (pages 3, steps 2) plan: {tmp_path / names[0]}" in out
    for name in names:
        code, out, err = cli(capsys, "run", tmp_path / name, "--random-inputs", "2", "--check")
        assert code == EXIT_OK, err


def test_a_run_prints_its_measured_time_beside_the_simulated_one(capsys):
    for way in ("unrolled", "steps"):
        argv = [*TINY, "--budget", "60%", "--page-size", "4", "--run", "--backend", "numpy"]
        code, out, err = cli(capsys, *argv, "--way", way)
        assert code == EXIT_OK, err
        run = out.split("\nrun\n")[1].split("\n\n")[0]
        measured = [line for line in run.splitlines() if line.split()[0] == "measured"]
        simulated = [line for line in run.splitlines() if "simulated (h100-pcie5)" in line]
        assert len(measured) == 1 and " ms, " in measured[0] and "tokens/s" in measured[0]
        assert len(simulated) == 1 and "tokens/s" in simulated[0]


def test_a_negative_seed_is_refused_by_name(capsys):
    """It reached NumPy, whose ValueError came out as a traceback."""
    code, _, err = cli(capsys, *TINY, "--budget", "100%", "--seed", "-1")
    assert code == EXIT_BAD_INPUT and "--seed" in err and "an integer >= 0, got -1" in err, err


@pytest.mark.parametrize("way", ["unrolled", "steps"])
def test_the_cost_model_is_the_one_the_plans_are_made_for(capsys, tmp_path, way):
    """--cost-model is 'prefetching and tokens/s': it used to reach the tokens/s only."""
    from memgraph import MemGraph

    path = tmp_path / "gen.json"
    argv = [*TINY, "--budget", "60%", "--page-size", "4", "--way", way, "--cost-model", "cpu"]
    code, out, err = cli(capsys, *argv, "-o", path)
    assert code == EXIT_OK and "simulated (cpu)" in out, err
    files = sorted(tmp_path.iterdir())
    assert len(files) == (1 if way == "unrolled" else 2)  # prefill, decode (pages 3)
    for file in files:
        assert MemGraph.from_json(file.read_text()).info["cost_model"] == "cpu", file
