"""One rank of the process-group teardown test: join, create an optimizer, run collectives, leave, report threads.

Usage: ``python leave_worker.py OUT MODE`` with MASTER_ADDR/PORT, RANK and WORLD_SIZE set. MODE ``tenplex``
joins and leaves with :mod:`tenplex.integration.process_group`; MODE ``plain`` with torch.distributed alone
(the control: the first optimizer's imports capture the default group). Writes ``OUT/threads-r{rank}.json``:
the names of this process's threads after leaving.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tenplex.integration.exchange import all_gather_json
from tenplex.integration.process_group import init_process_group, leave_process_group


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "tenplex":
        init_process_group("gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 4)
    torch.optim.SGD(model.parameters(), lr=0.1)  # its first use imports torch._dynamo
    grad = torch.ones(4)
    dist.all_reduce(grad)
    all_gather_json({"rank": rank})
    if mode == "tenplex":
        leave_process_group()
    else:
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()
    names = sorted(p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm"))
    (out / f"threads-r{rank}.json").write_text(json.dumps(names))


if __name__ == "__main__":
    main()
