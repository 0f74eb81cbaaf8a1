"""A simulated and a measured trace of one plan: the same lanes, the same event names, and
one file that holds both (to open side by side in https://ui.perfetto.dev)."""

from __future__ import annotations

import json

import pytest
from runtime_cases import block_program, make_inputs

import memgraph
import runtime
from memgraph.nodes import STREAM_OF
from memgraph.trace import (
    DISK_STREAMS,
    PEER_STREAM,
    STREAMS,
    combine_chrome_traces,
    read_chrome_trace,
)
from runtime import schedule


def test_the_lane_names_are_defined_once():
    assert schedule.STREAMS is STREAMS
    assert set(STREAM_OF.values()) - {"none"} == {*STREAMS, PEER_STREAM, *DISK_STREAMS}


@pytest.fixture(scope="module")
def traced():
    """A planner plan with reloads and offloads, simulated and run (threaded) with traces."""
    tg = block_program(layers=2)
    mg = memgraph.plan(tg, memgraph.streaming_minimum(tg) * 2 // 3)
    assert mg.stats.reload_count and mg.stats.offload_count
    simulated = memgraph.simulate(mg, "cpu", timeline=True)
    with runtime.Session(mg, "numpy", mode="streams", timeout=30) as session:
        session.run(make_inputs(tg, 0), trace=True)
        measured = session.last.trace
    return mg, simulated, measured


def test_simulated_and_measured_events_have_the_same_lanes_and_names(traced):
    mg, simulated, measured = traced
    measured_by_node = {e.node: e for e in measured.events}
    assert set(measured.streams) == set(STREAMS)
    # Every node the simulator times is in the run's trace, on the same lane, under the
    # same name and with the same arguments (the run also copies device outputs out).
    for event in simulated.events:
        twin = measured_by_node[event.node]
        assert (twin.stream, twin.label, twin.kind) == (event.stream, event.label, event.kind)
        assert twin.args == event.args
    extra = {mg[n].kind for n in set(measured_by_node) - {e.node for e in simulated.events}}
    assert extra <= {memgraph.NodeKind.OUTPUT}


def test_one_file_holds_both_traces_side_by_side(traced, tmp_path):
    _, simulated, measured = traced
    both = combine_chrome_traces(simulated.to_chrome_trace(), measured.to_chrome())
    path = tmp_path / "both.json"
    path.write_text(json.dumps(both))
    records = json.loads(path.read_text())["traceEvents"]
    processes = {r["pid"]: r["args"]["name"] for r in records if r["name"] == "process_name"}
    assert processes == {1: simulated.trace_title, 2: measured.title}
    lanes = {
        pid: {r["args"]["name"] for r in records if r["name"] == "thread_name" and r["pid"] == pid}
        for pid in processes
    }
    assert lanes[1] == lanes[2] == set(STREAMS)
    events = read_chrome_trace(path)
    assert len(events) == len(simulated.events) + len(measured.events)
    clocks = [other["clock"] for other in json.loads(path.read_text())["otherData"]["traces"]]
    assert clocks == ["simulated", "wall"]
