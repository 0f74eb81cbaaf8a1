"""Progress callbacks: `einpage.compile(progress=)` reports its stages in order, how far
the planner and the verifier are, a fraction that never decreases and ends at 1.0; the
CLI's console draws them."""

from __future__ import annotations

import io

import pytest

import einpage as ep
import memgraph
from einpage.cli.console import Console
from einpage.cli.presets import load_program
from einpage.pipeline import STAGE_SHARES
from einpage_core.progress import Progress, ProgressReport


def test_compile_reports_every_stage_in_order_up_to_one():
    events: list[Progress] = []
    compiled = ep.compile(load_program("mlp"), "40%", progress=events.append)
    assert compiled.block_limit is not None  # partitioned: every stage does work
    stages = list(dict.fromkeys(e.stage for e in events))
    assert stages == [*(s for s in STAGE_SHARES if s != "planning the host"), "done"]
    fractions = [e.fraction for e in events]
    assert fractions == sorted(fractions) and fractions[0] == 0.0
    assert events[-1] == Progress("done", 1, 1, 1.0)
    assert all(0.0 <= f <= 1.0 for f in fractions)
    planning = [e for e in events if e.stage == "planning"]
    assert len(planning) > 10  # the planner's walk, not just its start and end
    assert [e.done for e in planning] == sorted(e.done for e in planning)
    assert planning[-1].done == planning[-1].total > 0
    verifying = [e for e in events if e.stage == "verifying"]
    assert verifying[-1].done == verifying[-1].total == len(compiled.plan)


def test_a_host_tier_is_a_stage_of_its_own(tmp_path):
    events: list[Progress] = []
    ep.compile(load_program("mlp"), "40%", host_budget="50%", spill=tmp_path,
               progress=events.append)  # fmt: skip
    stages = list(dict.fromkeys(e.stage for e in events))
    assert stages == [*STAGE_SHARES, "done"]
    fractions = [e.fraction for e in events]
    assert fractions == sorted(fractions) and events[-1].fraction == 1.0


def test_without_verification_the_verifying_stage_is_skipped():
    events: list[Progress] = []
    ep.compile(load_program("mlp"), "100%", verify=False, progress=events.append)
    assert "verifying" not in {e.stage for e in events}
    assert events[-1].fraction == 1.0


def test_plan_and_verify_take_a_tick():
    tg = load_program("mlp")
    ticks: list[tuple[int, int]] = []
    mg = memgraph.plan(tg, "100%", progress=lambda done, total: ticks.append((done, total)))
    assert ticks[0][0] == 0 and ticks[-1][0] == ticks[-1][1] > 0
    checked: list[tuple[int, int]] = []
    memgraph.verify(mg, lambda done, total: checked.append((done, total)))
    assert checked[-1] == (len(mg), len(mg))
    assert len(checked) <= 102  # about a hundred reports, whatever the size


def test_a_progress_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match="progress must be a callable"):
        ep.compile(load_program("mlp"), "100%", progress=3)
    with pytest.raises(TypeError, match="progress must be a callable"):
        ProgressReport("yes", {"planning": 1.0})


def test_the_console_shows_the_planners_progress_on_its_bar():
    err = io.StringIO()
    console = Console(progress=True, out=io.StringIO(), err=err)
    with console.stages(1), console.stage("compiling"):
        ep.compile(load_program("mlp"), "40%", progress=console.report)
    text = err.getvalue()
    assert "compiling" in text and "planning" in text and "verifying 100%" in text
    quiet = Console(progress=False, out=io.StringIO(), err=io.StringIO())
    quiet.report(Progress("planning", 1, 2, 0.5))  # no bar: nothing drawn
    assert quiet.err.getvalue() == ""


@pytest.mark.parametrize("mode", ["sequential", "streams", "random"])
def test_a_run_reports_the_nodes_issued_and_the_end(mode):
    import runtime
    from einpage.cli.demo import random_inputs

    tg = load_program("mlp")
    mg = ep.compile(tg, "40%").plan
    ticks: list[tuple[int, int]] = []
    with runtime.Session(mg, "numpy", mode=mode) as session:
        session.run(random_inputs(tg, 0), progress=lambda done, total: ticks.append((done, total)))
    assert ticks[0] == (0, len(mg)) and ticks[-1] == (len(mg), len(mg))
    assert [d for d, _ in ticks] == sorted(d for d, _ in ticks)
    assert 2 < len(ticks) <= 102
