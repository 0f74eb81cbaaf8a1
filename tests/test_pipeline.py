"""The pipeline, `einpage.compile`: partition when needed, plan, verify, and say how.

`memgraph.plan` is a pure TaskGraph -> MemGraph pass (it plans the graph it is given and
refuses a task that cannot fit, naming the way out); `compile` chains the passes and
keeps the graph given, the graph planned, how the budget was read and how the block
limit was chosen.
"""

from __future__ import annotations

import doctest

import pytest

import einpage as ep
import einpage.pipeline.compiler as pipeline_module
import memgraph
import runtime
from einpage.cli.presets import load_program
from einpage.errors import InfeasibleBudgetError, InputError, PlanError
from einpage.pipeline import (
    MAX_AUTO_BLOCKS,
    Compiled,
    PartitionInfeasibleError,
    TooManyBlocksError,
    check_block_count,
    estimated_blocks,
    partition_mode,
)
from einpage_core.units import format_bytes
from memgraph.budgets import NO_OFFLOAD_PEAK, RESIDENT_PEAK, BudgetReading, read_budget
from taskgraph.partition import DEFAULT_BUDGET_FRACTION, finest_block, partition_for_budget

KiB = 1024


def softmax_program() -> ep.Program:
    """y = softmax(x @ w): the matmul needs 384 KiB at once (x 64 KiB, w 256 KiB, x @ w
    64 KiB)."""
    prog = ep.Program("smx")
    x = prog.input("x", (64, 256))
    w = prog.input("w", (256, 256), role="weight")
    prog.output(ep.softmax(x @ w), "y")
    return prog


def test_module_doctests():
    result = doctest.testmod(pipeline_module)
    assert result.attempted > 0 and result.failed == 0


def test_the_pipeline_is_exported_from_einpage():
    assert ep.compile is pipeline_module.compile and ep.Compiled is Compiled
    assert issubclass(ep.PartitionInfeasibleError, ep.InfeasibleBudgetError)
    assert issubclass(ep.TooManyBlocksError, ep.InfeasibleBudgetError)


def test_plan_is_a_pure_pass_that_names_the_way_out():
    tg = softmax_program().build()
    with pytest.raises(InfeasibleBudgetError) as caught:
        memgraph.plan(tg, "200KiB")
    error = caught.value
    assert not isinstance(error, PartitionInfeasibleError)
    assert (error.budget, error.needed) == (200 * KiB, 384 * KiB)
    message = str(error)
    assert "einpage.compile(" in message and "taskgraph.partition_for_budget(" in message
    mg = memgraph.plan(tg, "1MiB")
    assert mg.taskgraph is tg  # never a graph the user did not give it
    assert "block_limit" not in mg.info and mg.stats.block_limit is None


def test_compile_partitions_what_cannot_fit_and_says_how():
    prog = softmax_program()
    compiled = ep.compile(prog, "200KiB")
    tg = compiled.program
    assert tg.to_json() == prog.build().to_json()  # a Program is built first
    assert len(compiled.graph) > len(tg) and compiled.plan.taskgraph is compiled.graph
    chosen = compiled.partitioning
    assert (chosen.mode, chosen.block_limit, chosen.how) == (
        "auto",
        50 * KiB,
        "auto: 25% of the budget",
    )
    assert chosen.fraction == DEFAULT_BUDGET_FRACTION
    assert chosen.finest_block == finest_block(tg, 256)[0]
    assert compiled.min_budget == chosen.program_min_budget == 384 * KiB
    assert compiled.block_limit == 50 * KiB == compiled.plan.stats.block_limit
    assert compiled.budget == BudgetReading("200KiB", 200 * KiB)
    assert compiled.report is not None and compiled.report.peak_bytes <= 200 * KiB
    assert set(compiled.timings) == {"reading the budget", "partitioning", "planning", "verifying"}
    # The plan is exactly `plan` of `partition_for_budget`'s graph; compile adds to info.
    by_hand = memgraph.plan(partition_for_budget(tg, 200 * KiB).graph, "200KiB")
    assert by_hand.nodes == compiled.plan.nodes
    assert {**by_hand.info, **compiled.plan.info} == dict(compiled.plan.info)
    info = compiled.plan.info
    assert (info["partition"], info["block_limit"], info["original_tasks"]) == (
        "auto",
        50 * KiB,
        len(tg),
    )
    assert info["original_min_budget"] == 384 * KiB and info["budget_request"] == "200KiB"


