"""PyTorch memory snapshots of plans: torch's own readers (`torch.cuda._memory_viz`, which
run on the CPU) take them, and the sizes they report are the plan's."""

from __future__ import annotations

import base64
import copy
import pickle
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from plans import reference_plan
from plans import two_output_mlp as mlp_graph
from strategies import einsum_programs

from einpage.errors import EinpageError
from memgraph import MemGraph, NodeKind
from memgraph.planner import min_budget, plan, streaming_minimum
from memgraph.snapshot import memory_snapshot, replay_peak, write_memory_snapshot

viz = pytest.importorskip("torch.cuda._memory_viz")


def offloading_plan() -> MemGraph:
    mg = reference_plan(mlp_graph(), offload=frozenset({3, 5}))
    assert mg.stats.offload_count and mg.stats.reload_count
    return mg


def plain(value) -> bool:
    """Whether `value` holds only dicts, lists, tuples, ints and strings (no einpage objects)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(plain(v) for v in value)
    return isinstance(value, int | str)


def lines_of(flamegraph_lines: str) -> list[tuple[str, int]]:
    """(stack, bytes) of each line `memory` / `segments` hand to flamegraph.pl."""
    rows = []
    for line in flamegraph_lines.splitlines():
        stack, size = line.rsplit(" ", 1)
        rows.append((stack, int(size)))
    return rows


def test_the_pickle_holds_plain_data_in_torchs_schema(tmp_path):
    mg = offloading_plan()
    path = write_memory_snapshot(mg, tmp_path / "snap.pickle")
    snap = pickle.loads(path.read_bytes())
    assert snap == memory_snapshot(mg) and plain(snap)
    (segment,) = snap["segments"]
    assert segment["device"] == 0 and segment["total_size"] == mg.budget
    address = segment["address"]
    for block in segment["blocks"]:  # the blocks tile the arena, in address order
        assert block["address"] == address and block["state"] in ("active_allocated", "inactive")
        address += block["size"]
    assert address == segment["address"] + mg.budget
    (trace,) = snap["device_traces"]
    assert trace[0]["action"] == "segment_alloc" and trace[0]["size"] == mg.budget
    actions = [e["action"] for e in trace[1:]]
    assert actions.count("alloc") == len(mg.of_kind(NodeKind.ALLOC))
    assert actions.count("free_requested") == actions.count("free_completed")
    assert actions.count("free_completed") == len(mg.of_kind(NodeKind.FREE))
    for entry in trace:
        assert {"action", "addr", "size", "stream", "frames"} <= set(entry)
        assert all({"filename", "line", "name"} == set(f) for f in entry["frames"])


def test_torchs_text_summaries_read_it():
    mg = offloading_plan()
    snap = memory_snapshot(mg)
    summary = viz.segsum(snap)  # asserts its own accounting adds up to the segment
    assert f"total_reserved: {viz.Bytes(mg.budget)}" in summary
    text = viz.trace(snap)
    assert text.count("cudaMalloc(") == 1
    assert len(re.findall(r"^del ", text, re.M)) == len(mg.of_kind(NodeKind.FREE))
    assert len(re.findall(r"^\w+ = seg_0\[|^\w+ = \w+\[", text, re.M)) >= len(
        mg.of_kind(NodeKind.ALLOC)
    )


def test_torchs_memory_views_report_the_plans_peak():
    mg = offloading_plan()
    peak = mg.stats.peak_bytes
    at_peak = memory_snapshot(mg, at="peak")
    rows = lines_of(viz.memory(at_peak, format_flamegraph=lambda lines: lines))
    active = sum(size for stack, size in rows if ";active_allocated;" in stack)
    assert active == peak  # requested bytes plus the alignment padding ("<gaps>")
    rows = lines_of(viz.segments(at_peak, format_flamegraph=lambda lines: lines))
    assert sum(size for _, size in rows) == mg.budget
    assert replay_peak(at_peak) == replay_peak(memory_snapshot(mg)) == peak
    # What is never freed by the end is what is resident at the end.
    end = memory_snapshot(mg)
    kept = viz.filter_alloc_free_pairs(copy.deepcopy(end))["device_traces"][0]
    resident = [e["size"] for e in kept if e["action"] == "alloc"]
    assert sum(resident) == mg.residencies.live_bytes[-1]


@pytest.mark.parametrize("plot", ["trace_plot", "segment_plot"])
def test_torchs_html_viewers_embed_it(plot):
    mg = offloading_plan()
    snap = memory_snapshot(mg)
    html = getattr(viz, plot)(snap)
    encoded = re.search(r'"base64": "([^"]+)"', html).group(1)
    assert pickle.loads(base64.b64decode(encoded)) == snap


def test_a_snapshot_can_be_taken_after_any_node():
    mg = offloading_plan()
    first_free = next(n.id for n in mg.nodes if n.kind is NodeKind.FREE)
    early = memory_snapshot(mg, at=first_free - 1)
    assert all(e["action"] in ("segment_alloc", "alloc") for e in early["device_traces"][0])
    with pytest.raises(EinpageError, match="'end', 'peak' or a node id"):
        memory_snapshot(mg, at=len(mg))


@given(tg=einsum_programs(), data=st.data())
def test_the_trace_replays_to_the_peak_of_any_plan(tg, data):
    low, _ = min_budget(tg)
    budget = data.draw(st.integers(low, max(low, streaming_minimum(tg))), label="budget")
    mg = plan(tg, budget)
    at = data.draw(st.sampled_from([None, "peak"]), label="at")
    snap = memory_snapshot(mg, at=at)
    assert replay_peak(snap) == mg.stats.peak_bytes
    summary = viz.segsum(snap)
    assert f"total_reserved: {viz.Bytes(mg.budget)}" in summary
