"""Stream schedules: the events each node waits for cover exactly what its dependencies need."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from plans import reference_plan
from runtime_cases import PLAN_MAKERS, block_program, einsum_programs

from einpage.errors import BackendError, VerificationError
from memgraph import MemGraph, NodeKind
from runtime.schedule import Schedule, node_stream, random_order, resolve_mode


def done_before(schedule: Schedule) -> list[set[int] | None]:
    """For every node with work, the nodes certainly done when it starts, by brute force:
    the earlier work of its own stream, and everything done through the events it waited
    for (an event of node i means i and everything done before i)."""
    before: list[set[int] | None] = []
    last_on: dict[str, set[int]] = {}
    for node_id, stream in enumerate(schedule.stream_of):
        if stream is None:
            before.append(None)
            continue
        done = set(last_on.get(stream, set()))
        for waited in schedule.waits[node_id]:
            assert schedule.stream_of[waited] not in (None, stream)
            done |= before[waited] | {waited}
        before.append(done)
        last_on[stream] = done | {node_id}
    return before


def work_needed(mg: MemGraph, schedule: Schedule, node_id: int) -> set[int]:
    """The nodes with work that `node_id`'s dependencies need done (through bookkeeping)."""
    needed, stack = set(), list(mg[node_id].deps)
    while stack:
        dep = stack.pop()
        if schedule.stream_of[dep] is None:
            stack.extend(mg[dep].deps)
        else:
            needed.add(dep)
    return needed


def check_schedule(mg: MemGraph, schedule: Schedule) -> None:
    before = done_before(schedule)
    for node in mg.nodes:
        if schedule.stream_of[node.id] is None:
            continue
        missing = work_needed(mg, schedule, node.id) - before[node.id]
        assert not missing, f"n{node.id} may start before {sorted(missing)}"
        for waited in schedule.waits[node.id]:
            assert waited in schedule.recorded


@pytest.mark.parametrize("maker", sorted(PLAN_MAKERS))
@given(data=st.data(), poison=st.booleans())
def test_stream_schedules_cover_every_dependency(maker, data, poison):
    tg = data.draw(einsum_programs())
    mg = data.draw(PLAN_MAKERS[maker](tg))
    schedule = Schedule.build(mg, "streams", poison)
    check_schedule(mg, schedule)


def test_block_plan_schedule_waits_across_streams_only_when_needed():
    tg = block_program(layers=2)
    mg = reference_plan(tg, offload=frozenset(t.id for t in tg if t.id % 3 == 0))
    schedule = Schedule.build(mg, "streams")
    check_schedule(mg, schedule)
    waits = sum(len(w) for w in schedule.waits)
    cross = sum(
        1
        for node in mg.nodes
        if schedule.stream_of[node.id]
        for dep in node.deps
        if schedule.stream_of[dep] not in (None, schedule.stream_of[node.id])
    )
    assert 0 < waits <= cross  # redundant waits are elided
    assert set(schedule.stream_of) == {None, "compute", "h2d", "d2h"}


def test_the_schedule_check_fails_without_a_needed_wait():
    tg = block_program()
    mg = reference_plan(tg, offload=frozenset(t.id for t in tg if t.id % 3 == 0))
    schedule = Schedule.build(mg, "streams")
    node_id = next(i for i, w in enumerate(schedule.waits) if w)
    waits = list(schedule.waits)
    waits[node_id] = waits[node_id][1:]
    with pytest.raises(AssertionError, match=f"n{node_id} may start before"):
        check_schedule(mg, dataclasses.replace(schedule, waits=tuple(waits)))


def test_sequential_schedule_is_one_stream_without_events():
    mg = reference_plan(block_program(), offload=frozenset({5, 9}))
    schedule = Schedule.build(mg, "sequential")
    assert schedule.streams == ("compute",)
    assert set(schedule.stream_of) <= {None, "compute"}
    assert not schedule.recorded and not any(schedule.waits)


def test_node_streams():
    mg = reference_plan(block_program(), offload=frozenset({5, 9}), outputs_to_host=True)
    for node in mg.nodes:
        stream = node_stream(node)
        expected = {
            NodeKind.APPLY: "compute",
            NodeKind.RELOAD: "h2d",
            NodeKind.OFFLOAD: "d2h",
            NodeKind.ALLOC: None,
            NodeKind.FREE: None,
        }.get(node.kind, stream)
        assert stream == expected
        if node.kind is NodeKind.INPUT:
            assert stream == ("h2d" if node.region is not None else None)
    free = mg.of_kind(NodeKind.FREE)[0]
    assert node_stream(free, poison=True) == "compute"


@given(seed=st.integers(0, 2**32))
def test_random_orders_are_topological(seed):
    mg = reference_plan(block_program(), offload=frozenset({5, 9, 14}))
    order = random_order(mg, seed)
    assert sorted(order) == list(range(len(mg)))
    position = {node: i for i, node in enumerate(order)}
    for node in mg.nodes:
        assert all(position[d] < position[node.id] for d in node.deps)


def test_modes_and_bad_dependencies():
    assert resolve_mode(None, "sequential") == "sequential"
    assert resolve_mode("threaded", "sequential") == "streams"
    with pytest.raises(BackendError, match="unknown mode 'fast'.*'sequential'"):
        resolve_mode("fast", "sequential")
    mg = reference_plan(block_program())
    nodes = list(mg.nodes)
    nodes[3] = dataclasses.replace(nodes[3], deps=(7,))
    bad = MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment)
    with pytest.raises(VerificationError, match="n3 .*n7 is not an earlier node"):
        Schedule.build(bad, "streams")
