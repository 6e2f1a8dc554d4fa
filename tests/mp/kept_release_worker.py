"""A worker of tests/test_elastic_inplace_tp_fault.py: one rank of four of the GPT under DTensor (tp=2, dp=2).

Usage: ``python kept_release_worker.py DIR RANK``. The ranks form a gloo group (file:// under DIR, a group
timeout of :data:`GROUP_TIMEOUT_S`) and train one step. Then rank 3 dies (its device failed), ranks 1 and 2 leave
the world the way a survivor in place does (:meth:`tenplex.elastic.worlds.InPlaceWorlds._next_world`: keep the
state for a restore from memory, clear DTensor's caches, leave the group) and wait without any collective, while
rank 0 is in an all-reduce over its data-parallel group with rank 2 (a step's gradients). Rank 0 must see an error
of a lost peer (rank 2's closed connection), not sit out the group's timeout: prints one JSON line
{"error": str | null} on rank 0.
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

from tenplex.elastic import leftovers
from tenplex.integration.memory import Kept
from tenplex.integration.process_group import import_world_capturing_modules, leave_process_group
from tenplex.models.gpt import GPTConfig, Parallel, Trainer

GROUP_TIMEOUT_S = 60  # before the fix rank 0 waited this long for its recv, then failed with gloo's timeout


def main() -> None:
    directory, rank = Path(sys.argv[1]), int(sys.argv[2])
    import_world_capturing_modules()
    dist.init_process_group("gloo", init_method=f"file://{directory / 'group'}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    trainer = Trainer(GPTConfig(), Parallel(dp=2, tp=2), 420)
    trainer.train_step(0)
    dist.barrier()
    if rank == 3:
        os._exit(76)  # the device fault: the process ends, its sockets close
    if rank == 0:
        total = torch.ones(1)
        try:
            dist.all_reduce(total, group=trainer.mesh.get_group("dp"))  # rank 2, its dp peer, never joins it
            error = None
        except RuntimeError as e:
            error = str(e)
        print(json.dumps({"error": error}), flush=True)
        os._exit(0)
    time.sleep(1.0)  # rank 0 is in its all-reduce by now (it errs either way: before or after the others leave)
    kept = Kept.capture(trainer.model, trainer.optimizer, None, 1)  # what _keep_if_unchanged keeps
    del trainer
    leftovers.forget_world()
    leave_process_group(together=False)
    (directory / f"left-{rank}").touch()
    while not (directory / "done").exists():  # alive, holding what it kept, as a rank waiting for the next world
        time.sleep(0.05)
    del kept  # held until now
    os._exit(0)


if __name__ == "__main__":
    main()
