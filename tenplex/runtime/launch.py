"""Launch one job's worker processes like torchrun does, on simulated hosts of this machine.

May import: the standard library, ``tenplex.errors`` and ``tenplex.ports``.

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
(127.0.0.1) and a free MASTER_PORT, plus what ``tenplex.Checkpointer`` reads:
TENPLEX_HOST, TENPLEX_DEVICE, TENPLEX_STORE_ROOT (its host's store directory)
and TENPLEX_STORES (every host's store address). Workers report through files
(JSON, safetensors), never through pickles.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

from ..errors import ConfigError, TenplexError
from ..ports import free_port


class JobError(TenplexError, RuntimeError):
    """Worker processes failed; the message lists each failed rank with the end of its log."""


def place(world: int, hosts: int) -> list[str]:
    """Device ids of ``world`` ranks spread over ``hosts`` hosts in rank order (``h0/0``, ``h0/1``, ``h1/0``…).

    Rank r goes to host ``r * hosts // world``, so hosts get contiguous ranks
    (tensor-parallel groups share a host) and counts differ by at most one.
    """
    if not 1 <= hosts <= world:
        raise ConfigError(f"cannot spread {world} ranks over {hosts} hosts: use 1..{world} hosts")
    devices, used = [], {}  # type: list[str], dict[str, int]
    for rank in range(world):
        host = f"h{rank * hosts // world}"
        devices.append(f"{host}/{used.get(host, 0)}")
        used[host] = used.get(host, 0) + 1
    return devices


def run_job(argv: Sequence[str], devices: Sequence[str], roots: dict[str, Path], stores: dict[str, str],
            logdir: Path, timeout: float = 600, poll: Callable[[], None] | None = None) -> None:
    """Run ``argv`` once per rank (``devices[rank]`` is its device) and wait; raise JobError if any rank fails.

    ``poll`` is called about five times a second while the job runs (progress display).
    A failed rank stops the whole job at once: the others would wait in a collective forever.
    """
    logdir.mkdir(parents=True, exist_ok=True)
    world, port = len(devices), free_port()
    per_host: dict[str, int] = {}
    for device in devices:
        per_host[device.split("/")[0]] = per_host.get(device.split("/")[0], 0) + 1
    addresses = ",".join(f"{h}={a}" for h, a in sorted(stores.items()))
    procs, logs = [], []
    try:
        for rank, device in enumerate(devices):
            host, local = device.split("/")
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=local,
                       LOCAL_WORLD_SIZE=str(per_host[host]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", TENPLEX_HOST=host, TENPLEX_DEVICE=device,
                       TENPLEX_STORE_ROOT=str(roots[host]), TENPLEX_STORES=addresses)
            logs.append(logdir / f"rank{rank}.log")
            with open(logs[-1], "w") as out:
                procs.append(subprocess.Popen(list(argv), env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline, timed_out = time.monotonic() + timeout, False
        while any(p.poll() is None for p in procs):
            timed_out = time.monotonic() > deadline
            if timed_out or any(p.poll() not in (None, 0) for p in procs):
                break
            if poll:
                poll()
            time.sleep(0.2)
        if poll:
            poll()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        # The first rank to exit with an error holds the cause; the killed ones (-9) only echo it.
        failed.sort(key=lambda r: procs[r].returncode == -9)
        text = "\n".join(f"--- rank {r} ({devices[r]}, exit {procs[r].returncode}) ---\n"
                         f"{logs[r].read_text()[-3000:]}" for r in failed[:2])
        why = (f"the job did not finish within {timeout:.0f} s" if timed_out
               else f"{len(failed)} of {world} ranks failed")
        raise JobError(f"{why} (logs in {logdir}):\n{text}")


def run_spec_job(argv: Sequence[str], spec: dict, spec_path: Path, devices: Sequence[str], roots: dict[str, Path],
                 stores: dict[str, str], logdir: Path, timeout: float = 600,
                 poll: Callable[[], None] | None = None) -> None:
    """Write ``spec`` as JSON to ``spec_path``, then :func:`run_job` ``argv + [spec_path]``.

    This is how workers get their task: a JSON file, never a pickle.
    """
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec))
    run_job([*argv, str(spec_path)], devices, roots, stores, logdir, timeout=timeout, poll=poll)
