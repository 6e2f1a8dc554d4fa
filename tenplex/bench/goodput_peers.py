"""The peers' training loops for ``tenplex bench goodput``, written as their documentation shows them.

**torchrun + DCP** (``run_dcp``): the recipe of PyTorch's "Getting started with Distributed Checkpoint" and
"Asynchronous saving with DCP" tutorials under torchrun's elastic agent: an ``AppState`` (``Stateful``) over
``get_state_dict``/``set_state_dict``, ``dcp.async_save`` into a folder per step on shared storage with a gloo
group of its own (as the tutorial recommends for async saves), the previous save awaited before the next, and on
start the newest *complete* checkpoint loaded (DCP writes ``.metadata`` last). The save interval N is chosen once
per world for a 5% overhead: the first save's blocking time over 5% of the step time (the ranks agree on the
maximum), as a user would pick it after one measurement. No save on SIGTERM: a DCP save is collective, and the
other ranks do not know that one of them was told to stop (torchrun's agent forwards SIGTERM to its workers and
exits).

**torchft** (``run_torchft``): torchft's ``train_ddp.py``: one replica group per process (``Manager`` with
``min_replica_size=1``, ``init_sync=False`` (its docs: every replica seeds the same weights), ``ProcessGroupGloo``
with the 5 s timeout of its CPU example, checkpoint recovery over ``PGTransport``, its ``DistributedDataParallel``
and ``Optimizer`` wrappers, the default asynchronous quorum). One change, for the same global batches in every
mode: each step's global batch is split among the step's participants
(``participating_rank``/``num_participants``), where ``train_ddp.py``'s ``DistributedSampler`` shards by a fixed
replica-group count and drops the batches of missing groups.

May import: torch, torchft (on use), ``tenplex.bench.goodput_job``, ``tenplex.elastic.entry`` and the standard
library.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tenplex.bench.goodput_job import Record, Shares, build, check_device, state_bytes, train_step

BUDGET = 0.05  # a checkpoint may cost this fraction of the training time


class AppState:
    """DCP's ``Stateful`` application state, as the tutorial writes it."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def newest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint (``step-N`` with its ``.metadata``) and its step."""
    done = [(int(d.name.split("-")[1]), d) for d in folder.glob("step-*") if (d / ".metadata").exists()]
    return max(done) if done else None


def world_token() -> str:
    """Rank 0's token, the same on every rank: names this world in the records (a tensor, never a pickle)."""
    token = torch.tensor([time.time_ns() if dist.get_rank() == 0 else 0], dtype=torch.int64)
    dist.broadcast(token, 0)
    return f"{int(token):x}"


def _restore_dcp(args: argparse.Namespace, app: AppState) -> tuple[int | None, int]:
    """Load the newest complete checkpoint (every rank reads it all: DDP's state is replicated); (step, bytes)."""
    import torch.distributed.checkpoint as dcp

    newest = newest_checkpoint(args.checkpoints)
    if newest is None:
        return None, 0
    step, folder = newest
    dcp.load({"app": app}, checkpoint_id=str(folder))
    return step, sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def run_dcp(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel

    from tenplex.elastic.entry import die_with_parent

    die_with_parent(None)  # an emulated host: its workers die with its agent
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    host, device = os.environ["GOODPUT_HOST"], _device()
    rec = Record(args.record, "dcp", host, device)
    model, optimizer = build()
    model = DistributedDataParallel(model)
    app = AppState(model, optimizer)
    begin = time.monotonic()
    restored, nbytes = _restore_dcp(args, app)
    world = world_token()
    rec.write("start", world=world, size=size, restored_step=restored, restore_s=time.monotonic() - begin,
              bytes_read=nbytes)
    shares = Shares(args.data, args.global_batch)
    save_group = dist.new_group(backend="gloo")  # async_save's own group (the tutorial's advice)
    step, every, pending = restored or 0, None, None  # pending: the save in flight (a Future)
    while step < args.steps:
        check_device(args.faults, host, device)
        started = time.monotonic()
        ids, tokens = shares.get(step, size, rank)
        loss = train_step(model, tokens, args.step_ms)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        step_s = time.monotonic() - started
        rec.write("step", step=step, loss=loss, n=len(ids), dp=size, rank=rank, world=world)
        if step < args.steps and (every is None or step % every == 0):
            if pending is not None:
                pending.result()  # type: ignore[union-attr]
            began = time.monotonic()
            pending = dcp.async_save({"app": app}, checkpoint_id=str(args.checkpoints / f"step-{step}"),
                                     process_group=save_group)
            blocked = time.monotonic() - began
            rec.write("saved", step=step, blocked_s=blocked)
            if every is None:  # the first save of this world sets the interval: its cost within 5% of the steps
                agreed = torch.tensor([blocked, step_s], dtype=torch.float64)
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                every = max(1, int(-(-float(agreed[0]) // (BUDGET * float(agreed[1])))))
                rec.write("interval", every=every)
    if pending is not None:
        pending.result()  # type: ignore[union-attr]
    dist.barrier()
    dist.destroy_process_group()


def _device() -> str:
    """This worker's device: the node's healthy devices (GOODPUT_DEVICES, set by the driver) at LOCAL_RANK."""
    devices = os.environ.get("GOODPUT_DEVICES", "0,1").split(",")
    return devices[int(os.environ.get("LOCAL_RANK", "0"))]


def run_torchft(args: argparse.Namespace) -> None:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    host, device = os.environ["GOODPUT_HOST"], os.environ["GOODPUT_DEVICE"]
    rec = Record(args.record, "torchft", host, device)
    model, optimizer = build()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the replica group's own
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    manager = Manager(
        pg=pg, min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), optimizer.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"goodput_{host}_{device}", timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")),
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
        init_sync=False)  # the docs: False when every replica seeds the same initial weights (we do)
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, optimizer)
    shares = Shares(args.data, args.global_batch)
    rec.write("start", world=f"replica-{host}-{device}", size=None, restored_step=None, restore_s=0.0, bytes_read=0)
    while manager.current_step() < args.steps:
        check_device(args.faults, host, device)
        opt.zero_grad()  # starts the quorum
        step = manager.current_step()
        rank, participants = manager.participating_rank(), manager.num_participants()
        healing = rank is None or not manager.is_participating()  # a healer's gradients are zeroed
        ids, tokens = shares.get(step, participants, rank or 0)
        try:
            loss = train_step(ddp, tokens, args.step_ms)
        except AssertionError as e:
            # torchft 0.2.0's DDP comm hook asserts when the allreduce failed (a peer gone; its work's wait
            # returned False; cf. torchft issue 295): hand the error to the Manager, which drops the step (its
            # documented report_error), and wrap the model anew (the failed hook left DDP's reducer mid-reduction).
            manager.report_error(e)
            ddp = DistributedDataParallel(manager, model)
            loss = float("nan")
        opt.step()  # commits (should_commit) or drops the step
        if healing and manager.current_step() > 0:
            rec.write("heal", step=manager.current_step(), bytes_read=state_bytes(model, optimizer))
        if not healing and manager.current_step() == step + 1:
            # committed: the quorum agreed on the step (should_commit), so it counts even if a participant dies
            # before it writes its own record
            rec.write("step", step=step + 1, loss=loss, n=len(ids), dp=participants, rank=rank,
                      world=f"quorum-{manager._quorum_id}", committed=True)
    manager.shutdown(wait=False)
