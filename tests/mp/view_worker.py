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

import job_record  # its neighbour
from tenplex.elastic.dataview import GENERATION_ENV

GLOBAL_BATCH = 12


def main() -> None:
    folder, steps = Path(sys.argv[1]), int(sys.argv[2])
    job, write = job_record.recorded_job(folder, GLOBAL_BATCH)
    view = job.data_view                                          # MOUNT/.gN/rankR of this world
    doc = json.loads((view / "state.json").read_bytes())
    assert doc["world"] == job.world_id == os.environ[GENERATION_ENV], (doc["world"], job.world_id)
    index = np.load(view / "index.npy")                           # (n, 4): id, offset in data, length, crc
    job_record.write_start(write, job, position=doc["state"]["position"], view=str(view),
                           view_generation=doc["generation"])
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
