"""The simulator: known makespans of hand-made plans, invariants on random plans."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from plans import reference_plan
from strategies import einsum_cases

import einpage as ep
from einpage.errors import EinpageError, GraphError
from memgraph import MemGraph, MemGraphBuilder, NodeKind, Region, verify
from memgraph.cost import PRESETS, CostModel
from memgraph.simulate import SimResult, resolve_cost_model, simulate
from memgraph.trace import STREAMS, event_name, read_chrome_trace

KIB = 1024
# One task of 256 FLOPs takes 1 s; 1 KiB crosses the link in 1 s unless said otherwise.
RATES = {"flops_per_s": 256.0, "h2d_bytes_per_s": 1024.0, "d2h_bytes_per_s": 1024.0}


def fill_and_weight():
    """%0 = fill (1 KiB, 256 FLOPs), %1 = host weight (1 KiB), %2 = %0 * %1 (256 FLOPs)."""
    prog = ep.Program("fw")
    f = prog.fill((256,), 1.0)
    w = prog.input("w", (256,), role="weight")
    prog.output(f * w, "y")
    prog.output(f, "f")
    tg = prog.build()
    assert [t.kind for t in tg] == ["fill", "input", "einsum"]
    return tg


def reload_plan(reload_after_fill: bool) -> MemGraph:
    """fill, reload the weight (concurrently, or after the fill), multiply."""
    tg = fill_and_weight()
    b = MemGraphBuilder(tg, budget=3 * KIB)
    f_region, w_region, y_region = (Region(k * KIB, KIB) for k in range(3))
    host = b.input("w", 1, storage=0)
    f_alloc = b.alloc(0, f_region)
    fill = b.apply(0, [], f_region, deps=[f_alloc])
    w_alloc = b.alloc(1, w_region, deps=[fill] if reload_after_fill else [])
    reload = b.reload(1, 0, w_region, deps=[w_alloc, host])
    y_alloc = b.alloc(2, y_region)
    y = b.apply(2, [f_region, w_region], y_region, deps=[y_alloc, fill, reload])
    b.output("y", 2, region=y_region, deps=[y])
    b.output("f", 0, region=f_region, deps=[fill])
    mg = b.build()
    verify(mg)
    return mg


def test_compute_only_chain_takes_the_sum_of_its_task_times():
    prog = ep.Program("chain")
    x = prog.fill((64, 64), 0.5)
    for _ in range(5):
        x = ep.exp(x @ x)
    prog.output(x, "y")
    tg = prog.build()
    mg = reference_plan(tg)
    model = PRESETS["h100-pcie5"]
    expected = sum(model.task_seconds(tg, n.tensor) for n in mg.of_kind(NodeKind.APPLY))
    result = simulate(mg, model)
    assert result.makespan == pytest.approx(expected, rel=1e-12)
    assert result.compute_seconds == pytest.approx(expected, rel=1e-12)
    assert result.stall_seconds == pytest.approx(0.0, abs=1e-15)
    assert result.busy["h2d"] == result.busy["d2h"] == 0.0
    assert result.compute_utilization == pytest.approx(1.0)


def test_a_reload_hidden_behind_an_apply_adds_no_stall():
    result = simulate(reload_plan(False), **{**RATES, "h2d_bytes_per_s": 2048.0})
    assert result.compute_seconds == 2.0  # fill 1 s, multiply 1 s
    assert result.busy["h2d"] == 0.5  # the reload runs during the fill
    assert result.makespan == 2.0
    assert result.stall_seconds == 0.0


@pytest.mark.parametrize("h2d_rate, stall", [(512.0, 1.0), (256.0, 3.0), (1024.0, 0.0)])
def test_a_reload_the_next_apply_waits_for_stalls_by_the_uncovered_time(h2d_rate, stall):
    result = simulate(reload_plan(False), **{**RATES, "h2d_bytes_per_s": h2d_rate})
    transfer = KIB / h2d_rate
    assert result.busy["h2d"] == transfer
    assert result.stall_seconds == pytest.approx(max(0.0, transfer - 1.0)) == stall
    assert result.makespan == pytest.approx(2.0 + stall)


def test_a_reload_issued_after_the_fill_is_not_hidden():
    result = simulate(reload_plan(True), **RATES)
    assert result.makespan == 3.0  # fill, then the reload, then the multiply
    assert result.stall_seconds == 1.0


def concurrent_copies_plan() -> MemGraph:
    """After the fill, its offload (d2h) and the weight's reload (h2d) run side by side."""
    tg = fill_and_weight()
    b = MemGraphBuilder(tg, budget=3 * KIB)
    f_region, w_region, y_region = (Region(k * KIB, KIB) for k in range(3))
    host = b.input("w", 1, storage=0)
    f_alloc = b.alloc(0, f_region)
    fill = b.apply(0, [], f_region, deps=[f_alloc])
    offload = b.offload(0, f_region, 1, deps=[fill])
    w_alloc = b.alloc(1, w_region)
    reload = b.reload(1, 0, w_region, deps=[w_alloc, host, fill])
    y_alloc = b.alloc(2, y_region)
    y = b.apply(2, [f_region, w_region], y_region, deps=[y_alloc, fill, reload])
    b.free(0, f_region, deps=[f_alloc, fill, offload, y])
    b.output("f", 0, storage=1, deps=[offload])
    b.output("y", 2, region=y_region, deps=[y])
    mg = b.build()
    verify(mg)
    return mg


