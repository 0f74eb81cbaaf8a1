"""`memgraph.verify` against the oracle (`tests/oracle.py`), which shares no code with it.

The oracle judges a plan from its JSON text by its own reasoning (happens-before as
reachability bitsets, and a replay over the arena's bytes). Both must give the same
verdict on real plans (random programs, partitioned random programs, a small LLaMA)
and on each one-edit mutation of them: a deleted dependency, a shifted region or read,
a wrong storage, a dropped node (an offload, a reload, a free, ...), a smaller budget,
a shifted box, a swapped pair of nodes, a node moved up to just after its last
dependency, a node naming another tensor of the same size, a read of another live
tensor's region, a region grown or shrunk by a step, and for kernels' workspaces one
shifted, dropped, shrunk, put on another apply or onto a region its apply uses.
Accepted by both, with the same
peak; or rejected by both at the same node: each reports the first node, in insertion
order, that breaks one of its rules, and their rules are meant to be equivalent (the
oracle's docstring states them). Messages differ.
"""

from __future__ import annotations

import dataclasses
import functools

import oracle
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from partition_cases import random_programs
from strategies import einsum_programs

import einpage as ep
from einpage.errors import VerificationError
from einpage.models import llama
from memgraph import HostBox, MemGraph, NodeKind, Region, verify
from memgraph.planner import min_budget, plan, streaming_minimum
from taskgraph.partition import finest_block, partition, working_set

pytestmark = pytest.mark.judges_plans_itself  # the watch need not judge them again


def verifier_verdict(mg: MemGraph) -> tuple:
    """("accepted", peak bytes) or ("rejected", the node named) from `memgraph.verify`."""
    try:
        report = verify(mg)
    except VerificationError as err:
        return ("rejected", err.node)
    return ("accepted", report.peak_bytes)


def oracle_verdict(verdict: oracle.Verdict) -> tuple:
    """The same from the oracle's verdict."""
    return ("accepted", verdict.peak_bytes) if verdict.accepted else ("rejected", verdict.node)


def same_verdict(mg: MemGraph) -> tuple:
    """Both verdicts on `mg`, asserted equal."""
    new, independent = verifier_verdict(mg), oracle.judge(mg.to_json())
    assert new == oracle_verdict(independent), f"\nverifier: {new}\noracle:   {independent}"
    return new


# -- mutations ------------------------------------------------------------------------


def rebuilt(mg: MemGraph, nodes, budget: int | None = None) -> MemGraph:
    budget = mg.budget if budget is None else budget
    return MemGraph(mg.taskgraph, tuple(nodes), budget, mg.alignment, mg.info, mg.storages)


def replaced(mg: MemGraph, node_id: int, **changes) -> MemGraph:
    nodes = list(mg.nodes)
    nodes[node_id] = dataclasses.replace(nodes[node_id], **changes)
    return rebuilt(mg, nodes)


def dropped(mg: MemGraph, node_id: int) -> MemGraph:
    """`mg` without node `node_id`; later ids move down, dependencies on it vanish."""
    new_id = {n.id: n.id - (n.id > node_id) for n in mg.nodes if n.id != node_id}
    nodes = [
        dataclasses.replace(
            n, id=new_id[n.id], deps=tuple(new_id[d] for d in n.deps if d in new_id)
        )
        for n in mg.nodes
        if n.id != node_id
    ]
    return rebuilt(mg, nodes)


def swapped(mg: MemGraph, a: int) -> MemGraph:
    """Nodes `a` and `a + 1` trade places (dependencies follow them where they can)."""
    b = a + 1
    where = {a: b, b: a}
    nodes = []
    for n in mg.nodes:
        deps = tuple(where.get(d, d) for d in n.deps)
        nodes.append(dataclasses.replace(n, id=where.get(n.id, n.id), deps=deps))
    nodes[a], nodes[b] = nodes[b], nodes[a]
    if a in nodes[a].deps:  # the moved-up node cannot depend on the one now after it
        nodes[a] = dataclasses.replace(nodes[a], deps=tuple(d for d in nodes[a].deps if d != a))
    return rebuilt(mg, nodes)


