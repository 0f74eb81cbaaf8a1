"""The oracle (`tests/oracle.py`) and its watch (`tests/oracle_watch.py`).

The oracle accepts real plans with the peak the verifier reports, and rejects each
broken rule at the node that breaks it, naming the rule. A verifier with a wrong rule
is caught: by the equivalence check and by the watch that judges every plan the tests
make. (The check the oracle replaced compared `memgraph.verify` with a copy of itself,
which has every wrong rule the verifier has.)
"""

from __future__ import annotations

import dataclasses
import doctest
import functools

import oracle
import oracle_watch
import pytest
from plans import reference_plan, sliced_weight_plan, two_output_mlp

import einpage as ep
from einpage.errors import VerificationError
from einpage.models import llama
from memgraph import HostBox, MemGraph, NodeKind, Region, verify


def judged(mg: MemGraph) -> oracle.Verdict:
    return oracle.judge(mg.to_json())


def rebuilt(mg: MemGraph, nodes, storages=None) -> MemGraph:
    storages = mg.storages if storages is None else storages
    return MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, mg.info, storages)


def replaced(mg: MemGraph, node_id: int, **changes) -> MemGraph:
    nodes = list(mg.nodes)
    nodes[node_id] = dataclasses.replace(nodes[node_id], **changes)
    return rebuilt(mg, nodes)


def without(mg: MemGraph, node_id: int, dep: int) -> MemGraph:
    """`mg` with node `node_id` no longer depending on `dep`."""
    return replaced(mg, node_id, deps=tuple(d for d in mg[node_id].deps if d != dep))


def kept(mg: MemGraph, keep) -> MemGraph:
    """`mg` with only the nodes `keep(node)` accepts, renumbered."""
    nodes = [n for n in mg.nodes if keep(n)]
    new_id = {n.id: i for i, n in enumerate(nodes)}
    return rebuilt(
        mg,
        [
            dataclasses.replace(
                n, id=new_id[n.id], deps=tuple(new_id[d] for d in n.deps if d in new_id)
            )
            for n in nodes
        ],
    )


def first(mg: MemGraph, kind: NodeKind, where=lambda n: True):
    return next(n for n in mg.nodes if n.kind is kind and where(n))


@functools.cache
def mlp_plan() -> MemGraph:
    """A small plan with reloads, an offload and its reload, drops, outputs on the host."""
    return reference_plan(two_output_mlp(), offload=frozenset({3}), outputs_to_host=True)


@functools.cache
def llama_plan() -> MemGraph:
    """A partitioned plan with sliced reloads and an output assembled on the host."""
    tg = llama.prefill_program(llama.PRESETS["tiny"], 1, 16, "float32").build()
    return ep.compile(tg, "30%streaming", partition="16KiB", verify=False).plan


def test_the_oracles_example_runs():
    assert doctest.testmod(oracle).failed == 0


@pytest.mark.parametrize(
    "make",
    [
        mlp_plan,
        lambda: reference_plan(two_output_mlp(), offload=frozenset(range(11)), reuse=False),
        sliced_weight_plan,
        llama_plan,
    ],
    ids=["mlp", "mlp-offload-all", "sliced-weight", "partitioned-llama"],
)
def test_real_plans_are_accepted_with_the_verifiers_peak(make):
    mg = make()
    verdict = judged(mg)
    assert verdict.accepted, verdict
    assert verdict.peak_bytes == verify(mg).peak_bytes == mg.stats.peak_bytes


def test_the_partitioned_plan_exercises_sliced_copies():
    # So that the rules about boxes (H3, H4, H5) are checked on a real plan above.
    mg = llama_plan()
    assert any(n.kind is NodeKind.RELOAD and n.box is not None for n in mg.nodes)
    assert any(n.into is not None for n in mg.nodes)


# -- each rule, broken ------------------------------------------------------------------


def _free_before_reader(mg):
    free = first(mg, NodeKind.FREE, lambda n: any(mg[d].kind is NodeKind.APPLY for d in n.deps))
    reader = max(d for d in free.deps if mg[d].kind is NodeKind.APPLY)
    return without(mg, free.id, reader), free.id


def _alloc_before_free(mg):
    alloc = first(mg, NodeKind.ALLOC, lambda n: any(mg[d].kind is NodeKind.FREE for d in n.deps))
    return replaced(mg, alloc.id, deps=()), alloc.id


def _read_before_reload(mg):
    apply = first(mg, NodeKind.APPLY, lambda n: any(mg[d].kind is NodeKind.RELOAD for d in n.deps))
    reload = next(d for d in apply.deps if mg[d].kind is NodeKind.RELOAD)
    return without(mg, apply.id, reload), apply.id


