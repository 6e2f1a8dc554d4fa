"""A worker of tests/test_elastic_inplace.py: the loop form of tenplex.elastic.Job, in place.

argv: OUT. Started by `tenplex run --in-place` (which sets TENPLEX_IN_PLACE, TENPLEX_RDZV_ENDPOINT/ID,
TENPLEX_HOST, TENPLEX_STORE_ROOT/ADDRESS; torchrun sets LOCAL_RANK). A float64 Linear(8, 8) trained with
SGD: step s's global batch is torch.manual_seed(s); randn(4, 8), each rank takes its rows and all-reduces
its gradient sum, so every world computes the uninterrupted job's step. Writes OUT/w{LOCAL_RANK}.jsonl: one
line per world (pid, generation, rank, size, reasons, the step it restored) and per step;
OUT/final-{pid}.json at the end (parameters, reconfigurations, metrics).

Faults the tests turn on with files in OUT: ``crash-at`` (a step): the node's first worker process raises in user
code at that step, and a restarted one (TORCHELASTIC_RESTART_COUNT >= 1) raises in its ``build``, once its new
world formed but before its first step; ``hold-snapshots``: each snapshot's background write waits for the next
blocking save (see ``held_writes``).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from prometheus_client import generate_latest

import tenplex.elastic
from tenplex.integration import Checkpointer
from tenplex.integration.snapshot_writer import SnapshotWriter

out = Path(sys.argv[1])
faulthandler.register(signal.SIGUSR1)  # the test dumps a stuck worker's threads before it kills it
logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {os.getpid()} %(name)s %(message)s")


def steps(world) -> int:
    """Train on until the test writes OUT/steps, read only by a world of one rank (no rank can disagree)."""
    limit = out / "steps"
    return int(limit.read_text()) if world.world_size == 1 and limit.exists() else 10**9

me = out / f"w{os.environ['LOCAL_RANK']}.jsonl"


def say(**doc) -> None:
    with open(me, "a") as f:
        f.write(json.dumps(doc) + "\n")


restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
crash_at = out / "crash-at"


def crash_due(step: int) -> bool:
    return restarts == 0 and crash_at.exists() and step >= int(crash_at.read_text())


blocking_save = threading.Event()  # a blocking save began: in place, the stopping save of a change


def held_writes(write):
    """While OUT/hold-snapshots exists, each snapshot's background write waits (up to 5 s) for a blocking save to
    begin, so a change agreed meanwhile finds this snapshot in flight; it records whether that save released it."""
    def held(self, job, *args):
        released = (out / "hold-snapshots").exists() and blocking_save.wait(5.0)
        try:
            return write(self, job, *args)
        finally:
            say(snapshot_written=job.step, released_by_save=released)
    return held


def saves_begin(save):
    def begin(*args, **kwargs):
        blocking_save.set()
        return save(*args, **kwargs)
    return begin


SnapshotWriter._write = held_writes(SnapshotWriter._write)  # type: ignore[method-assign]
Checkpointer.save = saves_begin(Checkpointer.save)  # type: ignore[method-assign]


def build(world):
    if restarts >= 1 and crash_at.exists():  # a second failure, during the change: the world formed, no step yet
        say(building=world.generation, pid=os.getpid())
        raise RuntimeError("injected crash while building the new world's model")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


job = tenplex.elastic.Job(global_batch=4, max_tp=1, replicas=0, timeout=30, save_every=1)  # a snapshot every step
for world in job.worlds():
    with world:
        model, optimizer = build(world)
        job.restore(model, optimizer)
        say(pid=os.getpid(), generation=world.generation, rank=world.rank, size=world.world_size,
            reasons=list(world.reasons), restored=job.step, bytes=job.restored.bytes, restarts=restarts)
        while job.step < steps(world) and world.active:
            torch.manual_seed(job.step)
            x = torch.randn(4, 8, dtype=torch.float64)
            rows = x[4 * world.rank // world.world_size: 4 * (world.rank + 1) // world.world_size]
            if crash_due(job.step):
                raise RuntimeError(f"injected crash in user code at step {job.step}")
            loss = model(rows).square().sum() / x.numel()
            loss.backward()
            time.sleep(0.05)
            for p in model.parameters():
                dist.all_reduce(p.grad)
            optimizer.step()
            optimizer.zero_grad()
            job.step_done()
            say(step=job.step, generation=world.generation)
job.finish()
(out / f"final-{os.getpid()}.json").write_text(json.dumps({
    "params": {k: v.tolist() for k, v in model.state_dict().items()}, "step": job.step,
    "reconfigurations": job.reconfigurations, "metrics": generate_latest(job.metrics.registry).decode()}))
