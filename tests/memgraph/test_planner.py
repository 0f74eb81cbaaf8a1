"""Planner examples: what a plan does on small programs, its options and its errors."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import numpy as np
import pytest
from replay import check_outputs, check_plan
from strategies import program_inputs

import einpage as ep
import memgraph
import memgraph.eviction as eviction_module
import memgraph.orders as orders_module
import memgraph.planner as planner_module
from einpage.errors import InfeasibleBudgetError, PlanError
from einpage.models import llama
from einpage.units import BudgetFormatError, format_bytes
from memgraph import MemGraph, NodeKind, PlanOptions
from memgraph.budgets import RESIDENT_PEAK, STREAMING_MINIMUM, budget_references, read_budget
from memgraph.eviction import POLICIES, EvictionContext, register_policy
from memgraph.orders import ORDERS, check_order, get_order
from memgraph.planner import min_budget, plan, resident_peak, streaming_minimum
from taskgraph.graph import TaskGraph

DATA = Path(__file__).parent / "data"

KiB = 1024


def square(prog, name, role="activation", n=16):
    """An n x n float32 input (1 KiB for n = 16)."""
    return prog.input(name, (n, n), role=role)


def nodes(mg: MemGraph, kind: NodeKind, tensor: int | None = None) -> list:
    return [n for n in mg.nodes if n.kind is kind and (tensor is None or n.tensor == tensor)]


def ancestors(mg: MemGraph, node_id: int) -> set[int]:
    """Every node `node_id` waits for, directly or through dependencies."""
    seen, stack = set(), [node_id]
    while stack:
        for dep in mg.nodes[stack.pop()].deps:
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return seen


def apply_of(mg: MemGraph, task: int) -> int:
    return nodes(mg, NodeKind.APPLY, task)[0].id


def test_module_doctests():
    for module in (planner_module, orders_module, eviction_module):
        result = doctest.testmod(module)
        assert result.failed == 0, module.__name__


# -- behaviour ---------------------------------------------------------------------


def test_a_chain_that_fits_needs_no_transfers():
    prog = ep.Program("chain")
    h = square(prog, "x")
    for _ in range(6):
        h = ep.tanh(h) * 2.0
    prog.output(h, "y")
    tg = prog.build()
    mg = plan(tg, "1MiB")
    check_plan(mg)
    s = mg.stats
    assert (s.offload_count, s.reload_count, s.drop_count) == (0, 0, 0)
    assert s.peak_bytes == 2 * KiB  # a chain only ever holds an operand and an output
    assert nodes(mg, NodeKind.OUTPUT)[0].region is not None
    check_outputs(mg, program_inputs(tg, 0))


def test_a_weight_reused_later_is_dropped_not_offloaded_and_reloaded():
    prog = ep.Program("reuse")
    x = square(prog, "x")
    w = square(prog, "w", role="weight")
    v = square(prog, "v", role="weight")
    prog.output((x @ w) @ v @ w, "y")
    tg = prog.build()
    w_id = tg.inputs["w"]
    mg = plan(tg, 3 * KiB)  # three 1 KiB tensors: w must leave for v's step
    check_plan(mg)
    s = mg.stats
    assert (s.offload_count, s.drop_count, s.reload_count) == (0, 1, 3)
    assert len(nodes(mg, NodeKind.RELOAD, w_id)) == 2
    assert not nodes(mg, NodeKind.OFFLOAD, w_id)
    check_outputs(mg, program_inputs(tg, 1))


def test_an_activation_needed_much_later_is_offloaded_and_reloaded():
    prog = ep.Program("skip")
    x = square(prog, "x")
    skip = ep.exp(x)  # needed again only at the end
    h = skip
    for i in range(4):
        h = h @ square(prog, f"w{i}", role="weight")
    prog.output(h + skip, "y")
    tg = prog.build()
    skip_id = tg.tasks[-1].inputs[1]
    mg = plan(tg, 3 * KiB)
    check_plan(mg)
    offloads = nodes(mg, NodeKind.OFFLOAD, skip_id)
    reloads = nodes(mg, NodeKind.RELOAD, skip_id)
    assert len(offloads) == 1 and len(reloads) == 1
    assert reloads[0].id > offloads[0].id
    # The weights are dropped (host copies exist) rather than offloaded.
    assert all(n.tensor == skip_id for n in nodes(mg, NodeKind.OFFLOAD))
    check_outputs(mg, program_inputs(tg, 2))


def cyclic_weights(passes: int = 3, count: int = 4):
    """`count` weights used in turn, `passes` times: LRU's worst case."""
    prog = ep.Program("cyclic")
    weights = [square(prog, f"w{i}", role="weight") for i in range(count)]
    h = square(prog, "x")
    for _ in range(passes):
        for w in weights:
            h = ep.tanh(h @ w)
    prog.output(h, "y")
    return prog.build()


