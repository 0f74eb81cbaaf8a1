"""Byte sizes for humans: format `12.5 MiB`, parse `"8GiB"` / `"512MB"` / `1024`."""

from __future__ import annotations

import re

from einpage_core.errors import EinpageError

__all__ = ["format_bytes", "format_exact", "parse_bytes", "format_count", "BudgetFormatError"]

_BINARY = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS = {**_BINARY, **_DECIMAL, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_PATTERN = re.compile(r"^\s*([+-]?)\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_STEPS = ("B", "KiB", "MiB", "GiB", "TiB")
ROUNDINGS = ("nearest", "up", "down")
"""How `format_bytes` rounds to one decimal: to the nearest tenth, or up (a budget to type
back: never below the bytes meant), or down (a lower bound: never above them)."""


class BudgetFormatError(EinpageError, ValueError):
    """A size string such as a budget could not be parsed."""


def format_bytes(n: int | float, rounding: str = "nearest") -> str:
    """Format a byte count with binary units: `format_bytes(1536) == '1.5 KiB'`.

    `rounding` (`ROUNDINGS`) says which way the one decimal goes: "nearest", or "up" for a
    size someone will type back as a minimum (2,304 B is 2.25 KiB: '2.3 KiB', not
    '2.2 KiB', which means 2,253 B), or "down" for a bound nothing below may reach.

    >>> format_bytes(2304), format_bytes(2304, "up"), format_bytes(2304, "down")
    ('2.2 KiB', '2.3 KiB', '2.2 KiB')
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding != "nearest" and n < 0:  # the other way round for a negative count
        return "-" + format_bytes(-n, "down" if rounding == "up" else "up")
    if rounding != "nearest":
        n = int(-(-n // 1)) if rounding == "up" else int(n // 1)
        for power, unit in enumerate(_STEPS):
            scale = 1024**power
            if n < 1024 * scale or unit == "TiB":
                if unit == "B":
                    return f"{n} B"
                tenths = -(-n * 10 // scale) if rounding == "up" else n * 10 // scale
                if tenths < 10240 or unit == "TiB":
                    return f"{tenths // 10}.{tenths % 10} {unit}"
        raise AssertionError("unreachable")  # pragma: no cover
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in _STEPS:
        if n < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(n)} B"
            return f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_exact(nbytes: int, rounding: str = "up") -> str:
    """A size for a message that someone may act on: rounded (up by default: a minimum to
    type back) with its exact bytes, `'2.3 KiB (2304 B)'`, or just `'768 B'` where that
    says it all.

    >>> format_exact(2304), format_exact(768), format_exact(1024)
    ('2.3 KiB (2304 B)', '768 B', '1.0 KiB (1024 B)')
    """
    text = format_bytes(nbytes, rounding)
    return text if text == f"{nbytes} B" else f"{text} ({nbytes} B)"


def format_count(n: int | float, unit: str = "") -> str:
    """Format a large count with SI prefixes: `format_count(2.5e9, 'FLOP') == '2.5 GFLOP'`."""
    n = float(n)
    for prefix in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000 or prefix == "P":
            text = f"{n:.0f}" if prefix == "" else f"{n:.1f}"
            return f"{text} {prefix}{unit}".rstrip()
        n /= 1000
    raise AssertionError("unreachable")


def parse_bytes(size: int | str, what: str = "size") -> int:
    """Parse a byte size: an int, or a string like `"8GiB"`, `"512 MiB"`, `"1.5GB"`, `"4096"`.

    Binary units (KiB, MiB, GiB, TiB and the bare K, M, G, T) are powers of 1024;
    decimal units (KB, MB, GB, TB) powers of 1000. Units are case-insensitive. A size is
    never negative: `"-5GiB"` is refused for its sign. `what` names the size in errors
    ("budget", "block limit").

    >>> parse_bytes("8GiB")
    8589934592
    """
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise BudgetFormatError(f"{what} must be an int or a string like '8GiB', got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise BudgetFormatError(f"{what} must not be negative, got {size}")
        return size
    match = _PATTERN.match(size)
    unit = match.group(3).lower() if match else None
    if match is None or unit not in _UNITS:
        valid = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
        raise BudgetFormatError(
            f"cannot parse {what} {size!r}: expected a number and a unit ({valid})"
        )
    value = float(match.group(2))
    if match.group(1) == "-" and value != 0:
        unsigned = size.strip()[1:].strip()
        raise BudgetFormatError(
            f"{what} {size!r} is negative: a {what} is a size from 0 up, such as {unsigned!r}"
        )
    return int(round(value * _UNITS[unit]))
