"""Non-finite outputs are never passed over: `einpage.cli.checks` counts them and names the
first, in `einpage run`'s output summary and in `--check`, which fails when the output
has one where the reference is finite and says plainly when the reference itself is
not finite (it then vouches for nothing). And `--check` holds each output to the
tolerance of the least precise dtype it is computed from (a mixed-precision step's
float32 moments come from float16 gradients)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

import einpage as ep
import taskgraph
from einpage.cli.checks import (
    CheckFailedError,
    NonFinite,
    compare_outputs,
    raise_on_mismatch,
    summarize,
    tolerance_dtypes,
)
from einpage.cli.commands import EXIT_CHECK_FAILED, EXIT_OK, main


def test_nonfinite_counts_each_kind_and_names_the_first():
    a = np.array([[1.0, 2.0, np.nan], [np.inf, -np.inf, np.nan]], "float32")
    bad = NonFinite.of(a)
    assert (bad.count, bad.size, bad.nan, bad.posinf, bad.neginf) == (4, 6, 2, 1, 1)
    assert bad.first == (0, 2)
    assert str(bad) == "4 of 6 not finite (2 NaN, 1 +inf, 1 -inf), first at [0, 2]"
    assert NonFinite.of(np.arange(4)) is None
    assert NonFinite.of(np.ones(4, "bfloat16")) is None
    assert NonFinite.of(np.array([np.nan], "bfloat16")).nan == 1


def test_a_half_nan_output_does_not_look_fine_in_its_summary():
    value = np.array([1.0, np.nan, 3.0, np.nan], "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        line = summarize(value)
        nothing = summarize(np.full((2, 3), np.nan, "float32"))
    assert line == "float32[4]  2 of 4 not finite (2 NaN), first at [1]; finite: mean 2, max |x| 3"
    assert nothing == "float32[2,3]  all 6 not finite (6 NaN), first at [0, 0]"
    assert summarize(np.array([-1.0, 3.0], "bfloat16")) == "bfloat16[2]  mean 1, max |x| 3"


def test_an_output_that_is_not_finite_where_the_reference_is_fails_with_its_count():
    ref = {"y": np.array([1.0, 2.0, 3.0, 4.0], "float32")}
    (c,) = compare_outputs({"y": np.array([1.0, np.nan, 3.0, np.inf], "float32")}, ref)
    assert not c.ok and c.reference_finite
    assert c.worst() == (
        "2 of 4 not finite (1 NaN, 1 +inf), first at [1] where the reference is finite (nan vs 2)"
    )
    with pytest.raises(CheckFailedError, match=r"'y' differs .* 2 of 4 not finite"):
        raise_on_mismatch([c])


@pytest.mark.parametrize("got", [[1.0, np.nan, -4.0], [1.0, 5.0, -4.0]])
def test_a_reference_that_is_not_finite_fails_the_check_and_says_so(got):
    """Even where the output has the very same NaN (once reported 'nan vs nan ... ok')."""
    ref = {"y": np.array([1.0, np.nan, -4.0], "float32")}
    (c,) = compare_outputs({"y": np.array(got, "float32")}, ref)
    assert not c.ok and not c.reference_finite
    name, row = c.row()
    assert "the reference itself: 1 of 3 not finite (1 NaN), first at [1]" in row
    assert row.endswith("NOT CHECKED")
    with pytest.raises(CheckFailedError, match=r"output 'y' is itself not finite \(1 of 3"):
        raise_on_mismatch([c])


@pytest.fixture
def nan_plan(tmp_path):
    """A plan whose output "root" is sqrt of a normal input: NaN wherever it is negative."""
    prog = ep.Program("roots")
    x = prog.input("x", (16, 8))
    prog.output(ep.sqrt(x), "root")
    prog.output(x * 2.0, "twice")
    path = tmp_path / "roots.json"
    path.write_text(ep.compile(prog.build(), "1MiB").plan.to_json())
    return path


def test_einpage_run_reports_nan_outputs_and_check_fails(nan_plan, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy RuntimeWarning leaks out
        code = main(["run", str(nan_plan), "--backend", "numpy"])
        out = capsys.readouterr().out
        assert code == EXIT_OK
        assert "root   float32[16,8]  " in out and " not finite (" in out
        assert "twice  float32[16,8]  mean" in out
        code = main(["run", str(nan_plan), "--backend", "numpy", "--check"])
    captured = capsys.readouterr()
    assert code == EXIT_CHECK_FAILED
    assert "nan vs nan" not in captured.out
    assert "NOT CHECKED" in captured.out
    assert "output 'root' is itself not finite" in captured.err
    assert "Traceback" not in captured.err


def mixed_program() -> ep.Program:
    """A float32 output computed from a float16 one (as a mixed-precision step's AdamW
    moment from its float16 gradient), and one from a float16 input cast exactly."""
    prog = ep.Program("mixed")
    x = prog.input("x", (32,), "float16")
    prog.output(prog.einsum("i->i", ep.exp(x), dtype="float32") * 0.5, "from_half")
    prog.output(prog.einsum("i->i", x, dtype="float32") * 0.5, "exact")
    return prog


def test_an_output_is_held_to_the_tolerance_of_what_it_is_computed_from():
    tg = mixed_program().build()
    assert tolerance_dtypes(tg) == {"from_half": "float16", "exact": "float32"}
    want = taskgraph.evaluate(tg, {"x": np.linspace(-1, 1, 32).astype("float16")})
    # another implementation's float16 rounding, carried into the float32 output
    got = {name: value * np.float32(1 + 2**-11) for name, value in want.items()}
    plain = {c.name: c for c in compare_outputs(got, want)}
    assert not plain["from_half"].ok and not plain["exact"].ok
    held = {c.name: c for c in compare_outputs(got, want, tolerance_dtypes(tg))}
    assert held["from_half"].ok and not held["exact"].ok
    assert "of the float16 tolerance)  ok" in held["from_half"].row()[1]


def test_einpage_run_check_names_the_tolerance_it_applies(tmp_path, capsys):
    path = tmp_path / "mixed.json"
    path.write_text(ep.compile(mixed_program().build(), "1MiB").plan.to_json())
    assert main(["run", str(path), "--backend", "numpy", "--check"]) == EXIT_OK
    out = capsys.readouterr().out
    assert re.search(r"from_half\s+float32\[32\]  .* of the float16 tolerance\)  ok", out)
    assert re.search(r"exact\s+float32\[32\]  .* of the tolerance\)  ok", out)
