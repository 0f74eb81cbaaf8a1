"""The verifier: valid plans pass; each kind of violation is caught and named."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from plans import reference_plan, sliced_weight_plan
from plans import two_output_mlp as mlp_graph
from strategies import einsum_cases

import einpage as ep
from einpage.errors import VerificationError
from memgraph import HostBox, HostStorage, MemGraph, NodeKind, Region, verify


def replace_node(mg: MemGraph, node_id: int, **changes) -> MemGraph:
    nodes = list(mg.nodes)
    nodes[node_id] = dataclasses.replace(nodes[node_id], **changes)
    return MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, mg.info)


def first(mg: MemGraph, kind: NodeKind, **where):
    return next(
        n for n in mg.nodes if n.kind is kind and all(getattr(n, k) == v for k, v in where.items())
    )


@pytest.mark.parametrize("offload_all", [False, True])
@pytest.mark.parametrize("outputs_to_host", [False, True])
def test_reference_plans_verify(offload_all, outputs_to_host):
    tg = mlp_graph()
    offload = frozenset(t.id for t in tg) if offload_all else frozenset()
    mg = reference_plan(tg, offload=offload, outputs_to_host=outputs_to_host)
    report = verify(mg)
    assert report.nodes == len(mg)
    assert report.peak_bytes == mg.stats.peak_bytes <= mg.budget
    assert report.dependencies_checked > 0


@given(case=einsum_cases(max_operands=4), offload_mask=st.integers(0, 2**12), reuse=st.booleans())
def test_random_reference_plans_verify(case, offload_mask, reuse):
    prog = ep.Program()
    tensors = [
        prog.input(f"x{i}", s, case.dtype, role=("weight" if i % 2 else "activation"))
        for i, s in enumerate(case.shapes)
    ]
    y = prog.einsum(case.spec, *tensors)
    prog.output(ep.exp(y), "out")
    tg = prog.build()
    offload = frozenset(t for t in range(len(tg)) if offload_mask >> t & 1)
    verify(reference_plan(tg, offload=offload, reuse=reuse))


def test_deleting_any_dependency_fails_unless_implied():
    tg = mlp_graph()
    mg = reference_plan(tg, offload=frozenset({3, 5}))
    verify(mg)
    checked = 0
    for node in mg.nodes:
        for dep in node.deps:
            broken = replace_node(mg, node.id, deps=tuple(d for d in node.deps if d != dep))
            if _reachable(broken, node.id, dep):
                verify(broken)  # still implied through another chain
                continue
            with pytest.raises(VerificationError, match=f"missing dependency on n{dep}"):
                verify(broken)
            checked += 1
    assert checked > 20


def _reachable(mg: MemGraph, start: int, target: int) -> bool:
    stack, seen = [start], set()
    while stack:
        for dep in mg.nodes[stack.pop()].deps:
            if dep == target:
                return True
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return False


def test_transitive_dependencies_are_accepted():
    tg = mlp_graph()
    mg = reference_plan(tg)
    # Make every apply depend on the previous apply, then drop its direct operand deps
    # that the chain implies: the plan stays valid.
    applies = [n.id for n in mg.nodes if n.kind is NodeKind.APPLY]
    for prev, cur in itertools.pairwise(applies):
        mg = replace_node(mg, cur, deps=tuple(sorted(set(mg[cur].deps) | {prev})))
    verify(mg)


def violation(mg: MemGraph, match: str) -> VerificationError:
    with pytest.raises(VerificationError, match=match) as info:
        verify(mg)
    return info.value


def test_error_names_node_and_shows_context():
    mg = reference_plan(mlp_graph())
    apply = first(mg, NodeKind.APPLY)
    bad = replace_node(mg, apply.id, reads=(Region(0, 256),) * len(apply.reads))
    err = violation(bad, "is resident at")
    assert err.node == apply.id
    text = str(err)
    assert text.startswith(f"n{apply.id} (apply):")
    assert f"> n{apply.id}: apply" in text
    assert len(text.splitlines()) >= 4


def test_overlapping_live_regions():
    mg = reference_plan(mlp_graph(), reuse=False)
    allocs = mg.of_kind(NodeKind.ALLOC)
    victim = allocs[3]
    violation(replace_node(mg, victim.id, region=allocs[2].region), "overlaps")


def test_region_outside_budget_and_unaligned():
    mg = reference_plan(mlp_graph())
    alloc = first(mg, NodeKind.ALLOC)
    violation(replace_node(mg, alloc.id, region=Region(mg.budget, 256)), "outside the arena")
    violation(replace_node(mg, alloc.id, region=Region(8, alloc.region.size)), "not aligned")
    small = Region(alloc.region.offset, 1)
    violation(replace_node(mg, alloc.id, region=small), "smaller than")


def test_operand_not_resident():
    mg = reference_plan(mlp_graph())
    nodes = [n for n in mg.nodes if n.kind is not NodeKind.RELOAD]
    # Without reloads, weights are never on the device when applies read them.
    renumbered = _renumber(mg, nodes)
    violation(renumbered, "operand %1 is allocated but its data was never written")


def _renumber(mg: MemGraph, kept) -> MemGraph:
    new_id = {n.id: i for i, n in enumerate(kept)}
    nodes = tuple(
        dataclasses.replace(
            n, id=new_id[n.id], deps=tuple(new_id[d] for d in n.deps if d in new_id)
        )
        for n in kept
    )
    return MemGraph(mg.taskgraph, nodes, mg.budget, mg.alignment, mg.info)


def test_reload_of_unwritten_storage():
    mg = reference_plan(mlp_graph())
    reload = first(mg, NodeKind.RELOAD)
    violation(replace_node(mg, reload.id, storage=99), "host#99 holds no data")


def test_storage_of_another_tensor():
    mg = reference_plan(mlp_graph())
    reloads = mg.of_kind(NodeKind.RELOAD)
    a, b = reloads[0], next(r for r in reloads if r.tensor != reloads[0].tensor)
    violation(replace_node(mg, b.id, storage=a.storage), f"holds %{a.tensor}, not %{b.tensor}")


def test_free_of_wrong_region_and_double_compute():
    mg = reference_plan(mlp_graph())
    free = first(mg, NodeKind.FREE)
    violation(
        replace_node(mg, free.id, region=Region(free.region.offset + 256, 256)), "does not hold"
    )
    applies = mg.of_kind(NodeKind.APPLY)
    twice = _renumber(mg, list(mg.nodes) + [dataclasses.replace(applies[0], id=len(mg))])
    violation(twice, "computed a second time|already resident|not resident")


def test_missing_output_and_missing_compute():
    mg = reference_plan(mlp_graph())
    kept = [n for n in mg.nodes if not (n.kind is NodeKind.OUTPUT and n.name == "y")]
    violation(_renumber(mg, kept), r"output\(s\) \['y'\] are never produced")
    last_apply = mg.of_kind(NodeKind.APPLY)[-1]
    kept = [n for n in mg.nodes if n.id < last_apply.id]
    violation(_renumber(mg, kept), "never computed")


def test_output_must_name_the_base_of_a_view():
    mg = reference_plan(mlp_graph())
    out = first(mg, NodeKind.OUTPUT, name="h_flat")
    view_task = mg.taskgraph.outputs["h_flat"]
    violation(replace_node(mg, out.id, tensor=view_task), "is a view")


def test_input_nodes_are_checked():
    mg = reference_plan(mlp_graph())
    node = first(mg, NodeKind.INPUT, name="w1")
    violation(replace_node(mg, node.id, name="w2"), 'is not the input named "w2"')
    violation(replace_node(mg, node.id, region=Region(0, 256)), "exactly one of host storage")


def test_structure_checks():
    mg = reference_plan(mlp_graph())
    node = mg.nodes[5]
    violation(replace_node(mg, 5, deps=(7,)), "must be earlier nodes")
    violation(replace_node(mg, 5, id=9), "does not match its position")
    violation(replace_node(mg, 5, tensor=999), "not a task of the TaskGraph")
    assert node.kind is not None


def test_sliced_reload_produces_a_slice_of_an_input():
    mg = sliced_weight_plan()
    verify(mg)
    assert mg.stats.reload_bytes == 8 * 8 * 4  # only the box travels


def test_sliced_reload_needs_a_slice_of_the_stored_input():
    prog_graph = sliced_weight_plan().taskgraph
    assert prog_graph[2].kind == "einsum"
    bad = sliced_weight_plan(reload_tensor=2)
    violation(bad, "holds %0, not %2 \\(nor an input that %2 slices\\)")


# -- host storages and boxes ------------------------------------------------------


def with_storages(mg: MemGraph, **changes) -> MemGraph:
    """`mg` with its storage table edited: `host3=None` drops host#3, `host3=entry` sets it."""
    table = dict(mg.storages)
    for key, entry in changes.items():
        sid = int(key.removeprefix("host"))
        if entry is None:
            table.pop(sid)
        else:
            table[sid] = entry
    return MemGraph(mg.taskgraph, mg.nodes, mg.budget, mg.alignment, mg.info, table)