def test_compile_plans_a_program_that_fits_as_it_is():
    tg = softmax_program().build()
    compiled = ep.compile(tg, "1MiB", eviction="lru", verify=False)
    assert compiled.graph is tg and compiled.block_limit is None and compiled.report is None
    assert compiled.partitioning.describe() == "not partitioned (the program fits unsplit)"
    assert "verifying" not in compiled.timings
    assert compiled.plan.to_json() != memgraph.plan(tg, "1MiB").to_json()  # info differs
    assert compiled.plan.nodes == memgraph.plan(tg, "1MiB", eviction="lru").nodes
    assert compiled.plan.info["eviction"] == "lru" and compiled.plan.info["block_limit"] is None


def test_a_percentage_is_read_against_the_reference_point_it_names():
    tg = softmax_program().build()
    resident = memgraph.resident_peak(tg)
    reading = ep.compile(tg, "80%").budget
    assert reading == BudgetReading("80%", int(resident * 0.8), 80.0, RESIDENT_PEAK, resident)
    assert str(reading).startswith("80% of the resident peak ")
    peak = memgraph.streaming_minimum(tg)
    compiled = ep.compile(tg, "40%streaming")
    reading = compiled.budget
    assert reading == BudgetReading("40%streaming", int(peak * 0.4), 40.0, NO_OFFLOAD_PEAK, peak)
    assert str(reading).startswith("40% of the streaming minimum ")
    assert (
        compiled.plan.budget == reading.nbytes
        and compiled.plan.info["budget_request"] == "40%streaming"
    )
    assert read_budget(tg, "40%streaming") == reading
    assert read_budget(tg, "0%").nbytes == 0  # zero bytes: refused like 0 and 100 B


def test_zero_a_zero_percent_and_a_hundred_bytes_are_one_error_with_one_minimum():
    """Budgets below the minimum raise one error class whatever their spelling, naming
    the same smallest budget – the one that then compiles."""
    tg = softmax_program().build()
    errors = []
    for budget in (0, "0%", "0B", 100):
        with pytest.raises(InfeasibleBudgetError) as info:
            ep.compile(tg, budget)
        errors.append(info.value)
    assert len({type(e) for e in errors}) == 1 and len({e.needed for e in errors}) == 1
    ep.compile(tg, errors[0].needed)


def test_an_explicit_block_limit_and_the_finest_block():
    tg = softmax_program().build()
    explicit = ep.compile(tg, "1MiB", partition="32KiB")
    assert (explicit.partitioning.mode, explicit.partitioning.how) == ("limit", "explicit")
    assert explicit.block_limit == 32 * KiB and explicit.plan.info["partition"] == "limit"
    assert explicit.partitioning.describe() == "block limit 32.0 KiB (explicit)"
    # A budget whose quarter is below the finest block gets the finest block.
    floor, _ = finest_block(tg, 256)
    tight = ep.compile(tg, 2 * floor)
    assert tight.block_limit == floor and tight.partitioning.how == "auto: the finest block"


def test_partition_off_lets_plan_refuse_with_the_budget_as_asked():
    tg = softmax_program().build()
    with pytest.raises(InfeasibleBudgetError) as caught:
        ep.compile(tg, "40%streaming", partition="off")
    assert not isinstance(caught.value, PartitionInfeasibleError)
    assert str(caught.value).startswith("budget '40%streaming' = ")


def test_partition_arguments():
    assert partition_mode("auto") == partition_mode(True) == "auto"
    assert partition_mode("off") == partition_mode(False) == partition_mode(None) == "off"
    assert partition_mode("64KiB") == partition_mode(64 * KiB) == 64 * KiB
    with pytest.raises(PlanError, match="'auto', 'off'"):
        partition_mode("sometimes")
    with pytest.raises(InputError, match="a Program or a TaskGraph, got str"):
        ep.compile("mlp", "1MiB")
    with pytest.raises(PlanError, match="eviction policy 'random'"):
        ep.compile(softmax_program(), "1MiB", eviction="random")


