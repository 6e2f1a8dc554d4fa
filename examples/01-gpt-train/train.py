"""Train the tiny GPT under any parallel configuration; save with tenplex and resume under another one.

Run under torchrun (CPU, gloo)::

    torchrun --standalone --nproc-per-node 8 train.py --parallel dp=2,tp=2,pp=2 --steps 10 --store /tmp/tenplex-demo
    torchrun --standalone --nproc-per-node 4 train.py --parallel dp=4 --steps 20 --store /tmp/tenplex-demo

The second run restores the state the first saved (step 10) and continues to
step 20. See README.md in this folder for the multi-host form (store processes).
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

import tenplex
from tenplex.models.gpt import GPTConfig, Parallel, Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", default="dp=1", help="e.g. dp=2,tp=2,pp=2 (fsdp=1 shards over dp with FSDP2)")
    parser.add_argument("--steps", type=int, default=10, help="train until this step")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--store", help="this host's store directory (default: $TENPLEX_STORE_ROOT)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    par = Parallel.parse(args.parallel)
    trainer = Trainer(GPTConfig(), par, args.global_batch)
    ckpt = tenplex.Checkpointer(store_root=args.store, coords=trainer.coords)
    step = tenplex.restore(trainer.model, trainer.optimizer, scheduler=trainer.scheduler, checkpointer=ckpt) or 0
    rank = dist.get_rank()
    if rank == 0:
        how = "fresh start" if step == 0 else f"restored step {step} (transformed: {ckpt.last_restore.transformed})"
        print(f"[{args.parallel}] {how}", flush=True)
    while step < args.steps:
        loss = trainer.train_step(step)
        step += 1
        if rank == 0:
            print(f"step {step:4d}  loss {loss:.6f}", flush=True)
        if step == args.steps or (args.save_every and step % args.save_every == 0):
            version = tenplex.save(trainer.model, trainer.optimizer, step=step, scheduler=trainer.scheduler,
                                   checkpointer=ckpt)
            if rank == 0:
                print(f"saved step {step} as version {version}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