def test_belady_beats_lru_on_cyclic_weights():
    tg = cyclic_weights()
    budget = 5 * KiB  # room for 3 weights beside the activation and the output
    reloads = {}
    for policy in ("belady", "lru"):
        mg = plan(tg, budget, eviction=policy, lookahead=0)
        check_plan(mg)
        check_outputs(mg, program_inputs(tg, 3))
        reloads[policy] = mg.stats.reload_count
    # 12 weight uses through a cache of 3 weights: Belady's MIN misses 6 times (4 cold
    # misses, then one per pass after the first); LRU keeps evicting the weight that
    # is needed next.
    assert reloads["belady"] == 6
    assert reloads["lru"] >= 10


def test_a_registered_policy_decides_the_victims():
    """A policy that sees the transfer bytes: it evicts a tensor with a host copy (a
    weight, dropped for free) before an activation that would have to be offloaded,
    whatever their next uses; and the context it gets describes the live tensor."""
    seen: list[EvictionContext] = []

    def drop_first(ctx: EvictionContext) -> int:
        seen.append(ctx)
        return ctx.next_use - (1 << 40 if ctx.transfer_bytes else 0)

    tg = cyclic_weights(passes=2)
    register_policy("drop-first", drop_first)
    try:
        mg = plan(tg, 5 * KiB, eviction="drop-first", lookahead=0)
    finally:
        del eviction_module.POLICIES["drop-first"]
    check_plan(mg)
    check_outputs(mg, program_inputs(tg, 3))
    assert mg.info["eviction"] == "drop-first"
    assert mg.stats.offload_count == 0 and mg.stats.drop_count > 0
    assert seen and all(ctx.size == KiB for ctx in seen)
    assert {ctx.transfer_bytes for ctx in seen} == {0, KiB}  # weights, then activations
    assert plan(tg, 5 * KiB, eviction="belady", lookahead=0).to_json() != mg.to_json()


def test_prefetch_issues_a_future_weight_ahead_and_lets_it_overlap():
    prog = ep.Program("prefetch")
    h = square(prog, "x", n=64)
    for _ in range(3):
        h = ep.tanh(h @ h)  # compute-heavy steps, no transfers
    w = square(prog, "w", role="weight", n=64)
    prog.output(h @ w, "y")
    tg = prog.build()
    w_id = tg.inputs["w"]
    last_step = tg.outputs["y"]
    previous_step = tg[last_step].inputs[0]

    for options, ahead in (({"lookahead_seconds": None}, True), ({"lookahead": 0}, False)):
        mg = plan(tg, "1MiB", **options)
        check_plan(mg)
        reload = nodes(mg, NodeKind.RELOAD, w_id)[0]
        previous_apply = apply_of(mg, previous_step)
        assert (reload.id < previous_apply) is ahead
        if ahead:
            assert mg.info["prefetched_reloads"] == 1
            # Nothing forces the reload to wait for compute: it can overlap it.
            waits_for = ancestors(mg, reload.id)
            assert not any(mg.nodes[n].kind is NodeKind.APPLY for n in waits_for)
            assert set(reload.deps) == {nodes(mg, NodeKind.ALLOC, w_id)[0].id} | {
                nodes(mg, NodeKind.INPUT, w_id)[0].id
            }
        else:
            assert mg.info["prefetched_reloads"] == 0


def test_auto_lookahead_prefetches_only_what_compute_can_hide():
    prog = ep.Program("weights")
    h = square(prog, "x")
    for i in range(40):
        h = ep.tanh(h @ square(prog, f"w{i}", role="weight"))
    prog.output(h, "y")
    tg = prog.build()
    eager = plan(tg, "1MiB", lookahead_seconds=None, lookahead=64)
    auto = plan(tg, "1MiB")
    # Tiny matmuls hide nothing, so "auto" runs as far ahead as allowed, like "eager"...
    assert auto.info["max_steps_ahead"] == eager.info["max_steps_ahead"] == 64
    # ...while a fixed window of compute seconds keeps it near the execution horizon.
    near = plan(tg, "1MiB", lookahead_seconds=1e-9)
    assert near.info["max_steps_ahead"] <= 1
    for mg in (eager, auto, near):
        check_plan(mg)


