"""A worker of tests/test_elastic_reform.py: generations of real gloo groups through tenplex.elastic.reform.

argv: ENDPOINT JOB HOST OUT_DIR ROLE ("victim": SIGKILLs itself in the middle of an all-reduce of generation 1;
"survivor": trains on, then re-forms twenty times, counting what each re-formation leaves behind).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tenplex.elastic.protocol import Event
from tenplex.elastic.reform import Membership

endpoint, job, host, out, role = sys.argv[1:6]
logging.basicConfig(level=logging.WARNING)
REFORMS = 20


def gloo_threads() -> int:
    """The process's gloo worker threads: a process group that was not freed keeps its own."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            count += (task / "comm").read_text().strip() == "pt_gloo_runloop"
        except OSError:
            continue
    return count


def census() -> dict:
    """What a re-formation could leak: process groups (and their gloo threads), threads, file descriptors,
    resident memory."""
    return {"gloo_threads": gloo_threads(), "pg_map": len(dist.distributed_c10d._world.pg_map),
            "threads": len(os.listdir("/proc/self/task")), "py_threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")),
            "rss": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")}


def kill_me_soon(entered: threading.Event) -> None:
    entered.wait()
    time.sleep(0.005)  # inside the all-reduce (one takes tens of ms or more here)
    (Path(out) / "killed_at").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


# The heartbeat alone would take 600 s to count the victim dead (past the join's 120 s deadline): the survivors
# re-form because the close watch saw its process's connection close (tenplex.elastic.closewatch).
m = Membership(endpoint, job, host, 0, min_workers=3, timeout=60.0, dead_after=600.0)
m.register()
gen = m.join(deadline=time.monotonic() + 120)
report: dict = {"first": {"generation": gen.number, "rank": dist.get_rank(), "world": dist.get_world_size()}}
big = torch.ones(8_000_000)  # 32 MB: an all-reduce of it lasts long enough to be killed in
entered = threading.Event()
if role == "victim":
    threading.Thread(target=kill_me_soon, args=(entered,), daemon=True).start()
try:
    for i in range(200):
        if i == 3:
            entered.set()
        dist.all_reduce(big)
    raise SystemExit("the victim's death was never noticed")
except RuntimeError as e:
    report["error"] = {"at": time.time(), "text": str(e)[:300], "iteration": i}
m.protocol.on(Event.PEER_LOST)
m.leave_group()
t = time.monotonic()
gen = m.join(deadline=time.monotonic() + 120)
x = torch.ones(3)
dist.all_reduce(x)
report["second"] = {"generation": gen.number, "rank": dist.get_rank(), "world": dist.get_world_size(),
                    "reasons": list(gen.reasons), "sum": x.tolist(), "re_form_s": time.monotonic() - t,
                    "lost_by": [how for _, how in gen.lost_by]}
report["census"] = [census()]
for _ in range(REFORMS):  # the same members, a new group each time: what does each one leave behind?
    m.protocol.on(Event.CHANGE_AGREED)
    m.leave_group()
    report["census"].append(census())
    gen = m.join(deadline=time.monotonic() + 120)
    y = torch.full((1000,), float(dist.get_rank()))
    dist.all_reduce(y)
    assert y[0].item() == 1.0, (y[0], gen, dist.get_rank(), dist.get_world_size(), m.me)
report["last_generation"] = gen.number
m.mark_leaving()
m.leave_group(Event.FINISHED)
report["census"].append(census())
m.close()
report["states"] = [h[2].value for h in m.protocol.history]
(Path(out) / f"{host}.json").write_text(json.dumps(report))
