"""Transfer lower bounds: never above what a valid plan moves, exact on small cases."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st
from plans import reference_plan
from strategies import einsum_cases
from streaming_cases import PROGRAMS, mlp, working_budget

import einpage as ep
import memgraph.bounds as bounds_module
from einpage.errors import GraphError, InfeasibleBudgetError
from memgraph import MemGraph, NodeKind, verify
from memgraph.baselines import layer_streaming_plan
from memgraph.bounds import TransferBounds, transfer_lower_bounds

KIB = 1024


def test_module_doctests():
    assert doctest.testmod(bounds_module).failed == 0


def apply_order(mg: MemGraph) -> list[int]:
    return [n.tensor for n in mg.of_kind(NodeKind.APPLY) if not n.recompute]


def assert_below(bounds: TransferBounds, mg: MemGraph) -> None:
    """The bounds hold for `mg`: for a plan that recomputes, on what it offloads or
    discards and reloads or recomputes (see `PlanStats`: with each discard an offload and
    each recompute a reload, the plan would move no more)."""
    stats = mg.stats
    out = stats.offload_bytes + stats.discard_bytes
    back = stats.reload_bytes + stats.recompute_bytes
    assert bounds.compulsory_reload_bytes <= stats.reload_bytes
    assert bounds.reload_bytes <= back
    assert bounds.offload_bytes <= out
    assert bounds.total_bytes <= out + back


def chain():
    """x -> a -> b -> c -> d (1 KiB each), then y = sum(a * d) (4 B): a waits while b, c
    and d are computed."""
    prog = ep.Program("chain")
    x = prog.input("x", (256,))
    a = ep.exp(x)
    d = ep.exp(ep.exp(ep.exp(a)))
    prog.output(prog.einsum("i,i->", a, d), "y")
    return prog.build()


def test_the_parts_of_a_small_case():
    tg = chain()  # %0 x, %1 a, %2 b, %3 c, %4 d, %5 y
    roomy = transfer_lower_bounds(tg, 3 * KIB)
    assert (roomy.peak_live_bytes, roomy.peak_task) == (3 * KIB, 3)
    assert roomy.excess_bytes == roomy.offload_bytes == roomy.reload_bytes == 0
    tight = transfer_lower_bounds(tg, "2.5KiB")  # a beside b and c, or c and d: 512 B over
    assert (tight.excess_bytes, tight.excess_task) == (KIB // 2, 3)
    assert (tight.offload_bytes, tight.offload_task) == (KIB // 2, 3)
    assert (tight.reload_bytes, tight.total_bytes) == (KIB // 2, KIB)
    assert tight.as_dict()["total_bytes"] == KIB
    assert "reloads >= 512 B (0 B compulsory + 512 B over the budget)" in str(tight)


def test_a_plan_that_offloads_the_waiting_tensor_moves_more_than_the_bound():
    tg = chain()
    mg = reference_plan(tg, offload=frozenset({1}))  # a goes to the host and comes back
    verify(mg)
    bounds = transfer_lower_bounds(tg, mg.budget, apply_order(mg))
    assert mg.budget == 2 * KIB + 256
    # 768 B must go out and come back; whole tensors move, so the best plan moves 2 KiB.
    assert (bounds.offload_bytes, bounds.reload_bytes) == (768, 768)
    assert_below(bounds, mg)


def test_every_host_input_read_is_reloaded_at_least_once():
    tg = mlp(layers=2, width=64, batch=4)
    weights = sum(tg[t].nbytes for t in tg.inputs.values() if tg[t].op.location == "host")
    bounds = transfer_lower_bounds(tg, "1GiB")
    assert bounds.compulsory_reload_bytes == bounds.reload_bytes == weights
    assert bounds.excess_bytes == bounds.offload_bytes == 0


def test_a_host_input_nobody_reads_needs_no_reload():
    prog = ep.Program()
    w = prog.input("w", (64,), role="weight")
    prog.input("unused", (64,), role="weight")
    prog.output(ep.exp(w), "y")
    assert transfer_lower_bounds(prog.build(), "1MiB").compulsory_reload_bytes == 256


def test_the_order_changes_the_capacity_bound():
    """Two branches, each reduced to a scalar: finishing one before starting the other
    keeps less alive."""
    prog = ep.Program()
    x = prog.input("x", (256,))
    a1, b1 = ep.exp(x), ep.exp(x)
    a2, b2 = prog.einsum("i->", a1), prog.einsum("i->", b1)
    prog.output(a2 + b2, "y")
    tg = prog.build()  # %1 a1, %2 b1, %3 a2, %4 b2, %5 y
    interleaved = transfer_lower_bounds(tg, "2.5KiB", [1, 2, 3, 4, 5])
    grouped = transfer_lower_bounds(tg, "2.5KiB", [1, 3, 2, 4, 5])
    assert (interleaved.excess_bytes, interleaved.excess_task) == (KIB // 2, 2)
    assert grouped.excess_bytes == 0


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_layer_streaming_plans_move_at_least_the_bounds(name, prefetch, scale):
    tg = PROGRAMS[name]()
    mg = layer_streaming_plan(tg, int(working_budget(tg) * scale), prefetch=prefetch)
    bounds = transfer_lower_bounds(tg, mg.budget, apply_order(mg))
    assert_below(bounds, mg)
    assert bounds.compulsory_reload_bytes > 0


@given(
    case=einsum_cases(max_operands=4),
    offload_mask=st.integers(0, 2**12),
    reuse=st.booleans(),
    outputs_to_host=st.booleans(),
)
def test_reference_plans_move_at_least_the_bounds(case, offload_mask, reuse, outputs_to_host):
    prog = ep.Program()
    tensors = [
        prog.input(f"x{i}", s, case.dtype, role=("weight" if i % 2 else "activation"))
        for i, s in enumerate(case.shapes)
    ]
    y = prog.einsum(case.spec, *tensors)
    prog.output(ep.exp(y) * y, "out")
    tg = prog.build()
    offload = frozenset(t for t in range(len(tg)) if offload_mask >> t & 1)
    mg = reference_plan(tg, offload=offload, reuse=reuse, outputs_to_host=outputs_to_host)
    assert_below(transfer_lower_bounds(tg, mg.budget, apply_order(mg)), mg)


def test_a_task_that_alone_exceeds_the_budget_is_infeasible():
    tg = chain()
    with pytest.raises(InfeasibleBudgetError, match="task %5 alone needs 2.0 KiB") as err:
        transfer_lower_bounds(tg, 2 * KIB)
    assert (err.value.needed, err.value.task) == (2 * KIB + 4, 5)


def test_bad_orders_are_rejected():
    tg = chain()
    with pytest.raises(GraphError, match="missing %5"):
        transfer_lower_bounds(tg, "1MiB", [1, 2, 3, 4])
    with pytest.raises(GraphError, match="not computed tasks: %0"):
        transfer_lower_bounds(tg, "1MiB", [0, 1, 2, 3, 4, 5])
    with pytest.raises(GraphError, match="some tasks repeat"):
        transfer_lower_bounds(tg, "1MiB", [1, 2, 3, 4, 5, 5])
    with pytest.raises(GraphError, match="runs %3 before its operand %2"):
        transfer_lower_bounds(tg, "1MiB", [1, 3, 2, 4, 5])


def test_bounds_follow_where_the_plan_starts_its_inputs():
    # A device input that the plan starts in host storage can be dropped for free: the
    # offload bound must not count it (found by the plan benchmark's property test).
    from memgraph.bounds import host_inputs_of
    from memgraph.planner import plan

    prog = ep.Program()
    x = prog.input("x", (256,))
    z = prog.input("z", (768,))
    a = ep.exp(x)
    big = prog.einsum("i->", ep.exp(z))
    prog.output(x * a * big, "out")
    tg = prog.build()
    for recompute in ("never", "auto"):  # a discards and recomputes `a` with "auto"
        mg = plan(tg, 6144, inputs="host", recompute=recompute)
        bounds = transfer_lower_bounds(tg, mg.budget, apply_order(mg), host_inputs_of(mg))
        assert_below(bounds, mg)
    assert mg.stats.recompute_count == 1
    assert sorted(host_inputs_of(mg)) == ["x", "z"]
    with pytest.raises(GraphError, match=r"unknown input\(s\) \['nope'\]"):
        transfer_lower_bounds(tg, 6144, host_inputs=["nope"])


@pytest.mark.parametrize("budget", ["256KiB", "384KiB", "1MiB"])
def test_bounds_hold_for_plans_that_stream_a_weight_in_slices(budget):
    # A 1 MiB weight read only through 128 KiB column slices: the plan reloads slices,
    # never the whole weight, so the bounds must not charge the whole weight per slice.
    from memgraph.bounds import host_inputs_of
    from memgraph.planner import plan

    prog = ep.Program("columns")
    x = prog.input("x", (8, 256))
    w = prog.input("w", (256, 1024), role="weight")
    parts = [x @ prog.slice(w, (0, 128 * j), (256, 128)) for j in range(8)]
    prog.output(ep.concat(parts, axis=1), "y")
    tg = prog.build()
    mg = plan(tg, budget)
    assert mg.info["sliced_reloads"] > 0
    bounds = transfer_lower_bounds(tg, mg.budget, apply_order(mg), host_inputs_of(mg))
    assert bounds.compulsory_reload_bytes == 256 * 1024 * 4  # every slice once = the weight
    assert bounds.reload_bytes <= mg.stats.reload_bytes
    assert bounds.offload_bytes <= mg.stats.offload_bytes
