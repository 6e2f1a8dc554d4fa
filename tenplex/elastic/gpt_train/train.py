"""Train the tiny GPT as an elastic job: any world size, any parallel configuration, state kept across changes.

Run one ``tenplex run`` per node (see README.md in this folder)::

    tenplex rendezvous serve --port 29400 &
    tenplex run --host h0 --store-root /tmp/gpt/h0 --nnodes 1:4 --nproc-per-node 2 \\
        --rdzv-endpoint 127.0.0.1:29400 train.py --data /tmp/gpt/data/dataset --steps 40

Nodes may join, leave (SIGTERM) or die while it trains: torchrun restarts the
workers in the new world and this script continues where the job stopped,
under the configuration tenplex's policy picks for that world. With
``tenplex run --in-place`` the survivors keep their processes: the loop over
``job.worlds()`` builds the model again for each world, in the same process.

May import: ``tenplex.elastic``, ``tenplex.models.gpt``, ``record`` (its neighbour) and the standard library.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import tenplex.elastic
from record import Record
from tenplex.models.gpt import GPTConfig, Parallel, Trainer


def main() -> None:
    args = parse_args()
    record: Record | None = None
    job = tenplex.elastic.Job(dataset=args.data, global_batch=args.global_batch, max_tp=args.max_tp,
                              pinned=args.pin, save_every=args.save_every, replicas=args.replicas, timeout=args.timeout,
                              checkpointer_options={"keep": args.keep_versions},
                              on_save=(lambda save: record.saved(save)) if args.record else None,
                              on_exit=(lambda code, why: record.exit(code, why)) if args.record else None)
    try:
        # One world without --in-place (torchrun restarts this script at a change); with it, one per change.
        for world in job.worlds():
            with world:                               # a lost peer ends this world, not the process
                # when this world began here: in place, when it formed (a joiner started before, warm)
                started = time.time() if world.generation else job.started
                c = world.config
                trainer = Trainer(GPTConfig(), Parallel(dp=c.dp, tp=c.tp, pp=c.pp), job.global_batch,
                                  seed=args.init_seed, group=job.group)  # the training ranks (some may idle)
                job.restore(trainer.model, trainer.optimizer, scheduler=trainer.scheduler, coords=trainer.coords)
                record = Record(args.record, job, trainer, started) if args.record else None
                if job.rank == job.choice.ranks[0]:  # the first rank that trains
                    print(f"world {job.world_size} on {','.join(job.hosts)}: {job.choice.degrees()} "
                          f"({job.choice.reason}); "
                          f"{'fresh start' if job.restored.version is None else f'restored step {job.step}'}",
                          flush=True)
                train(job, world, trainer, record, args.steps)
            if record and not world.active:
                record.ended(world.ended)             # and drops its reference to the trainer
            # Nothing of this world may outlive it: a process group still referenced (the pipeline's) stays open,
            # and a peer waiting on it in a receive would wait forever.
            trainer = None
        job.finish()
        if job.rank == job.choice.ranks[0]:
            print(f"done at step {job.step}; saving cost {json.dumps(job.save_cost())}", flush=True)
    except BaseException as e:
        if record:
            record.exit(getattr(e, "code", 1), f"{type(e).__name__}: {e}")
        raise
    if record:
        record.exit(0, "done")


def train(job, world, trainer: Trainer, record: Record | None, steps: int) -> None:
    """Train this world until the last step, or until it ends (a change, a lost peer)."""
    while job.step < steps and world.active:
        if record:
            record.hold()
        batch = job.batch()                       # this rank's share of the global batch at job.step
        tokens = batch.data.long()                # (micro-batch, seq + 1)
        loss = trainer.train_step(job.step, (tokens[:, :-1], tokens[:, 1:]))
        if record:
            record.step(job.step + 1, loss, batch.ids)
        if job.rank == job.choice.ranks[0]:
            print(f"step {job.step + 1:4d}  loss {loss:.6f}", flush=True)
        job.step_done()                           # periodic save; on SIGTERM: agree, save, exit (or next world)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="packed dataset directory (make_data.py writes one)")
    p.add_argument("--steps", type=int, default=40, help="train until this step")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--max-tp", type=int, default=8, help="cap of the policy's tensor parallelism")
    p.add_argument("--pin", action="append", default=[], metavar="WORLD:SPEC",
                   help="pin a configuration for a world size, e.g. 4:tp=2,pp=2 (repeatable)")
    p.add_argument("--save-every", type=int, default=None,
                   help="steps between saves (default: automatic, at most 5%% of training time; 0: only on stop)")
    p.add_argument("--replicas", type=int, default=None,
                   help="copies of regions no other host holds (default: 1 with two or more hosts)")
    p.add_argument("--keep-versions", type=int, default=2, help="saved versions each store keeps")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a collective waits for a peer before giving up (a partitioned peer sends no reset)")
    p.add_argument("--init-seed", type=int, default=0, help="seed of the initial weights of a fresh start")
    p.add_argument("--record", type=Path, help="directory for per-rank JSON lines and state dumps (the demo)")
    args = p.parse_args()
    args.pin = {int(w): spec for w, _, spec in (item.partition(":") for item in args.pin)}
    return args


if __name__ == "__main__":
    main()
