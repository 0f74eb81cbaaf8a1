"""KV pages are their own kind in reports and pictures: residencies, memory maps and plan
drawings show them apart from weights and other activations, in both ways of planning."""

from __future__ import annotations

import numpy as np
import pytest

from einpage.models import llama
from einpage.workloads.generate import Planning, generate
from memgraph.render import MEM_STYLES, memgraph_dot
from taskgraph.facts import is_kv_page

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from memgraph.plots import KIND_MEANINGS, TENSOR_KINDS, memory_map  # noqa: E402


@pytest.fixture(scope="module", params=["unrolled", "steps"])
def plan(request):
    out = generate(llama.PRESETS["tiny"], np.zeros((2, 9), np.int64), 6, "100KiB",
                   page_size=4, plan=Planning(way=request.param), run=None)  # fmt: skip
    return out.plan


def kv_plans(plan):
    return [c.plan for c in plan.plans.values() if any(is_kv_page(t) for t in c.graph)]


def test_residencies_of_pages_have_their_own_kind(plan):
    mgs = kv_plans(plan)
    assert mgs
    for mg in mgs:
        stays = mg.residencies.stays
        kinds = {r.kind for r in stays}
        assert "kv" in kinds and "weight" in kinds
        for r in stays:
            assert (r.kind == "kv") == is_kv_page(mg.taskgraph[r.tensor])


def test_memory_maps_colour_pages(plan):
    mg = kv_plans(plan)[-1]
    fig = memory_map(mg)
    rects = {c.get_gid(): c for c in fig.axes[0].collections}
    assert len(rects["residencies:kv"].get_paths()) == sum(
        r.kind == "kv" for r in mg.residencies.stays
    )
    assert "kv" in TENSOR_KINDS
    assert KIND_MEANINGS["kv"] in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_drawings_style_page_transfers_apart(plan):
    mg = kv_plans(plan)[-1]
    dot = memgraph_dot(mg, fold_layers=False, max_nodes=None)
    assert MEM_STYLES["reload_kv"].fillcolor in dot and "reload of a KV page" in dot
