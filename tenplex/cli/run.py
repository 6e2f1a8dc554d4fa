"""``tenplex run``: one per node. Start or reuse the node's store, then run torchrun's elastic agent.

May import: every tenplex layer.

    tenplex run --host NAME --store-root DIR [torchrun options] script.py [args]

Everything after ``run`` is parsed by :func:`tenplex.elastic.launcher.parse`
(torchrun's own parser plus tenplex's options), so torchrun options that
tenplex does not know pass through unchanged; ``tenplex run --help`` lists both.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    # No option prefix: every token after `run` reaches the launcher's parser untouched.
    parser = subparsers.add_parser("run", help="run torchrun's elastic agent on this node, with its tenplex store",
                                   prefix_chars="\x00", add_help=False)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    parser.set_defaults(handler=_run)


def _run(args) -> int:
    from ..elastic.launcher import run
    from . import _run_operations

    argv, operations = _run_operations.take(args.argv)
    _run_operations.start(operations)
    return run(argv)

