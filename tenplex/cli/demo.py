"""``tenplex demo``: a small GPT job trains, is rescaled onto other hosts and parallelism, and continues.

May import: ``tenplex.runtime``, ``tenplex.elastic`` (``--elastic``, on use), ``tenplex.errors`` and the
standard library (no torch in this process).
"""

from __future__ import annotations

import argparse
import os
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..errors import UsageError
from ..runtime.demo import DemoConfig, check_parallel, degrees, run, world_of
from .units import human_bytes


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="train a small GPT, rescale it (other hosts and parallelism), continue, and check",
        description="Train the example GPT on CPU under one configuration, save through tenplex, restart it "
                    "under another configuration on another number of hosts (the stores transform the state), "
                    "continue, and compare with an uninterrupted run. Exits non-zero if a check fails.")
    p.add_argument("--elastic", action="store_true",
                   help="run an elastic job on real torchrun agents (tenplex run) through a schedule of nodes "
                        "joining, failing and leaving")
    p.add_argument("--schedule", help="with --elastic: events KIND:HOST@STEP, comma-separated, KIND one of join, "
                                      "fail, leave, partition (with --link-mbit), gpufail:HOST/DEVICE@STEP, or "
                                      "evict:all@STEP (the whole job lost, restored from a bucket on three new nodes; "
                                      "needs moto) (default join:h2@4,fail:h1@8,leave:h2@12; h0 and h1 run at the "
                                      "start)")
    p.add_argument("--plot", type=Path, help="with --elastic: write both loss curves, the events and each event's "
                                             "pause to this PNG")
    p.add_argument("--restart-mode", action="store_true",
                   help="with --elastic: torchrun restarts every worker at each change (the mode before issue 36) "
                        "instead of the default in place (tenplex run --in-place: survivors keep their processes; "
                        "schedules with partition or evict, and --link-mbit, run in restart mode)")
    p.add_argument("--link-mbit", type=float, metavar="N",
                   help="with --elastic: run every node in its own network namespace with a link of N Mbit/s each "
                        "way (needs root and iproute2); enables partition:HOST@STEP events")
    p.add_argument("--steps", type=int, default=None,
                   help="steps before the rescale, and after it (default 8); with --elastic: all steps (default 16)")
    p.add_argument("--from", dest="parallel_from", default="tp=2,dp=2", metavar="PARALLEL",
                   help="configuration A, e.g. tp=2,dp=2 (keys dp, tp, pp, fsdp=1)")
    p.add_argument("--to", dest="parallel_to", default="pp=2,dp=2", metavar="PARALLEL",
                   help="configuration B after the rescale (default pp=2,dp=2)")
    p.add_argument("--hosts-from", type=int, default=2, help="simulated hosts of configuration A (default 2)")
    p.add_argument("--hosts-to", type=int, default=3, help="simulated hosts of configuration B (default 3)")
    p.add_argument("--global-batch", type=int, default=8,
                   help="samples per step; dp x 2 micro-batches must divide it (default 8)")
    p.add_argument("--fuse", action="store_true",
                   help="workers read the dataset through a FUSE mount (tenplex vfs) instead of in process")
    p.add_argument("--workdir", type=Path, help="keep everything here (default: a temporary directory in memory, "
                                                "under /dev/shm where there is one, as a cluster's stores keep "
                                                "their versions on tmpfs)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary (progress on stderr)")
    p.set_defaults(handler=main)


def _output_and_workdir(args: argparse.Namespace, prefix: str):
    """Where progress goes (stderr with --json, whose stdout is the summary) and the work directory."""
    out = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    if args.workdir and args.workdir.exists() and any(args.workdir.iterdir()):
        raise UsageError(f"--workdir {args.workdir} is not empty; give a new or empty directory")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=prefix, dir=memory_dir()))
    workdir.mkdir(parents=True, exist_ok=True)
    return say, workdir