def test_outputs_to_host_are_offloaded_as_soon_as_computed():
    prog = ep.Program("host-out")
    x = square(prog, "x")
    y = ep.exp(x)
    prog.output(y, "y")
    prog.output(ep.tanh(y), "z")
    prog.output(x, "x_again")  # a device input that is also an output
    tg = prog.build()
    mg = plan(tg, "1MiB", outputs="host")
    check_plan(mg)
    for out in nodes(mg, NodeKind.OUTPUT):
        assert out.storage is not None and out.region is None
    y_apply = apply_of(mg, tg.outputs["y"])
    assert mg.nodes[y_apply + 1].kind is NodeKind.OFFLOAD
    check_outputs(mg, program_inputs(tg, 4))


def test_device_outputs_that_do_not_fit_at_the_end_stay_on_the_host():
    prog = ep.Program("many-outputs")
    h = square(prog, "x")
    for i in range(4):
        h = ep.tanh(h) + 1.0
        prog.output(h, f"y{i}")
    tg = prog.build()
    mg = plan(tg, 2 * KiB)
    check_plan(mg)
    on_host = mg.info["outputs_on_host"]
    assert len(on_host) == 2
    assert {n.name for n in nodes(mg, NodeKind.OUTPUT) if n.storage is not None} == set(on_host)
    check_outputs(mg, program_inputs(tg, 5))


def test_device_inputs_that_do_not_fit_start_on_the_host():
    prog = ep.Program("inputs")
    xs = [square(prog, f"x{i}") for i in range(4)]
    prog.output((xs[0] + xs[1]) * (xs[2] + xs[3]), "y")
    tg = prog.build()
    mg = plan(tg, 3 * KiB)
    check_plan(mg)
    assert mg.info["inputs_on_host_for_room"] == ["x3"]
    hosted = plan(tg, 3 * KiB, inputs="host")
    assert all(n.storage is not None for n in nodes(hosted, NodeKind.INPUT))
    check_outputs(mg, program_inputs(tg, 6))
    check_outputs(hosted, program_inputs(tg, 6))


def passthrough_program() -> TaskGraph:
    """A device input that is also an output and that nothing reads (1 KiB), beside a
    chain of 1 KiB activations whose steps fill a 2 KiB arena."""
    prog = ep.Program("passthrough")
    x = square(prog, "x")
    prog.output(x, "x_out")
    h = ep.exp(square(prog, "a"))
    for _ in range(3):
        h = ep.tanh(h) + 1.0
    prog.output(h, "y")
    return prog.build()


def test_an_input_that_is_an_output_starts_on_the_host_when_that_moves_less():
    # Started on the device, x must be offloaded when the chain fills the arena (it has
    # no host copy) and, as a device output, reloaded at the end: 2 KiB moved where the
    # optimum moves none. Started on the host it moves only that delivery reload.
    tg = passthrough_program()
    mg = plan(tg, 2 * KiB)
    check_plan(mg)
    assert mg.info["inputs_on_host_to_move_less"] == ["x"]
    x_input = [n for n in nodes(mg, NodeKind.INPUT) if n.name == "x"][0]
    assert x_input.storage is not None
    stats = mg.stats
    assert (stats.offload_bytes, stats.reload_bytes) == (0, 1 * KiB)
    delivery = nodes(mg, NodeKind.RELOAD, tg.inputs["x"])
    assert len(delivery) == 1 and delivery[0].id > apply_of(mg, tg.outputs["y"])
    assert memgraph.optimal.optimal_transfers(tg, 2 * KiB).moved_bytes == 0
    check_outputs(mg, program_inputs(tg, 7))


def test_inputs_stay_on_the_device_when_starting_them_on_the_host_moves_no_less():
    # x is read first and last; evicted in between (each h + tanh(h) needs the whole
    # 3 KiB arena) it moves 1 KiB out and 1 KiB back, started on the host 1 KiB in twice:
    # a tie, which keeps x on the device.
    prog = ep.Program("reread")
    x = square(prog, "x")
    h = ep.exp(x)
    for _ in range(2):
        h = h + ep.tanh(h)
    prog.output(h * x, "y")
    tg = prog.build()
    mg = plan(tg, 3 * KiB)
    check_plan(mg)
    assert nodes(mg, NodeKind.OFFLOAD, tg.inputs["x"])  # the tie is real: x was evicted
    assert mg.info["inputs_on_host_to_move_less"] == []
    check_outputs(mg, program_inputs(tg, 8))


