"""The ``tenplex`` command line.

May import: every tenplex layer (this is the top of the stack). Each
subcommand lives in its own module ``tenplex.cli.<name>`` exposing
``register(subparsers)``; the registered handler takes the parsed arguments
and returns an exit code. Errors that are the user's to fix print one line
and exit non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import TenplexError

# Subcommand modules, in the order ``tenplex --help`` lists them.
COMMANDS = ("layout", "plan", "data", "vfs", "store", "bench", "demo", "operator")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tenplex",
        description="Change a training job's parallel configuration without losing its state.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (TenplexError, ValueError, OSError) as e:
        print(f"tenplex {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tenplex {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