def memory_dir(candidate: str = "/dev/shm") -> str | None:
    """Where the demo's temporary work directory goes: a RAM filesystem if this machine has a writable one (the
    nodes' stores then keep their versions in memory, as on a cluster's GPU nodes, and a save's fsyncs cost
    nothing: on a shared disk they were most of a change's stopping save), else the system's temporary folder."""
    return candidate if os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK) else None


def _clean_up(args: argparse.Namespace, workdir: Path, finished: bool, say, tell: bool = False) -> None:
    """Remove the temporary work directory after a run that finished; keep it (and say where) when asked to, or
    when the run failed: its error names the logs in it."""
    if args.workdir is not None:
        return
    if finished and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    elif tell or not finished:
        say(f"kept {workdir}" + ("" if finished else " (the run failed: its logs are there; remove it when done)"))


def main(args: argparse.Namespace) -> int:
    if args.elastic:
        return elastic(args)
    if args.schedule or args.plot or args.link_mbit is not None or args.restart_mode:
        raise UsageError("--schedule, --plot, --link-mbit and --restart-mode belong to --elastic")
    args.steps = 8 if args.steps is None else args.steps
    if args.steps < 1:
        raise UsageError("--steps must be at least 1")
    cfg = DemoConfig(steps=args.steps, parallel_from=args.parallel_from, parallel_to=args.parallel_to,
                     hosts_from=args.hosts_from, hosts_to=args.hosts_to, global_batch=args.global_batch,
                     fuse=args.fuse)
    for flag, parallel, hosts in (("--from", cfg.parallel_from, cfg.hosts_from),
                                  ("--to", cfg.parallel_to, cfg.hosts_to)):
        check_parallel(flag, parallel)
        if not 1 <= hosts <= world_of(parallel):
            raise UsageError(f"{flag} {parallel} has {world_of(parallel)} ranks, which cannot fill {hosts} hosts")
        dp = degrees(parallel)["dp"]
        if cfg.global_batch < 1 or cfg.global_batch % (2 * dp):
            # The example splits each dp rank's share into 2 pipeline micro-batches of equal size.
            raise UsageError(f"{flag} {parallel}: dp={dp} x 2 micro-batches does not divide the global batch "
                             f"{cfg.global_batch}; choose --global-batch as a multiple of {2 * dp}")
    say, workdir = _output_and_workdir(args, "tenplex-demo-")
    start = time.monotonic()
    finished = False
    try:
        summary = run(cfg, workdir, say)
        finished = True
    finally:
        _clean_up(args, workdir, finished, say)
    summary["wall_s"] = round(time.monotonic() - start, 1)
    summary["workdir"] = str(workdir) if args.workdir or args.keep else None
    if args.json:
        print(json.dumps(summary, indent=1))
    report(summary, say)
    return 0 if summary["ok"] else 1