def test_views_read_their_base_and_keep_it_alive():
    prog = ep.Program("views")
    x = square(prog, "x")
    flat = ep.exp(x).reshape((256,))
    prog.output(flat * 2.0, "y")
    prog.output(flat.reshape((16, 16)), "y_view")
    tg = prog.build()
    mg = plan(tg, "1MiB")
    check_plan(mg)
    view_ids = {t.id for t in tg if t.kind == "view"}
    assert not any(n.tensor in view_ids for n in mg.nodes)
    check_outputs(mg, program_inputs(tg, 7))


def test_unused_inputs_and_dead_tasks_are_handled():
    prog = ep.Program("dead")
    x = square(prog, "x")
    prog.input("unused", (8,))
    prog.output(ep.exp(x), "y")
    tg = prog.build()
    mg = plan(tg, "1MiB")
    check_plan(mg)
    unused = nodes(mg, NodeKind.INPUT, tg.inputs["unused"])[0]
    assert unused.storage is not None


def test_a_fragmented_arena_is_handled_without_copies():
    # Small long-lived tensors interleave with big short-lived ones, so free bytes
    # suffice long before any contiguous window does.
    prog = ep.Program("fragments")
    keep = []
    h = square(prog, "x", n=32)
    for i in range(6):
        keep.append(ep.exp(square(prog, f"s{i}", n=8)))
        h = ep.tanh(h) * 2.0
    total = keep[0]
    for k in keep[1:]:
        total = total + k
    prog.output(total, "small")
    prog.output(h, "big")
    tg = prog.build()
    low, _ = min_budget(tg)
    for budget in range(low, streaming_minimum(tg) + 1, 256):
        mg = plan(tg, budget)
        check_plan(mg)
        check_outputs(mg, program_inputs(tg, 8))


def layer_chain(count: int = 4):
    """`count` layers, each with its own weight, used once: a prefill's shape."""
    prog = ep.Program("chain")
    h = square(prog, "x")
    for i in range(count):
        h = ep.tanh(h @ square(prog, f"w{i}", role="weight"))
    prog.output(h, "y")
    return prog.build()


def test_percentages_name_their_reference_point():
    tg = layer_chain()
    resident, streaming = resident_peak(tg), streaming_minimum(tg)
    assert streaming_minimum is streaming_minimum  # the former name
    weights = sum(tg[i].nbytes for i in tg.inputs.values() if tg[i].op.role == "weight")
    assert resident >= weights > streaming  # all four weights stay / one at a time
    for spelled in ("100%", "100%resident", "100 % Resident"):
        reading = read_budget(tg, spelled)
        assert (reading.nbytes, reading.reference) == (resident, RESIDENT_PEAK)
    assert read_budget(tg, "50%").nbytes == resident // 2
    reading = read_budget(tg, "150%streaming")
    assert (reading.nbytes, reading.reference) == (int(streaming * 1.5), STREAMING_MINIMUM)
    assert str(reading).startswith("150% of the streaming minimum")
    assert plan(tg, "100%streaming").budget == streaming
    refs = budget_references(tg)
    assert (refs.resident_peak, refs.streaming_minimum) == (resident, streaming)
    assert (refs.min_budget, refs.min_task) == min_budget(tg)
    with pytest.raises(BudgetFormatError, match="'100%resident'.*'100%streaming'"):
        read_budget(tg, "100%peak")
    for order in ORDERS:
        mg = plan(tg, streaming_minimum(tg, order=order), order=order, lookahead=0)
        assert mg.stats.offload_count == mg.stats.drop_count == 0
        assert mg.stats.high_water == streaming_minimum(tg, order=order)


def test_the_resident_peak_moves_nothing():
    tg = cyclic_weights()  # each weight read three times
    weights = sum(tg[i].nbytes for i in tg.inputs.values() if tg[i].op.role == "weight")
    for policy in POLICIES:
        mg = plan(tg, "100%", eviction=policy)
        check_plan(mg)
        s = mg.stats
        assert (s.offload_count, s.drop_count, s.reload_bytes) == (0, 0, weights)
        assert (s.first_load_count, s.first_load_bytes) == (s.reload_count, weights)
        assert dict(s.rows())["reloaded"].endswith("(all first loads: nothing came back)")
        tighter = plan(tg, mg.budget - 1 * KiB, eviction=policy).stats
        assert tighter.reload_bytes > weights  # one weight fewer fits: reloads
        assert tighter.first_load_bytes == weights < tighter.reload_bytes
        assert f"{format_bytes(weights)} in 4 first loads" in dict(tighter.rows())["reloaded"]


