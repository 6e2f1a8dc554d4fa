"""``tenplex bench goodput``: one training job run several ways under one event trace; goodput side by side.

May import: ``tenplex.bench.goodput_*``, ``tenplex.runtime.demo`` (the dataset), matplotlib (``--plot``, on use)
and the standard library. No torch in this process: the training runs in the workers.

The job (:mod:`.goodput_worker`): a small DDP model on a packed dataset, the same seed, data and global batch in
every mode, each step its CPU work plus ``--step-ms`` of emulated accelerator time. Each node is an emulated host
with two GPUs (two workers) on this machine. The trace (:mod:`.goodput_trace`) is replayed for every mode
(:mod:`.goodput_run`): joins, planned leaves with a notice, killed nodes and GPU faults. The modes
(:mod:`.goodput_modes`): tenplex's restart mode, tenplex in place (``tenplex run --in-place``), torchrun + DCP and
torchft, and tenplex in place on a second job that only it can run (``tenplex-inplace-tp``: the tiny GPT under
DTensor tensor parallelism, tp changing with the world's size, :mod:`.goodput_tp`), each configured as its
documentation recommends (``settings`` in the JSON says what and why). The accounting (:mod:`.goodput_account`)
reads what the workers recorded: goodput, the ideal, per event the pause and the steps lost, the bytes read, and
whether the losses equal the uninterrupted reference run of the mode's job.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from pathlib import Path

from .goodput_account import account, read_records
from .goodput_modes import MODES, Unavailable, job_of
from .goodput_run import Setup, run_mode, run_reference
from .goodput_trace import DEFAULT_RATES, build

DESCRIPTION = "goodput of one job under one event trace: tenplex vs torchrun + DCP vs torchft"
FORMAT = "tenplex.bench.goodput/1"
GLOBAL_BATCH = 840   # divides into equal shares for every data-parallel degree from 1 to 8
# What a peer cannot do at all is a row too, not a silent omission.
CANNOT = {
    "tp/pp job": {
        "tenplex": "not part of this benchmark yet: tenplex demo --elastic runs tp=2 -> pp=3 -> dp through the "
                   "same kinds of events (docs/guides/elastic.md)",
        "tenplex-inplace": "runs: mode tenplex-inplace-tp (tp=2 on even worlds, tp=1 on odd ones, its own "
                           "reference run)",
        "torchrun-dcp": "possible in principle (DCP reshards at load), but the user writes the new world's tp/pp "
                        "configuration and the data split themselves; not written here",
        "torchft": "cannot: torchft changes only the number of data-parallel replica groups; the tp/pp layout "
                   "inside a group is fixed for the job's life",
    },
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=480, help="training steps (default 480: 4 minutes of 500 ms)")
    p.add_argument("--step-ms", type=float, default=500.0, help="emulated accelerator time per step (ms)")
    p.add_argument("--trace", default=DEFAULT_RATES,
                   help=f"events per minute by kind (default {DEFAULT_RATES}), explicit events "
                        f"(fail:h1@20,join:h2@40,gpufail:h0/1@60,leave:h2@80: seconds after the first step), or "
                        f"'short' (the tests' fixed trace)")
    p.add_argument("--seed", type=int, default=3,
                   help="seed of the random trace (default 3: the first whose 4 minutes have every kind of event)")
    p.add_argument("--nodes", type=int, default=2, help="nodes at the start (h0, h1, …), two GPUs each")
    p.add_argument("--max-nodes", type=int, default=4, help="most nodes at once")
    p.add_argument("--grace", type=float, default=30.0, help="seconds between a leave's SIGTERM and the node's end")
    p.add_argument("--modes", default=",".join(MODES), help=f"modes to run (of {', '.join(MODES)})")
    p.add_argument("--timeout", type=float, default=None, help="seconds per mode (default: 3x ideal + 300)")
    p.add_argument("--plot", type=Path, default=None, help="write the plot (PNG): steps over wall time")
    p.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temporary folder)")


def run(args: argparse.Namespace) -> dict:
    from ..runtime.demo import make_dataset

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tenplex-goodput-"))
    step_s = args.step_ms / 1000
    initial = [f"h{i}" for i in range(args.nodes)]
    trace = build(args.trace, args.steps * step_s, args.seed, initial, args.max_nodes)
    try:
        make_dataset(workdir / "data", GLOBAL_BATCH * min(args.steps, 40), GLOBAL_BATCH, seed=0)
        setup = Setup(workdir, workdir / "data" / "dataset", args.steps, args.step_ms, GLOBAL_BATCH, trace, initial,
                      args.max_nodes, args.grace, args.timeout or 3 * args.steps * step_s + 300)
        references: dict[str, dict[int, float]] = {}  # by job: its uninterrupted run, once
        modes = [_mode(setup, name, references) for name in args.modes.split(",")]
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    result = {"format": FORMAT, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.node()}: {platform.processor() or platform.machine()}",
              "load": _load(), "steps": args.steps, "step_ms": args.step_ms, "global_batch": GLOBAL_BATCH,
              "nodes": args.nodes, "max_nodes": args.max_nodes, "grace_s": args.grace,
              "trace": [e.to_dict() for e in trace], "modes": modes, "cannot": CANNOT}
    if args.plot is not None:
        from .goodput_plot import plot

        plot(result, args.plot)
    return result


def _mode(setup: Setup, name: str, references: dict[str, dict[int, float]]) -> dict:
    entry = MODES.get(name)
    if entry is None:
        return {"mode": name, "status": "unknown", "error": f"no mode {name!r} (modes: {', '.join(MODES)})"}
    if isinstance(entry, Unavailable):
        return {"mode": name, "status": "unavailable", "error": entry.reason}
    cls, worker_mode, what = entry
    reference_mode, global_batch = job_of(worker_mode, setup.global_batch)
    if reference_mode not in references:
        references[reference_mode] = run_reference(setup, reference_mode)
    setup.say(f"{name}: {what}")
    load_before = _load()
    launched, fired, error = run_mode(setup, name)
    load = {"start": load_before, "end": _load()}  # [1, 5, 15 min]: the end's 5-min value spans most of a run
    report = account(read_records(setup.workdir / name / "record"), [f for f in fired if f["reached"]],
                     references[reference_mode], setup.steps, setup.step_ms / 1000, launched, global_batch)
    report["events"] += [f for f in fired if not f["reached"]]
    ok = error is None and report["finished"]
    return {"mode": name, "what": what, "status": "ok" if ok else "error",
            "error": error if error or ok else "the job did not finish every step completely",
            "settings": cls.SETTINGS, "load": load, **report}


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in __import__("os").getloadavg()]
    except OSError:
        return None


def table(objects: list[dict]) -> str:
    result = objects[0]
    lines = [f"goodput, {result['steps']} steps of {result['step_ms']:g} ms, trace: "
             f"{', '.join(_event(e) for e in result['trace']) or 'none'} (load {result['load']})",
             f"{'mode':<16} {'goodput':>8} {'wall s':>8} {'ideal s':>8} {'lost':>5} {'pauses s':<24} "
             f"{'read MB':>8} {'losses':<8}"]
    for m in result["modes"]:
        if m["status"] in ("unavailable", "unknown") or not m.get("steps"):
            lines.append(f"{m['mode']:<16} {m['status']}: {m.get('error')}")
            continue
        pauses = ",".join(f"{e['pause_s']:.1f}" for e in m["events"] if e.get("pause_s") is not None)
        lost = sum(e["steps_lost"] or 0 for e in m["events"] if e.get("reached"))
        goodput = f"{m['goodput']:.3f}" if m["goodput"] is not None else "-"
        lines.append(f"{m['mode']:<16} {goodput:>8} {m['wall_s']:>8.1f} {m['ideal_s']:>8.1f} {lost:>5} "
                     f"{pauses or '-':<24} {m['bytes_read'] / 1e6:>8.2f} "
                     f"{'equal' if m['losses']['equal'] else 'DIFFER'}"
                     + (f"  ({m['status']}: {m['error']})" if m["status"] != "ok" else ""))
    for job, rows in result["cannot"].items():
        for mode, why in rows.items():
            lines.append(f"{job} / {mode}: {why}")
    return "\n".join(lines)


def _event(e: dict) -> str:
    where = f"{e['host']}/{e['device']}" if "device" in e else e["host"]
    return f"{e['kind']}:{where}@{e['at']:g}"
