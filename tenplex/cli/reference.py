"""The command-line reference page (``docs/reference/cli.md``): every subcommand's ``--help``, as argparse prints it.

May import: :mod:`tenplex.cli` (it only walks the parser). Regenerate the page after changing an option::

    python -m tenplex.cli.reference > docs/reference/cli.md

``tests/test_docs.py`` fails when the committed page differs from what this prints.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator

from . import build_parser

WIDTH = 100  # columns argparse wraps the help at, fixed so that the page does not depend on the terminal

HEADER = """# Command-line reference

Every `tenplex` command and subcommand with its `--help`, generated from the parser itself
(`python -m tenplex.cli.reference > docs/reference/cli.md`; a test fails when this page is stale).
User errors print one line and exit with 2; `TENPLEX_LOG=info` (or `debug`) shows the library's diagnostics.
"""


def _commands(parser: argparse.ArgumentParser, path: list[str]) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:  # argparse exposes subcommands only through its actions
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + [name])


def render() -> str:
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)  # argparse's HelpFormatter reads the width from here
    try:
        parts = [HEADER]
        for path, parser in _commands(build_parser(), ["tenplex"]):
            heading = "#" * min(len(path) + 1, 4)
            parts.append(f"{heading} `{' '.join(path)}`\n\n<!-- illustrative -->\n```text\n"
                         f"{parser.format_help().rstrip()}\n```\n")
        return "\n".join(parts)
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


if __name__ == "__main__":
    sys.stdout.write(render())
