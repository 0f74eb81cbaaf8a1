"""The smallest budget an error names compiles when typed back (issue 21).

What is claimed, for `einpage.compile` with partition "auto" (any `max_blocks` cap) or
"off": when a budget is refused with an `InfeasibleBudgetError`, its `needed` is a budget
that compiles with the same program, options and cap, and one byte less is refused; the
message prints it rounded up with its exact bytes, and that figure typed back compiles
too. Below the finest block nothing can work (`No budget below ... can work`); between
that bound and `needed` not every budget is tried (the search assumes more room never
makes more blocks), so "smallest" means: it compiles, and a byte less does not.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from partition_cases import random_programs
from strategies import einsum_programs

import einpage as ep
import einpage.pipeline as pipeline
import einpage.pipeline.search as search
import memgraph
import memgraph.budgets as budgets
from einpage.cli.presets import load_program
from einpage_core.errors import InfeasibleBudgetError
from einpage_core.units import format_bytes, format_exact, parse_bytes
from taskgraph.partition import BlockLimitError


def refusal(tg, budget, **options) -> InfeasibleBudgetError | None:
    """The error `compile` raises for `budget`, or None when it compiles (verified)."""
    try:
        ep.compile(tg, budget, **options)
    except InfeasibleBudgetError as error:
        return error
    return None


def typed_back(nbytes: int) -> int:
    """The bytes of the figure a message prints for `nbytes` (rounded up), typed back."""
    return parse_bytes(format_bytes(nbytes, "up").replace(" ", ""))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tg=st.one_of(einsum_programs(), random_programs().map(lambda case: case.tg)),
    cap=st.sampled_from([None, 1, 10, 100, 1000]),
    alignment=st.sampled_from([256, 64, 16]),
    partition=st.sampled_from(["auto", "auto", "off"]),
    where=st.floats(0, 1),
)
def test_the_budget_a_refusal_names_compiles_and_a_byte_less_does_not(
    tg, cap, alignment, partition, where
):
    options = {"max_blocks": cap, "alignment": alignment, "partition": partition}
    unsplit, _ = memgraph.min_budget(tg, alignment)
    error = refusal(tg, int(unsplit**where), verify=False, **options)  # 1 B up, log-spaced
    if error is None:
        event("the budget compiles")
        return
    event(f"refused: {type(error).__name__}, searched: {'a byte less' in str(error)}")
    assert not isinstance(error, BlockLimitError)  # a block limit, not a budget
    needed = error.needed
    assert needed > error.budget // alignment * alignment
    assert format_exact(needed) in str(error)
    assert refusal(tg, needed, **options) is None, f"{needed} B named, and refused"
    assert refusal(tg, typed_back(needed), verify=False, **options) is None
    if cap is None:  # the search stays within the default cap (see below)
        options["max_blocks"] = pipeline.MAX_AUTO_BLOCKS
    assert refusal(tg, needed - 1, verify=False, **options) is not None, f"{needed - 1} B too"


def test_a_program_that_fits_unsplit_below_its_finest_block_names_the_unsplit_budget():
    """The issue's 2-task program compiled at 512 B while `ep.compile(tg, 0)` said nothing
    below 768 B could work (the finest block of a sum: three partials, 768 B)."""
    prog = ep.Program("sum")
    x = prog.input("x", (2,), "float64")
    prog.output(prog.einsum("i->", x), "s")
    tg = prog.build()
    error = refusal(tg, 0)
    assert error.needed == 512 and "the program unsplit" in str(error)
    assert refusal(tg, 512) is None and refusal(tg, 511) is not None


def test_the_budget_named_under_a_cap_compiles_under_that_cap():
    """The estimate of blocks is a lower bound, far below the blocks made near the finest
    block of a LLaMA: the budget named was below the cap by the estimate and refused
    when made (13 KiB here; 2.2 KiB for `einpage plan llama:tiny --budget 0`)."""
    tg = load_program("llama:tiny", seq=16)
    error = refusal(tg, 0, max_blocks=3000, verify=False)
    needed = error.needed
    assert refusal(tg, needed, max_blocks=3000) is None
    assert refusal(tg, needed - 1, max_blocks=3000, verify=False) is not None
    assert f"with a byte less ({needed - 1:,} B), automatic partitioning" in str(error)
    too_many = refusal(tg, needed - 1, max_blocks=3000, verify=False)
    assert isinstance(too_many, ep.TooManyBlocksError) and too_many.needed == needed


def test_the_figure_printed_is_rounded_up_and_a_bound_down():
    """2,304 B printed as '2.2 KiB' means 2,253 B typed back, which is refused: a budget
    to type back is printed rounded up, a bound nothing below can reach rounded down."""
    prog = ep.Program("mm")
    x = prog.input("x", (4, 64))  # 1 KiB
    w = prog.input("w", (64, 4), role="weight")  # 1 KiB
    prog.output(x @ w, "y")  # 64 B: 256 B aligned, 2,304 B in all
    error = refusal(prog, 0, partition="off")
    assert error.needed == 2304 and "2.3 KiB (2304 B)" in str(error)
    assert refusal(prog, "2.3KiB", partition="off") is None
    assert refusal(prog, "2.2KiB", partition="off") is not None
    tg = load_program("llama:tiny", seq=16)
    assert search.finest_block(tg, 256)[0] == 2304
    error = refusal(tg, 0, max_blocks=3000, verify=False)
    assert "No budget below 2.2 KiB (2304 B) can work" in str(error)
    lead = str(error).split(". ")[0]
    assert lead.endswith(f"the smallest budget that compiles, {format_exact(error.needed)}")


def test_without_a_cap_the_search_stops_where_the_default_cap_would(monkeypatch):
    """Without `max_blocks` the host's memory caps a partition (millions of tasks): the
    search for the budget to name stays within `MAX_AUTO_BLOCKS` tasks, and says so; the
    budget it names compiles without the cap too (6 minutes to name 2.2 KiB before the
    bound, for llama:tiny at 16 positions: 1.5 million tasks)."""
    monkeypatch.setattr(search, "MAX_AUTO_BLOCKS", 3000)
    tg = load_program("llama:tiny", seq=16)
    error = refusal(tg, 0, max_blocks=None, verify=False)
    assert "searched within 3,000 tasks: with no cap, max_blocks=None" in str(error)
    assert error.needed == refusal(tg, 0, max_blocks=3000, verify=False).needed
    assert refusal(tg, error.needed, max_blocks=None, verify=False) is None


def test_each_figure_is_computed_once_per_compile(monkeypatch):
    """Issue 22: `compile` computed the program's `min_budget` up to three times and the
    finest block on every step of a bisection; now each graph's `min_budget` is computed
    once (the planner's check reuses it) and the finest block once per compile."""
    computed: list[int] = []
    finest: list[int] = []
    storage_roots, finest_block = budgets.storage_roots, search.finest_block

    def count_min_budget(tg):  # `min_budget` computes a graph's storage roots first
        computed.append(id(tg))
        return storage_roots(tg)

    def count_finest(tg, alignment=1):
        finest.append(id(tg))
        return finest_block(tg, alignment)

    monkeypatch.setattr(budgets, "storage_roots", count_min_budget)
    monkeypatch.setattr(search, "finest_block", count_finest)
    prog = ep.Program("smx")
    x = prog.input("x", (64, 256))
    w = prog.input("w", (256, 256), role="weight")
    prog.output(ep.softmax(x @ w), "y")
    compiled = ep.compile(prog, "200KiB")  # partitioned: the program and its partition
    assert sorted(computed) == sorted([id(compiled.program), id(compiled.graph)])
    assert finest == [id(compiled.program)]
    computed.clear(), finest.clear()
    tg = load_program("mlp", batch=64, seq=None)
    with pytest.raises(ep.TooManyBlocksError):
        ep.compile(tg, "16KiB", max_blocks=2000)  # searches for the smallest budget
    assert computed.count(id(tg)) == 1 and finest == [id(tg)]
    assert len(computed) == len(set(computed))  # each partition tried: once