def test_too_many_blocks_is_refused_only_when_asked():
    tg = softmax_program().build()
    assert estimated_blocks(tg, 1024) > estimated_blocks(tg, 64 * KiB) > 0
    check_block_count(tg, 200 * KiB, max_blocks=MAX_AUTO_BLOCKS)  # a handful of blocks
    with pytest.raises(TooManyBlocksError) as caught:
        ep.compile(tg, "200KiB", max_blocks=3)
    error = caught.value
    assert error.count > 3 and error.needed > error.budget == 200 * KiB
    assert "partition='auto' stops at 3" in str(error)
    assert "raise the cap (max_blocks=)" in str(error)
    cli = error.spelled("--partition auto", "--partition SIZE", "--max-blocks")
    assert "--partition auto stops at 3" in str(cli) and cli.needed == error.needed
    assert "raise the cap (--max-blocks)" in str(cli)
    # Without max_blocks the same budget compiles.
    assert ep.compile(tg, "200KiB", verify=False).block_limit == 50 * KiB


def test_no_block_fits_names_the_smallest_budget_and_block_limit():
    tg = softmax_program().build()
    floor, floor_task = finest_block(tg, 256)
    with pytest.raises(PartitionInfeasibleError) as caught:
        ep.compile(tg, floor - 256)
    error = caught.value
    assert (error.block_limit, error.block_task, error.needed) == (floor, floor_task, floor)
    assert "partitioning brings that down to the smallest block limit that works" in str(error)


def test_a_budget_below_every_block_leads_with_the_one_budget_that_compiles():
    """The issue: budget 0 was 'below the smallest feasible budget' of the unsplit program
    (32 MiB for the mlp) and later 'no budget below 1 KiB' and 204 KiB: the first figure
    said is now the true minimum, the unsplit need only a reason."""
    tg = load_program("mlp")
    unsplit, _ = memgraph.min_budget(tg)
    with pytest.raises(PartitionInfeasibleError) as caught:
        ep.compile(tg, 0)
    error = caught.value
    lead = str(error).split(". ")[0]
    needed = f"{format_bytes(error.needed)} ({error.needed} B)"
    assert lead == f"budget 0 B is below the smallest budget that compiles, {needed}"
    assert error.needed < unsplit and "smallest feasible" not in str(error)
    assert f"({format_bytes(unsplit)} ({unsplit} B)); partitioning brings" in str(error)


def test_compiled_repr_and_rows():
    compiled = ep.compile(softmax_program(), "200KiB")
    text = repr(compiled)
    tasks = len(compiled.program)
    assert text.startswith(f"<Compiled 'smx': {tasks} tasks -> {len(compiled.graph)}, ")
    assert "budget 200.0 KiB" in text and "block limit 50.0 KiB (auto: 25% of the budget)" in text
    assert text.endswith("verified>")
    labels = [label for label, _ in compiled.rows()]
    assert labels == ["program", "budget", "partition", "plan", "verify"]
    rows = dict(compiled.rows())
    assert rows["partition"].startswith(
        f"{tasks} -> {len(compiled.graph)} tasks, block limit 50.0 KiB"
    )
    assert "assembled on the host" in rows["plan"]  # y's blocks go straight to the host


def test_compile_declares_the_kernels_workspaces_on_every_graph_it_plans():
    """The program, and each partition of it (blocks are new tasks), carry the workspace
    each GPU kernel needs (`runtime.declare_workspaces`), and the plan holds them."""
    prog = ep.Program("ws")
    x = prog.input("x", (64, 96))
    ids = prog.input("ids", (32,), "int64")
    table = prog.input("table", (100, 64), role="weight")
    h = prog.gather(table, ids)  # a gather's flag: 16 bytes of workspace
    y = prog.einsum("ij,jk->", h, x)  # cuBLAS reads both in place: no workspace
    prog.output(y + prog.einsum("ij,ji->", x, prog.einsum("ij->ji", x)), "y")
    tg = prog.build()
    assert tg.workspace_bytes == 0
    for budget in ("1MiB", "40KiB"):
        compiled = ep.compile(tg, budget)
        graph = compiled.graph
        assert compiled.program is tg
        assert runtime.declare_workspaces(graph) is graph  # every task's is what it needs
        assert graph.workspace_bytes > 0
        held = {n.tensor: n.workspace for n in compiled.plan.nodes if n.workspace is not None}
        assert held and all(graph[t].workspace <= r.size for t, r in held.items())
        assert {t.id for t in graph if t.workspace} == set(held)
    assert compiled.block_limit is not None  # the second budget partitioned it
