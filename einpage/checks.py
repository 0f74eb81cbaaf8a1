"""Checking outputs against the reference evaluator (`taskgraph.evaluate`).

`compare_outputs` measures each output's largest error relative to the reference's
magnitude, with a tolerance per dtype (`TOLERANCES`); `raise_on_mismatch` turns a
failed comparison into a `CheckFailedError`. The CLI's `run --check`, the demo and the
notebooks use them.
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

TOLERANCES = {"float16": 1e-2, "bfloat16": 8e-2, "float32": 1e-4, "float64": 1e-9}
"""Largest |output - reference| a check accepts, relative to the reference's largest
magnitude (at least 1), by dtype; integer outputs must be equal."""


class CheckFailedError(EinpageError):
    """`run --check` (or the demo) found outputs that differ from the reference."""


@dataclass(frozen=True)
class Comparison:
    """One output against the reference: `error` is max |output - reference| divided by
    `scale` (the reference's largest magnitude, at least 1); NaNs must coincide."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    error: float
    scale: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def row(self) -> tuple[str, str]:
        """(name, `dtype[shape]  error ... (tolerance ...)  ok`) for a table."""
        verdict = "ok" if self.ok else "MISMATCH"
        shape = "[" + ",".join(map(str, self.shape)) + "]"
        return (
            self.name,
            f"{self.dtype}{shape}  error {self.error:.2e} (tolerance {self.tolerance:.0e})  "
            f"{verdict}",
        )


CHECK_TITLE = "check against the reference evaluator (error: max |out - ref| / max(1, |ref|))"


def compare_outputs(
    outputs: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]
) -> list[Comparison]:
    """Compare every reference output with the same-named output (see `Comparison`).

    >>> ref = {"y": np.array([1.0, 2.0], "float32")}
    >>> [c.ok for c in compare_outputs({"y": np.array([1.0, 2.00001], "float32")}, ref)]
    [True]
    >>> compare_outputs({"y": np.array([1.0, 2.5], "float32")}, ref)[0].error
    0.25
    """
    found = []
    for name, ref in reference.items():
        out = np.asarray(outputs[name])
        ref = np.asarray(ref)
        dtype = ref.dtype.name
        if out.shape != ref.shape:
            found.append(Comparison(name, ref.shape, dtype, float("inf"), 1.0, 0.0))
            continue
        tolerance = TOLERANCES.get(dtype, 0.0)
        wide_out, wide_ref = out.astype(np.float64), ref.astype(np.float64)
        nan_out, nan_ref = np.isnan(wide_out), np.isnan(wide_ref)
        finite = ~nan_ref
        scale = max(1.0, float(np.max(np.abs(wide_ref[finite]), initial=0.0)))
        if not np.array_equal(nan_out, nan_ref):
            error = float("inf")
        else:
            diff = np.abs(wide_out[finite] - wide_ref[finite])
            error = float(np.max(diff, initial=0.0)) / scale
            if np.isnan(error):  # infinities in different places
                error = float("inf")
        found.append(Comparison(name, ref.shape, dtype, error, scale, tolerance))
    return found


def raise_on_mismatch(comparisons: list[Comparison]) -> None:
    """Raise `CheckFailedError` naming the first output that differs from the reference."""
    bad = [c for c in comparisons if not c.ok]
    if bad:
        c = bad[0]
        raise CheckFailedError(
            f"check failed: output {c.name!r} differs from the reference evaluator: "
            f"max |out - ref| / {c.scale:.3g} = {c.error:.2e} > {c.tolerance:.0e}"
            + (f" ({len(bad) - 1} more output(s) differ)" if len(bad) > 1 else "")
        )