def test_d2h_and_h2d_run_concurrently():
    result = simulate(concurrent_copies_plan(), **RATES, timeline=True)
    assert result.busy == {"compute": 2.0, "h2d": 1.0, "d2h": 1.0}
    assert result.makespan == 3.0  # 1 + max(1, 1) + 1, not 1 + 1 + 1 + 1
    copies = {e.stream: (e.start, e.end) for e in result.events if e.stream != "compute"}
    assert copies == {"h2d": (1.0, 2.0), "d2h": (1.0, 2.0)}
    assert result.bytes_moved == {"compute": 0, "h2d": KIB, "d2h": KIB}


def test_streams_run_their_nodes_in_insertion_order():
    """Two reloads on one stream: the second waits for the first even though it is ready."""
    prog = ep.Program()
    w1 = prog.input("w1", (256,), role="weight")
    w2 = prog.input("w2", (256,), role="weight")
    prog.output(w1 + w2, "y")
    tg = prog.build()
    b = MemGraphBuilder(tg, budget=3 * KIB)
    regions = [Region(k * KIB, KIB) for k in range(3)]
    writers = []
    for t in (0, 1):
        host = b.input(f"w{t + 1}", t, storage=t)
        alloc = b.alloc(t, regions[t])
        writers.append(b.reload(t, t, regions[t], deps=[alloc, host]))
    y_alloc = b.alloc(2, regions[2])
    y = b.apply(2, regions[:2], regions[2], deps=[y_alloc, *writers])
    b.output("y", 2, region=regions[2], deps=[y])
    mg = b.build()
    verify(mg)
    result = simulate(mg, **RATES, timeline=True)
    assert [(e.start, e.end) for e in result.events] == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    assert result.makespan == 3.0


def test_device_inputs_are_copies_and_host_inputs_are_free():
    prog = ep.Program()
    x = prog.input("x", (256,))  # on the device: an h2d copy
    w = prog.input("w", (256,), role="weight")  # on the host: no time
    prog.output(x, "x_out")
    prog.output(w, "w_out")
    b = MemGraphBuilder(prog.build(), budget=KIB)
    alloc = b.alloc(0, Region(0, KIB))
    x_in = b.input("x", 0, region=Region(0, KIB), deps=[alloc])
    w_in = b.input("w", 1, storage=0)
    b.output("x_out", 0, region=Region(0, KIB), deps=[x_in])
    b.output("w_out", 1, storage=0, deps=[w_in])
    mg = b.build()
    verify(mg)
    result = simulate(mg, **RATES, timeline=True)
    assert result.makespan == 1.0
    assert result.busy["h2d"] == 1.0 and result.h2d_bytes == KIB
    assert [e.label for e in result.events] == ["input %0 x"]


# -- invariants on random plans ------------------------------------------------------------


def random_plan(case, offload_mask: int, outputs_to_host: bool) -> MemGraph:
    prog = ep.Program()
    tensors = [
        prog.input(f"x{i}", s, case.dtype, role=("weight" if i % 2 else "activation"))
        for i, s in enumerate(case.shapes)
    ]
    y = prog.einsum(case.spec, *tensors)
    prog.output(ep.exp(y) + y, "out")
    tg = prog.build()
    offload = frozenset(t for t in range(len(tg)) if offload_mask >> t & 1)
    return reference_plan(tg, offload=offload, outputs_to_host=outputs_to_host)


def node_seconds(mg: MemGraph, model: CostModel) -> list[float]:
    """Each node's duration in the simulator's model (0 for bookkeeping)."""
    tg, out = mg.taskgraph, []
    for n in mg.nodes:
        if n.kind is NodeKind.APPLY:
            out.append(model.task_seconds(tg, n.tensor))
        elif n.kind is NodeKind.RELOAD or (n.kind is NodeKind.INPUT and n.storage is None):
            out.append(model.transfer_seconds(tg[n.tensor].nbytes, "h2d"))
        elif n.kind is NodeKind.OFFLOAD:
            out.append(model.transfer_seconds(tg[n.tensor].nbytes, "d2h"))
        else:
            out.append(0.0)
    return out


