"""The `einpage` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from einpage.errors import EinpageError

__all__ = ["main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


def _demo(args: argparse.Namespace) -> int:
    from einpage.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="einpage",
        description="Compile einsum tensor programs into memory plans for small GPUs.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser("demo", help="build, print and evaluate the demo MLP")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 failed check, 2 bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except EinpageError as err:
        print(f"einpage: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