def _write_before_alloc(mg):
    apply = first(mg, NodeKind.APPLY)
    alloc = next(d for d in apply.deps if mg[d].kind is NodeKind.ALLOC)
    return without(mg, apply.id, alloc), apply.id


def _read_elsewhere(mg):
    apply = first(mg, NodeKind.APPLY)
    moved = Region(apply.reads[0].offset + mg.alignment, apply.reads[0].size)
    return replaced(mg, apply.id, reads=(moved, *apply.reads[1:])), apply.id


def _alloc_overlapping(mg):
    allocs = mg.of_kind(NodeKind.ALLOC)
    alloc = allocs[1]  # while the first alloc's tensor is still held
    return replaced(
        mg, alloc.id, region=Region(allocs[0].region.offset, alloc.region.size)
    ), alloc.id


def _unaligned(mg):
    alloc = first(mg, NodeKind.ALLOC)
    return replaced(mg, alloc.id, region=Region(8, alloc.region.size)), alloc.id


def _outside(mg):
    alloc = first(mg, NodeKind.ALLOC)
    return replaced(mg, alloc.id, region=Region(mg.budget, mg.alignment)), alloc.id


def _later_dependency(mg):
    return replaced(mg, 5, deps=(7,)), 5


def _names_a_view(mg):
    out = first(mg, NodeKind.OUTPUT, lambda n: n.name == "h_flat")
    return replaced(mg, out.id, tensor=mg.taskgraph.outputs["h_flat"]), out.id


def _reload_of_nothing(mg):
    reload = first(mg, NodeKind.RELOAD)
    return replaced(mg, reload.id, storage=max(mg.storages) + 1), reload.id


def _reload_before_offload(mg):
    reload = first(mg, NodeKind.RELOAD, lambda n: mg.storages[n.storage].kind == "offload")
    offload = next(d for d in reload.deps if mg[d].kind is NodeKind.OFFLOAD)
    return without(mg, reload.id, offload), reload.id


def _offload_into_another_tensors_storage(mg):
    offload = first(mg, NodeKind.OFFLOAD)
    weight = first(mg, NodeKind.INPUT, lambda n: n.storage is not None)
    return replaced(mg, offload.id, storage=weight.storage), offload.id


def _wrong_table_entry(mg):
    offload = first(mg, NodeKind.OFFLOAD)
    table = dict(mg.storages)
    entry = table[offload.storage]
    table[offload.storage] = dataclasses.replace(entry, nbytes=entry.nbytes + 4)
    return rebuilt(mg, mg.nodes, table), offload.id


def _renamed_input(mg):
    node = first(mg, NodeKind.INPUT, lambda n: n.name == "w1")
    return replaced(mg, node.id, name="w2"), node.id


def _output_before_its_offload(mg):
    out = first(mg, NodeKind.OUTPUT)
    return replaced(mg, out.id, deps=()), out.id


def _last_apply_dropped(mg):
    last = mg.of_kind(NodeKind.APPLY)[-1]
    return kept(mg, lambda n: n.id < last.id), None


def _output_dropped(mg):
    return kept(mg, lambda n: not (n.kind is NodeKind.OUTPUT and n.name == "y")), None


def _sliced_reload_box_shifted(mg):
    reload = first(mg, NodeKind.RELOAD, lambda n: n.box is not None)
    box = reload.box
    moved = HostBox(box.shape, box.dtype, (box.starts[0] + 1, *box.starts[1:]), box.sizes)
    return replaced(mg, reload.id, box=moved), reload.id


def _sliced_offload_box_swapped(mg):
    offloads = [n for n in mg.nodes if n.into is not None]
    a, b = offloads[0], next(n for n in offloads if n.box != offloads[0].box)
    return replaced(mg, a.id, box=b.box), a.id


def _assembled_output_before_a_piece(mg):
    out = first(mg, NodeKind.OUTPUT, lambda n: n.storage is not None)
    return replaced(mg, out.id, deps=()), out.id


BROKEN = {
    "S1": [_later_dependency],
    "S2": [_names_a_view],
    "S3": [_outside],
    "S4": [_unaligned],
    "D1": [_alloc_overlapping, _alloc_before_free],
    "D2": [_write_before_alloc],
    "D3": [_read_before_reload, _read_elsewhere],
    "D4": [_free_before_reader],
    "H1": [_wrong_table_entry],
    "H2": [_offload_into_another_tensors_storage],
    "H3": [_reload_of_nothing, _reload_before_offload],
    "H5": [_output_before_its_offload],
    "P1": [_renamed_input],
    "P2": [_last_apply_dropped],
    "P3": [_output_dropped],
}
BROKEN_PARTITIONED = {
    "H3": [_sliced_reload_box_shifted],
    "H4": [_sliced_offload_box_swapped],
    "H5": [_assembled_output_before_a_piece],
}


