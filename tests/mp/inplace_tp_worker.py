"""A worker of tests/test_elastic_inplace_tp.py: the tiny GPT under DTensor tensor parallelism, rebuilt in place.

argv: OUT (started by `tenplex run --in-place`) or `--reference OUT STEPS` (one process, its own group, tp=1:
the uninterrupted run's losses). Pinned: 2 ranks train tp=2, 1 rank tp=1, so each change of the world size
rebuilds the model on a new DeviceMesh in the same process. Per world it writes a line to OUT/w.jsonl (pid,
generation, size, tp, the restored step, whether the restored full state equals bit for bit the one this
process held at the old world's last step, and a census of process groups, gloo threads, threads and fds);
per step the loss. The job ends when the test writes OUT/steps (the ranks agree on the smallest limit seen).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tenplex.integration.process_group import leave_process_group
from tenplex.models.gpt import GPTConfig, Parallel, Trainer

CFG, BATCH = GPTConfig(), 4


def census() -> dict:
    """What a world could leave behind: process groups, their gloo threads, threads, file descriptors."""
    gloo = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            gloo += (task / "comm").read_text().strip() == "pt_gloo_runloop"
        except OSError:
            continue
    return {"pg_map": len(dist.distributed_c10d._world.pg_map), "gloo_threads": gloo,
            "threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}


def reference(out: Path, steps: int) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    trainer = Trainer(CFG, Parallel(), BATCH)
    losses = [trainer.train_step(step) for step in range(steps)]
    (out / "reference.json").write_text(json.dumps(losses))
    del trainer  # before its groups are destroyed: freeing a group joins its threads
    leave_process_group(together=False)


def limit(out: Path) -> int:
    """The last step, agreed: the smallest the ranks read (a rank that has not seen OUT/steps yet says none)."""
    path = out / "steps"
    mine = torch.tensor([float(path.read_text()) if path.exists() else 1e9], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    return int(mine.item())


def train(out: Path) -> None:
    import tenplex.elastic

    me = out / "w.jsonl"

    def say(**doc) -> None:
        with open(me, "a") as f:
            f.write(json.dumps(doc) + "\n")

    job = tenplex.elastic.Job(global_batch=BATCH, pinned={1: "tp=1", 2: "tp=2"}, replicas=0, timeout=30, save_every=1)
    held: tuple[int, dict] | None = None  # (step, full state) at the old world's last step, kept in this process
    for world in job.worlds():
        with world:
            c = job.config
            trainer = Trainer(CFG, Parallel(dp=c.dp, tp=c.tp, pp=c.pp), BATCH, group=job.group)  # a new DeviceMesh
            job.restore(trainer.model, trainer.optimizer, scheduler=trainer.scheduler, coords=trainer.coords)
            state = trainer.full_state()
            same = None if held is None or held[0] != job.step else all(
                torch.equal(state[k], v) for k, v in held[1].items()) and state.keys() == held[1].keys()
            say(pid=os.getpid(), generation=world.generation, size=world.world_size, tp=c.tp, restored=job.step,
                same_as_held=same, census=census())
            while world.active and job.step < limit(out):  # an ended world has no group left
                loss = trainer.train_step(job.step)
                # the state a change's stopping save will hold (collective: before a leaver may exit in step_done)
                held = (job.step + 1, trainer.full_state())
                job.step_done()
                say(step=job.step, loss=loss, generation=world.generation)
        trainer = None  # type: ignore[assignment]  # DTensors hold the mesh, the mesh this world's groups
    job.finish()


if __name__ == "__main__":
    if sys.argv[1] == "--reference":
        reference(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        train(Path(sys.argv[1]))
