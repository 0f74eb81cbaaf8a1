"""No runaway work: automatic partitioning is bounded before it starts.

`einpage.compile` counts the tasks a budget's partition would make from the block sizes
alone (`taskgraph.partition.estimate_tasks`, milliseconds) and refuses a budget over
`max_blocks` with the smallest budget under it; materializing stops past twice the cap
whatever the estimate said. Counts are asserted, never wall-clock times.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from partition_cases import random_programs

import einpage as ep
import memgraph
from einpage.cli import EXIT_INFEASIBLE, main
from einpage.pipeline import (
    MAX_AUTO_BLOCKS,
    PLANNER_BYTES_PER_TASK,
    TooManyBlocksError,
    estimated_blocks,
    task_cap,
)
from einpage.presets import load_program
from einpage_core.errors import EinpageError
from taskgraph.partition import (
    TooManyTasksError,
    estimate_tasks,
    finest_block,
    partition,
)


def test_a_tiny_budget_is_refused_with_a_budget_that_compiles():
    tg = load_program("mlp", batch=64, seq=None)
    with pytest.raises(TooManyBlocksError) as info:
        ep.compile(tg, "16KiB", max_blocks=2000)
    err = info.value
    assert err.count > 2000 and err.max_blocks == 2000 and err.needed > 16 * 1024
    assert "2,000" in str(err) and "budget" in str(err)
    compiled = ep.compile(tg, err.needed, max_blocks=2000, verify=False)
    assert len(compiled.graph) <= 2 * 2000
    with pytest.raises(TooManyBlocksError):
        ep.compile(tg, err.needed - 4096, max_blocks=2000, verify=False)


def test_the_default_cap_refuses_the_mlp_at_16_kib_in_the_library_and_the_cli(capsys):
    tg = load_program("mlp")
    with pytest.raises(TooManyBlocksError) as info:
        ep.compile(tg, "16KiB")
    assert info.value.max_blocks == MAX_AUTO_BLOCKS and info.value.count > 10 * MAX_AUTO_BLOCKS
    assert main(["plan", "mlp", "--budget", "16KiB"]) == EXIT_INFEASIBLE
    assert "stops at 100,000" in capsys.readouterr().err


def test_partition_stops_at_max_tasks():
    tg = load_program("mlp", batch=64, seq=None)
    with pytest.raises(TooManyTasksError, match="more than 500 tasks"):
        partition(tg, "8KiB", max_tasks=500)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs(), st.floats(0, 1))
def test_the_estimate_is_a_lower_bound_of_the_partition(case, where):
    tg = case.tg
    floor, _ = finest_block(tg)
    peak = max(floor, memgraph.no_offload_peak(tg))
    limit = int(floor + where * (peak - floor))
    made = len(partition(tg, limit))
    assert estimated_blocks(tg, limit) <= made
    assert estimate_tasks(tg, limit).tasks == estimated_blocks(tg, limit)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs(), st.integers(0, 40))
def test_any_budget_compiles_or_raises_a_typed_error_with_bounded_tasks(case, step):
    """From 1 byte to the peak (log-spaced), with a small cap: a plan whose graph stays
    within twice the cap, or an `EinpageError`."""
    tg = case.tg
    peak = max(1, memgraph.no_offload_peak(tg))
    budget = max(1, int(peak ** (step / 40)))
    try:
        compiled = ep.compile(tg, budget, max_blocks=300, verify=False)
    except EinpageError:
        return
    assert len(compiled.graph) <= max(600, len(tg))


def test_api_misuse_raises_typed_errors_that_say_what_was_expected():
    from einpage_core.errors import GraphError, ProgramError

    with pytest.raises(GraphError, match="takes a TaskGraph, got str"):
        memgraph.plan("mlp", "1GiB")
    with pytest.raises(ProgramError, match="non-empty string, got 3"):
        ep.Program(3)
    prog = ep.Program()
    with pytest.raises(ProgramError, match="expected a Tensor"):
        prog.slice(3, (0,), (1,))
    with pytest.raises(EinpageError, match="shape must be a sequence of ints"):
        prog.fill(3, 1.0)


def test_no_cap_still_refuses_what_the_host_memory_cannot_plan(monkeypatch):
    import einpage.pipeline as pipeline

    tg = load_program("mlp")
    monkeypatch.setattr(pipeline, "available_memory", lambda: 500 * PLANNER_BYTES_PER_TASK)
    assert task_cap(None)[0] == task_cap(10_000)[0] == 500
    assert task_cap(100) == (100, "")  # the smaller cap wins, and needs no reason
    with pytest.raises(TooManyBlocksError) as caught:
        ep.compile(tg, "1MiB", max_blocks=None)  # about 7,000 blocks
    err = caught.value
    assert err.max_blocks == 500 and err.count > 500
    assert "host memory available" in str(err) and "stops at 500 here" in str(err)
    assert ep.compile(tg, err.needed, max_blocks=None).plan.budget == err.needed
    monkeypatch.setattr(pipeline, "available_memory", lambda: None)  # the system won't say
    assert task_cap(None) == (None, "")
