"""Byte sizes for humans (`einpage_core.units`): formatting that rounds the way a reader
will use the figure, and parsing that says what is wrong with a size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from einpage_core.units import BudgetFormatError, format_bytes, format_exact, parse_bytes

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def test_a_minimum_is_printed_rounded_up_and_a_bound_down():
    """The issue: 2,304 B printed '2.2 KiB', which typed back is 2,253 B."""
    assert format_bytes(2304) == "2.2 KiB"
    assert format_bytes(2304, "up") == "2.3 KiB" and format_bytes(2304, "down") == "2.2 KiB"
    assert format_bytes(2**20 - 1, "up") == "1.0 MiB"  # not '1024.0 KiB'
    assert format_bytes(2**20 - 1, "down") == "1023.9 KiB"
    assert format_exact(2304) == "2.3 KiB (2304 B)" and format_exact(768) == "768 B"
    with pytest.raises(ValueError, match="rounding must be one of"):
        format_bytes(1, "sideways")


@given(st.integers(0, 2**52))
def test_rounded_figures_typed_back_bound_the_bytes(nbytes):
    up, down = format_bytes(nbytes, "up"), format_bytes(nbytes, "down")
    assert parse_bytes(up.replace(" ", "")) >= nbytes >= parse_bytes(down.replace(" ", ""))
    value, unit = up.split()
    tenth = UNITS[unit] // 10 if unit != "B" else 1
    assert parse_bytes(up.replace(" ", "")) - nbytes <= tenth + 1  # the next tenth up
    assert up.split()[1] == format_bytes(nbytes).split()[1] or value == "1.0"


@pytest.mark.parametrize("size", ["-5GiB", " -5 GiB", "-1", "-0.5KiB"])
def test_a_negative_size_is_refused_for_its_sign(size):
    """'-5GiB' was 'expected a number and a unit': it has both; the sign is the problem."""
    with pytest.raises(BudgetFormatError) as caught:
        parse_bytes(size, "budget")
    message = str(caught.value)
    assert f"budget {size!r} is negative" in message and "a number and a unit" not in message
    assert size.strip().lstrip("-").strip() in message  # the size it may have meant


def test_sizes_parse_as_before():
    assert parse_bytes("8GiB") == 8 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("-0") == parse_bytes("0B") == 0 and parse_bytes("+1KiB") == 1024
    with pytest.raises(BudgetFormatError, match="cannot parse size 'lots'"):
        parse_bytes("lots")
    with pytest.raises(BudgetFormatError, match="must not be negative, got -5"):
        parse_bytes(-5)
