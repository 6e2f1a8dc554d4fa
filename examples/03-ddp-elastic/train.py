"""A plain DistributedDataParallel script made elastic with ``tenplex.elastic.Job`` under ``tenplex run``.

    tenplex run --host h0 --store-root /tmp/ddp/h0 --standalone --nproc-per-node 2 \\
        train.py --data /tmp/ddp/data/dataset --steps 20

The script does not know how many ranks it has: ``Job`` joins the process group, restores model, optimizer, RNG
and the data position, and hands each rank its share of every global batch. Nodes may join, leave or die under
torchrun (see ../01-gpt-train); the script continues where the job stopped, on the same global batches.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import tenplex.elastic

VOCAB = 64


class NextToken(torch.nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.mix = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU())
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(tokens)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="packed dataset directory (make_data.py writes one)")
    p.add_argument("--steps", type=int, default=20, help="train until this step")
    p.add_argument("--save-every", type=int, default=None, help="steps between saves (default: automatic)")
    p.add_argument("--width", type=int, default=32, help="the model's width (default 32)")
    p.add_argument("--accelerator-ms", type=float, default=0.0,
                   help="a sleep per step standing in for accelerator time (default 0)")
    p.add_argument("--report", action="store_true", help="print job.save_cost() as JSON at the end (rank 0)")
    args = p.parse_args()

    # max_tp=1: a data-parallel model has no tensor-parallel structure, so every rank is a data-parallel replica.
    job = tenplex.elastic.Job(dataset=args.data, global_batch=8, max_tp=1, save_every=args.save_every)
    torch.manual_seed(0)
    model = DistributedDataParallel(NextToken(args.width), process_group=job.group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    job.restore(model, optimizer)
    if job.rank == 0:
        print(f"world {job.world_size}: {job.choice.degrees()}; "
              f"{'fresh start' if job.restored.version is None else f'restored step {job.step}'}", flush=True)
    while job.step < args.steps:
        tokens = job.batch().data.long()                   # this rank's share of the global batch at job.step
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()                                    # DDP averages the gradients over the replicas
        time.sleep(args.accelerator_ms / 1000)
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.AVG, group=job.group)
        if job.rank == 0:
            print(f"step {job.step + 1:3d}  loss {loss.item():.6f}", flush=True)
        job.step_done()                                    # periodic save; on SIGTERM: agree, save, exit
    if args.report and job.rank == 0:
        print("save_cost", json.dumps(job.save_cost()), flush=True)
    job.finish()
    if job.rank == 0:
        print(f"done at step {job.step}", flush=True)


if __name__ == "__main__":
    main()
