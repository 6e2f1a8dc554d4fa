"""One rank of the mid-step SIGTERM test: a tiny model trained through tenplex.elastic.Job (gloo, 2 ranks).

Usage: ``python sigterm_worker.py OUT MODE`` with torchrun's environment and TENPLEX_STORE_ROOT and
TENPLEX_HOST set.
Each step takes about half a second, in two halves around a collective; before it starts, the rank writes
the step's index to ``OUT/r{rank}.in-step``. It saves at step 2 (``save_every=2``) and whenever the ranks
agree to stop. After each committed save, ``OUT/saved-{step}-r{rank}.safetensors`` holds its parameters.
With three ranks the policy is pinned to dp=2: rank 2 stays idle (``Job.wait_idle``). MODE ``three-steps``
trains three steps and finishes. MODE ``slow-save`` makes every save after the first wait 60 s before
preparing its part (after writing ``OUT/r{rank}.saving``), so that the test can kill the ranks in the middle
of a save.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import tenplex.elastic
from tenplex.store.writer import VersionWriter


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    job = tenplex.elastic.Job(global_batch=4, save_every=2, replicas=0, timeout=60, pinned={3: "dp=2"}, max_tp=1,
                              on_save=lambda info: save_file(
                                  {k: v.contiguous() for k, v in model.state_dict().items()},
                                  str(out / f"saved-{info['step']}-r{job.rank}.safetensors")),
                              on_exit=lambda code, why: (out / f"exit-r{job.rank}.json").write_text(
                                  json.dumps({"code": code, "why": why, "step": job.step})))
    if job.idle:
        job.wait_idle()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    job.restore(model, optimizer)
    if mode == "slow-save":
        prepare = VersionWriter.prepare

        def slow_prepare(self):
            if job.step > 2:
                (out / f"r{job.rank}.saving").write_text(str(job.step))
                time.sleep(60)
            prepare(self)

        VersionWriter.prepare = slow_prepare
    while job.step < (3 if mode == "three-steps" else 1000):
        (out / f"r{job.rank}.in-step").write_text(str(job.step))
        torch.manual_seed(job.step)
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        time.sleep(0.25)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=job.group)  # the training ranks (all but idle ones)
        time.sleep(0.25)
        optimizer.step()
        optimizer.zero_grad()
        with open(out / f"steps-r{job.rank}.txt", "a") as f:
            f.write(f"{job.step + 1}\n")
        job.step_done()
    job.finish()
    (out / f"exit-r{job.rank}.json").write_text(json.dumps({"code": 0, "why": "done", "step": job.step}))


if __name__ == "__main__":
    main()
