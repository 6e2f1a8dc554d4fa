"""A worker of tests/test_elastic_inplace_idle.py: the loop form of tenplex.elastic.Job, in place, with a policy
that leaves a rank idle in worlds of two (pinned: 2 ranks train ``dp=1``, 3 ranks ``dp=3``).

argv: OUT (started by `tenplex run --in-place`). A float64 Linear(8, 8) trained with SGD: step s's global batch
is torch.manual_seed(s); randn(4, 8) (samples 4s .. 4s+3); each training rank takes the rows of its dp
coordinate and all-reduces its gradient sum over ``job.group`` (the training ranks), so every world computes
the uninterrupted job's step. Writes OUT/w{LOCAL_RANK}.jsonl: a line when the process starts, one per world the
loop's body runs in (pid, generation, size, dp, restored step, a digest of the restored state, the generations
idled through so far, a census of groups and threads), one per step (its samples, this rank's part of the loss,
the state's digest after the step), one at an exit at a step boundary (``on_exit``), and OUT/final-{pid}.json at
the end.
The job ends at the step in OUT/steps (the training ranks agree on the smallest they read).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tenplex.elastic

out = Path(sys.argv[1])
me = out / f"w{os.environ['LOCAL_RANK']}.jsonl"
logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {os.getpid()} %(name)s %(message)s")


def say(**doc) -> None:
    with open(me, "a") as f:
        f.write(json.dumps(doc) + "\n")


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode() + value.numpy().tobytes())
    return h.hexdigest()


def census() -> dict:
    """What a world could leave behind: process groups, their gloo threads, threads."""
    comms = []
    for task in Path("/proc/self/task").iterdir():
        try:
            comms.append((task / "comm").read_text().strip())
        except OSError:
            continue
    return {"pg_map": len(dist.distributed_c10d._world.pg_map), "gloo_threads": comms.count("pt_gloo_runloop"),
            "threads": len(comms)}


def limit(job) -> int:
    path = out / "steps"
    mine = torch.tensor([float(path.read_text()) if path.exists() else 1e9], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=job.group)
    return int(mine.item())


say(started=os.getpid(), restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
job = tenplex.elastic.Job(global_batch=4, max_tp=1, pinned={2: "dp=1", 3: "dp=3"}, replicas=0, timeout=30,
                          save_every=1, on_exit=lambda code, why: say(exit=code, why=why, pid=os.getpid(),
                                                                      idle_worlds=list(job.idle_worlds)))
for world in job.worlds():  # only the worlds this rank trains in: it idles through the others inside the loop
    with world:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        job.restore(model, optimizer)
        dp, n = job.coords["dp"], job.config.dp
        say(pid=os.getpid(), generation=world.generation, size=world.world_size, dp=n, reasons=list(world.reasons),
            restored=job.step, version=job.restored.version, lost=job.restored.lost_steps,
            digest=digest(model), idled=list(job.idle_worlds), census=census())
        while world.active and job.step < limit(job):  # an ended world has no group left
            step = job.step
            torch.manual_seed(step)
            x = torch.randn(4, 8, dtype=torch.float64)
            lo, hi = 4 * dp // n, 4 * (dp + 1) // n
            loss = model(x[lo:hi]).square().sum() / x.numel()
            loss.backward()
            time.sleep(0.05)
            for p in model.parameters():
                dist.all_reduce(p.grad, group=job.group)
            optimizer.step()
            optimizer.zero_grad()
            # before step_done: a leaver exits in it, after the stopping save of this step
            say(step=step + 1, generation=world.generation, samples=list(range(4 * step + lo, 4 * step + hi)),
                loss=loss.item(), digest=digest(model))
            job.step_done()
job.finish()
(out / f"final-{os.getpid()}.json").write_text(json.dumps({
    "params": {k: v.tolist() for k, v in model.state_dict().items()}, "step": job.step,
    "reconfigurations": job.reconfigurations}))
