"""The worker of tests/test_cuda_inplace.py: one process destroys its one-rank world and forms a new one, in place.

argv: OUT DEVICE BACKEND (``cuda nccl`` on a GPU; ``cpu gloo`` runs the same path anywhere). World 0 trains the
reference GPT uninterrupted (the reference losses). World 1 trains two steps and saves with tenplex; its group is
destroyed (DTensor's caches cleared as in place: tenplex.elastic.leftovers) while this process keeps the model's
device allocations; world 2 is a new group of the same backend in the same process: the kept tensors must still
hold the saved values at the same addresses, a model rebuilt on the new group restores the save bit for bit on
the device, and trains on. Writes OUT/report.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import tenplex
from tenplex.elastic.leftovers import forget_world
from tenplex.integration.process_group import leave_process_group
from tenplex.models.gpt import GPTConfig, Parallel, Trainer

CFG = GPTConfig(vocab=40, seq=8, hidden=32, heads=4, layers=2, ffn=64)
STEPS, SAVED = 4, 2
out, device, backend = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
store = dist.HashStore()


def enter(generation: int) -> None:
    """A new one-rank world on its own prefix of the store, as tenplex.elastic.reform forms each generation."""
    kwargs = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
    dist.init_process_group(backend, store=dist.PrefixStore(f"pg/{generation}/", store), rank=0, world_size=1,
                            **kwargs)


def leave() -> int:
    """End the world as a change in place does; returns how many process groups are left (none expected)."""
    forget_world()
    leave_process_group(together=False)
    return len(dist.distributed_c10d._world.pg_map)


def checkpointer() -> tenplex.Checkpointer:
    return tenplex.Checkpointer(store_root=out / "store", host="h0", device="h0/0", stores={})


if device == "cuda":
    torch.cuda.set_device(0)
report: dict = {"left": []}
enter(0)
reference = Trainer(CFG, Parallel(), global_batch=4, device=device)
report["reference"] = [reference.train_step(step) for step in range(STEPS)]
reference = None  # type: ignore[assignment]
report["left"].append(leave())

enter(1)
old = Trainer(CFG, Parallel(), global_batch=4, device=device)
report["losses"] = [old.train_step(step) for step in range(SAVED)]
tenplex.save(old.model, old.optimizer, scheduler=old.scheduler, step=SAVED, checkpointer=checkpointer())
held = old.full_state()
kept = {name: (p, p.data_ptr()) for name, p in old.model.named_parameters()}  # the device allocations kept
old = None  # type: ignore[assignment]
report["left"].append(leave())

enter(2)
report["kept_in_place"] = all(p.data_ptr() == ptr and torch.equal(p.detach().cpu(), held[name])
                              for name, (p, ptr) in kept.items())
new = Trainer(CFG, Parallel(), global_batch=4, device=device)
report["restored_step"] = tenplex.restore(new.model, new.optimizer, scheduler=new.scheduler,
                                          checkpointer=checkpointer())
state = new.full_state()
report["restored_bit_for_bit"] = state.keys() == held.keys() and all(
    torch.equal(state[k].view(torch.uint8), v.view(torch.uint8)) for k, v in held.items())
report["devices"] = sorted({p.device.type for p in new.model.parameters()})
report["losses"] += [new.train_step(step) for step in range(SAVED, STEPS)]
new = None  # type: ignore[assignment]
report["left"].append(leave())
report["pid"] = os.getpid()
(out / "report.json").write_text(json.dumps(report))
