"""An elastic worker (``tenplex run --dataset SOURCE --data-mount``) that trains on an in-place source through
``job.loader()``: a DataLoader with 2 worker processes, prefetching and pinned memory, reading the node's FUSE
view. At each step it also reads its share of the other sources in process (``open_fallback`` at the job's
position). The ids it logs come from the samples' contents (``source_helpers.sample_id``).

    source_worker.py RECORD_DIR STEPS SOURCES_JSON

SOURCES_JSON: ``{"primary": KIND, "others": {KIND: PATH}}``. It writes the records
``tenplex.elastic.timeline.read_worlds`` reads (start, step, saved, exit) and waits at ``hold-STEP``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests folder: source_helpers

import job_record  # noqa: E402  (its neighbour)
import source_helpers  # noqa: E402
from tenplex.dataset import open_dataset  # noqa: E402
from tenplex.dataset.reader import open_fallback  # noqa: E402

GLOBAL_BATCH = 12


def other_ids(job, infos: dict) -> dict[str, list[int]]:
    """This rank's ids of the job's current step in each other source (same seed and position)."""
    state, out = job.data_state, {}
    for kind, info in infos.items():
        mine = dataclasses.replace(state, dataset=info.identity, num_samples=info.num_samples)
        reader = open_fallback(info, mine, job.config.dp, job.coords["dp"])
        out[kind] = [source_helpers.sample_id(kind, reader.get(i)) for i in range(int(reader.micro_batches[0]))]
    return out


def main() -> None:
    folder, steps, sources = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    job, write = job_record.recorded_job(folder, GLOBAL_BATCH)
    job_record.write_start(write, job, position=job.data_state.position, view=str(job.data_view))
    infos = {kind: open_dataset(path) for kind, path in sources["others"].items()}
    primary = sources["primary"]
    loader = job.loader(num_workers=2, prefetch_factor=2, pin_memory=True, collate_fn=list)
    for batch in loader:
        if job.step >= steps:
            break
        hold = folder / f"hold-{job.step}"
        while hold.exists() and not job.stop_requested:  # the loader's workers read ahead meanwhile
            time.sleep(0.05)
        ids = [source_helpers.sample_id(primary, sample) for sample in batch.data]
        assert ids == batch.ids, (ids, batch.ids)
        write(event="step", step=job.step + 1, loss=float(sum(ids)), ids=ids, others=other_ids(job, infos),
              time=time.time())
        job.step_done()
    job.finish()
    write(event="exit", code=0, why="done", time=time.time())


if __name__ == "__main__":
    main()