@given(
    case=einsum_cases(max_operands=4),
    offload_mask=st.integers(0, 2**12),
    outputs_to_host=st.booleans(),
    model=st.sampled_from(sorted(PRESETS)),
)
def test_random_plans_keep_the_invariants(case, offload_mask, outputs_to_host, model):
    mg = random_plan(case, offload_mask, outputs_to_host)
    cost = PRESETS[model]
    result = simulate(mg, model, timeline=True)
    eps = 1e-12 * max(1.0, result.makespan)
    assert result.makespan + eps >= result.compute_seconds
    assert all(result.makespan + eps >= busy for busy in result.busy.values())
    assert result.makespan <= sum(node_seconds(mg, cost)) + eps
    applies = mg.of_kind(NodeKind.APPLY)
    assert result.compute_seconds == pytest.approx(
        sum(cost.task_seconds(mg.taskgraph, n.tensor) for n in applies)
    )
    # Events: one per node on a stream, in insertion order, never overlapping on a stream.
    streamed = [n.id for n in mg.nodes if n.stream != "none" and n.kind is not NodeKind.INPUT]
    streamed += [n.id for n in mg.of_kind(NodeKind.INPUT) if n.storage is None]
    assert sorted(e.node for e in result.events) == sorted(streamed)
    for stream in ("compute", "h2d", "d2h"):
        mine = [e for e in result.events if e.stream == stream]
        assert [e.node for e in mine] == sorted(e.node for e in mine)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:], strict=False))
        assert sum(e.duration for e in mine) == pytest.approx(result.busy[stream])
    # Every node starts after all of its dependencies ended.
    times = result.node_times
    for n in mg.nodes:
        assert all(times[n.id][0] >= times[d][1] for d in n.deps)
        assert times[n.id][1] >= times[n.id][0]
    # Bytes: reloads and device inputs go h2d, offloads d2h.
    device_inputs = sum(
        mg.taskgraph[n.tensor].nbytes for n in mg.of_kind(NodeKind.INPUT) if n.storage is None
    )
    assert result.h2d_bytes == mg.stats.reload_bytes + device_inputs
    assert result.d2h_bytes == mg.stats.offload_bytes


# -- the cost model argument -----------------------------------------------------------------


def test_cost_model_by_name_instance_or_rates():
    mg = reload_plan(False)
    assert simulate(mg).cost_model is PRESETS["h100-pcie5"]
    assert simulate(mg, "cpu").cost_model is PRESETS["cpu"]
    custom = CostModel("mine", 1e9, 1e9, 1e6, 2e6)
    assert simulate(mg, custom).cost_model is custom
    faster = simulate(mg, "cpu", h2d_bytes_per_s=1e12).cost_model
    assert faster.h2d_bytes_per_s == 1e12 and faster.flops_per_s == PRESETS["cpu"].flops_per_s
    plain = resolve_cost_model(flops_per_s=10.0, h2d_bytes_per_s=5.0)
    assert (plain.d2h_bytes_per_s, plain.device_bytes_per_s) == (5.0, math.inf)
    assert plain.kernel_latency_s == plain.transfer_latency_s == 0.0


def test_bad_cost_model_arguments_say_what_is_wrong():
    mg = reload_plan(False)
    with pytest.raises(EinpageError, match="unknown cost model 'tpu'.*h100-pcie5"):
        simulate(mg, "tpu")
    with pytest.raises(EinpageError, match="need h2d_bytes_per_s"):
        simulate(mg, flops_per_s=1e9)
    with pytest.raises(EinpageError, match="h2d_bytes_per_s must be positive"):
        simulate(mg, flops_per_s=1e9, h2d_bytes_per_s=0)


def test_a_dependency_on_a_later_node_is_rejected():
    mg = reload_plan(False)
    nodes = list(mg.nodes)
    nodes[1] = type(nodes[1])(1, nodes[1].kind, (5,), nodes[1].tensor, nodes[1].region)
    with pytest.raises(GraphError, match="n1 .*n5 is not an earlier node"):
        simulate(MemGraph(mg.taskgraph, tuple(nodes), mg.budget))


# -- the result -------------------------------------------------------------------------------


