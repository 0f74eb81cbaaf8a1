"""Checking outputs against the reference evaluator (`taskgraph.evaluate`).

`compare_outputs` checks every element as `numpy.testing.assert_allclose` does, with a
tolerance per dtype (`TOLERANCES`): |out - ref| <= atol + rtol * |ref|, where atol is a
fraction of the reference's largest magnitude (at least 1), so that small values
(probabilities near 0.004) are held to their own relative precision; it reports the
worst element (its index, both values). `raise_on_mismatch` turns a failed comparison
into a `CheckFailedError`. The CLI's `run --check`, the demo and the notebooks use them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from einpage_core.errors import EinpageError

__all__ = [
    "TOLERANCES",
    "CHECK_TITLE",
    "CheckFailedError",
    "Comparison",
    "compare_outputs",
    "raise_on_mismatch",
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


class CheckFailedError(EinpageError):
    """`run --check` (or the demo) found outputs that differ from the reference."""


@dataclass(frozen=True)
class Comparison:
    """One output against the reference: `error` is the worst element's |out - ref| over
    what it may be (atol + rtol * |ref|), so 1 is the limit; `index`, `got` and `want`
    name that element. NaNs must coincide."""

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

    @property
    def ok(self) -> bool:
        return self.error <= 1.0

    def worst(self) -> str:
        if self.index is None:
            return "shapes or NaNs differ" if not self.ok else "equal"
        return f"worst at {list(self.index)}: {self.got:.6g} vs {self.want:.6g}"

    def row(self) -> tuple[str, str]:
        """(name, `dtype[shape]  worst at [i, j]: out vs ref (x of tolerance)  ok`)."""
        verdict = "ok" if self.ok else "MISMATCH"
        shape = "[" + ",".join(map(str, self.shape)) + "]"
        return (
            self.name,
            f"{self.dtype}{shape}  {self.worst()} ({self.error:.2g} of the tolerance)  {verdict}",
        )


CHECK_TITLE = (
    "check against the reference evaluator (each element: |out - ref| <= atol + rtol |ref|)"
)


def compare_outputs(
    outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]
) -> list[Comparison]:
    """Compare every reference output with the same-named output (see `Comparison`).

    >>> ref = {"y": np.array([1.0, 2.0], "float32")}
    >>> [c.ok for c in compare_outputs({"y": np.array([1.0, 2.00001], "float32")}, ref)]
    [True]
    >>> bad = compare_outputs({"y": np.array([1.0, 2.5], "float32")}, ref)[0]
    >>> bad.ok, bad.index, bad.got, bad.want
    (False, (1,), 2.5, 2.0)
    """
    found = []
    for name, ref in reference.items():
        out = np.asarray(outputs[name])
        ref = np.asarray(ref)
        dtype = ref.dtype.name
        rtol, atol_fraction = TOLERANCES.get(dtype, (0.0, 0.0))
        if out.shape != ref.shape:
            found.append(Comparison(name, ref.shape, dtype, float("inf"), 1.0, rtol, 0.0))
            continue
        wide_out, wide_ref = out.astype(np.float64), ref.astype(np.float64)
        nan_out, nan_ref = np.isnan(wide_out), np.isnan(wide_ref)
        finite = ~nan_ref
        scale = max(1.0, float(np.max(np.abs(wide_ref[finite]), initial=0.0)))
        atol = atol_fraction * scale
        if not np.array_equal(nan_out, nan_ref):
            found.append(Comparison(name, ref.shape, dtype, float("inf"), scale, rtol, atol))
            continue
        diff = np.where(finite, np.abs(wide_out - wide_ref), 0.0)
        same_inf = np.isinf(wide_ref) & (wide_out == wide_ref)
        diff = np.where(same_inf, 0.0, diff)
        diff = np.where(np.isnan(diff), np.inf, diff)  # infinities in different places
        allowed = atol + rtol * np.abs(np.where(finite & ~same_inf, wide_ref, 0.0))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(diff == 0, 0.0, diff / allowed)
        if ratio.size == 0:
            found.append(Comparison(name, ref.shape, dtype, 0.0, scale, rtol, atol))
            continue
        flat = int(np.argmax(ratio))
        index = tuple(int(i) for i in np.unravel_index(flat, ratio.shape))
        found.append(
            Comparison(name, ref.shape, dtype, float(ratio.flat[flat]), scale, rtol, atol,
                       index, float(wide_out.flat[flat]), float(wide_ref.flat[flat]))
        )  # fmt: skip
    return found


def raise_on_mismatch(comparisons: list[Comparison]) -> None:
    """Raise `CheckFailedError` naming the first output that differs from the reference."""
    bad = [c for c in comparisons if not c.ok]
    if bad:
        c = bad[0]
        raise CheckFailedError(
            f"check failed: output {c.name!r} differs from the reference evaluator: "
            f"{c.worst()}, {c.error:.3g} times the tolerance (rtol {c.rtol:.0e}, atol "
            f"{c.atol:.2e})" + (f" ({len(bad) - 1} more output(s) differ)" if len(bad) > 1 else "")
        )