def sliced_reload(mg: MemGraph):
    return next(n for n in mg.nodes if n.kind is NodeKind.RELOAD and n.box is not None)


def test_the_builder_records_storages_and_the_sliced_reload_box():
    mg = sliced_weight_plan()
    assert mg.storages == {0: HostStorage(0, (64, 8), "float32", 2048, 0, "input")}
    assert sliced_reload(mg).box == HostBox((64, 8), "float32", (16, 0), (8, 8))
    assert mg.host_bytes == 2048
    # A MemGraph remade from the nodes alone works the same table out.
    again = MemGraph(mg.taskgraph, mg.nodes, mg.budget)
    assert again.storages == mg.storages


@pytest.mark.parametrize(
    "box, message",
    [
        (HostBox((64, 8), "float32", (60, 0), (8, 8)), r"\[60:68, 0:8\] does not lie inside"),
        (HostBox((64, 8), "float32", (16, 0), (4, 8)), r"is float32\[4,8\], but the reloaded %1"),
        (HostBox((64, 8), "float32", (8, 0), (8, 8)), r"starts at \[8, 0\], but %1 slices %0"),
        (HostBox((32, 16), "float32", (0, 0), (8, 8)), r"is of a float32\[32,16\] array, not"),
        (HostBox((64, 8), "float64", (16, 0), (8, 8)), r"float64\[64,8\] array, not of host#0"),
        (None, "a sliced reload of %1 from host#0 carries no box"),
    ],
)
def test_a_sliced_reload_box_is_checked(box, message):
    mg = sliced_weight_plan()
    violation(replace_node(mg, sliced_reload(mg).id, box=box), message)


