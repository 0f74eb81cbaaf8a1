"""Byte sizes for humans: format `12.5 MiB`, parse `"8GiB"` / `"512MB"` / `1024`."""

from __future__ import annotations

import re

from einpage_core.errors import EinpageError

__all__ = ["format_bytes", "parse_bytes", "format_count", "BudgetFormatError"]

_BINARY = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS = {**_BINARY, **_DECIMAL, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class BudgetFormatError(EinpageError, ValueError):
    """A size string such as a budget could not be parsed."""


def format_bytes(n: int | float) -> str:
    """Format a byte count with binary units: `format_bytes(1536) == '1.5 KiB'`."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(n)} B"
            return f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_count(n: int | float, unit: str = "") -> str:
    """Format a large count with SI prefixes: `format_count(2.5e9, 'FLOP') == '2.5 GFLOP'`."""
    n = float(n)
    for prefix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or prefix == "P":
            text = f"{n:.0f}" if prefix == "" else f"{n:.1f}"
            return f"{text} {prefix}{unit}".rstrip()
        n /= 1000
    raise AssertionError("unreachable")


def parse_bytes(size: int | str) -> int:
    """Parse a byte size: an int, or a string like `"8GiB"`, `"512 MiB"`, `"1.5GB"`, `"4096"`.

    Binary units (KiB, MiB, GiB, TiB and the bare K, M, G, T) are powers of 1024;
    decimal units (KB, MB, GB, TB) powers of 1000. Units are case-insensitive.

    >>> parse_bytes("8GiB")
    8589934592
    """
    if isinstance(size, bool):
        raise BudgetFormatError(f"size must be an int or a string like '8GiB', got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise BudgetFormatError(f"size must not be negative, got {size}")
        return size
    if not isinstance(size, str):
        raise BudgetFormatError(f"size must be an int or a string like '8GiB', got {size!r}")
    match = _PATTERN.match(size)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        valid = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
        raise BudgetFormatError(
            f"cannot parse size {size!r}: expected a number and a unit ({valid})"
        )
    return int(round(float(match.group(1)) * _UNITS[unit]))
