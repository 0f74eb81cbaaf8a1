"""The random-order mode catches plans with a missing dependency: the check can fail.

Deleting a dependency edge that the verifier needs (one not implied through other
edges) and running the broken plan, unverified, in random order with poisoned
memory must give a wrong answer or an error for some seed.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from plans import reference_plan
from runtime_cases import block_program, make_inputs, mlp_program, outputs_match, reference

import runtime
from einpage.errors import EinpageError, VerificationError
from memgraph import MemGraph, NodeKind

SEEDS = 40

# Poisoned memory reads as NaN, which NumPy warns about.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")


def without_edge(mg: MemGraph, node_id: int, dep: int) -> MemGraph:
    nodes = list(mg.nodes)
    node = nodes[node_id]
    nodes[node_id] = dataclasses.replace(node, deps=tuple(d for d in node.deps if d != dep))
    return MemGraph(mg.taskgraph, tuple(nodes), mg.budget, mg.alignment, mg.info)


def reachable(mg: MemGraph, start: int, target: int) -> bool:
    stack, seen = [start], set()
    while stack:
        for dep in mg.nodes[stack.pop()].deps:
            if dep == target:
                return True
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return False


def needed_edges(mg: MemGraph):
    """(node, dep) pairs whose deletion leaves the dep unreachable: the verifier needs them."""
    for node in mg.nodes:
        for dep in node.deps:
            if not reachable(without_edge(mg, node.id, dep), node.id, dep):
                yield node.id, dep


def first_failing_seed(mg: MemGraph, inputs, expected) -> int | None:
    for seed in range(SEEDS):
        try:
            got = runtime.run(
                mg, inputs, "numpy", mode="random", seed=seed, unsafe_skip_verify=True
            )
        except EinpageError:
            return seed
        if not outputs_match(got, expected):
            return seed
    return None


@pytest.fixture(scope="module")
def case():
    tg = mlp_program()
    mg = reference_plan(tg, offload=frozenset({3, 5}))
    inputs = make_inputs(tg, 0)
    return mg, inputs, reference(tg, inputs)


def test_intact_plan_is_right_for_every_seed(case):
    mg, inputs, expected = case
    assert first_failing_seed(mg, inputs, expected) is None


def kind_pair(mg, node_id, dep):
    return f"{mg[node_id].kind}<-{mg[dep].kind}"


def vacuous_at_run_time(mg: MemGraph, dep: int) -> bool:
    """An edge to `dep` that no execution can notice: `dep` does no work and waits for
    nothing (an alloc of fresh bytes), or does no work during the run (a host-side
    input is placed before the run starts)."""
    node = mg[dep]
    fresh_alloc = node.kind is NodeKind.ALLOC and not node.deps
    host_input = node.kind is NodeKind.INPUT and node.region is None
    return fresh_alloc or host_input


# Edges of each rule: read-after-write (an apply after the reload or the apply it reads, an
# offload after its writer, a reload after the offload it reads, a device output after its
# writer) and write-after-read (a free after a reader, an alloc after the free of the bytes
# it reuses). Every read-after-write edge must be caught; of the others at least one.
RAW = ["apply<-reload", "apply<-apply", "apply<-input", "offload<-apply", "reload<-offload",
       "output<-apply"]  # fmt: skip
WAR = ["free<-apply", "free<-offload", "alloc<-free"]


@pytest.mark.parametrize("rule", RAW + WAR)
def test_deleting_a_needed_edge_is_caught_in_random_order(case, rule):
    mg, inputs, expected = case
    edges = [(n, d) for n, d in needed_edges(mg) if kind_pair(mg, n, d) == rule]
    assert edges, f"the plan has no needed {rule} edge"
    caught = []
    for node_id, dep in edges:
        broken = without_edge(mg, node_id, dep)
        with pytest.raises(VerificationError, match=f"missing dependency on n{dep}"):
            runtime.run(broken, inputs, "numpy")
        if first_failing_seed(broken, inputs, expected) is not None:
            caught.append((node_id, dep))
    if rule in RAW:
        assert caught == edges, f"{rule}: caught only {caught} of {edges}"
    else:
        assert caught, f"{rule}: none of {edges} was caught"


def test_most_needed_edges_are_caught():
    """Across every needed edge of a plan with offloads that an execution could notice,
    random order catches nearly all. (The rest are ordered anyway through other paths,
    or only matter in a narrow window, as the verifier is stricter than any run.)"""
    tg = block_program(seq=4, d=4, heads=2, vocab=5)
    mg = reference_plan(tg, offload=frozenset(t.id for t in tg if t.id % 4 == 1))
    inputs = make_inputs(tg, 0)
    expected = reference(tg, inputs)
    caught, missed = Counter(), Counter()
    for node_id, dep in needed_edges(mg):
        if vacuous_at_run_time(mg, dep):
            continue
        broken = without_edge(mg, node_id, dep)
        found = first_failing_seed(broken, inputs, expected) is not None
        (caught if found else missed)[kind_pair(mg, node_id, dep)] += 1
    total = sum(caught.values()) + sum(missed.values())
    assert total > 50
    assert sum(caught.values()) >= 0.9 * total, f"caught {dict(caught)}, missed {dict(missed)}"


def test_the_broken_plan_passes_in_insertion_order():
    """Insertion order hides a missing dependency: the random mode is what finds it."""
    tg = mlp_program()
    mg = reference_plan(tg, offload=frozenset({3, 5}))
    inputs = make_inputs(tg, 0)
    expected = reference(tg, inputs)
    node_id, dep = next(
        (n, d) for n, d in needed_edges(mg) if kind_pair(mg, n, d) == "apply<-reload"
    )
    broken = without_edge(mg, node_id, dep)
    got = runtime.run(broken, inputs, "numpy", mode="sequential", unsafe_skip_verify=True)
    assert outputs_match(got, expected)
    assert first_failing_seed(broken, inputs, expected) is not None
