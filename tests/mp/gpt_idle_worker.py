"""A worker of tests/test_models_gpt_idle.py: the example GPT ``Trainer`` in a world whose policy leaves a rank idle.

argv: OUT STEPS, one rank of ``tenplex.runtime.launch.run_job`` under ``max_tp=2``: with three ranks, h0/0 alone
on its node and h1/0, h1/1, the policy gives tp=2 on h1 and leaves rank 0 idle; with two ranks on one node (the
comparison) tp=2 and nobody idles. The training ranks build the Trainer over ``job.group``, train STEPS steps and
save at the end; each rank writes ``OUT/r{rank}.json`` (idle or its coordinates, losses, the mesh, the job's group
size) and the first rank of the mesh the full parameters and Adam moments (``OUT/state.safetensors``). Nothing is
pickled.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file

from tenplex.models.gpt import GPTConfig, Parallel, Trainer

CFG, BATCH = GPTConfig(), 4


def train(out: Path, steps: int) -> None:
    import tenplex.elastic

    job = tenplex.elastic.Job(global_batch=BATCH, max_tp=2, replicas=0, save_every=0, timeout=60)
    mine = {"rank": job.rank, "idle": job.idle, "degrees": job.choice.degrees(), "ranks": list(job.choice.ranks)}
    (out / f"r{job.rank}.json").write_text(json.dumps(mine))  # an idle rank exits in the loop, never writes again
    for _world in job.worlds():  # an idle rank waits in here until the training ranks finish, then exits 0
        c = job.config
        trainer = Trainer(CFG, Parallel(dp=c.dp, tp=c.tp, pp=c.pp), job.global_batch, group=job.group)
        job.restore(trainer.model, trainer.optimizer, scheduler=trainer.scheduler, coords=trainer.coords)
        losses = []
        while job.step < steps:
            losses.append(trainer.train_step(job.step))
            job.step_done()
        state = trainer.full_state()  # collective over the mesh: the training ranks only
        if not any(trainer.coords.values()):
            save_file({k: v.contiguous() for k, v in state.items()}, str(out / "state.safetensors"))
        mine.update(coords=trainer.coords, losses=losses, mesh=trainer.mesh.mesh.tolist(),
                    group=dist.get_world_size(job.group) if job.group is not None else None)
        (out / f"r{job.rank}.json").write_text(json.dumps(mine))
        trainer = None  # type: ignore[assignment]  # its mesh holds this world's groups
    job.finish()


if __name__ == "__main__":
    train(Path(sys.argv[1]), int(sys.argv[2]))
