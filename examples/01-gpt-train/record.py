"""``train.py --record DIR``: what ``tenplex demo --elastic`` reads and checks (see tenplex.elastic.timeline).

Per-rank JSON lines (world, configuration, restored step and position, losses, sample ids, saves, exit) and
the full parameters and Adam moments (safetensors) after every save and after the restore. Nothing is pickled.

May import: safetensors (on use) and the standard library.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class Record:
    """What ``tenplex demo --elastic`` checks: per-rank JSON lines (losses, sample ids, saves, times) and the
    full parameters and Adam moments (safetensors) after every save and after the restore."""

    def __init__(self, folder: Path, job, trainer, started: float | None = None):
        """``started``: when this world began in this process (the job's start for its first world)."""
        self.folder, self.job, self.trainer = folder, job, trainer
        (folder / "dumps").mkdir(parents=True, exist_ok=True)
        generation = job.world.generation  # 0 without --in-place; in place one file per world of this process
        self.tag = f"{os.getpid()}-{job.rank}" + (f"-g{generation}" if generation else "")
        self.file = open(folder / f"rank-{job.host}-{self.tag}.jsonl", "a")
        r = job.restored
        device = f"{job.host}/{os.environ.get('LOCAL_RANK', job.rank)}"
        self.write(event="start", world_id=job.world_id, time=job.started if started is None else started,
                   ready=time.time(), world=job.world_size, hosts=job.hosts, pid=os.getpid(), device=device,
                   generation=generation,
                   parallel=job.choice.degrees(), rank=job.rank, host=job.host, coords=trainer.coords,
                   restored_step=r.step if r.version is not None else None, version=r.version,
                   saved_version=r.saved_version,
                   transformed=r.transformed, read_through=r.read_through, plan_stats=r.plan_stats,
                   restore_s=r.seconds,
                   position=job.data_state.position, data_view=str(job.data_view) if job.data_view else None)
        if r.version is not None:
            self.dump(f"restored-{r.step}-{self.tag}")

    def hold(self) -> None:
        """Wait while the demo holds the job at this step (file ``hold-STEP``), unless the world is about to
        change (torchrun stops us, or in place the membership saw a join, leave or loss)."""
        flag = self.folder / f"hold-{self.job.step}"
        while flag.exists() and not self.job.change_pending:  # SIGTERM, or in place a join, leave or loss
            time.sleep(0.05)

    def write(self, **doc) -> None:
        self.file.write(json.dumps(doc) + "\n")
        self.file.flush()

    def step(self, step: int, loss: float, ids: list[int]) -> None:
        self.write(event="step", step=step, loss=loss, ids=ids, time=time.time())

    def saved(self, save: dict) -> None:
        self.write(event="saved", **save, position=self.job.data_state.position, time=time.time())
        self.dump(f"saved-{save['step']}-{self.tag}")

    def dump(self, name: str) -> None:
        """The demo's own check, not the job's work: its time is recorded (``dump``) so that the demo can tell
        it apart from a change's pause."""
        from safetensors.torch import save_file

        begin = time.time()
        state = self.trainer.full_state()  # collective: every rank calls it
        if self.trainer.coords["dp"] == 0 and self.trainer.coords["tp"] == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, str(self.folder / "dumps" / f"{name}.safetensors"))
        self.write(event="dump", what="-".join(name.split("-")[:2]), begin=begin, time=time.time())

    def ended(self, why: str | None) -> None:
        """This world ended in place (``why``: change, lost); the process goes on in the next one."""
        if not self.file.closed:
            self.write(event="end", why=why, time=time.time())
            self.file.close()
        self.trainer = None  # its model and process groups end with the world

    def exit(self, code: int, why: str) -> None:
        if not self.file.closed:
            self.write(event="exit", code=code, why=why, time=time.time(), sigterm=self.job.stop_requested)
            self.file.close()
