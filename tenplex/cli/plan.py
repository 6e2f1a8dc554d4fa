"""``tenplex plan OLD NEW``: plan the transfers that turn one layout into another and summarise them.

May import: ``tenplex.files``, ``tenplex.planner``, ``tenplex.transfer_plan``, ``tenplex.errors``,
tqdm and the standard library.
"""

from __future__ import annotations

import argparse
import sys
import time

from tqdm import tqdm

from ..files import dumps, load_layout, write_json_atomic
from ..transfer_plan import Plan
from ..planner import plan
from .units import human_bytes


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="plan the minimal data movement between two layouts",
        description="Read two tenplex.layout/1 files and print how much state stays, is copied within hosts and "
                    "crosses hosts when the job moves from OLD to NEW.")
    parser.add_argument("old", metavar="OLD.json", help="layout before the change")
    parser.add_argument("new", metavar="NEW.json", help="layout after the change")
    parser.add_argument("--json", action="store_true", help="print the plan as tenplex.plan/1 JSON instead")
    parser.add_argument("-o", "--output", metavar="FILE", help="also write the plan JSON to FILE")
    parser.add_argument("--allow-new-tensors", action="store_true",
                        help="tensors only NEW has are left to be initialised instead of being an error")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # Large layouts (1,024 devices) take seconds per step; show the steps on a terminal.
    with tqdm(total=3, desc="tenplex plan", unit="step", leave=False, disable=None) as progress:
        progress.set_postfix_str(f"reading {args.old}")
        old = load_layout(args.old)
        progress.update()
        progress.set_postfix_str(f"reading {args.new}")
        new = load_layout(args.new)
        progress.update()
        progress.set_postfix_str("planning")
        started = time.perf_counter()
        result = plan(old, new, allow_new_tensors=args.allow_new_tensors)
        seconds = time.perf_counter() - started
        progress.update()
    doc = result.to_dict() if args.output or args.json else None
    if args.output:
        write_json_atomic(args.output, doc)
    if args.json:
        sys.stdout.flush()
        sys.stdout.buffer.write(dumps(doc) + b"\n")
    else:
        print(summary(result, {n: s.itemsize for n, s in new.tensors.items()}, seconds,
                      f"{len(old.devices)} devices / {len(old.hosts())} hosts",
                      f"{len(new.devices)} devices / {len(new.hosts())} hosts"))
    return 0


def summary(result: Plan, itemsizes: dict[str, int], seconds: float, old: str, new: str) -> str:
    s = result.stats
    target = s.target_bytes or 1

    def line(label: str, nbytes: int) -> str:
        return f"  {label:<28}{human_bytes(nbytes):>12}  {100 * nbytes / target:5.1f}%"

    traffic = result.host_traffic(itemsizes)
    lines = [f"plan: {old} -> {new}, {len(result.transfers)} transfers, planned in {seconds:.2f} s",
             line("new state", s.target_bytes),
             line("kept in place", s.kept_bytes),
             line("copied within hosts", s.intra_host_bytes),
             line("sent between hosts", s.inter_host_bytes),
             line("  lower bound", s.inter_host_lower_bound)]
    if s.initialized_bytes:
        lines.append(line("left to initialise", s.initialized_bytes))
        lines.append(f"  new tensors: {', '.join(result.new_tensors[:5])}{' …' if len(result.new_tensors) > 5 else ''}")
    if traffic:
        sender = max(traffic, key=lambda h: traffic[h][0])  # traffic is sorted: ties go to the first host
        receiver = max(traffic, key=lambda h: traffic[h][1])
        lines.append(f"  busiest sender   {sender}: {human_bytes(traffic[sender][0])} out")
        lines.append(f"  busiest receiver {receiver}: {human_bytes(traffic[receiver][1])} in")
    else:
        lines.append("  nothing crosses hosts")
    return "\n".join(lines)