def test_timeline_feeds_traces_and_plots(tmp_path):
    result = simulate(concurrent_copies_plan(), **RATES, timeline=True)
    assert isinstance(result, SimResult)
    back = read_chrome_trace(result.write_chrome_trace(tmp_path / "trace.json"))
    assert [(e.stream, e.start, e.end, e.node) for e in back] == [
        (e.stream, e.start, e.end, e.node) for e in result.events
    ]
    assert result.to_chrome_trace()["traceEvents"]
    assert result.times[len(result.node_times) - 1] == result.node_times[-1]
    figure = result.plot(tmp_path / "lanes.png")
    assert figure is not None and (tmp_path / "lanes.png").stat().st_size > 0


def test_without_timeline_there_are_no_events():
    result = simulate(reload_plan(False), **RATES)
    assert result.events is None and result.node_times is None
    with pytest.raises(EinpageError, match="timeline=True"):
        result.times  # noqa: B018
    with pytest.raises(EinpageError, match="timeline=True"):
        result.plot()


def test_result_prints_a_table_and_a_one_line_repr():
    result = simulate(reload_plan(False), **{**RATES, "h2d_bytes_per_s": 512.0})
    text = str(result)
    assert "makespan              3000.000 ms" in text
    assert "stall from transfers  1000.000 ms" in text
    assert "h2d busy              2000.000 ms (66.7%), 1.0 KiB" in text
    assert repr(result).startswith("<SimResult rates makespan=3000.000ms")


def test_empty_plan():
    prog = ep.Program()
    w = prog.input("w", (4,), role="weight")
    prog.output(w, "w")
    b = MemGraphBuilder(prog.build(), budget=KIB)
    b.output("w", 0, storage=0, deps=[b.input("w", 0, storage=0)])
    result = simulate(b.build())
    assert result.makespan == 0.0 and result.compute_utilization == 1.0


# -- the simulated schedule as a Chrome / Perfetto trace ----------------------------------


@given(case=einsum_cases(max_operands=4), offload_mask=st.integers(0, 2**12))
def test_the_chrome_trace_has_one_event_per_timed_node_on_its_lane(case, offload_mask):
    mg = random_plan(case, offload_mask, outputs_to_host=bool(offload_mask & 1))
    result = simulate(mg, "h100-pcie5", timeline=True)
    doc = json.loads(json.dumps(result.to_chrome_trace()))  # plain JSON, loads back
    records = doc["traceEvents"]
    assert {r["pid"] for r in records} == {1}
    process = [r for r in records if r["name"] == "process_name"]
    assert process[0]["args"]["name"] == f"einpage {mg.taskgraph.name} (simulated, h100-pcie5)"
    lanes = {r["tid"]: r["args"]["name"] for r in records if r["name"] == "thread_name"}
    assert set(lanes.values()) <= set(STREAMS)  # the one definition of lane names
    complete = [r for r in records if r["ph"] == "X"]
    by_node = {r["args"]["node"]: r for r in complete}
    timed = {n.id: n for n in mg.nodes if n.kind is NodeKind.APPLY or n.copies is not None}
    assert len(complete) == len(by_node) == len(timed) and set(by_node) == set(timed)
    for node_id, record in by_node.items():
        node = timed[node_id]
        lane = "compute" if node.kind is NodeKind.APPLY else node.copies
        task = mg.taskgraph[node.tensor]
        assert lanes[record["tid"]] == lane and record["cat"] == node.kind.value
        assert record["name"] == event_name(mg, node)
        assert record["args"]["bytes"] == task.nbytes and record["args"]["tensor"] == task.id
        assert ("flops" in record["args"]) == (node.kind is NodeKind.APPLY)
        start, end = result.node_times[node_id]
        assert record["ts"] == pytest.approx(start * 1e6, abs=1e-3)
        assert record["dur"] == pytest.approx((end - start) * 1e6, abs=1e-3)
    for stream in STREAMS:  # durations add up to the simulator's busy times
        durations = [r["dur"] for r in complete if lanes[r["tid"]] == stream]
        assert sum(durations) == pytest.approx(
            result.busy[stream] * 1e6, abs=1e-3 * (1 + len(durations))
        )
    assert doc["otherData"]["clock"] == "simulated"
    assert doc["otherData"]["makespan_s"] == result.makespan


def test_a_written_trace_reads_back_with_names_and_args(tmp_path):
    mg = reference_plan(fill_and_weight(), offload=frozenset({0}))
    result = simulate(mg, **RATES, timeline=True)
    path = result.write_chrome_trace(tmp_path / "sim.json")
    back = read_chrome_trace(path)
    assert [(e.stream, e.label, e.kind, e.node) for e in back] == [
        (e.stream, e.label, e.kind, e.node) for e in result.events
    ]
    offload = next(e for e in back if e.kind == "offload")
    assert offload.label == "offload %0" and offload.args["bytes"] == KIB
    assert offload.args["step"] == mg[offload.node].describe()
