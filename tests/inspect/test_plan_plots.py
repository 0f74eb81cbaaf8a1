"""Memory map and live-bytes pictures: residencies, collections, markers, files, curves."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.image  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from inspect_fixtures import mlp_graph, mlp_plan  # noqa: E402
from plans import reference_plan  # noqa: E402

import einpage as ep  # noqa: E402
from einpage.errors import RenderError  # noqa: E402
from memgraph import MemGraph, NodeKind  # noqa: E402
from memgraph.plots import (  # noqa: E402
    KIND_MEANINGS,
    SHADES_NOTE,
    live_bytes,
    live_bytes_timeline,
    memory_map,
    residencies,
    residency_label,
    step_positions,
)


@pytest.fixture(scope="module")
def plan() -> MemGraph:
    return mlp_plan()


def collections(fig, prefix):
    ax = fig.axes[0]
    return {c.get_gid(): c for c in ax.collections if (c.get_gid() or "").startswith(prefix)}


def test_residencies_pair_allocs_with_frees(plan):
    stays = residencies(plan)
    assert len(stays) == len(plan.of_kind(NodeKind.ALLOC))
    for r in stays:
        assert plan[r.alloc].kind is NodeKind.ALLOC and plan[r.alloc].tensor == r.tensor
        if r.free is not None:
            assert plan[r.free].kind is NodeKind.FREE and plan[r.free].region == r.region
    kinds = {r.kind for r in stays}
    assert kinds == {"weight", "activation", "output"}
    still_open = [r for r in stays if r.free is None]
    assert [r.tensor for r in still_open] == [plan.taskgraph.outputs["y"]]
    assert still_open[0].kind == "output" and still_open[0].source == "reload"
    assert sum(r.offload is not None for r in stays) == plan.stats.offload_count
    assert sum(r.source == "reload" for r in stays) == plan.stats.reload_count


def test_drops_are_found():
    prog = ep.Program("drop")
    x = prog.input("x", (4, 4))
    w = prog.input("w", (4, 4), role="weight")
    prog.output((x @ w) @ w, "y")
    mg = reference_plan(prog.build())
    stays = residencies(mg)
    assert sum(r.dropped for r in stays) == mg.stats.drop_count == 1


def test_memory_map_has_one_rectangle_per_residency(plan):
    fig = memory_map(plan)
    rects = collections(fig, "residencies:")
    stays = residencies(plan)
    assert sum(len(c.get_paths()) for c in rects.values()) == len(stays)
    for kind in ("weight", "activation", "output"):
        assert len(rects[f"residencies:{kind}"].get_paths()) == sum(r.kind == kind for r in stays)
    marks = collections(fig, "transfers:")
    assert len(marks["transfers:offload"].get_offsets()) == plan.stats.offload_count
    assert len(marks["transfers:reload"].get_offsets()) == plan.stats.reload_count
    ax = fig.axes[0]
    assert ax.get_ylabel() == "arena offset (KiB)"
    assert "budget 10.0 KiB" in ax.get_title() and "offloaded" in ax.get_title()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:3] == [KIND_MEANINGS[k] for k in ("weight", "activation", "output")]
    assert any(t.startswith("offload") for t in legend) and "budget 10.0 KiB" in legend


def test_every_colour_and_marker_of_the_memory_map_is_explained(plan):
    ax = memory_map(plan).axes[0]
    legend = ax.get_legend()
    assert legend.get_title().get_text() == SHADES_NOTE  # the shades within a kind
    texts = [t.get_text() for t in legend.get_texts()]
    drawn = {gid.split(":")[1] for gid in collections(memory_map(plan), "residencies:")}
    for kind in drawn:  # every colour drawn, with what it means
        assert KIND_MEANINGS[kind] in texts and ": " in KIND_MEANINGS[kind]
    for name in ("offload (device to host)", "reload (host to device)"):
        assert any(t.startswith(name) for t in texts)
    assert len(texts) == len(drawn) + len(collections(memory_map(plan), "transfers:")) + 1


def test_the_largest_residencies_are_named(plan):
    fig = memory_map(plan, labels=3)
    ax = fig.axes[0]
    texts = {
        t.get_gid(): t.get_text() for t in ax.texts if (t.get_gid() or "").startswith("largest")
    }
    steps = len(plan)  # x="node": a residency spans alloc .. free + 1 (or the plan's end)
    area = {
        r.tensor: ((r.free + 1 if r.free is not None else steps) - r.alloc) * r.region.size
        for r in residencies(plan)
    }
    biggest = max(area, key=lambda t: (area[t], -t))
    assert {texts["largest:1"], texts["largest:2"], texts["largest:3"]} == {"1", "2", "3"}
    listing = texts["largest:list"].splitlines()
    assert listing[0] == "largest residencies:" and len(listing) == 4
    assert listing[1].startswith(f"1. {residency_label(plan, biggest)} (")
    assert residency_label(plan, biggest).startswith(f"%{biggest} ")
    quiet = memory_map(plan, labels=0).axes[0]
    assert not [t for t in quiet.texts if (t.get_gid() or "").startswith("largest")]


def test_a_residency_label_names_the_input_or_the_task_and_its_scope():
    prog = ep.Program("named")
    x = prog.input("x", (4, 4))
    with prog.scope("layers.0"):
        w = prog.input("layers.0.w", (4, 4), role="weight")
        y = ep.exp(x @ w)
    prog.output(y, "y")
    mg = reference_plan(prog.build())
    tg = mg.taskgraph
    assert residency_label(mg, tg.inputs["layers.0.w"]) == f"%{tg.inputs['layers.0.w']} layers.0.w"
    out = tg.outputs["y"]
    assert residency_label(mg, out) == f"%{out} {tg[out].label or tg[out].kind} layers.0"
    assert len(residency_label(mg, out, width=6)) == 6


def test_memory_map_rectangle_geometry(plan):
    fig = memory_map(plan, x="node")
    stays = [r for r in residencies(plan) if r.kind == "weight"]
    paths = collections(fig, "residencies:")["residencies:weight"].get_paths()
    for r, path in zip(stays, paths, strict=True):
        xs, ys = path.vertices[:, 0], path.vertices[:, 1]
        assert xs.min() == r.alloc and xs.max() == r.free + 1
        assert np.isclose(ys.min(), r.region.offset / 1024)
        assert np.isclose(ys.max(), r.region.end / 1024)


@pytest.mark.parametrize("suffix", ["png", "svg", "pdf"])
def test_memory_map_saved(tmp_path, plan, suffix):
    path = tmp_path / f"map.{suffix}"
    plan.memory_map(path, figsize=(8, 4))
    assert path.stat().st_size > 0
    if suffix == "png":
        assert matplotlib.image.imread(path).shape[:2] == (400, 800)


def test_unknown_plot_suffix(tmp_path, plan):
    with pytest.raises(RenderError, match=r"unknown format 'bmp'.*\.png, \.svg, \.pdf"):
        memory_map(plan, tmp_path / "map.bmp")


def test_step_axes(plan):
    start, end = step_positions(plan, "apply")
    applies = [n.id for n in plan if n.kind is NodeKind.APPLY]
    assert end[applies[-1]] == len(applies) and start[applies[0]] == 0
    assert all(end[i] - start[i] == 1 for i in applies)
    times = {i: (i * 1e-3, i * 1e-3 + 5e-4) for i in range(0, len(plan), 2)}
    start, end = step_positions(plan, times=times)
    assert start[2] == 2e-3 and end[3] == end[2]  # missing nodes take the previous end
    fig = memory_map(plan, times=times)
    assert fig.axes[0].get_xlabel() == "time (ms)"
    assert memory_map(plan, x="apply").axes[0].get_xlabel() == "plan step (applies done)"
    with pytest.raises(RenderError, match="x must be 'node' or 'apply'"):
        step_positions(plan, "time")


@given(mask=st.integers(0, 2**9 - 1), reuse=st.booleans(), x=st.sampled_from(["node", "apply"]))
def test_live_bytes_peak_is_the_plan_peak(mask, reuse, x):
    tg = mlp_graph()
    offload = frozenset(t for t in range(len(tg)) if mask >> t & 1)
    mg = reference_plan(tg, offload=offload, reuse=reuse)
    xs, ys = live_bytes(mg, x)
    assert ys.max() == mg.stats.peak_bytes
    assert np.all(np.diff(xs) >= 0)
    assert ys[-1] == sum(r.region.size for r in residencies(mg) if r.free is None)


def test_live_bytes_timeline_compares_curves(tmp_path, plan):
    base = mlp_plan(offload=False)
    path = tmp_path / "live.png"
    fig = live_bytes_timeline(
        plan,
        path,
        compare={"no offload": base, "flat": ([0, 5], [1024, 1024])},
        label="offloading plan",
        figsize=(10, 4),
    )
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0].startswith("offloading plan (peak")
    assert labels[1].startswith("no offload (peak") and labels[2] == "flat (peak 1.0 KiB)"
    assert labels[-1] == "budget 10.0 KiB"
    assert matplotlib.image.imread(path).shape[:2] == (400, 1000)
    with pytest.raises(RenderError, match="differ in length"):
        live_bytes_timeline(plan, compare={"bad": ([0, 1, 2], [1, 2])})


def test_graph_packages_do_not_import_matplotlib():
    import subprocess
    import sys

    code = (
        "import sys, taskgraph, memgraph, einpage\n"
        "assert 'matplotlib' not in sys.modules\n"
        "import memgraph.render, memgraph.plots\n"
        "assert 'matplotlib' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
