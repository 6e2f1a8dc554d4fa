"""``tenplex bench NAME``: benchmarks that print JSON and compare against a baseline measured in the same run.

Each benchmark is a module ``tenplex.bench.<name>`` exposing ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args) -> dict | list[dict]``. Without
``--json`` the result is printed as indented JSON, or by the module's
``table(objects) -> str`` when it has one; with it, compactly on one line per
object (a list prints one object per line).

May import: ``tenplex.bench`` (by name, on use) and the standard library.
"""

from __future__ import annotations

import argparse
import importlib
import json

# Benchmark modules under tenplex.bench.
BENCHMARKS: tuple[str, ...] = ("vfs", "restore", "reads", "plan", "transfer", "reconfig", "compare", "partition",
                              "simulate", "replicate", "snapshot", "durable", "data", "goodput")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark and print JSON")
    names = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name in BENCHMARKS:
        module = importlib.import_module(f"tenplex.bench.{name}")
        sub = names.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION)
        sub.add_argument("--json", action="store_true", help="print compact JSON only")
        module.add_arguments(sub)
        sub.set_defaults(handler=_runner(module))


def _runner(module):
    def handle(args: argparse.Namespace) -> int:
        result = module.run(args)
        objects = result if isinstance(result, list) else [result]
        if not args.json and hasattr(module, "table"):
            print(module.table(objects))
            return 0
        for obj in objects:
            print(json.dumps(obj) if args.json else json.dumps(obj, indent=2))
        return 0
    return handle
