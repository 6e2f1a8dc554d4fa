"""The tensor-parallel job of ``tenplex bench goodput``: what the DDP-only peers cannot run.

    python -m tenplex.bench.goodput_worker tenplex-inplace-tp …   (under ``tenplex run --in-place``)
    python -m tenplex.bench.goodput_worker reference-tp …         (one process: the losses to reproduce)

The tiny GPT of :mod:`tenplex.models.gpt` under DTensor tensor parallelism, its configuration pinned by the world's
size (:data:`PINNED`: tp=2 on an even number of workers, tp=1 on an odd one, dp the rest), so that nearly every
event of the trace changes tp as well as dp, and every survivor rebuilds its model on a new DeviceMesh in the same
process. Its global batch is the GPT's synthetic batch of each step (:func:`tenplex.models.gpt.batch`), the same in
every configuration; the loss every rank returns is the global batch's mean, recorded once per step (by the world's
rank 0, as the whole batch: ``dp`` 1, ``n`` :data:`GLOBAL_BATCH`), so the accounting of
:mod:`tenplex.bench.goodput_account` reads it unchanged. Each step sleeps ``--step-ms`` after its work, as the DDP
job does.

May import: torch, ``tenplex.elastic`` (``Job``, ``devices``), ``tenplex.models.gpt``,
``tenplex.bench.goodput_job`` (records, the emulated GPU) and the standard library.
"""

from __future__ import annotations

import argparse
import time

import torch.distributed as dist

from tenplex.bench.goodput_job import Record, check_device, run_worlds
from tenplex.models.gpt import GPTConfig, Parallel, Trainer

GLOBAL_BATCH = 420   # divides by every dp from 1 to 7 (tp=1 on odd worlds of up to 7 workers, tp=2 on even ones)
PINNED = {n: "tp=2" if n % 2 == 0 else "tp=1" for n in range(1, 17)}
CFG = GPTConfig()    # 4 heads: tp=2 computes whole heads


def run_reference(args: argparse.Namespace) -> None:
    """One process, tp=1, every step: the losses the tp job must reproduce (tp changes only the order of sums)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    trainer = Trainer(CFG, Parallel(), GLOBAL_BATCH)
    rec = Record(args.record, "reference-tp", "h0", "0")
    rec.write("start", world="reference", size=1, restored_step=None, restore_s=0.0, bytes_read=0)
    for step in range(args.steps):
        loss = trainer.train_step(step)
        rec.write("step", step=step + 1, loss=loss, n=GLOBAL_BATCH, dp=1, world="reference")
    del trainer  # before the group goes: freeing a group joins its threads
    dist.destroy_process_group()


def run_tenplex_tp(args: argparse.Namespace) -> None:
    """The loop form under ``tenplex run --in-place``: a new world, mesh and model per change, one process."""
    import tenplex.elastic

    run_worlds(args, tenplex.elastic.Job(global_batch=GLOBAL_BATCH, pinned=PINNED), _train_world)


def _train_world(args: argparse.Namespace, job, world, rec: Record, device: str) -> None:
    c = job.config
    trainer = Trainer(CFG, Parallel(dp=c.dp, tp=c.tp, pp=c.pp), GLOBAL_BATCH)  # a new DeviceMesh on this world
    job.restore(trainer.model, trainer.optimizer, scheduler=trainer.scheduler, coords=trainer.coords)
    r = job.restored
    moved = r.plan_stats.get("intra_host_bytes", 0) + r.plan_stats.get("inter_host_bytes", 0)
    membership = getattr(job, "_membership", None)
    phases = {"job": job.started, **(membership.timeline if membership is not None else {})}
    rec.write("start", world=job.world_id, size=job.world_size, restored_step=r.step if r.version is not None
              else None, restore_s=r.seconds, bytes_read=moved, moved_bytes=moved, generation=world.generation,
              phases=phases, tp=c.tp, dp=c.dp)
    first = dist.get_rank() == 0
    while job.step < args.steps and world.active:
        check_device(args.faults, job.host, device)
        loss = trainer.train_step(job.step)  # every rank: the global batch's mean loss
        time.sleep(args.step_ms / 1000)
        if first:
            rec.write("step", step=job.step + 1, loss=loss, n=GLOBAL_BATCH, dp=1, world=job.world_id, tp=c.tp)
        job.step_done()
