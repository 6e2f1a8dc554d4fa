"""The ``tenplex`` command line.

May import: every tenplex layer (this is the top of the stack). Each
subcommand lives in its own module ``tenplex.cli.<name>`` exposing
``register(subparsers)``; the registered handler takes the parsed arguments
and returns an exit code.

Errors. What the user must fix prints one line and exits with 2, never a
traceback: argument errors (argparse), every :class:`~tenplex.errors.TenplexError`
(a handler raises :class:`~tenplex.errors.UsageError` for a bad option), and
an ``OSError`` that names a file (missing, not permitted, disk full). Anything
else is a bug and shows its traceback. ``TENPLEX_LOG=debug`` (or ``info``)
sends the library's diagnostics (``logging``) to stderr; without it only
warnings and errors reach stderr.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from ..errors import TenplexError
from ..ops import logs

# Subcommand modules, in the order ``tenplex --help`` lists them.
COMMANDS = ("layout", "plan", "data", "vfs", "store", "durable", "bench", "demo", "rendezvous", "run", "operator",
            "status")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tenplex",
        description="Change a training job's parallel configuration without losing its state.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def user_error(error: BaseException) -> bool:
    """Whether ``error`` is the user's to fix (one line) rather than a bug (traceback)."""
    return isinstance(error, TenplexError) or (isinstance(error, OSError) and error.filename is not None)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if os.environ.get("TENPLEX_LOG"):  # otherwise warnings reach stderr through logging's last-resort handler
        level = getattr(logging, os.environ["TENPLEX_LOG"].upper(), logging.INFO)
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except Exception as e:
        if not user_error(e):
            raise
        logs.line(f"tenplex {args.command}: error: {e}", sys.stderr, logging.ERROR, "tenplex.cli")
        return 2
    except KeyboardInterrupt:
        logs.line(f"tenplex {args.command}: interrupted", sys.stderr, logging.WARNING, "tenplex.cli")
        return 130


if __name__ == "__main__":
    sys.exit(main())
