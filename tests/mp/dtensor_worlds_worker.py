"""One rank of tests/test_elastic_dtensor_worlds.py: the example GPT (dp=2, tp=2: DTensor) in two worlds in this
process, as a survivor in place builds it; the second world creates other groups first, so that its groups'
names differ from the first's. Prints "ok" or the error of the second world.

Usage: dtensor_worlds_worker.py RANK PORT {forget,keep}
"""

from __future__ import annotations

import datetime
import os
import sys

import torch.distributed as dist

from tenplex.elastic.leftovers import forget_world
from tenplex.integration.process_group import leave_process_group
from tenplex.models.gpt import GPTConfig, Parallel, Trainer


def world(store, rank: int, number: int, extra_groups: int) -> None:
    dist.init_process_group("gloo", store=dist.PrefixStore(f"world/{number}/", store), rank=rank, world_size=4)
    for _ in range(extra_groups):
        dist.new_group([0, 1, 2, 3])
    trainer = Trainer(GPTConfig(), Parallel(dp=2, tp=2, pp=1), 12, seed=0)
    trainer.train_step(0)
    trainer.full_state()  # collective over the mesh: DTensor's full_tensor()
    trainer = None
    leave_process_group(together=True)


def main() -> None:
    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 4, rank == 0, timeout=datetime.timedelta(seconds=120))
    world(store, rank, 1, 0)
    if mode == "forget":
        forget_world()  # what Job does between worlds in place
    try:
        world(store, rank, 2, 3)
        print("ok", flush=True)
    except RuntimeError as e:
        print(f"error: {e}", flush=True)
    os._exit(0)  # no teardown: a failed world may have left groups behind


if __name__ == "__main__":
    main()
