"""Stream timelines: StreamEvents, Chrome traces in and out, lanes and files."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.image  # noqa: E402
import pytest  # noqa: E402

from einpage.errors import TraceError  # noqa: E402
from memgraph.plots import stream_timeline  # noqa: E402
from memgraph.trace import StreamEvent, read_chrome_trace, to_chrome_trace  # noqa: E402

# What a runtime's profiler might write: numeric tids named by metadata, microseconds,
# an absolute clock, other phases mixed in, CUDA-style stream names.
CHROME_TRACE = {
    "traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Compute"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "HtoD"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "DtoH"}},
        {"ph": "X", "name": "reload %1", "pid": 1, "tid": 8, "ts": 1e9, "dur": 400},
        {"ph": "X", "name": "apply %3", "pid": 1, "tid": 7, "ts": 1e9 + 400, "dur": 1000},
        {"ph": "X", "name": "reload %4", "pid": 1, "tid": 8, "ts": 1e9 + 500, "dur": 300},
        {"ph": "X", "name": "apply %5", "pid": 1, "tid": 7, "ts": 1e9 + 1400, "dur": 800},
        {
            "ph": "X",
            "name": "offload %3",
            "pid": 1,
            "tid": 9,
            "ts": 1e9 + 1400,
            "dur": 600,
            "args": {"node": 12},
        },
        {"ph": "i", "name": "marker", "pid": 1, "tid": 7, "ts": 1e9 + 10},
        {"ph": "X", "name": "memset", "pid": 1, "tid": "misc", "ts": 1e9 + 100, "dur": 50},
    ]
}


def test_read_chrome_trace_names_lanes_and_converts_units(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(CHROME_TRACE))
    events = read_chrome_trace(path)
    assert len(events) == 6
    assert [e.stream for e in events] == ["h2d", "compute", "h2d", "compute", "d2h", "misc"]
    first = events[0]
    assert first.label == "reload %1"
    assert first.start == pytest.approx(1e3) and first.duration == pytest.approx(400e-6)
    assert events[4].node == 12 and events[0].node is None
    assert read_chrome_trace(CHROME_TRACE["traceEvents"]) == events


def test_chrome_trace_round_trip():
    events = [
        StreamEvent("compute", 0.0, 1e-3, "apply %3", 7),
        StreamEvent("h2d", 0.0, 5e-4, "reload %1", 4),
        StreamEvent("d2h", 1e-3, 1.5e-3, "offload %3"),
    ]
    trace = to_chrome_trace(events)
    records = trace["traceEvents"]
    threads = [r for r in records if r["name"] == "thread_name"]
    assert len(threads) == 3
    assert all(isinstance(r["tid"], int) for r in records if "tid" in r)  # numeric threads
    names = {r["tid"]: r["args"]["name"] for r in threads}
    assert names == {1: "compute", 2: "h2d", 3: "d2h"}
    again = read_chrome_trace(json.loads(json.dumps(trace)))
    key = lambda e: (e.stream, e.label, e.node)  # noqa: E731
    assert sorted(map(key, again), key=str) == sorted(map(key, events), key=str)
    by_label = {e.label: e for e in again}
    for b in events:
        a = by_label[b.label]
        assert a.start == pytest.approx(b.start) and a.end == pytest.approx(b.end)


def test_bad_trace_is_a_trace_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(TraceError, match="not a JSON trace"):
        read_chrome_trace(path)
    with pytest.raises(TraceError, match="numeric 'ts' and 'dur'"):
        read_chrome_trace([{"ph": "X", "name": "x", "tid": 1}])


def test_stream_timeline_from_a_trace_file(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(CHROME_TRACE))
    out = tmp_path / "streams.png"
    fig = stream_timeline(trace, out, figsize=(10, 3))
    ax = fig.axes[0]
    lanes = {c.get_gid(): len(c.get_paths()) for c in ax.collections}
    assert lanes == {"stream:compute": 2, "stream:h2d": 2, "stream:d2h": 1, "stream:misc": 1}
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "compute",
        "H2D (reload)",
        "D2H (offload)",
        "misc",
    ]
    assert ax.get_xlabel() == "time (ms)"
    assert "makespan 2.2 ms" in ax.get_title() and "compute busy 1.8 ms (82%)" in ax.get_title()
    assert matplotlib.image.imread(out).shape[:2] == (300, 1000)


def test_stream_timeline_from_tuples_and_events(tmp_path):
    events = [("compute", 0.0, 2.0, "a"), ("HtoD", 0.5, 1.0, "b"), ("compute", 1.5, 3.0, "c")]
    fig = stream_timeline(events, tmp_path / "t.svg")
    ax = fig.axes[0]
    assert {c.get_gid() for c in ax.collections} == {"stream:compute", "stream:h2d"}
    assert "compute busy 3 s (100%)" in ax.get_title()  # overlaps counted once
    assert (tmp_path / "t.svg").stat().st_size > 0
    same = stream_timeline(iter([StreamEvent("compute", 0.0, 2.0, "a")]))
    assert same.axes[0].get_xlabel() == "time (s)"
    records = stream_timeline(CHROME_TRACE["traceEvents"])
    assert len(records.axes[0].collections) == 4
