"""Running plans with a host tier: weights read from a checkpoint, offloads spilled and read
back, in every mode, equal to the reference; what a run refuses and what it leaves behind."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plans import reference_plan, sliced_weight_plan
from run_tier_plans import tier_plan, write_checkpoint
from strategies import einsum_programs, program_inputs

import einpage as ep
import runtime
import taskgraph
from einpage_core.errors import BackendError, DiskError, HostBudgetPlanError, InputError
from memgraph import MemGraph
from memgraph import plan as plan_device
from memgraph.multi import DevicePart, DevicePlan, MultiPlan, PlacedGraph
from memgraph.nodes import NodeKind
from memgraph.tiers import CheckpointPlace, place_host
from runtime.diskio import DiskFiles
from runtime.multi import DeviceRunner
from runtime.schedule import DISK_STREAMS, Schedule
from runtime.tiers import DiskPort, disk_inputs, host_arena_bytes, tier_held
from taskgraph.nodes import Input

MODES = ["sequential", "streams", "random"]


def mlp():
    prog = ep.Program("mlp")
    x = prog.input("x", (4, 8))
    w1 = prog.input("w1", (8, 16), role="weight")
    w2 = prog.input("w2", (16, 8), role="weight")
    h = ep.gelu(x @ w1)
    prog.output(ep.softmax(h @ w2 + x), "y")
    return prog.build()


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    weights = {
        "w1": rng.standard_normal((8, 16)).astype("float32"),
        "w2": rng.standard_normal((16, 8)).astype("float32"),
    }
    return weights, {"x": rng.standard_normal((4, 8)).astype("float32")}


@pytest.fixture
def case(tmp_path):
    """The MLP's plan with both weights read from a checkpoint, its hidden layer spilled,
    its output on the host; the spill folder; the weights; the activations."""
    weights, xs = arrays()
    path = tmp_path / "model.safetensors"
    offsets = write_checkpoint(path, weights)
    base = reference_plan(mlp(), offload=frozenset({4}), outputs_to_host=True)
    spill = tmp_path / "spill"
    spill.mkdir()
    return tier_plan(base, path, offsets), spill, weights, xs


def reference(mg, weights, xs):
    return taskgraph.evaluate(mg.taskgraph, {**weights, **xs})


def test_the_hand_made_plan_reads_writes_and_releases(case):
    mg, *_ = case
    kinds = [n.kind for n in mg.nodes]
    assert kinds.count(NodeKind.READ) == 3 and kinds.count(NodeKind.WRITE) == 1
    assert [f.kind for f in mg.tier.files] == ["checkpoint", "spill"]
    mg.verified()


@pytest.mark.parametrize("mode", MODES)
def test_a_tier_plan_runs_to_the_reference_in_every_mode(case, mode):
    mg, spill, weights, xs = case
    expected = reference(mg, weights, xs)
    for seed in range(3 if mode == "random" else 1):
        got = runtime.run(mg, xs, backend="numpy", mode=mode, seed=seed, spill=spill)
        np.testing.assert_array_equal(got["y"], expected["y"])
    assert os.listdir(spill) == []


def test_a_session_keeps_its_spill_file_open_until_it_closes(case):
    mg, spill, weights, _ = case
    with runtime.Session(mg, "numpy", mode="streams", spill=spill) as session:
        assert os.listdir(spill) == []  # unlinked at once, open by its descriptor
        (spill_fd,) = [
            fd for fd, f in zip(session.disk_files.fds, mg.tier.files, strict=True)
            if f.kind == "spill"
        ]  # fmt: skip
        assert os.fstat(spill_fd).st_size == mg.tier.spill_bytes
        for seed in (1, 2):
            _, xs = arrays(seed)
            got = session.run(xs)
            np.testing.assert_array_equal(got["y"], reference(mg, weights, xs)["y"])
        memory = session.last.memory
        assert memory["host_tier_bytes"] == host_arena_bytes(mg)
    assert os.listdir(spill) == []


def test_the_host_arena_is_the_high_water_not_the_budget(tmp_path):
    weights, xs = arrays()
    path = tmp_path / "m.safetensors"
    base = reference_plan(mlp(), outputs_to_host=True)
    mg = tier_plan(base, *checkpoint_of(path, weights), budget_extra=1 << 20)
    assert host_arena_bytes(mg) < mg.tier.budget
    with runtime.Session(mg, "numpy") as session:
        got = session.run(xs)
        assert session.last.memory["host_tier_bytes"] == host_arena_bytes(mg)
    np.testing.assert_array_equal(got["y"], reference(mg, weights, xs)["y"])


def checkpoint_of(path, weights):
    return path, write_checkpoint(path, weights)


def test_a_plan_reading_only_a_checkpoint_needs_no_spill_folder(tmp_path):
    weights, xs = arrays()
    path, offsets = checkpoint_of(tmp_path / "m.safetensors", weights)
    mg = tier_plan(reference_plan(mlp()), path, offsets)
    assert [f.kind for f in mg.tier.files] == ["checkpoint"]
    for mode in MODES:
        got = runtime.run(mg, xs, backend="numpy", mode=mode)
        np.testing.assert_array_equal(got["y"], reference(mg, weights, xs)["y"])


@pytest.mark.parametrize("mode", MODES)
def test_a_sliced_reload_copies_its_box_from_the_slot(tmp_path, mode):
    w = {"w": np.arange(64 * 8, dtype="float32").reshape(64, 8) / 100}
    path, offsets = checkpoint_of(tmp_path / "w.safetensors", w)
    mg = tier_plan(sliced_weight_plan(), path, offsets)
    got = runtime.run(mg, {}, backend="numpy", mode=mode)
    np.testing.assert_array_equal(got["y"], taskgraph.evaluate(mg.taskgraph, w)["y"])


def test_a_plan_with_a_spill_file_needs_a_spill_folder(case):
    mg, spill, _, xs = case
    with pytest.raises(DiskError, match="give a spill folder"):
        runtime.run(mg, xs, backend="numpy")


def test_weights_on_disk_are_not_passed(case):
    mg, spill, weights, xs = case
    with pytest.raises(InputError, match="'w1' from .*model.safetensors.* itself"):
        runtime.run(mg, {**xs, "w1": weights["w1"]}, backend="numpy", spill=spill)
    with runtime.Session(mg, "numpy", spill=spill) as session:
        with pytest.raises(InputError, match="do not pass them"):
            session.stage({"w2": weights["w2"]})
        with pytest.raises(InputError, match="do not pass them"):
            session.run({**xs, "w2": weights["w2"]})
        with pytest.raises(InputError, match="'x'"):
            session.run({})  # the activation is still required
    assert os.listdir(spill) == []


# -- refusals and failures, each leaving no spill file -----------------------------------


def test_a_checkpoint_of_another_size_is_refused_before_anything_runs(case, tmp_path):
    mg, spill, _, xs = case
    with open(mg.tier.files[0].path, "ab") as grow:
        grow.write(b"x")
    with pytest.raises(DiskError, match="plan again"):
        runtime.run(mg, xs, backend="numpy", spill=spill)
    assert os.listdir(spill) == []


@pytest.mark.parametrize("direct_io", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_that_grows_during_the_run_is_an_error(case, monkeypatch, mode, direct_io):
    """Buffered, and with O_DIRECT (where the file system allows it; else buffered)."""
    mg, spill, _, xs = case
    real = os.preadv
    path = mg.tier.files[0].path

    def preadv_then_grow(fd, buffers, offset):
        got = real(fd, buffers, offset)
        with open(path, "ab") as grow:
            grow.write(b"x")
        return got

    monkeypatch.setattr(os, "preadv", preadv_then_grow)
    with pytest.raises(DiskError, match="changed size during the run"):
        runtime.run(mg, xs, backend="numpy", mode=mode, spill=spill, direct_io=direct_io)
    assert os.listdir(spill) == []


def test_an_interrupted_run_leaves_no_spill_file(case, monkeypatch):
    mg, spill, _, xs = case
    calls = []
    real = os.preadv

    def interrupt_on_second_read(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 2:
            assert os.listdir(spill) == []  # the spill file is open, by descriptor only
            raise KeyboardInterrupt
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", interrupt_on_second_read)
    with pytest.raises(KeyboardInterrupt):
        runtime.run(mg, xs, backend="numpy", mode="sequential", spill=spill)
    assert os.listdir(spill) == []


@pytest.mark.parametrize("mode", ["streams", "random"])
def test_an_interrupted_run_on_streams_stays_interrupted_and_leaves_no_spill_file(
    case, monkeypatch, mode
):
    mg, spill, _, xs = case

    def interrupt(fd, buffers, offset):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "preadv", interrupt)
    with pytest.raises(KeyboardInterrupt):
        runtime.run(mg, xs, backend="numpy", mode=mode, spill=spill)
    assert os.listdir(spill) == []


def test_a_release_that_does_not_wait_for_its_reload_is_caught(tmp_path):
    """The poison mutant: some random order releases (poisons) the slot before the reload
    copies from it; the run must then not give the right answer."""
    weights, xs = arrays()
    path, offsets = checkpoint_of(tmp_path / "m.safetensors", weights)
    base = reference_plan(mlp(), offload=frozenset({4}))
    good = tier_plan(base, path, offsets)
    bad = tier_plan(base, path, offsets, release_after_read=True)
    expected = reference(good, weights, xs)["y"]
    wrong = 0
    for seed in range(12):
        ok = runtime.run(good, xs, backend="numpy", mode="random", seed=seed, spill=tmp_path)
        np.testing.assert_array_equal(ok["y"], expected)
        try:
            got = runtime.run(
                bad, xs, backend="numpy", mode="random", seed=seed, spill=tmp_path,
                unsafe_skip_verify=True,
            )  # fmt: skip
        except BackendError:
            wrong += 1
            continue
        if not np.array_equal(got["y"], expected):
            wrong += 1
    assert wrong > 0


# -- schedules, streams and sessions ------------------------------------------------------


def test_reads_and_writes_get_disk_streams_that_overlap_compute(case):
    mg, spill, _, xs = case
    schedule = Schedule.build(mg, "streams", poison=True)
    assert set(DISK_STREAMS) <= set(schedule.streams)
    for node, stream in zip(mg.nodes, schedule.stream_of, strict=True):
        if node.kind is NodeKind.READ:
            assert stream == "disk_read"
        elif node.kind in (NodeKind.WRITE, NodeKind.RELEASE):
            assert stream == "disk_write"
    assert (
        Schedule.build(mg, "streams").stream_of[
            next(n.id for n in mg.nodes if n.kind is NodeKind.RELEASE)
        ]
        is None
    )
    with runtime.Session(mg, "numpy", mode="streams", spill=spill) as session:
        session.run(xs, trace=True)
        lanes = {event.stream for event in session.last.trace.events}
    assert {"compute", "disk_read", "disk_write"} <= lanes


def test_a_session_of_several_plans_refuses_a_tier(case):
    mg, spill, *_ = case
    with pytest.raises(BackendError, match="several plans cannot run plans with host tiers"):
        runtime.Session({"prefill": mg, "decode": mg}, "numpy", spill=spill)
    assert os.listdir(spill) == []


def test_plans_for_several_devices_refuse_a_tier(case):
    mg, spill, weights, xs = case
    with pytest.raises(BackendError, match="host tier"):
        DeviceRunner(0, mg, spill=spill)
    tg = mg.taskgraph
    placed = PlacedGraph(
        1, (DevicePart(0, tg, tuple(range(len(tg)))),), (), {n: (0, n) for n in tg.outputs}
    )
    mp = MultiPlan(placed, (DevicePlan(0, mg, mg.budget),))
    with pytest.raises(BackendError, match=r"device 0.*host tier"):
        runtime.run_devices(mp, {**weights, **xs})
    assert os.listdir(spill) == []


# -- plans made by the pass (memgraph.tiers.place_host) ------------------------------------


def unslotted_outputs(mg):
    """Output nodes naming a storage the tier holds but no slot."""
    held = tier_held(mg)
    return [n for n in mg.nodes if n.kind is NodeKind.OUTPUT and n.storage in held and not n.slot]


def test_a_weight_returned_twice_from_the_host_is_read_once_and_returned_twice(tmp_path):
    prog = ep.Program("echo")
    a = prog.input("a", (1,), role="weight", location="host")
    prog.output(prog.view(a, (1,)), "out")
    prog.output(a, "extra")
    tg = prog.build()
    mg, _ = pass_plan(tg, tmp_path, {"a": np.full(1, 7, "float32")}, "host", 1)
    assert not unslotted_outputs(mg)
    assert len(mg.of_kind(NodeKind.READ)) == 1
    got = runtime.run(mg, {}, backend="numpy")
    assert got["out"].tolist() == got["extra"].tolist() == [7.0]


def test_an_output_of_a_tier_storage_without_a_slot_is_refused(tmp_path):
    prog = ep.Program("echo")
    a = prog.input("a", (1,), role="weight", location="host")
    prog.output(a, "out")
    tg = prog.build()
    mg, _ = pass_plan(tg, tmp_path, {"a": np.ones(1, "float32")}, "host", 1)
    output = next(n for n in mg.nodes if n.kind is NodeKind.OUTPUT)
    nodes = list(mg.nodes)
    nodes[output.id] = replace(output, slot=None)
    broken = MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, mg.info,
                      mg.storages, mg.tier)  # fmt: skip
    with pytest.raises(BackendError, match="must name its slot of the host arena"):
        runtime.run(broken, {}, backend="numpy", unsafe_skip_verify=True)


def pass_plan(tg, folder, inputs, outputs, host_factor):
    """`tg` planned at its smallest device budget with its host weights in a checkpoint,
    then its host planned by `place_host` at the smallest host budget of a few tried
    that it accepts, times `host_factor`."""
    from memgraph.planner import min_budget

    device = plan_device(tg, min_budget(tg)[0], outputs=outputs, inputs="host")
    host_inputs = {
        n.name for n in device.nodes if n.kind is NodeKind.INPUT and n.storage is not None
    }
    names = [
        name for name in host_inputs
        if isinstance(tg[tg.inputs[name]].op, Input) and tg[tg.inputs[name]].op.role == "weight"
    ]  # fmt: skip
    places = {}
    if names:
        path = folder / "ckpt.safetensors"
        offsets = write_checkpoint(path, {name: inputs[name] for name in names})
        size = path.stat().st_size
        places = {name: CheckpointPlace(str(path), size, offsets[name]) for name in names}
    largest = max((s.nbytes for s in device.storages.values()), default=1)
    budget = 4096 * (-(-largest // 4096))
    for _ in range(12):
        try:
            return place_host(device, budget * host_factor, places), names
        except HostBudgetPlanError:
            budget *= 2
    raise AssertionError("no host budget planned")


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tg=einsum_programs(max_tasks=12), data=st.data())
def test_pass_made_plans_run_to_the_reference(tg, data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tier")
    inputs = program_inputs(tg, seed=len(tg))
    outputs = data.draw(st.sampled_from(["device", "host"]), label="outputs")
    factor = data.draw(st.sampled_from([1, 2]), label="host budget factor")
    mode = data.draw(st.sampled_from(MODES), label="mode")
    mg, _ = pass_plan(tg, folder, inputs, outputs, factor)
    mg.verified()
    assert not unslotted_outputs(mg)
    given_inputs = {k: v for k, v in inputs.items() if k not in disk_inputs(mg)}
    with np.errstate(all="ignore"):
        expected = taskgraph.evaluate(tg, inputs)
        got = runtime.run(mg, given_inputs, backend="numpy", mode=mode, seed=len(tg), spill=folder)
    for name, value in expected.items():
        finite = np.abs(value[np.isfinite(value)])
        scale = max(1.0, float(finite.max(initial=0.0)))
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5 * scale, err_msg=name)
    assert not [f for f in os.listdir(folder) if f.startswith("einpage-spill-")]


def test_host_work_on_a_cuda_stream_runs_as_a_host_function_whose_failure_is_kept(case):
    """On CuPy a disk transfer is a host function in the stream's order (`launch_host_func`);
    nothing can raise there, so the port keeps the first failure for the session to raise,
    and skips later work. A stand-in stream runs the function at once."""
    mg, spill, *_ = case

    class Cuda:
        def __init__(self):
            self.launched = 0

        def launch_host_func(self, callback, arg):
            self.launched += 1
            callback(arg)

    class CudaStream:
        name = "disk_read"

        def __init__(self):
            self.cuda = Cuda()

    files = DiskFiles.open(mg.tier, spill)
    arena = np.zeros(host_arena_bytes(mg), dtype=np.uint8)
    port = DiskPort(mg, files, arena)
    stream = CudaStream()
    read = next(n for n in mg.nodes if n.kind is NodeKind.READ)
    try:
        port.read(read, stream)
        assert port.failure is None and arena.any()
        files.close()  # the next read fails: its file is gone
        port.read(read, stream)
        port.read(read, stream)
    finally:
        files.close()
    assert stream.cuda.launched == 3
    failure = port.take_failure()
    assert failure is not None and failure.context is read and failure.stream == "disk_read"
    assert port.take_failure() is None


@pytest.mark.parametrize("mode", MODES)
def test_a_run_writes_nothing_outside_its_spill_folder(case, tmp_path, monkeypatch, mode):
    """The checkpoint is never written (its bytes and time stamp unchanged), the working
    folder gets nothing, the spill folder ends empty, and the tree holds what it held."""
    mg, spill, weights, xs = case
    checkpoint = tmp_path / "model.safetensors"
    before = checkpoint.read_bytes(), checkpoint.stat().st_mtime_ns
    tree = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    elsewhere = tmp_path.parent / f"{tmp_path.name}-cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    got = runtime.run(mg, xs, backend="numpy", mode=mode, spill=spill)
    np.testing.assert_array_equal(got["y"], reference(mg, weights, xs)["y"])
    assert (checkpoint.read_bytes(), checkpoint.stat().st_mtime_ns) == before
    assert list(elsewhere.iterdir()) == [] and os.listdir(spill) == []
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == tree