def test_a_run_that_would_move_something_at_the_resident_peak_is_replaced():
    # A random program (found by the property test) whose planner run at its resident
    # peak evicts, as prefetching and room placement crowd the arena: the resident
    # run's plan, which fits, is returned instead.
    text = (DATA / "crowded_at_the_resident_peak.json").read_text(encoding="utf-8")
    tg = TaskGraph.from_json(text)
    budget = resident_peak(tg)
    mg = plan(tg, budget)
    check_plan(mg)
    check_outputs(mg, program_inputs(tg, 3))
    assert mg.info["resident_run"] is True
    assert mg.info["evictions"] == 0 and mg.stats.high_water <= budget == mg.budget
    assert "resident_run" not in plan(tg, budget - 256).info  # below it: the planner's own


def test_plans_are_deterministic():
    tg = cyclic_weights(passes=4)
    for order in ORDERS:
        for policy in POLICIES:
            first = plan(tg, 5 * KiB, order=order, eviction=policy).to_json()
            assert plan(tg, 5 * KiB, order=order, eviction=policy).to_json() == first
            assert MemGraph.from_json(first).to_json() == first


def test_info_records_options_and_counters_as_json():
    tg = cyclic_weights()
    mg = plan(tg, "50%streaming", order="memory", eviction="lru", outputs="host")
    info = json.loads(json.dumps(dict(mg.info)))
    assert info["order"] == "memory" and info["eviction"] == "lru"
    assert info["budget_request"] == "50%streaming" and info["outputs"] == "host"
    assert info["min_budget"] == min_budget(tg)[0]
    for counter in ("evictions", "fragmentation_events", "steps"):
        assert isinstance(info[counter], int)
    assert mg.stats.fragmentation_events == info["fragmentation_events"]
    # What the nodes tell is counted from them (mg.stats), not kept twice in info.
    for counter in ("offloads", "reloads", "drops", "sliced_offloads", "high_water"):
        assert counter not in info
    s = mg.stats
    assert min(s.offload_count, s.reload_count, s.drop_count, s.high_water) >= 0
    assert s.offload_count + s.drop_count >= info["evictions"] > 0


def test_a_custom_order_is_checked_and_used():
    tg = cyclic_weights(passes=1)
    order = get_order("memory")(tg)
    mg = plan(tg, "100%streaming", order=order)
    check_plan(mg)
    assert mg.info["order"] == "custom"
    with pytest.raises(PlanError, match="comes before its input"):
        plan(tg, "1MiB", order=list(reversed(order)))
    with pytest.raises(PlanError, match="appears twice"):
        check_order(tg, [0, 0])
    with pytest.raises(PlanError, match="missing"):
        check_order(tg, [0])


def test_the_memory_order_lowers_the_peak_of_independent_branches():
    # Four branches each load a big weight and reduce it to a small result: in program
    # order all four weights are loaded before any reduction (they are inputs first
    # used early); the memory order finishes each branch before starting the next.
    prog = ep.Program("branches")
    x = square(prog, "x", n=8)
    bigs = [ep.exp(x @ square(prog, f"w{i}", role="weight", n=8)) for i in range(4)]
    smalls = [b.sum(axis=-1) for b in bigs]
    total = smalls[0]
    for s in smalls[1:]:
        total = total + s
    prog.output(total, "y")
    tg = prog.build()
    assert streaming_minimum(tg, order="memory") < streaming_minimum(tg, order="program")
    order = get_order("memory")(tg)
    assert check_order(tg, order) == order
    # ... but choosing it does not change what a percentage means: the larger one counts
    for word, measure in (("", resident_peak), ("streaming", streaming_minimum)):
        peaks = [measure(tg, PlanOptions(order=o)) if not word else measure(tg, o) for o in ORDERS]
        for o in ORDERS:
            reading = read_budget(tg, f"50%{word}", PlanOptions(order=o))
            assert reading.reference_bytes == max(peaks) and reading.nbytes == max(peaks) // 2
    mg = plan(tg, "100%", order="memory")
    assert mg.info["evictions"] == 0 and mg.stats.drop_count == 0