def test_a_whole_reload_carries_no_box():
    mg = reference_plan(mlp_graph())
    reload = first(mg, NodeKind.RELOAD)
    storage = mg.storages[reload.storage]
    bad = replace_node(mg, reload.id, box=storage.box)
    violation(bad, f"reloads all of host#{reload.storage}, yet carries box")


def test_only_copies_carry_boxes():
    mg = reference_plan(mlp_graph(), offload=frozenset({3}))
    box = HostBox((1,), "float32", (0,), (1,))
    free = first(mg, NodeKind.FREE)
    violation(replace_node(mg, free.id, box=box), "only an offload or a reload can copy a box")
    offload = first(mg, NodeKind.OFFLOAD)
    violation(replace_node(mg, offload.id, box=box), r"only a sliced offload \('into'\)")


def test_every_storage_a_node_names_is_in_the_table():
    mg = reference_plan(mlp_graph())
    node = first(mg, NodeKind.INPUT, region=None)
    violation(
        with_storages(mg, **{f"host{node.storage}": None}),
        f"host#{node.storage} is not in the plan's table of host storages",
    )


def test_the_table_holds_what_is_copied_in():
    mg = reference_plan(mlp_graph(), offload=frozenset({3}))
    offload = first(mg, NodeKind.OFFLOAD)
    entry = mg.storages[offload.storage]
    assert entry.kind == "offload" and entry.tensor == 3
    key = f"host{offload.storage}"
    wrong_bytes = dataclasses.replace(entry, nbytes=entry.nbytes + 4)
    violation(with_storages(mg, **{key: wrong_bytes}), r"bytes\), but it holds offload %3")
    wrong_shape = dataclasses.replace(entry, shape=(entry.nbytes // 4,))
    violation(with_storages(mg, **{key: wrong_shape}), "the storage table has host#.*holds offload")
    wrong_kind = dataclasses.replace(entry, kind="input")
    violation(with_storages(mg, **{key: wrong_kind}), "input %3.*but it holds offload %3")
    weight = first(mg, NodeKind.INPUT, region=None)
    stored = mg.storages[weight.storage]
    other = dataclasses.replace(stored, tensor=3)
    violation(with_storages(mg, **{f"host{weight.storage}": other}), "but it holds input")


def test_the_table_lists_no_storage_that_nothing_writes():
    mg = reference_plan(mlp_graph())
    extra = HostStorage(99, (4,), "float32", 16, 0, "offload")
    violation(with_storages(mg, host99=extra), r"lists \['host#99: .*which no node writes")


# -- mutations of whole plans -------------------------------------------------------------


def test_a_dropped_offload_leaves_its_reload_without_data():
    mg = reference_plan(mlp_graph(), offload=frozenset({3}))
    offload = first(mg, NodeKind.OFFLOAD)
    kept = [n for n in mg.nodes if n.id != offload.id]
    violation(_renumber(mg, kept), f"host#{offload.storage} holds no data yet")


def test_a_budget_below_the_plans_arena_is_overflowed():
    mg = reference_plan(mlp_graph())
    top = max(n.region.end for n in mg.nodes if n.region is not None)
    small = MemGraph(mg.taskgraph, mg.nodes, top - 1, mg.alignment, mg.info, mg.storages)
    violation(small, f"is outside the arena of {top - 1} bytes")


def test_running_on_one_stream_is_no_excuse_for_a_missing_dependency():
    # The apply that reuses the bytes of a freed operand and the apply that read it both
    # run on the compute stream, which runs in issue order, but the runtime's random
    # mode does not: the free must wait for the reader (the verified model: only the
    # dependencies order two nodes).
    mg = reference_plan(mlp_graph())
    free = next(
        f
        for f in mg.of_kind(NodeKind.FREE)
        if len(f.deps) > 1 and any(mg[d].kind is NodeKind.APPLY for d in f.deps)
    )
    reader = [d for d in free.deps if mg[d].kind is NodeKind.APPLY][-1]
    assert mg[reader].stream == "compute"
    bad = replace_node(mg, free.id, deps=tuple(d for d in free.deps if d != reader))
    violation(bad, f"missing dependency on n{reader}")


def test_a_plan_serialized_through_its_predecessors_verifies_alike():
    mg = reference_plan(mlp_graph(), offload=frozenset({3, 5}))
    chained = tuple(dataclasses.replace(n, deps=(n.id - 1,) if n.id else ()) for n in mg.nodes)
    serial = MemGraph(mg.taskgraph, chained, mg.budget, mg.alignment, mg.info, mg.storages)
    assert verify(serial) == verify(mg)
    middle = len(mg) // 2
    broken = replace_node(serial, middle, deps=())
    err = violation(broken, "missing dependency on n")
    assert err.node >= middle
