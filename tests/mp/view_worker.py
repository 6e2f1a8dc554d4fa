"""An elastic worker (under ``tenplex run --dataset --data-mount``) that reads its samples only from files under its
dataset view: ``index.npy``, ``data`` and ``state.json`` of ``job.data_view``, no tenplex data API. Each record of
the test's dataset holds its sample id, so the ids it logs come from the bytes it read.

    view_worker.py RECORD_DIR STEPS

It writes the records ``tenplex.elastic.demo`` follows and ``tenplex.elastic.timeline.read_worlds`` reads
(start, step, saved, exit), and waits at ``hold-STEP`` like the demo's GPT script.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import tenplex.elastic
from tenplex.elastic.dataview import GENERATION_ENV

GLOBAL_BATCH = 12


def main() -> None:
    folder, steps = Path(sys.argv[1]), int(sys.argv[2])
    out = None

    def write(**doc) -> None:
        out.write(json.dumps(doc) + "\n")
        out.flush()

    job = tenplex.elastic.Job(global_batch=GLOBAL_BATCH, max_tp=1, save_every=2, timeout=60,
                              checkpointer_options={"keep": 1000},
                              on_save=lambda save: write(event="saved", **save, time=time.time()),
                              on_exit=lambda code, why: write(event="exit", code=code, why=why, time=time.time()))
    model = torch.nn.Linear(2, 1)
    out = open(folder / f"rank-{job.host}-{os.getpid()}-{job.rank}.jsonl", "a")
    job.restore(model, torch.optim.SGD(model.parameters(), lr=0.01))
    view = job.data_view                                          # MOUNT/.gN/rankR of this world
    doc = json.loads((view / "state.json").read_bytes())
    assert doc["world"] == job.world_id == os.environ[GENERATION_ENV], (doc["world"], job.world_id)
    index = np.load(view / "index.npy")                           # (n, 4): id, offset in data, length, crc
    r = job.restored
    write(event="start", world_id=job.world_id, time=job.started, ready=time.time(), world=job.world_size,
          hosts=job.hosts, parallel=job.choice.degrees(), rank=job.rank, host=job.host, coords=job.coords,
          restored_step=r.step if r.version is not None else None, version=r.version, saved_version=r.saved_version,
          transformed=r.transformed, read_through=r.read_through, plan_stats=r.plan_stats, restore_s=r.seconds,
          position=doc["state"]["position"], view=str(view), view_generation=doc["generation"])
    first, done = job.step, 0
    with open(view / "data", "rb") as data:
        while job.step < steps:
            hold = folder / f"hold-{job.step}"
            while hold.exists() and not job.stop_requested:
                time.sleep(0.05)
            n = doc["micro_batches"][job.step - first]
            ids = []
            for _, offset, length, _ in index[done:done + n].tolist():
                data.seek(offset)
                ids.append(int(np.frombuffer(data.read(length), dtype=np.uint16)[0]))
            done += n
            write(event="step", step=job.step + 1, loss=float(sum(ids)), ids=ids, time=time.time())
            job.step_done()
    job.finish()
    write(event="exit", code=0, why="done", time=time.time())


if __name__ == "__main__":
    main()
