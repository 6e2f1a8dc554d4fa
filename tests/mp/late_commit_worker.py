"""A world of one rank whose job key-value store comes up only after its first snapshot (a slow start).

Usage: ``python late_commit_worker.py OUT PORT``. The rank's ``MASTER_ADDR:MASTER_PORT`` names PORT, where no
store listens yet; the process group itself rendezvouses through a file. Snapshot 0 cannot reach the key-value
store and commits at the next boundary (late). Once an attempt to connect has failed, the rank starts a real c10d
TCPStore server on PORT and keeps snapshotting, one step at a time, until a snapshot's host commit happens in the
background before the next boundary (the store's newest version reaches it while the training thread waits for
it, at most 3 s per step). Writes ``OUT/result.json``: the stats after snapshot 0, the failed attempts by then,
the step of the first on-time commit (None: none within 90 s) and the final stats.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import tenplex
from tenplex.integration import jobstore
from tenplex.integration.process_group import init_process_group, leave_process_group


def main() -> None:
    out, port = Path(sys.argv[1]), int(sys.argv[2])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    jobstore.CONNECT_S = 1.0  # one connection attempt gives up after a second (10 s by default)
    init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=0, world_size=1)
    model = torch.nn.Linear(4, 4)
    ckpt = tenplex.Checkpointer(store_root=out / "store", host="h0", replicas=0)
    ckpt.async_save(model, step=0)
    ckpt.wait_snapshot()
    first = ckpt.snapshot_stats()
    kv, deadline = ckpt._snapshots._kv, time.monotonic() + 60  # type: ignore[union-attr]
    while kv.failed_attempts == 0 and time.monotonic() < deadline:  # the first attempt fails: nothing listens
        time.sleep(0.01)
    failed_first = kv.failed_attempts
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    on_time, step, deadline = None, 0, time.monotonic() + 90
    while on_time is None and time.monotonic() < deadline:
        step += 1
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.async_save(model, step=step)
        version, waited = ckpt.snapshot_stats()["staged_version"], time.monotonic() + 3
        while ckpt.store.latest() != version and time.monotonic() < waited:
            time.sleep(0.01)
        if ckpt.store.latest() == version:
            on_time = step
    ckpt.wait_snapshot()
    (out / "result.json").write_text(json.dumps({"first": first, "failed_first": failed_first, "on_time": on_time,
                                                 "last": ckpt.snapshot_stats()}))
    ckpt.close()
    leave_process_group()
    del server


if __name__ == "__main__":
    main()
