"""Checking outputs against the reference evaluator (`taskgraph.evaluate`).

`compare_outputs` checks every element as `numpy.testing.assert_allclose` does, with a
tolerance per dtype (`TOLERANCES`): |out - ref| <= atol + rtol * |ref|, where atol is a
fraction of the reference's largest magnitude (at least 1), so that small values
(probabilities near 0.004) are held to their own relative precision; it reports the
worst element (its index, both values). `raise_on_mismatch` turns a failed comparison
into a `CheckFailedError`. The CLI's `run --check`, the demo and the notebooks use them.

An output inherits the rounding of what it is computed from: a float32 output of a
mixed-precision training step (an AdamW moment) is made from a float16 gradient, which
another implementation rounds differently. `tolerance_dtypes(tg)` gives, for each
output, the least precise float dtype among the tasks that compute it, whose tolerance
`compare_outputs` then applies.

Non-finite values (NaN, ±inf) are never passed over: `NonFinite` counts them and names
the first, `summarize` puts that in an output's one-line summary, and a comparison
fails when the output has one where the reference is finite, or when the reference
itself has any: a reference that is not finite vouches for nothing (with random inputs,
an input may lie outside what the program accepts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from einpage_core.errors import EinpageError
from taskgraph import dtypes
from taskgraph.graph import TaskGraph

__all__ = [
    "TOLERANCES",
    "CHECK_TITLE",
    "CheckFailedError",
    "NonFinite",
    "Comparison",
    "compare_outputs",
    "raise_on_mismatch",
    "summarize",
    "tolerance_dtypes",
]

TOLERANCES = {
    "float16": (1e-2, 1e-3),
    "bfloat16": (8e-2, 8e-3),
    "float32": (1e-4, 1e-5),
    "float64": (1e-9, 1e-11),
}
"""(rtol, atol as a fraction of the reference's largest magnitude, at least 1) by dtype:
about ten roundings of the dtype relative, a tenth of that absolute. Integer outputs
must be equal."""


def tolerance_dtypes(tg: TaskGraph) -> dict[str, str]:
    """For each output of `tg`, the float dtype whose tolerance holds it: the least
    precise (largest rtol in `TOLERANCES`) among the tasks that compute it, it included
    (inputs and views round nothing: a float16 weight cast to float32 is exact).

    >>> import einpage as ep
    >>> prog = ep.Program()
    >>> x = prog.input("x", (4,), "float16")
    >>> wide = prog.einsum("i->i", x, dtype="float32")
    >>> prog.output(wide, "exact")
    >>> prog.output(prog.einsum("i->i", ep.exp(x), dtype="float32"), "rounded")
    >>> tolerance_dtypes(prog.build())
    {'exact': 'float32', 'rounded': 'float16'}
    """
    loosest: list[str | None] = []
    for task in tg:
        found = [loosest[i] for i in task.inputs]
        if task.is_compute and task.dtype in TOLERANCES:
            found.append(task.dtype)
        found = [d for d in found if d is not None]
        loosest.append(max(found, key=lambda d: TOLERANCES[d][0]) if found else None)
    return {name: loosest[task_id] or tg[task_id].dtype for name, task_id in tg.outputs.items()}


class CheckFailedError(EinpageError):
    """`run --check` (or the demo) found outputs that differ from the reference."""


@dataclass(frozen=True)
class NonFinite:
    """The non-finite elements of an array: how many of `size`, of which NaN, +inf and
    -inf, and the index of the first (in C order).

    >>> NonFinite.of(np.array([1.0, np.nan, np.inf, np.nan]))
    NonFinite(count=3, size=4, nan=2, posinf=1, neginf=0, first=(1,))
    >>> print(NonFinite.of(np.array([1.0, np.nan, np.inf, np.nan])))
    3 of 4 not finite (2 NaN, 1 +inf), first at [1]
    >>> NonFinite.of(np.ones(3)) is None
    True
    """

    count: int
    size: int
    nan: int
    posinf: int
    neginf: int
    first: tuple[int, ...]

    @classmethod
    def of(cls, array: np.ndarray) -> NonFinite | None:
        """The non-finite elements of `array`, or None when it has none (or holds integers)."""
        array = np.asarray(array)
        if not dtypes.is_float_array(array.dtype) or array.size == 0:
            return None
        wide = array.astype(np.float64)
        bad = ~np.isfinite(wide)
        count = int(np.count_nonzero(bad))
        if not count:
            return None
        flat = int(np.argmax(bad))
        return cls(
            count=count,
            size=int(array.size),
            nan=int(np.count_nonzero(np.isnan(wide))),
            posinf=int(np.count_nonzero(wide == np.inf)),
            neginf=int(np.count_nonzero(wide == -np.inf)),
            first=tuple(int(i) for i in np.unravel_index(flat, array.shape)),
        )

    def __str__(self) -> str:
        kinds = [(self.nan, "NaN"), (self.posinf, "+inf"), (self.neginf, "-inf")]
        split = ", ".join(f"{n} {what}" for n, what in kinds if n)
        share = f"all {self.count}" if self.count == self.size else f"{self.count} of {self.size}"
        return f"{share} not finite ({split}), first at {list(self.first)}"


def summarize(value: np.ndarray) -> str:
    """An output in one line: `dtype[shape]` and, for floats, the mean and largest
    magnitude of its finite elements, after its non-finite ones if it has any
    (`NonFinite`); for integers the range.

    >>> summarize(np.array([1.0, -3.0], "float32"))
    'float32[2]  mean -1, max |x| 3'
    >>> summarize(np.array([[1.0, np.nan]], "float32"))
    'float32[1,2]  1 of 2 not finite (1 NaN), first at [0, 1]; finite: mean 1, max |x| 1'
    >>> summarize(np.full(3, np.nan))
    'float64[3]  all 3 not finite (3 NaN), first at [0]'
    """
    shape = "[" + ",".join(map(str, value.shape)) + "]"
    if not value.size:
        return f"{value.dtype.name}{shape}  empty"
    if not dtypes.is_float_array(value.dtype):
        return f"{value.dtype.name}{shape}  min {value.min()}, max {value.max()}"
    wide = value.astype(np.float64)
    finite = wide[np.isfinite(wide)]
    stats = f"mean {finite.mean():.4g}, max |x| {np.abs(finite).max():.4g}" if finite.size else ""
    bad = NonFinite.of(value)
    if bad is None:
        return f"{value.dtype.name}{shape}  {stats}"
    return f"{value.dtype.name}{shape}  {bad}" + (f"; finite: {stats}" if stats else "")


@dataclass(frozen=True)
class Comparison:
    """One output against the reference: `error` is the worst element's |out - ref| over
    what it may be (atol + rtol * |ref|), so 1 is the limit; `index`, `got` and `want`
    name that element. `got_nonfinite` and `want_nonfinite` are the non-finite elements
    of the output and of the reference (`NonFinite`, None when there are none): the
    output may have one only where the reference has the same value, and a reference
    with any fails the check (`reference_finite`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    error: float
    scale: float
    rtol: float
    atol: float
    index: tuple[int, ...] | None = None
    got: float | None = None
    want: float | None = None
    got_nonfinite: NonFinite | None = None
    want_nonfinite: NonFinite | None = None
    tolerance: str | None = None
    """The dtype whose tolerance applied, where not `dtype` (`tolerance_dtypes`)."""

    @property
    def reference_finite(self) -> bool:
        return self.want_nonfinite is None

    @property
    def ok(self) -> bool:
        return self.error <= 1.0 and self.reference_finite

    def worst(self) -> str:
        """What decides the verdict, in words: a reference that is not finite, output
        values that are not finite where the reference is, or the worst element."""
        if not self.reference_finite:
            output = self.got_nonfinite if self.got_nonfinite is not None else "all finite"
            same = " (the same)" if self.got_nonfinite == self.want_nonfinite else ""
            return f"the reference itself: {self.want_nonfinite}; the output: {output}{same}"
        if self.got_nonfinite is not None:
            return (
                f"{self.got_nonfinite} where the reference is finite "
                f"({self.got:.6g} vs {self.want:.6g})"
            )
        if self.index is None:
            return "shapes differ" if not self.ok else "equal"
        return f"worst at {list(self.index)}: {self.got:.6g} vs {self.want:.6g}"

    def row(self) -> tuple[str, str]:
        """(name, `dtype[shape]  worst at [i, j]: out vs ref (x of the tolerance)  ok`);
        `NOT CHECKED` when the reference is not finite."""
        shape = "[" + ",".join(map(str, self.shape)) + "]"
        if not self.reference_finite:
            return self.name, f"{self.dtype}{shape}  {self.worst()}  NOT CHECKED"
        verdict = "ok" if self.ok else "MISMATCH"
        whose = "the" if self.tolerance is None else f"the {self.tolerance}"
        return (
            self.name,
            f"{self.dtype}{shape}  {self.worst()} ({self.error:.2g} of {whose} tolerance)  "
            f"{verdict}",
        )


CHECK_TITLE = (
    "check against the reference evaluator (each element: |out - ref| <= atol + rtol |ref|)"
)


def compare_outputs(
    outputs: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    tolerances: Mapping[str, str] | None = None,
) -> list[Comparison]:
    """Compare every reference output with the same-named output (see `Comparison`),
    each held to the tolerance of its dtype or of `tolerances[name]` where given (a
    dtype of `TOLERANCES`, e.g. from `tolerance_dtypes`).

    >>> ref = {"y": np.array([1.0, 2.0], "float32")}
    >>> [c.ok for c in compare_outputs({"y": np.array([1.0, 2.00001], "float32")}, ref)]
    [True]
    >>> bad = compare_outputs({"y": np.array([1.0, 2.5], "float32")}, ref)[0]
    >>> bad.ok, bad.index, bad.got, bad.want
    (False, (1,), 2.5, 2.0)
    >>> print(compare_outputs({"y": np.array([1.0, np.nan], "float32")}, ref)[0].worst())
    1 of 2 not finite (1 NaN), first at [1] where the reference is finite (nan vs 2)
    """
    found = []
    for name, ref in reference.items():
        out = np.asarray(outputs[name])
        ref = np.asarray(ref)
        dtype = ref.dtype.name
        held_to = (tolerances or {}).get(name, dtype)
        if not dtypes.is_float(dtype):
            held_to = dtype  # integers are equal or not
        rtol, atol_fraction = TOLERANCES.get(held_to, (0.0, 0.0))
        other = held_to if held_to != dtype else None
        got_bad, want_bad = NonFinite.of(out), NonFinite.of(ref)
        if out.shape != ref.shape:
            found.append(
                Comparison(name, ref.shape, dtype, float("inf"), 1.0, rtol, 0.0,
                           got_nonfinite=got_bad, want_nonfinite=want_bad, tolerance=other)
            )  # fmt: skip
            continue
        wide_out, wide_ref = out.astype(np.float64), ref.astype(np.float64)
        finite = np.isfinite(wide_ref)
        scale = max(1.0, float(np.max(np.abs(wide_ref[finite]), initial=0.0)))
        atol = atol_fraction * scale
        # equal values (infinities of one sign, NaN and NaN) differ by 0; any other pair
        # with a non-finite value differs by inf
        same = (wide_out == wide_ref) | (np.isnan(wide_out) & np.isnan(wide_ref))
        with np.errstate(invalid="ignore"):
            diff = np.where(same, 0.0, np.abs(wide_out - wide_ref))
        diff = np.where(np.isnan(diff), np.inf, diff)
        allowed = atol + rtol * np.abs(np.where(finite, wide_ref, 0.0))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(diff == 0, 0.0, diff / allowed)
        if ratio.size == 0:
            found.append(
                Comparison(name, ref.shape, dtype, 0.0, scale, rtol, atol, tolerance=other)
            )
            continue
        flat = int(np.argmax(ratio))  # the first non-finite difference, if any
        index = tuple(int(i) for i in np.unravel_index(flat, ratio.shape))
        found.append(
            Comparison(name, ref.shape, dtype, float(ratio.flat[flat]), scale, rtol, atol,
                       index, float(wide_out.flat[flat]), float(wide_ref.flat[flat]),
                       got_bad, want_bad, other)
        )  # fmt: skip
    return found


def raise_on_mismatch(comparisons: list[Comparison]) -> None:
    """Raise `CheckFailedError` naming the first output that differs from the reference,
    or whose reference is not finite (nothing to check it against)."""
    bad = [c for c in comparisons if not c.ok]
    if bad:
        c = bad[0]
        more = f" ({len(bad) - 1} more output(s) failed)" if len(bad) > 1 else ""
        if not c.reference_finite:
            raise CheckFailedError(
                f"check failed: the reference evaluator's output {c.name!r} is itself not "
                f"finite ({c.want_nonfinite}), so the run cannot be checked against it; are "
                "the inputs in the program's domain?" + more
            )
        raise CheckFailedError(
            f"check failed: output {c.name!r} differs from the reference evaluator: "
            f"{c.worst()}, {c.error:.3g} times the tolerance (rtol {c.rtol:.0e}, atol "
            f"{c.atol:.2e})" + more
        )
