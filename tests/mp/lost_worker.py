"""One rank of the lost-steps test: a tiny model trained through tenplex.elastic.Job (gloo), one host per rank.

Usage: ``python lost_worker.py OUT STEPS`` with torchrun's environment, TENPLEX_STORE_ROOT and TENPLEX_HOST set.
It restores, writes ``OUT/restored-r{rank}.json`` (``job.restored``'s lost steps, ``job.save_cost()``'s and the
worker's metrics, its host's progress record), trains up to step STEPS with blocking saves every 4 steps
(``save_every=4``, no snapshots, so the newest committed step is known), writes ``OUT/trained-r{rank}`` and
waits to be killed (at most 120 s).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tenplex.elastic
from tenplex.elastic import progress


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    job = tenplex.elastic.Job(global_batch=4, save_every=4, snapshots=False, replicas=0, timeout=60, max_tp=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    job.restore(model, optimizer)
    assert job.restored is not None
    cost, registry = job.save_cost(), job.metrics.registry
    (out / f"restored-r{job.rank}.json").write_text(json.dumps({
        "step": job.restored.step, "lost_steps": job.restored.lost_steps,
        "lost_steps_total": job.restored.lost_steps_total,
        "cost": {k: cost[k] for k in ("lost_steps", "lost_steps_total")},
        "metrics": {name: registry.get_sample_value(name)
                    for name in ("tenplex_job_lost_steps_total", "tenplex_job_last_lost_steps")},
        # this world's record starts at the restored step (a world that dies before its first boundary lost none)
        "record": dataclasses.asdict(progress.read(os.environ["TENPLEX_STORE_ROOT"]))}))
    while job.step < steps:
        model(torch.randn(4, 8)).square().mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=job.group)
        optimizer.step()
        optimizer.zero_grad()
        job.step_done()
    (out / f"trained-r{job.rank}").write_text(str(job.step))
    time.sleep(120)  # the test kills this process: no final save


if __name__ == "__main__":
    main()
