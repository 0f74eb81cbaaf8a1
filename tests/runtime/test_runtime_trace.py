"""Timing traces: the backend-neutral Chrome trace writer, and traces of NumPy runs."""

from __future__ import annotations

import json

import pytest
from plans import reference_plan
from runtime_cases import block_program, make_inputs

import runtime
from memgraph.trace import StreamEvent
from runtime.trace import Trace


def spans(*items):
    return [StreamEvent(stream, start, end, f"n{i}", i, "apply") for i, (stream, start, end) in
            enumerate(items)]  # fmt: skip


def test_busy_and_overlap_merge_intervals():
    trace = Trace(
        spans(
            ("compute", 0.0, 1.0),
            ("compute", 0.5, 2.0),
            ("compute", 3.0, 4.0),
            ("h2d", 1.5, 3.5),
            ("d2h", 10.0, 11.0),
        )
    )
    assert trace.busy("compute") == pytest.approx(3.0)
    assert trace.overlap("compute", "h2d") == pytest.approx(1.0)
    assert trace.overlap("h2d", "compute") == pytest.approx(1.0)
    assert trace.overlap("compute", "d2h") == 0.0
    assert trace.makespan == pytest.approx(11.0)
    assert trace.streams == ("compute", "h2d", "d2h")


def test_chrome_format_has_one_track_per_stream():
    trace = Trace(
        spans(("h2d", 0.001, 0.002), ("compute", 0.0015, 0.004), ("extra", 0.0, 0.001)),
        title="t",
    )
    doc = json.loads(trace.to_json())
    events = doc["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert list(names) == ["compute", "h2d", "extra"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 3
    by_node = {e["args"]["node"]: e for e in complete}
    assert by_node[0]["tid"] == names["h2d"] and by_node[1]["tid"] == names["compute"]
    assert by_node[2]["ts"] == 0.0  # times from the first span's start, in microseconds
    assert by_node[0]["ts"] == pytest.approx(1000.0) and by_node[0]["dur"] == pytest.approx(1000.0)
    assert doc["displayTimeUnit"] == "ms" and doc["otherData"]["clock"] == "wall"


@pytest.mark.parametrize("mode", ["threaded", "sequential", "random"])
def test_numpy_runs_record_a_trace(mode, tmp_path):
    tg = block_program(layers=2)
    mg = reference_plan(tg, offload=frozenset(t.id for t in tg if t.id % 3 == 0))
    inputs = make_inputs(tg, 0)
    with runtime.Session(mg, "numpy", mode=mode, timeout=30) as session:
        session.run(inputs, trace=True)
        trace = session.last.trace
    with_work = [n for n in mg.nodes if session.schedule.stream_of[n.id] is not None]
    assert len(trace.events) == len(with_work)
    expected_streams = {"compute"} if mode == "sequential" else {"compute", "h2d", "d2h"}
    assert set(trace.streams) == expected_streams
    for event in trace.events:
        assert 0.0 <= event.start <= event.end
    assert trace.clock == "wall"
    path = tmp_path / "trace.json"
    trace.write(path)
    doc = json.loads(path.read_text())
    assert sum(1 for e in doc["traceEvents"] if e["ph"] == "X") == len(with_work)


def test_run_writes_a_trace_file(tmp_path):
    tg = block_program()
    mg = reference_plan(tg, offload=frozenset({7}))
    path = tmp_path / "run.json"
    runtime.run(mg, make_inputs(tg, 0), "numpy", mode="threaded", trace=path)
    doc = json.loads(path.read_text())
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {"compute", "h2d", "d2h"}


def test_the_backend_says_which_clock_a_trace_reads():
    from runtime.cupy_backend import CupyBackend
    from runtime.numpy_backend import NumpyBackend

    class EventClockBackend(NumpyBackend):
        clock = "cuda"

    assert NumpyBackend.clock == "wall" and CupyBackend.clock == "cuda"
    tg = block_program()
    mg = reference_plan(tg)
    with runtime.Session(mg, EventClockBackend(), mode="sequential") as session:
        session.run(make_inputs(tg, 0), trace=True)
        assert session.last.trace.clock == "cuda"
        assert session.last.trace.to_chrome()["otherData"]["clock"] == "cuda"
