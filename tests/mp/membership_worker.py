"""A tiny elastic worker for ``tenplex run``'s restart accounting: all-reduce in a loop, record each start.

Usage: ``membership_worker.py FOLDER MODE [STEPS]``. Each start appends a JSON line to ``FOLDER/starts.jsonl``
(host, rank, world size, its device, TENPLEX_DEVICES, pid). MODE ``loop``: all-reduce a stop flag every 50 ms
until ``FOLDER/stop`` exists or STEPS steps are done, with the fault of ``TENPLEX_INJECT_DEVICE_FAULT``
injected at each step boundary; a lost peer surfaces as gloo raises it (the entry shim classifies it). MODE
``crash``: a bug, at once. MODE ``slow-start``: ``loop``, but the fault is injected before joining the process
group, and while the node runs more than one worker, each that has no fault takes a long time to start (as a slow
import would), without a SIGTERM handler yet.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tenplex.elastic.devices import worker_device
from tenplex.elastic.faults import inject_device_fault


def main() -> None:
    folder, mode = Path(sys.argv[1]), sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else None
    host = os.environ["TENPLEX_HOST"]
    if mode == "crash":
        _record(folder, host=host, pid=os.getpid())
        raise ValueError("a bug in the training script")
    if mode == "slow-start":
        _record(folder, host=host, device=worker_device(), pid=os.getpid(), starting=True)
        inject_device_fault(host, worker_device(), 0)
        if int(os.environ["LOCAL_WORLD_SIZE"]) > 1:
            time.sleep(600)  # torchrun stops this one (SIGTERM, its default action) when its sibling fails
    dist.init_process_group("gloo")
    _record(folder, host=host, rank=dist.get_rank(), world=dist.get_world_size(), device=worker_device(),
            devices=os.environ.get("TENPLEX_DEVICES"), pid=os.getpid())
    step = 0
    while True:
        inject_device_fault(host, worker_device(), step)
        done = (folder / "stop").exists() or (steps is not None and step >= steps)
        flag = torch.tensor([1.0 if done else 0.0])
        dist.all_reduce(flag)
        if flag.item() > 0:
            break
        step += 1
        time.sleep(0.05)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no teardown: every rank is done, and the agent only needs the exit code


def _record(folder: Path, **doc) -> None:
    with open(folder / "starts.jsonl", "a") as f:
        f.write(json.dumps(dict(doc, time=time.time())) + "\n")


if __name__ == "__main__":
    main()