def test_a_small_llama_plans_and_computes_the_reference_at_tight_budgets():
    cfg = llama.LlamaConfig(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
        vocab_size=50,
    )  # fmt: skip
    tg = llama.prefill_program(cfg, 1, 8, "float32").build()
    rng = np.random.default_rng(0)
    weights = {
        name: (0.2 * rng.standard_normal(tg[i].shape)).astype("float32")
        for name, i in tg.inputs.items()
        if tg[i].op.role == "weight"
    }
    inputs = llama.prefill_inputs(cfg, rng.integers(0, 50, (1, 8)), weights)
    low, _ = min_budget(tg, 64)
    for budget in (low, (low + streaming_minimum(tg, alignment=64)) // 2, "100%streaming"):
        for policy in POLICIES:
            mg = plan(tg, budget, eviction=policy, alignment=64)
            check_plan(mg)
            check_outputs(mg, inputs)


def test_llama_7b_plans_within_its_budget():
    tg = llama.prefill_program(llama.PRESETS["7b"], 1, 128, "float16").build()
    mg = plan(tg, "100%streaming")
    check_plan(mg)
    weights = sum(tg[i].nbytes for i in tg.inputs.values() if tg[i].op.role == "weight")
    assert mg.stats.reload_bytes >= weights


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize("budget", ["lots", "12 parsecs", "abc%", "%", "-5%", True, 1.5])
def test_malformed_budgets_are_refused(budget):
    with pytest.raises(BudgetFormatError):
        plan(cyclic_weights(), budget)


def test_an_infeasible_budget_names_the_task_and_the_minimum():
    prog = ep.Program("tight")
    x = square(prog, "x")
    with prog.scope("block.0"):
        y = x @ square(prog, "w", role="weight")
    prog.output(y, "y")
    tg = prog.build()
    needed, task = min_budget(tg)
    assert (needed, task) == (3 * KiB, tg.outputs["y"])
    with pytest.raises(InfeasibleBudgetError) as caught:
        plan(tg, "2KiB")
    error = caught.value
    assert (error.budget, error.needed, error.task) == (2 * KiB, needed, task)
    message = str(error)
    assert "3.0 KiB (3072 B)" in message and tg[task].line() in message
    assert "'block.0'" in message
    # the way out: partitioning, by the pipeline or by hand
    assert "einpage.compile(" in message and "taskgraph.partition_for_budget(" in message
    with pytest.raises(InfeasibleBudgetError):
        plan(tg, 0)
    with pytest.raises(InfeasibleBudgetError, match="'10%' = "):
        plan(tg, "10%")
    with pytest.raises(PlanError, match="does not partition: use einpage.compile"):
        plan(tg, "2KiB", partition=False)


def test_a_graph_without_compute_needs_one_alignment_unit():
    prog = ep.Program("identity")
    prog.output(square(prog, "x"), "y")
    tg = prog.build()
    assert min_budget(tg) == (256, None)
    with pytest.raises(InfeasibleBudgetError, match="one alignment unit"):
        plan(tg, 100)
    mg = plan(tg, 256)
    check_plan(mg)
    assert mg.info["outputs_on_host"] == ["y"]


@pytest.mark.parametrize(
    "option, value, match",
    [
        ("order", "random", "valid orders: 'program', 'memory'"),
        ("eviction", "fifo", "valid policies: 'belady', 'lru'"),
        ("lookahead", -1, "lookahead"),
        ("lookahead", 2.5, "lookahead"),
        ("lookahead_seconds", "soon", "lookahead_seconds"),
        ("lookahead_seconds", -1.0, "lookahead_seconds"),
        ("outputs", "gpu", "outputs must be one of"),
        ("inputs", "device", "inputs must be one of"),
        ("alignment", 0, "alignment"),
        ("placement", "first_fit", "placement must be one of"),
    ],
)
def test_bad_options_are_refused_with_the_valid_ones(option, value, match):
    with pytest.raises(PlanError, match=match):
        plan(cyclic_weights(), "1MiB", **{option: value})


def test_unknown_cost_model_is_refused():
    with pytest.raises(ep.EinpageError, match="presets"):
        plan(cyclic_weights(), "1MiB", cost_model="tpu")


def test_the_former_name_of_the_streaming_minimum_is_a_deprecated_alias():
    """`no_offload_peak` was renamed `streaming_minimum`: the old name still works, once
    warned about, and is nowhere used in the project itself (the grep in the issue)."""
    import warnings

    with pytest.warns(DeprecationWarning, match="no_offload_peak is deprecated: use memgraph"):
        old = memgraph.no_offload_peak
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert memgraph.streaming_minimum is old
        from memgraph import budgets

        with pytest.warns(DeprecationWarning):
            assert budgets.no_offload_peak is old
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        memgraph.nope  # noqa: B018
