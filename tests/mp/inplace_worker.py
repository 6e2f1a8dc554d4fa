"""A worker of tests/test_elastic_inplace.py: the loop form of tenplex.elastic.Job, in place.

argv: OUT. Started by `tenplex run --in-place` (which sets TENPLEX_IN_PLACE, TENPLEX_RDZV_ENDPOINT/ID,
TENPLEX_HOST, TENPLEX_STORE_ROOT/ADDRESS; torchrun sets LOCAL_RANK). A float64 Linear(8, 8) trained with
SGD: step s's global batch is torch.manual_seed(s); randn(4, 8), each rank takes its rows and all-reduces
its gradient sum, so every world computes the uninterrupted job's step. Writes OUT/w{LOCAL_RANK}.jsonl: one
line per world (pid, generation, rank, size, reasons, the step it restored) and per step;
OUT/final-{pid}.json at the end (parameters, reconfigurations, metrics).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from prometheus_client import generate_latest

import tenplex.elastic

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


def build():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


job = tenplex.elastic.Job(global_batch=4, max_tp=1, replicas=0, timeout=30, save_every=1)  # a snapshot every step
for world in job.worlds():
    with world:
        model, optimizer = build()
        job.restore(model, optimizer)
        say(pid=os.getpid(), generation=world.generation, rank=world.rank, size=world.world_size,
            reasons=list(world.reasons), restored=job.step, bytes=job.restored.bytes)
        while job.step < steps(world) and world.active:
            torch.manual_seed(job.step)
            x = torch.randn(4, 8, dtype=torch.float64)
            rows = x[4 * world.rank // world.world_size: 4 * (world.rank + 1) // world.world_size]
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
