"""`einpage plan --trace --memory-snapshot` and `einpage run --trace`: the simulated and the
measured trace of one plan have the same lanes and event names; the snapshot reads in
PyTorch's memory viewer code with the plan's peak."""

from __future__ import annotations

import json
import pickle

import pytest
from cli_runner import cli

import memgraph
from einpage.cli.commands import EXIT_OK
from memgraph.snapshot import replay_peak
from memgraph.trace import STREAMS, read_chrome_trace

TINY_LLAMA = ["llama:tiny", "--seq", "64"]


def lanes(path) -> set[str]:
    records = json.loads(path.read_text())["traceEvents"]
    return {r["args"]["name"] for r in records if r["name"] == "thread_name"}


def test_plan_writes_a_simulated_trace_and_a_memory_snapshot(capsys, tmp_path):
    plan, sim, snap = tmp_path / "plan.json", tmp_path / "sim.json", tmp_path / "snap.pickle"
    argv = ["plan", *TINY_LLAMA, "--budget", "60%streaming", "-o", plan, "--trace", sim]
    code, out, err = cli(capsys, *argv, "--memory-snapshot", snap)
    assert code == EXIT_OK, err
    assert f"simulated trace (open it in https://ui.perfetto.dev): {sim}" in out
    assert f"memory snapshot (open it in https://pytorch.org/memory_viz): {snap}" in out
    mg = memgraph.MemGraph.from_json(plan.read_text())
    simulated = read_chrome_trace(sim)
    expected = memgraph.simulate(mg, "h100-pcie5", timeline=True)
    assert {e.node: (e.stream, e.label) for e in simulated} == {
        e.node: (e.stream, e.label) for e in expected.events
    }
    assert lanes(sim) == set(STREAMS)
    snapshot = pickle.loads(snap.read_bytes())
    assert replay_peak(snapshot) == mg.stats.peak_bytes
    assert snapshot["segments"][0]["total_size"] == mg.budget

    # The run's trace of the same plan: the same lane names, the same event names.
    run = tmp_path / "run.json"
    code, _, err = cli(
        capsys, "run", plan, "--backend", "numpy", "--mode", "streams", "--trace", run
    )
    assert code == EXIT_OK, err
    assert lanes(run) == lanes(sim)
    measured = {e.node: e for e in read_chrome_trace(run)}
    for event in simulated:
        assert (measured[event.node].stream, measured[event.node].label) == (
            event.stream,
            event.label,
        )


def test_the_snapshot_reads_in_torchs_memory_viz(capsys, tmp_path):
    viz = pytest.importorskip("torch.cuda._memory_viz")
    snap = tmp_path / "snap.pickle"
    code, _, err = cli(capsys, "plan", "mlp", "--budget", "50%streaming", "--memory-snapshot", snap)
    assert code == EXIT_OK, err
    snapshot = pickle.loads(snap.read_bytes())
    assert "total_reserved" in viz.segsum(snapshot)
    assert "<script" in viz.trace_plot(snapshot)