def hoisted(mg: MemGraph, node_id: int) -> MemGraph:
    """Node `node_id` moved up to just after its last dependency (the earliest place its
    dependencies allow): only the insertion order changes."""
    moving = mg.nodes[node_id]
    place = max(moving.deps, default=-1) + 1
    order = [n.id for n in mg.nodes if n.id != node_id]
    order.insert(place, node_id)
    new_id = {old: new for new, old in enumerate(order)}
    nodes = [
        dataclasses.replace(
            mg.nodes[old], id=new, deps=tuple(new_id[d] for d in mg.nodes[old].deps)
        )
        for new, old in enumerate(order)
    ]
    return rebuilt(mg, nodes)


MUTATIONS = (
    "delete dependency",
    "shift region",
    "shift read",
    "wrong storage",
    "drop node",
    "drop offload",
    "smaller budget",
    "shift box",
    "swap nodes",
    "hoist node",
    "other tensor",
    "read another region",
    "resize region",
    "shift workspace",
    "drop workspace",
    "shrink workspace",
    "move workspace",
    "workspace on a region",
)


def mutate(mg: MemGraph, how: str, draw) -> MemGraph | None:
    """`mg` changed as `how` says, at a place `draw` picks (None when nothing applies)."""
    nodes = mg.nodes

    def pick(candidates):
        candidates = list(candidates)
        return draw(st.sampled_from(candidates), label="node") if candidates else None

    if how == "delete dependency":
        node = pick(n for n in nodes if n.deps)
        if node is None:
            return None
        dep = draw(st.sampled_from(node.deps), label="dependency")
        return replaced(mg, node.id, deps=tuple(d for d in node.deps if d != dep))
    if how == "shift region":
        node = pick(n for n in nodes if n.region is not None)
        if node is None:
            return None
        step = draw(st.sampled_from([-mg.alignment, mg.alignment, 1, -node.region.offset]))
        region = Region(max(0, node.region.offset + step), node.region.size)
        return replaced(mg, node.id, region=region)
    if how == "shift read":
        node = pick(n for n in nodes if n.reads)
        if node is None:
            return None
        k = draw(st.integers(0, len(node.reads) - 1), label="operand")
        reads = list(node.reads)
        reads[k] = Region(reads[k].offset + mg.alignment, reads[k].size)
        return replaced(mg, node.id, reads=tuple(reads))
    if how == "wrong storage":
        node = pick(n for n in nodes if n.storage is not None)
        if node is None:
            return None
        other = draw(st.sampled_from(sorted(set(mg.storages) | {max(mg.storages, default=0) + 1})))
        return replaced(mg, node.id, storage=other)
    if how in ("drop node", "drop offload"):
        kinds = (NodeKind.OFFLOAD, NodeKind.RELOAD) if how == "drop offload" else tuple(NodeKind)
        node = pick(n for n in nodes if n.kind in kinds)
        return None if node is None else dropped(mg, node.id)
    if how == "smaller budget":
        cut = draw(st.sampled_from([1, mg.alignment, mg.budget // 10 + 1]), label="cut")
        return rebuilt(mg, nodes, max(1, mg.budget - cut))
    if how == "shift box":
        node = pick(n for n in nodes if n.box is not None)
        if node is None:
            return None
        box = node.box
        axis = draw(st.integers(0, len(box.starts) - 1), label="axis")
        starts = list(box.starts)
        starts[axis] += draw(st.sampled_from([-1, 1]))
        return replaced(mg, node.id, box=HostBox(box.shape, box.dtype, tuple(starts), box.sizes))
    if how == "swap nodes":
        if len(nodes) < 2:
            return None
        return swapped(mg, draw(st.integers(0, len(nodes) - 2), label="position"))
    if how == "hoist node":
        node = pick(n for n in nodes if n.id > max(n.deps, default=-1) + 1)
        return None if node is None else hoisted(mg, node.id)
    if how == "other tensor":
        tg = mg.taskgraph
        node = pick(nodes)
        if node is None:
            return None
        size = tg[node.tensor].nbytes
        same_size = [
            t.id for t in tg if t.nbytes == size and t.id != node.tensor and not t.op.aliases_input
        ]
        if not same_size:
            return None
        return replaced(mg, node.id, tensor=draw(st.sampled_from(same_size), label="tensor"))
    if how == "read another region":
        node = pick(n for n in nodes if n.reads)
        if node is None:
            return None
        k = draw(st.integers(0, len(node.reads) - 1), label="operand")
        others = sorted({n.region for n in nodes if n.region is not None} - {node.reads[k]})
        if not others:
            return None
        reads = list(node.reads)
        reads[k] = draw(st.sampled_from(others), label="region")
        return replaced(mg, node.id, reads=tuple(reads))
    if how == "resize region":
        node = pick(n for n in nodes if n.region is not None)
        if node is None:
            return None
        step = draw(st.sampled_from([-mg.alignment, mg.alignment]), label="step")
        region = Region(node.region.offset, max(1, node.region.size + step))
        return replaced(mg, node.id, region=region)
    if how.endswith("workspace") or how == "workspace on a region":
        return mutate_workspace(mg, how, pick, draw)
    raise AssertionError(how)


def mutate_workspace(mg: MemGraph, how: str, pick, draw) -> MemGraph | None:
    """The workspace mutations of `mutate` (None when the plan has no workspace)."""
    node = pick(n for n in mg.nodes if n.workspace is not None)
    if node is None:
        return None
    region = node.workspace
    if how == "shift workspace":
        step = draw(st.sampled_from([-mg.alignment, mg.alignment, 1, -region.offset]))
        return replaced(mg, node.id, workspace=Region(max(0, region.offset + step), region.size))
    if how == "drop workspace":
        return replaced(mg, node.id, workspace=None)
    if how == "shrink workspace":
        return replaced(mg, node.id, workspace=Region(region.offset, max(1, region.size // 2)))
    if how == "move workspace":  # onto another apply, which declares none or its own
        other = pick(n for n in mg.nodes if n.kind is NodeKind.APPLY and n.id != node.id)
        if other is None:
            return None
        return replaced(replaced(mg, node.id, workspace=None), other.id, workspace=region)
    regions = [node.region, *node.reads]
    return replaced(mg, node.id, workspace=draw(st.sampled_from(regions), label="region"))


@st.composite
def with_workspaces(draw, tg):
    """`tg` with random kernel workspaces (0 to 3 KiB) on some of its compute tasks."""
    computed = [t.id for t in tg if t.is_compute]
    chosen = draw(st.lists(st.sampled_from(computed), unique=True)) if computed else []
    sizes = {t: draw(st.integers(1, 3072), label=f"workspace of %{t}") for t in chosen}
    return tg.with_workspaces(sizes)


def check_mutations(mg: MemGraph, data) -> None:
    """The plan itself verifies under both; then one mutation of it, compared."""
    assert same_verdict(mg)[0] == "accepted"
    how = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    broken = mutate(mg, how, data.draw)
    if broken is not None:
        event(f"{how}: {same_verdict(broken)[0]}")


# -- plans ----------------------------------------------------------------------------


@given(tg=einsum_programs(), data=st.data())
def test_same_verdict_on_mutated_plans_with_workspaces(tg, data):
    tg = data.draw(with_workspaces(tg), label="workspaces")
    alignment = data.draw(st.sampled_from([16, 256]), label="alignment")
    low, _ = min_budget(tg, alignment)
    high = streaming_minimum(tg, alignment=alignment)
    budget = data.draw(st.integers(low, max(low, high)), label="budget")
    order = data.draw(st.sampled_from(["program", "memory"]), label="order")
    mg = plan(tg, budget, alignment=alignment, order=order)
    assert all(
        (n.workspace is not None) == bool(tg[n.tensor].workspace)
        for n in mg.nodes
        if n.kind is NodeKind.APPLY
    )
    check_mutations(mg, data)


@given(tg=einsum_programs(), data=st.data())
def test_same_verdict_on_mutated_plans_of_random_programs(tg, data):
    alignment = data.draw(st.sampled_from([16, 64]), label="alignment")
    low, _ = min_budget(tg, alignment)
    high = streaming_minimum(tg, alignment=alignment)
    budget = data.draw(st.integers(low, max(low, high)), label="budget")
    options = {
        "order": data.draw(st.sampled_from(["program", "memory"]), label="order"),
        "eviction": data.draw(st.sampled_from(["belady", "lru"]), label="eviction"),
        "outputs": data.draw(st.sampled_from(["device", "host"]), label="outputs"),
        "inputs": data.draw(st.sampled_from(["auto", "host"]), label="inputs"),
    }
    check_mutations(plan(tg, budget, alignment=alignment, **options), data)


@given(case=random_programs(), data=st.data())
def test_same_verdict_on_mutated_plans_of_partitioned_programs(case, data):
    tg = case.tg
    floor, _ = finest_block(tg, 16)
    largest = max(working_set(tg, t.id, 16) for t in tg if t.kind != "input")
    limit = data.draw(st.integers(max(floor, 1), max(floor, largest, 1)), label="limit")
    parted = partition(tg, limit, alignment=16)
    low, _ = min_budget(parted, 16, "host")
    high = streaming_minimum(parted, alignment=16, inputs="host")
    budget = data.draw(st.integers(low, max(low, high)), label="budget")
    outputs = data.draw(st.sampled_from(["device", "host"]), label="outputs")
    check_mutations(plan(parted, budget, alignment=16, inputs="host", outputs=outputs), data)


@functools.cache
def small_llama(seq: int, budget: str, block: str) -> MemGraph:
    tg = llama.prefill_program(llama.PRESETS["tiny"], 1, seq, "float32").build()
    return ep.compile(tg, budget, partition=block, verify=False).plan


@pytest.mark.slow
@given(
    which=st.sampled_from([(8, "40%streaming", "auto"), (16, "30%streaming", "16KiB")]),
    data=st.data(),
)
def test_same_verdict_on_mutated_small_llama_plans(which, data):
    check_mutations(small_llama(*which), data)


def test_every_deleted_dependency_of_a_partitioned_llama_plan_gets_the_same_verdict():
    # Exhaustive on one real plan: sliced reloads, drops, offloads, host assembly.
    mg = small_llama(16, "30%streaming", "16KiB")
    rejected = 0
    for node in mg.nodes[:160]:
        for dep in node.deps:
            broken = replaced(mg, node.id, deps=tuple(d for d in node.deps if d != dep))
            rejected += same_verdict(broken)[0] == "rejected"
    assert rejected > 60


def test_a_missing_dependency_is_reported_before_a_later_violation():
    # The new verifier settles dependency questions in a batch; the first violation in
    # replay order still wins, whether it is a dependency or something else.
    mg = small_llama(8, "40%streaming", "auto")
    free = next(n for n in mg.nodes if n.kind is NodeKind.FREE and len(n.deps) == 1)
    no_dep = replaced(mg, free.id, deps=())
    later = max(n.id for n in mg.nodes if n.kind is NodeKind.ALLOC)
    both = replaced(no_dep, later, region=Region(mg.budget, mg.alignment))
    assert same_verdict(both) == ("rejected", free.id)
    with pytest.raises(VerificationError, match="missing dependency"):
        verify(both)
    assert "does not happen after" in oracle.judge(both.to_json()).reason
    earlier = next(n.id for n in mg.nodes if n.kind is NodeKind.ALLOC and n.id < free.id)
    first = replaced(no_dep, earlier, region=Region(mg.budget, mg.alignment))
    assert same_verdict(first)[1] == earlier


def test_a_serialized_llama_plan_asks_about_nodes_far_back():
    # Each node depends on its predecessor only: every question is settled through a
    # chain, some over more than a thousand nodes (the sweep's longer-lived classes).
    mg = small_llama(8, "40%streaming", "auto")
    chained = [dataclasses.replace(n, deps=(n.id - 1,) if n.id else ()) for n in mg.nodes]
    serial = rebuilt(mg, chained)
    assert same_verdict(serial)[0] == "accepted"
    for cut in (len(mg) // 3, len(mg) - 5):
        status, node = same_verdict(replaced(serial, cut, deps=()))
        assert status == "rejected" and node >= cut
