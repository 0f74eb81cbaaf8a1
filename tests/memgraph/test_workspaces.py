"""Kernel workspaces through the IRs: declared on tasks, planned as transient regions.

A task's `workspace` (bytes its kernel needs besides its operands and output) is carried
by the TaskGraph and its JSON; the planner gives the task's apply a region of that size,
held for the apply alone (`MemNode.workspace`), counted in `min_budget`, the peak and the
high-water mark; the verifier (and the oracle, through the watch) checks it like any
region: no overlap with live tensors, after the frees of its bytes, within the budget.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import einsum_programs

import einpage as ep
import memgraph
from einpage.errors import GraphError, InfeasibleBudgetError, SerializationError
from memgraph import MemGraph, NodeKind, Region
from taskgraph import TaskGraph


def chain(layers: int = 4, width: int = 32, weights: int = 1) -> TaskGraph:
    """x @ w, then tanh(h @ w) a few times (`weights` different ones, in turn): matmuls
    whose workspaces the tests declare."""
    prog = ep.Program("chain")
    x = prog.input("x", (width, width))
    ws = [prog.input(f"w{i}", (width, width), role="weight") for i in range(weights)]
    h = x @ ws[0]
    for layer in range(layers):
        h = ep.tanh(h @ ws[(layer + 1) % weights])
    prog.output(h, "y")
    return prog.build()


def matmuls(tg: TaskGraph) -> list[int]:
    return [t.id for t in tg if t.kind == "einsum" and len(t.inputs) == 2]


def with_matmul_workspaces(tg: TaskGraph, nbytes: int) -> TaskGraph:
    return tg.with_workspaces(dict.fromkeys(matmuls(tg), nbytes))


# -- the TaskGraph -----------------------------------------------------------------------


def test_workspaces_are_task_fields_in_listings_and_json():
    tg = with_matmul_workspaces(chain(), 3000)
    task = tg[matmuls(tg)[0]]
    assert task.workspace == 3000 and "(workspace 2.9 KiB)" in task.line()
    assert tg.workspace_bytes == 3000 and chain().workspace_bytes == 0
    text = tg.to_json()
    again = TaskGraph.from_json(text)
    assert [t.workspace for t in again] == [t.workspace for t in tg]
    assert again.to_json() == text
    entry = json.loads(text)["tasks"][task.id]
    assert entry["workspace"] == 3000 and list(entry)[-1] == "workspace"


def test_graphs_without_workspaces_write_no_key_and_declaring_nothing_changes_nothing():
    tg = chain()
    assert '"workspace"' not in tg.to_json()
    assert tg.with_workspaces({}) is tg and tg.with_workspaces({matmuls(tg)[0]: 0}) is tg
    declared = with_matmul_workspaces(tg, 512)
    assert with_matmul_workspaces(declared, 512) is declared


@pytest.mark.parametrize(
    ("value", "message"),
    [(-1, "expected a number of bytes"), (1.5, "expected a number of bytes"),
     (True, "expected a number of bytes")],
)  # fmt: skip
def test_bad_workspaces_in_json_are_refused_by_path(value, message):
    doc = json.loads(with_matmul_workspaces(chain(), 64).to_json())
    doc["tasks"][2]["workspace"] = value
    with pytest.raises(SerializationError, match=rf"\$\.tasks\[2\]\.workspace: {message}"):
        TaskGraph.from_json(json.dumps(doc))


def test_only_computed_tasks_have_workspaces():
    tg = chain()
    with pytest.raises(GraphError, match="%0 \\(input\\) is not computed by the device"):
        tg.with_workspaces({0: 256})
    with pytest.raises(GraphError, match="a number of bytes >= 0"):
        tg.with_workspaces({2: -5})
    doc = json.loads(tg.to_json())
    doc["tasks"][0]["workspace"] = 256
    with pytest.raises(SerializationError, match=r"\$\.tasks\[0\]: .*no workspace"):
        TaskGraph.from_json(json.dumps(doc))


# -- planning ---------------------------------------------------------------------------


def test_min_budget_counts_the_workspace_and_is_exact():
    plain = chain()
    tg = with_matmul_workspaces(plain, 3000)
    (low, task), (plain_low, _) = memgraph.min_budget(tg), memgraph.min_budget(plain)
    assert low == plain_low + 3072 and tg[task].workspace == 3000
    mg = memgraph.plan(tg, low)
    assert memgraph.verify(mg).peak_bytes <= low
    with pytest.raises(InfeasibleBudgetError, match="kernel's workspace \\(2.9 KiB\\)"):
        memgraph.plan(tg, low - 256)


def test_every_apply_of_a_task_with_a_workspace_holds_one_for_itself():
    tg = with_matmul_workspaces(chain(), 3000)
    low, _ = memgraph.min_budget(tg)
    for budget in (low, 2 * low, 100 * low):
        mg = memgraph.plan(tg, budget)
        applies = mg.of_kind(NodeKind.APPLY)
        held = [n for n in applies if n.workspace is not None]
        assert [n.tensor for n in held] == matmuls(tg)
        assert all(n.workspace.size == 3072 for n in held)
        stays = mg.residencies
        assert [w.apply for w in stays.workspaces] == [n.id for n in held]
        for node in held:  # counted while its apply runs, and then no more
            assert stays.live_bytes[node.id] == stays.live_bytes[node.id - 1] + 3072
            if node.id + 1 < len(mg) and mg[node.id + 1].kind is not NodeKind.ALLOC:
                assert stays.live_bytes[node.id + 1] <= stays.live_bytes[node.id] - 3072
        assert mg.stats.high_water >= max(n.workspace.end for n in held)
        assert "+ workspace [0x" in held[0].line()


def two_branches() -> TaskGraph:
    """y = exp(x) with a workspace, and z = exp(w) of a weight: nothing orders them."""
    prog = ep.Program("branches")
    x = prog.input("x", (64,))
    w = prog.input("w", (64,), role="weight")
    prog.output(ep.exp(x), "y")
    prog.output(ep.exp(w), "z")
    tg = prog.build()
    return tg.with_workspaces({2: 256})


def branch_plan(wait_for_the_workspace: bool, budget: int = 1024) -> MemGraph:
    """By hand: the weight is reloaded into the bytes the apply of y held as its workspace;
    its alloc waits for that apply, or (the mistake) does not."""
    b = memgraph.MemGraphBuilder(two_branches(), budget)
    a0 = b.alloc(0, Region(0, 256))
    x = b.input("x", 0, region=Region(0, 256), deps=[a0])
    host = b.input("w", 1, storage=0)
    a2 = b.alloc(2, Region(256, 256))
    y = b.apply(2, [Region(0, 256)], Region(256, 256), [x, a2], workspace=Region(512, 256))
    a1 = b.alloc(1, Region(512, 256), deps=[y] if wait_for_the_workspace else [])
    w = b.reload(1, 0, Region(512, 256), deps=[host, a1])
    a3 = b.alloc(3, Region(768, 256))
    z = b.apply(3, [Region(512, 256)], Region(768, 256), [w, a3])
    b.output("y", 2, region=Region(256, 256), deps=[y])
    b.output("z", 3, region=Region(768, 256), deps=[z])
    return b.build()


def test_bytes_a_workspace_held_are_taken_again_only_after_its_apply():
    """The alloc that takes a workspace's bytes must wait for the apply that held them
    (nothing else orders the two branches); without that dependency a reload could
    overwrite the workspace while the kernel runs."""
    assert memgraph.verify(branch_plan(True)).peak_bytes == 1024
    with pytest.raises(ep.VerificationError, match="n5 .*missing dependency on n4"):
        memgraph.verify(branch_plan(False))


def test_a_workspace_lies_in_the_arena_and_cannot_hold_live_bytes():
    with pytest.raises(ep.VerificationError, match=r"n4 .*region \[0x00000200, \+256 B\) is outs"):
        memgraph.verify(branch_plan(True, budget=512 + 255))
    good = branch_plan(True)
    nodes = list(good.nodes)
    nodes[4] = nodes[4].__class__(**{**_fields(nodes[4]), "workspace": Region(0, 256)})
    on_x = MemGraph(good.taskgraph, tuple(nodes), good.budget, good.alignment, {}, good.storages)
    with pytest.raises(ep.VerificationError, match="n4 .*workspace .* overlaps %0"):
        memgraph.verify(on_x)


def _fields(node):
    return {name: getattr(node, name) for name in node.__dataclass_fields__}


def test_plans_with_workspaces_round_trip_and_plans_without_keep_their_bytes():
    tg = with_matmul_workspaces(chain(), 1000)
    mg = memgraph.plan(tg, 2 * memgraph.min_budget(tg)[0])
    text = mg.to_json()
    again = MemGraph.from_json(text)
    assert again.to_json() == text
    assert [n.workspace for n in again.nodes] == [n.workspace for n in mg.nodes]
    assert json.loads(text)["nodes"][held_node(mg)]["workspace"] == [
        mg[held_node(mg)].workspace.offset,
        mg[held_node(mg)].workspace.size,
    ]
    plain = memgraph.plan(chain(), "64KiB")
    assert '"workspace"' not in plain.to_json()
    doc = json.loads(text)
    doc["nodes"][held_node(mg)]["workspace"] = [0, 0]
    with pytest.raises(SerializationError, match=r"nodes\[\d+\]\.workspace\[1\]"):
        MemGraph.from_json(json.dumps(doc))


def held_node(mg: MemGraph) -> int:
    return next(n.id for n in mg.nodes if n.workspace is not None)


@st.composite
def programs_with_workspaces(draw):
    tg = draw(einsum_programs())
    computed = [t.id for t in tg if t.is_compute]
    chosen = draw(st.lists(st.sampled_from(computed), unique=True)) if computed else []
    return tg.with_workspaces({t: draw(st.integers(1, 5000)) for t in chosen})


@settings(max_examples=40, deadline=None)
@given(tg=programs_with_workspaces(), data=st.data())
def test_random_programs_with_workspaces_plan_within_budget(tg, data):
    """Every option of the planner, at any budget from `min_budget` up: the plan verifies
    (and the oracle agrees, through the watch), each workspace is held by its apply alone
    and counted in the peak, which stays within the budget."""
    low, _ = memgraph.min_budget(tg)
    high = max(low, memgraph.streaming_minimum(tg))
    budget = data.draw(st.integers(low, 2 * high), label="budget")
    options = {
        "order": data.draw(st.sampled_from(sorted(memgraph.ORDERS)), label="order"),
        "eviction": data.draw(st.sampled_from(["belady", "lru", "belady-cost"]), label="evict"),
        "outputs": data.draw(st.sampled_from(["device", "host"]), label="outputs"),
        "lookahead": data.draw(st.sampled_from([0, 4, 64]), label="lookahead"),
    }
    mg = memgraph.plan(tg, budget, **options)
    report = memgraph.verify(mg)
    assert report.peak_bytes == mg.stats.peak_bytes <= budget
    for node in mg.of_kind(NodeKind.APPLY):
        assert (node.workspace is None) == (tg[node.tensor].workspace == 0)
        if node.workspace is not None:
            assert mg.residencies.live_bytes[node.id] >= node.workspace.size


def test_memory_maps_and_live_bytes_show_the_workspaces():
    pytest.importorskip("matplotlib")
    from memgraph.plots import WORKSPACE_MEANING, live_bytes

    tg = with_matmul_workspaces(chain(), 3000)
    mg = memgraph.plan(tg, memgraph.min_budget(tg)[0])
    _, ys = live_bytes(mg)
    assert ys.max() == mg.stats.peak_bytes == mg.budget  # the workspace makes the peak
    plain = memgraph.plan(chain(), mg.budget)
    assert live_bytes(plain)[1].max() == plain.stats.peak_bytes < mg.stats.peak_bytes
    fig = mg.memory_map()
    ax = fig.axes[0]
    drawn = [c for c in ax.collections if c.get_gid() == "workspaces"]
    assert len(drawn) == 1 and len(drawn[0].get_paths()) == len(matmuls(tg))
    assert WORKSPACE_MEANING in [t.get_text() for t in ax.get_legend().get_texts()]