def _cases(table, plan):
    return [
        pytest.param(rule, breaker, plan, id=f"{rule}-{breaker.__name__.strip('_')}")
        for rule, breakers in table.items()
        for breaker in breakers
    ]


@pytest.mark.parametrize(
    "rule, breaker, plan", _cases(BROKEN, mlp_plan) + _cases(BROKEN_PARTITIONED, llama_plan)
)
def test_each_broken_rule_is_named_at_the_node_that_breaks_it(rule, breaker, plan):
    broken, node = breaker(plan())
    verdict = judged(broken)
    assert (verdict.accepted, verdict.rule, verdict.node) == (False, rule, node), verdict
    with pytest.raises(VerificationError) as info:  # the verifier agrees
        verify(broken)
    assert info.value.node == node


def test_a_shared_stream_orders_nothing():
    # Two applies on the compute stream, the second reading what the first wrote: without
    # the dependency, nothing orders them (the runtime's random mode).
    mg = mlp_plan()
    reader = first(mg, NodeKind.APPLY, lambda n: any(mg[d].kind is NodeKind.APPLY for d in n.deps))
    writer = max(d for d in reader.deps if mg[d].kind is NodeKind.APPLY)
    verdict = judged(without(mg, reader.id, writer))
    assert (verdict.rule, verdict.node) == ("D3", reader.id)
    assert f"does not happen after n{writer}" in verdict.reason


# -- a verifier with a wrong rule is caught ---------------------------------------------


def stream_trusting_verify(mg: MemGraph):
    """A verifier with a wrong rule: it takes each stream to run its nodes in insertion
    order (true of the runtime's "streams" mode, not of its "random" one), as though
    every node depended on the node before it on its stream."""
    last: dict[str, int] = {}
    nodes = []
    for node in mg.nodes:
        before = last.get(node.stream)
        deps = node.deps if before is None else tuple(sorted({*node.deps, before}))
        nodes.append(dataclasses.replace(node, deps=deps))
        if node.stream != "none":
            last[node.stream] = node.id
    return verify(rebuilt(mg, nodes))


def verdicts(check, mg: MemGraph) -> tuple[bool, bool]:
    """(accepted by `check`, accepted by the oracle)."""
    try:
        check(mg)
        accepted = True
    except VerificationError:
        accepted = False
    return accepted, judged(mg).accepted


def test_the_oracle_disagrees_with_a_verifier_that_trusts_stream_order():
    # Deleting each dependency of a real plan in turn: the verifier and the oracle agree
    # on every one; a verifier that trusts stream order accepts some that both reject.
    mg = mlp_plan()
    right = wrong = 0
    for node in mg.nodes:
        for dep in node.deps:
            broken = without(mg, node.id, dep)
            accepted, by_oracle = verdicts(verify, broken)
            assert accepted == by_oracle, (node.id, dep)
            right += 1
            wrong += verdicts(stream_trusting_verify, broken)[0] != by_oracle
    assert right > 40 and wrong >= 3


def test_the_watch_reports_a_plan_the_verifier_and_the_oracle_judge_differently(monkeypatch):
    mg = mlp_plan()
    reader = first(mg, NodeKind.APPLY, lambda n: any(mg[d].kind is NodeKind.APPLY for d in n.deps))
    writer = max(d for d in reader.deps if mg[d].kind is NodeKind.APPLY)
    watch = oracle_watch.WATCH
    assert not watch.take()
    monkeypatch.setattr(watch, "verify", stream_trusting_verify)
    without(mg, reader.id, writer)  # made: the watch judges it
    found = watch.take()
    assert len(found) == 1 and "the verifier accepted it" in found[0]
    assert "rule='D3'" in found[0]


def test_the_watch_leaves_out_plans_its_json_cannot_say():
    # A box on a free is no field of a free: the JSON leaves it out, so the oracle judges
    # a plan without it (and accepts), while the verifier rejects the plan with it.
    mg = mlp_plan()
    free = first(mg, NodeKind.FREE)
    watch = oracle_watch.WATCH
    before = watch.counts["JSON unlike the plan"]
    bad = replaced(mg, free.id, box=HostBox((1,), "float32", (0,), (1,)))
    assert judged(bad).accepted
    with pytest.raises(VerificationError, match="only an offload or a reload can copy a box"):
        verify(bad)
    assert watch.counts["JSON unlike the plan"] == before + 1
    assert not watch.take()
