"""Running the `einpage` command line inside a test (tests only)."""

from __future__ import annotations

from einpage.cli.commands import main


def cli(capsys, *argv) -> tuple[int, str, str]:
    """Run `einpage ARGV` (each argument as a string); return (exit code, stdout, stderr)
    as pytest's `capsys` captured them."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err
