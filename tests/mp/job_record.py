"""The job set-up and per-rank record shared by the data-path test workers (source_worker, view_worker): a
``tenplex.elastic.Job`` restored onto a tiny model, and the JSON lines ``tenplex.elastic.timeline.read_worlds``
reads (start, step, saved, exit) in ``RECORD_DIR/rank-HOST-PID-RANK.jsonl``. Workers import it as their neighbour."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Callable

import torch

import tenplex.elastic


def recorded_job(folder: Path, global_batch: int) -> tuple[tenplex.elastic.Job, Callable[..., None]]:
    """A restored job (saves every 2 steps, keeps every checkpoint) and the writer of its records; the job's
    saves and exits are recorded already."""
    out: list[IO[str]] = []  # opened once the job knows its host and rank

    def write(**doc) -> None:
        out[0].write(json.dumps(doc) + "\n")
        out[0].flush()

    job = tenplex.elastic.Job(global_batch=global_batch, max_tp=1, save_every=2, timeout=60,
                              checkpointer_options={"keep": 1000},
                              on_save=lambda save: write(event="saved", **save, time=time.time()),
                              on_exit=lambda code, why: write(event="exit", code=code, why=why, time=time.time()))
    model = torch.nn.Linear(2, 1)
    out.append(open(folder / f"rank-{job.host}-{os.getpid()}-{job.rank}.jsonl", "a"))
    job.restore(model, torch.optim.SGD(model.parameters(), lr=0.01))
    return job, write


def write_start(write: Callable[..., None], job: tenplex.elastic.Job, **more) -> None:
    """The ``start`` record: the world, this rank's place in it and what its restore did (plus ``more``)."""
    r = job.restored
    write(event="start", world_id=job.world_id, time=job.started, ready=time.time(), world=job.world_size,
          hosts=job.hosts, parallel=job.choice.degrees(), rank=job.rank, host=job.host, coords=job.coords,
          restored_step=r.step if r.version is not None else None, version=r.version, saved_version=r.saved_version,
          transformed=r.transformed, read_through=r.read_through, plan_stats=r.plan_stats, restore_s=r.seconds,
          **more)
