"""A worker of tests/test_elastic_pinned_groups.py: the example GPT in place, where the user's code keeps (or not)
the old world's trainer after its world ended.

argv: OUT (started by `tenplex run --in-place`). ``max_tp=1``: the Trainer's DeviceMesh is pp=1, dp=WORLD, tp=1,
and its DTensor-free parameters still hold the mesh's groups through the trainer. The worker of LOCAL_RANK 0 on h0
keeps its first world's trainer in a variable that outlives the world (``kept``, as a loop variable would); every
other worker drops it (``trainer = None``) when the loop's body ends. Writes OUT/w{LOCAL_RANK}.jsonl: a line per
world (pid, generation, size), per step, every warning of the job's logger, and at the end the job's
reconfigurations. The job ends at the step in OUT/steps (the ranks agree on the smallest they read).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import tenplex.elastic
from tenplex.models.gpt import GPTConfig, Parallel, Trainer

out = Path(sys.argv[1])
me = out / f"w{os.environ['LOCAL_RANK']}.jsonl"
keeps = os.environ["TENPLEX_HOST"] == "h0" and os.environ["LOCAL_RANK"] == "0"


def say(**doc) -> None:
    with open(me, "a") as f:
        f.write(json.dumps(doc) + "\n")


class Warnings(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        say(warning=record.getMessage())


logging.getLogger("tenplex.elastic.job").addHandler(Warnings(logging.WARNING))


def limit() -> int:
    path = out / "steps"
    mine = torch.tensor([float(path.read_text()) if path.exists() else 1e9], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    return int(mine.item())


job = tenplex.elastic.Job(global_batch=12, max_tp=1, replicas=0, timeout=30, save_every=1)
kept = None
for world in job.worlds():
    with world:
        c = job.config
        trainer = Trainer(GPTConfig(), Parallel(dp=c.dp, tp=c.tp, pp=c.pp), job.global_batch, group=job.group)
        job.restore(trainer.model, trainer.optimizer, scheduler=trainer.scheduler, coords=trainer.coords)
        say(pid=os.getpid(), generation=world.generation, size=world.world_size, keeps=keeps)
        while world.active and job.step < limit():
            trainer.train_step(job.step)
            job.step_done()
            say(step=job.step, generation=world.generation)
    if keeps and kept is None:
        kept = trainer  # the old world's trainer outlives its world: its mesh holds that world's groups
    trainer = None  # type: ignore[assignment]
job.finish()
say(reconfigurations=job.reconfigurations)