def report(s: dict, say) -> None:
    """The human-readable result: losses side by side, bytes moved, and every check."""
    cfg = s["config"]
    say("")
    say(f"elastic run: {cfg['parallel_from']} on {cfg['hosts_from']} host(s) for steps 1..{cfg['steps']}, then "
        f"{cfg['parallel_to']} on {cfg['hosts_to']} host(s)")
    say(f"reference:   {cfg['parallel_from']} throughout, never stopped (steps 1..{cfg['steps']} are the same run; "
        "later steps differ only by float rounding: tp/pp/dp sum in other orders)")
    say(f"{'step':>5} {'phase':>5} {'loss (elastic)':>15} {'loss (reference)':>17} {'|diff|':>10}")
    for r in s["steps"]:
        loss = f"{r['loss']:.6f}" if r["loss"] is not None else "missing"
        diff = f"{r['diff']:.2e}" if r["diff"] is not None else "-"
        say(f"{r['step']:>5} {r['phase']:>5} {loss:>15} {r['reference']:>17.6f} {diff:>10}")
    restore, plan = s["restore"], s["restore"]["plan"]
    if restore["transformed"] or restore["read_through"]:
        how = ("every rank read its part of the plan from the stores (no new version written)"
               if restore["read_through"] else "the stores transformed the state")
        say(f"restore at step {restore['step']}: {how}: "
            f"{human_bytes(plan.get('target_bytes', 0))} needed; kept in place "
            f"{human_bytes(plan.get('kept_bytes', 0))}, copied within hosts "
            f"{human_bytes(plan.get('intra_host_bytes', 0))}, sent between hosts "
            f"{human_bytes(plan.get('inter_host_bytes', 0))} (lower bound "
            f"{human_bytes(plan.get('inter_host_lower_bound', 0))})")
    else:
        say(f"restore at step {restore['step']}: every rank assembled its shards from its own host's store "
            "(no transformation needed for this change)")
    samples, params = s["samples"], s["params"]
    marks = {True: "ok  ", False: "FAIL"}
    c = s["checks"]
    say(f"[{marks[c['losses_match']]}] losses match the reference (max |diff| {s['max_loss_diff']:.2e}, "
        f"relative tolerance {s['loss_rtol']:g})")
    say(f"[{marks[c['exactly_once']]}] every sample seen exactly once: {samples['distinct']} of "
        f"{samples['dataset']} samples, {samples['seen']} reads, duplicates {samples['duplicates'] or 'none'}, "
        f"missing {samples['missing'] or 'none'}; read {' and '.join(samples['readers'])}")
    say(f"[{marks[c['same_batches_as_reference']]}] every step trained on the reference's global batch")
    say(f"[{marks[c['params_bit_equal']]}] parameters and Adam moments after restore equal the saved ones bit for "
        f"bit ({params['tensors']} tensors, {human_bytes(params['bytes'])}"
        + (f"; differ: {', '.join(params['differ'][:5])}" if params["differ"] else "") + ")")
    say(f"[{marks[c['restored_step_and_position']]}] restored step {restore['step']} and dataset position "
        f"{restore['dataset_state']['position']}")
    say(f"{'all checks passed' if s['ok'] else 'SOME CHECKS FAILED'} in {s['wall_s']} s")


def elastic(args: argparse.Namespace) -> int:
    """``tenplex demo --elastic``: see :mod:`tenplex.elastic.demo`."""
    from ..elastic.demo import DEFAULT_SCHEDULE, parse_schedule, require_links, require_moto, run
    from ..elastic.timeline import plot, print_timeline

    steps = 16 if args.steps is None else args.steps
    schedule = args.schedule or DEFAULT_SCHEDULE
    if args.fuse:
        from ..elastic.dataview import require_fuse

        require_fuse()  # one line where FUSE cannot be used, before anything starts
    if args.link_mbit is not None and args.link_mbit <= 0:
        raise UsageError(f"--link-mbit must be positive, got {args.link_mbit:g}")
    # bad input: one line, before anything starts
    events = parse_schedule(schedule, ("h0", "h1"), steps, links=args.link_mbit is not None)
    in_place = False if args.restart_mode else None  # None: in place where the schedule allows it
    if any(e.kind == "evict" for e in events):
        require_moto()
    if args.link_mbit is not None:
        require_links()
    say, workdir = _output_and_workdir(args, "tenplex-elastic-")
    start = time.monotonic()
    finished = False
    try:
        summary, history = run(workdir, schedule, steps, say=say, link_mbit=args.link_mbit, fuse=args.fuse,
                               in_place=in_place)
        finished = True
    finally:
        _clean_up(args, workdir, finished, say, tell=True)
    say(f"timeline ({time.monotonic() - start:.0f} s):")
    print_timeline(summary, say)
    if "view" in summary:
        v = summary["view"]
        say(f"dataset view: {'read by every worker of' if v['read'] else 'NOT read by every worker of'} "
            f"{v['worlds']} worlds; switches per node: "
            + ", ".join(f"{h} {n if n is not None else '(failed)'}" for h, n in v["switches"].items()))
    if args.plot:
        plot(summary, history, args.plot)
        say(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1
