"""One mode of ``tenplex bench goodput`` under the trace: start the nodes, set off each event, wait for the end.

May import: ``tenplex.bench.goodput_modes``, ``.goodput_trace``, ``.goodput_account`` and the standard library.

An event is set off at its time after the job's first step, but never before the job has recorded a step since
the previous event (events do not pile onto a recovery: each pause is its own); the time it was set off is
recorded. A planned leave is SIGTERM, then, after the grace period, the node is gone (its processes and its
store killed) whether or not it finished leaving. An event whose time comes after the job's last step is not
set off (``"reached": false``). "Runs again" means a step by a world that was not there before the previous
event. Once the last step is recorded, the mode's processes get ``LINGER_S`` to end by themselves (a final save,
the teardown) before they are ended.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .goodput_account import read_records
from .goodput_modes import MODES
from .goodput_trace import Event

POLL_S = 0.25
SETTLE_S = 60.0  # an event that forms no new world: the next one waits this long after it


@dataclass
class Setup:
    """What every mode shares: the job, the trace, the nodes."""

    workdir: Path
    data: Path
    steps: int
    step_ms: float
    global_batch: int
    trace: list[Event]
    initial: list[str]
    max_nodes: int
    grace_s: float
    timeout_s: float
    say: Callable[[str], None] = field(default=lambda m: print(m, file=sys.stderr, flush=True))  # progress
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ, OMP_NUM_THREADS="1"))


def worker_args(setup: Setup, mode: str, base: Path) -> list[str]:
    return ["-m", "tenplex.bench.goodput_worker", mode, "--data", str(setup.data), "--record", str(base / "record"),
            "--steps", str(setup.steps), "--step-ms", f"{setup.step_ms:g}", "--global-batch", str(setup.global_batch),
            "--faults", str(base / "faults"), "--checkpoints", str(base / "checkpoints")]


def run_reference(setup: Setup, worker_mode: str = "reference") -> dict[int, float]:
    """The uninterrupted run of a job (``reference``: the DDP job's, ``reference-tp``: the tp job's): one process,
    every step (no emulated accelerator time: only the losses count)."""
    base = setup.workdir / worker_mode
    base.mkdir(parents=True, exist_ok=True)
    args = worker_args(setup, worker_mode, base)
    args[args.index("--step-ms") + 1] = "0"
    with open(base / "worker.log", "ab") as log:
        code = subprocess.run([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                              env=setup.env, timeout=setup.timeout_s).returncode
    if code != 0:
        raise RuntimeError(f"the reference run failed (exit {code}); see {base / 'worker.log'}")
    return {d["step"]: d["loss"] for d in read_records(base / "record") if d["event"] == "step"}


def run_mode(setup: Setup, name: str) -> tuple[float, list[dict], str | None]:
    """Run mode ``name`` under the trace; (launch time, the events as set off, the error if it failed)."""
    cls, worker_mode, _ = MODES[name]  # type: ignore[misc]
    base = setup.workdir / name
    for sub in ("record", "faults", "checkpoints"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    script = worker_args(setup, worker_mode, base)
    if name == "torchft":
        script = [sys.executable, *script]
    fired, error = [], None
    # The clock starts at the first node's launch, with the mode's service (rendezvous store, lighthouse) already
    # serving: a cluster's service, started once and waited for in every mode alike, not a part of the job's start.
    cluster = cls(base, script, setup.env, setup.max_nodes)
    launched = time.time()
    try:
        for host in setup.initial:
            cluster.start(host)
        setup.say(f"{name}: nodes {', '.join(setup.initial)} started")
        fired = _replay(setup, cluster, base, name)
    except Exception as e:  # noqa: BLE001 -- a peer that fails is reported with its error, not dropped
        error = f"{type(e).__name__}: {e}"
    finally:
        cluster.close()
    return launched, fired, error


def _replay(setup: Setup, cluster, base: Path, name: str) -> list[dict]:
    deadline = time.monotonic() + setup.timeout_s
    fired: list[dict] = []
    gone: list[tuple[float, str]] = []  # (when, node): a leave's grace period ends
    first_step, old = None, set[str]()
    for e in setup.trace:
        while True:
            docs = [d for d in read_records(base / "record") if d["event"] == "step"]
            first_step = first_step or min((d["time"] for d in docs), default=None)
            gone = _end_grace(cluster, gone)
            if first_step is not None and time.time() >= first_step + e.at and _recovered(docs, fired, old):
                break
            _check(cluster, deadline, name, f"the event {e.describe()}")
            if not cluster.running():
                break
            time.sleep(POLL_S)
        if not cluster.running():
            fired.append(dict(e.to_dict(), time=None, reached=False))
            continue
        setup.say(f"{name}: {e.describe()} (step {max(d['step'] for d in docs)})")
        old = {d["world"] for d in docs}
        fired.append(dict(e.to_dict(), time=time.time(), reached=True))
        _set_off(cluster, e, base, setup.grace_s, gone)
    ended = None  # when the last step was first recorded
    while cluster.running():
        gone = _end_grace(cluster, gone)
        _check(cluster, deadline, name, "the job's last step")
        if ended is None and any(d["event"] == "step" and d["step"] == setup.steps
                                 for d in read_records(base / "record")):
            ended = time.monotonic()
        if ended is not None and time.monotonic() > ended + cluster.LINGER_S:
            break  # the job is done; close() ends what still runs
        time.sleep(POLL_S)
    return fired


def _recovered(docs: list[dict], fired: list[dict], old: set[str]) -> bool:
    """Whether the job runs again after the previous event: a step by a world that was not there before it (or,
    where an event forms no new world, any step and a minute gone by)."""
    reached = [f for f in fired if f["reached"]]
    if not reached:
        return True
    since = reached[-1]["time"]
    after = [d for d in docs if d["time"] > since]
    return any(d["world"] not in old for d in after) or (bool(after) and time.time() > since + SETTLE_S)


def _set_off(cluster, e: Event, base: Path, grace_s: float, gone: list[tuple[float, str]]) -> None:
    if e.kind == "join":
        cluster.start(e.host)
    elif e.kind == "fail":
        cluster.fail(e.host)
    elif e.kind == "leave":
        cluster.leave(e.host)
        gone.append((time.monotonic() + grace_s, e.host))
    else:
        (base / "faults" / f"{e.host}-{e.device}").touch()
        cluster.gpufail(e.host, e.device)


def _end_grace(cluster, gone: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """Kill the nodes whose grace period is over (a preempted machine goes away); the others still wait."""
    for when, host in gone:
        if time.monotonic() >= when:
            cluster.fail(host)
    return [(w, h) for w, h in gone if time.monotonic() < w]


def _check(cluster, deadline: float, name: str, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"{name} did not reach {what} in time (running nodes: "
                           f"{', '.join(cluster.running()) or 'none'})")
