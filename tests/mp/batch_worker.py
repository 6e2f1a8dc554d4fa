"""A worker of tests/test_elastic_join_batch.py: steps in generations of real gloo groups (tenplex.elastic.reform),
recording each generation and, per step, what its watch thread holds back.

argv: ENDPOINT JOB HOST LOCAL_RANK LOCAL_WORLD RECORD STOP_FILE. Each step all-reduces (change wanted, stop
asked): a change re-forms in this process, a stop ends every member at the same step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tenplex.elastic.protocol import Event
from tenplex.elastic.reform import Membership

endpoint, job, host, local_rank, local_world, record, stop_file = sys.argv[1:8]
out = open(record, "a")


def write(**doc) -> None:
    out.write(json.dumps(doc) + "\n")
    out.flush()


# batch_wait far beyond the test: only the registration of a host's last worker may admit the host
m = Membership(endpoint, job, host, int(local_rank), min_workers=1, timeout=60.0, dead_after=5.0,
               local_world=int(local_world), batch_wait=600.0)
m.register()
gen = m.join(deadline=time.monotonic() + 240)
write(kind="generation", wid=m.me.wid, generation=gen.number, members=list(gen.members),
      reasons=list(gen.reasons))
while True:
    flags = torch.tensor([1.0 if m.wanted else 0.0, 1.0 if Path(stop_file).exists() else 0.0])
    dist.all_reduce(flags)
    write(kind="step", generation_of_step=gen.number, held_back=sorted(m.held_back),
          size=dist.get_world_size())
    if flags[1] > 0:
        break
    if flags[0] > 0:
        m.protocol.on(Event.CHANGE_AGREED)
        m.leave_group()
        gen = m.join(deadline=time.monotonic() + 240)
        write(kind="generation", wid=m.me.wid, generation=gen.number, members=list(gen.members),
              reasons=list(gen.reasons))
    time.sleep(0.05)
m.mark_leaving()
m.close()
out.close()
os._exit(0)  # every member stops at the same step; no collective follows (see integration.process_group)
