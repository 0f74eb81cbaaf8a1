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
from einpage.cli.commands import EXIT_BAD_INPUT, EXIT_INFEASIBLE, main
from einpage.cli.presets import load_program
from einpage.pipeline import (
    MAX_AUTO_BLOCKS,
    PLANNER_BYTES_PER_TASK,
    TooManyBlocksError,
    estimated_blocks,
    task_cap,
)
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


def test_partition_refuses_or_stops_at_max_tasks():
    """Over the cap by the estimate: refused before making a block; over it only in
    the making (the estimate is a lower bound): stopped there."""
    tg = load_program("mlp", batch=64, seq=None)
    at_least = f"at least {estimated_blocks(tg, 8 * 1024):,} tasks, more than 500; refused"
    with pytest.raises(TooManyTasksError, match=at_least):
        partition(tg, "8KiB", max_tasks=500)
    counted, made = estimated_blocks(tg, 64 * 1024), len(partition(tg, "64KiB"))
    assert counted < made
    with pytest.raises(TooManyTasksError, match=f"more than {counted:,} tasks; stopped"):
        partition(tg, "64KiB", max_tasks=counted)
    assert len(partition(tg, "64KiB", max_tasks=made)) == made


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs(), st.floats(0, 1))
def test_the_estimate_is_a_lower_bound_of_the_partition(case, where):
    tg = case.tg
    floor, _ = finest_block(tg)
    peak = max(floor, memgraph.streaming_minimum(tg))
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
    peak = max(1, memgraph.streaming_minimum(tg))
    budget = max(1, int(peak ** (step / 40)))
    try:
        compiled = ep.compile(tg, budget, max_blocks=300, verify=False)
    except EinpageError:
        return
    assert len(compiled.graph) <= max(600, len(tg))


def test_api_misuse_raises_typed_errors_that_say_what_was_expected():
    from einpage_core.errors import GraphError, ProgramError

    with pytest.raises(GraphError, match="takes a taskgraph.TaskGraph, got str"):
        memgraph.plan("mlp", "1GiB")
    with pytest.raises(ProgramError, match="non-empty string, got 3"):
        ep.Program(3)
    prog = ep.Program()
    with pytest.raises(ProgramError, match="expected a Tensor"):
        prog.slice(3, (0,), (1,))
    with pytest.raises(EinpageError, match="shape must be a sequence of ints"):
        prog.fill(3, 1.0)


def test_every_entry_point_names_the_graph_it_takes():
    """Passing a string where a graph belongs raised AttributeError from inside
    `taskgraph.evaluate` and `memgraph.verify`; every entry point says what it takes."""
    import runtime
    import taskgraph
    from einpage_core.errors import GraphError

    calls = {
        "taskgraph.evaluate takes a taskgraph.TaskGraph": lambda: taskgraph.evaluate("mlp", {}),
        "memgraph.plan takes a taskgraph.TaskGraph": lambda: memgraph.plan("mlp", "1GiB"),
        "memgraph.verify takes a memgraph.MemGraph": lambda: memgraph.verify("p.json"),
        "memgraph.simulate takes a memgraph.MemGraph": lambda: memgraph.simulate("p.json"),
        "runtime.run takes a memgraph.MemGraph": lambda: runtime.run("p.json", {}),
        "runtime.Session takes a memgraph.MemGraph": lambda: runtime.Session("p.json"),
    }
    for message, call in calls.items():
        with pytest.raises(GraphError, match=f"^{message}, got str '(mlp|p.json)'"):
            call()


def test_compile_names_its_options_when_given_one_it_lacks():
    from einpage_core.errors import PlanError

    tg = load_program("mlp", batch=64, seq=None)
    with pytest.raises(
        PlanError,
        match=r"einpage.compile has no option 'evict'; it takes "
        r"budget, partition, verify, max_blocks, progress, host_budget, checkpoint, spill, "
        r"order, eviction",
    ):
        ep.compile(tg, "1GiB", evict="lru")
    with pytest.raises(PlanError, match="memgraph.plan has no option 'partition_size'"):
        memgraph.plan(tg, "1GiB", partition_size=4096)
    for bad in ("many", 0, True, 2.5):
        with pytest.raises(PlanError, match="max_blocks must be a count >= 1 or None"):
            ep.compile(tg, "1KiB", max_blocks=bad)


def test_no_cap_still_refuses_what_the_host_memory_cannot_plan(monkeypatch):
    import einpage.pipeline.search as pipeline

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


def huge_program() -> ep.Program:
    """The issue's program: a 2**62-element dimension (an empty MemoryError from deep in
    the partition before)."""
    prog = ep.Program("huge")
    x = prog.input("x", (2**62,))
    w = prog.input("w", (2**62,), role="weight")
    prog.output(prog.einsum("i,i->i", x, w), "y")
    return prog


def test_a_capped_partition_is_refused_before_making_a_block():
    with pytest.raises(TooManyTasksError, match="refused before making any") as caught:
        partition(huge_program().build(), "1MiB", max_tasks=1000)
    assert caught.value.counted > 10**12 and caught.value.max_tasks == 1000


def test_an_explicit_block_limit_is_capped_by_the_host_memory(monkeypatch):
    import einpage.pipeline.search as pipeline

    monkeypatch.setattr(pipeline, "available_memory", lambda: 1000 * PLANNER_BYTES_PER_TASK)
    with pytest.raises(TooManyTasksError) as caught:
        ep.compile(huge_program(), "1GiB", partition="1MiB")
    assert caught.value.max_tasks == 1000 and "host memory available" in str(caught.value)
    small = load_program("mlp", batch=64, seq=None)
    assert len(ep.compile(small, "1GiB", partition="256KiB", verify=False).graph) <= 1000


def test_the_cli_says_a_partition_is_too_large_instead_of_a_traceback(capsys, tmp_path):
    program = tmp_path / "huge.py"
    program.write_text(
        "import einpage as ep\n"
        "program = ep.Program('huge')\n"
        "x = program.input('x', (2**62,))\n"
        "program.output(program.einsum('i,i->i', x, x), 'y')\n"
    )
    for argv in (["show", program, "--partition", "1MiB"],
                 ["plan", program, "--budget", "1GiB", "--partition", "1MiB"]):  # fmt: skip
        assert main([str(a) for a in argv]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert "refused before making any" in err and "Traceback" not in err


def test_the_cli_reports_running_out_of_memory_in_words(capsys, monkeypatch):
    import einpage.cli.commands as cli

    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(cli, "load_program", exhausted)
    assert main(["show", "mlp"]) == EXIT_BAD_INPUT
    assert "einpage: error: out of host memory: the program" in capsys.readouterr().err
