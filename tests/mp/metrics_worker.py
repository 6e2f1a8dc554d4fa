"""One rank of the metrics test: a tiny model trained through tenplex.elastic.Job (gloo), then it waits.

Usage: ``python metrics_worker.py OUT`` with torchrun's environment, TENPLEX_STORE_ROOT, TENPLEX_HOST and
TENPLEX_METRICS_PORT set. It trains 4 steps, saving at steps 2 and 4 (``save_every=2``), writes
``OUT/trained-r{rank}``, and keeps its metrics endpoint up until ``OUT/stop`` exists (at most 120 s).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tenplex.elastic


def main() -> None:
    out = Path(sys.argv[1])
    # max_tp=1: a data-parallel script (under tp > 1 Job.restore refuses a model without tp structure)
    job = tenplex.elastic.Job(global_batch=4, save_every=2, replicas=0, timeout=60, max_tp=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    job.restore(model, optimizer)
    while job.step < 4:
        model(torch.randn(4, 8)).square().mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=job.group)
        optimizer.step()
        optimizer.zero_grad()
        job.step_done()
    (out / f"trained-r{job.rank}").write_text(str(job.step))
    deadline = time.monotonic() + 120
    while not (out / "stop").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    job.finish()


if __name__ == "__main__":
    main()
