"""The training job of ``tenplex bench goodput``: one program, run by every mode in the way that mode runs it.

    python goodput_worker.py MODE --data DIR --record DIR --steps N [--step-ms MS] …

MODE is ``tenplex`` (under ``tenplex run``, through :class:`tenplex.elastic.Job`), ``dcp`` (under torchrun, with
PyTorch Distributed Checkpoint as its documentation shows it), ``torchft`` (one replica group per process, its
``Manager`` and ``DistributedDataParallel`` as torchft's ``train_ddp.py`` shows them) or ``reference`` (one
process, every step, no events: the losses every mode must reproduce).

Every mode trains the same model (seeded), on the same global batches (the packed dataset's order, split into
equal contiguous shares as :mod:`tenplex.dataset.state` defines them), and sleeps ``--step-ms`` per step: the
emulated accelerator time, so that two shared cores do not decide the result. Each rank appends JSON lines to
``RECORD/rank-HOST-DEVICE-PID.jsonl`` (``start``, ``step`` with its local loss and share, ``saved``, ``heal``) that
:mod:`tenplex.bench.goodput_account` reads. A GPU fault is the file ``FAULTS/HOST-DEVICE``: the worker on that
device raises the CUDA error torch would raise, and the device stays broken.

May import: torch, torchft (its mode only), ``tenplex.elastic`` (``Job``, ``entry``, ``faults``), ``tenplex.dataset``
and the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

VOCAB = 64


class NextToken(torch.nn.Module):
    """examples/03-ddp-elastic's model: small enough that the emulated accelerator time dominates a step."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.mix = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.GELU())
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(tokens)))


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = NextToken()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters and the optimizer's tensors: what a restore or a heal must bring in."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for s in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
    return total


class Shares:
    """This rank's share of the global batch at a step: the packed dataset's order (seed, epoch), each global batch
    split into ``dp`` contiguous micro-batches (:mod:`tenplex.dataset.state`), as ``Job.batch`` reads it."""

    def __init__(self, dataset: str, global_batch: int, seed: int = 0):
        from tenplex.dataset import DatasetState, open_dataset

        self.info = open_dataset(dataset)
        self.state0 = DatasetState(self.info.identity, self.info.num_samples, seed, 0, global_batch)
        self.readers: dict[tuple[int, int, int], tuple[int, Any, list[list[int]]]] = {}

    def get(self, step: int, dp: int, rank: int) -> tuple[list[int], torch.Tensor]:
        from tenplex.dataset.reader import FallbackRankReader

        state = self.state0.advance(step)
        key = (state.epoch, dp, rank)
        if key not in self.readers:  # one reader per epoch and split: it holds the rest of that epoch
            reader = FallbackRankReader(self.info, state, dp, rank)
            self.readers = {key: (step, reader, list(reader.batches()))}
        first, reader, batches = self.readers[key]
        positions = batches[step - first]
        ids = [int(reader.sample_ids[i]) for i in positions]
        rows = np.stack([reader.get(i) for i in positions]).astype(np.int64)
        return ids, torch.from_numpy(rows)  # (share, seq + 1) tokens


class Record:
    """One rank's JSON lines."""

    def __init__(self, folder: Path, mode: str, host: str, device: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.base = {"mode": mode, "host": host, "device": device, "pid": os.getpid()}
        self.file = open(folder / f"rank-{host}-{device}-{os.getpid()}.jsonl", "a")

    def write(self, event: str, **doc) -> None:
        self.file.write(json.dumps({"event": event, "time": time.time(), **self.base, **doc}) + "\n")
        self.file.flush()


def check_device(faults: Path | None, host: str, device: str) -> None:
    """Raise the CUDA error of a failed GPU when the trace broke this worker's device (it stays broken)."""
    if faults is not None and (faults / f"{host}-{device}").exists():
        from tenplex.elastic.faults import INJECTED_TEXT

        raise RuntimeError(INJECTED_TEXT)


def train_step(model: torch.nn.Module, tokens: torch.Tensor, step_ms: float) -> float:
    """Forward and backward on this rank's share, then the emulated accelerator time; the local mean loss."""
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()  # DDP averages the gradients of equal shares: the global batch's mean gradient
    time.sleep(step_ms / 1000)
    return float(loss.detach())


def run_reference(args: argparse.Namespace) -> None:
    model, optimizer = build()
    shares = Shares(args.data, args.global_batch)
    rec = Record(args.record, "reference", "h0", "0")
    rec.write("start", world="reference", size=1, restored_step=None, restore_s=0.0, bytes_read=0)
    for step in range(args.steps):
        ids, tokens = shares.get(step, 1, 0)
        loss = train_step(model, tokens, args.step_ms)
        optimizer.step()
        optimizer.zero_grad()
        rec.write("step", step=step + 1, loss=loss, n=len(ids), dp=1, world="reference")


def run_tenplex(args: argparse.Namespace) -> None:
    import tenplex.elastic
    from tenplex.elastic.devices import worker_device
    from torch.nn.parallel import DistributedDataParallel

    # save_every None: snapshots at the interval that keeps their cost within 5% of the step time (Job's default).
    job = tenplex.elastic.Job(dataset=args.data, global_batch=args.global_batch, max_tp=1)
    device = worker_device() or os.environ.get("LOCAL_RANK", "0")
    rec = Record(args.record, "tenplex", job.host, device)
    job.on_save = lambda info: rec.write("saved", step=info["step"], blocked_s=info.get("seconds", 0.0),
                                         why=info.get("why"))
    model, optimizer = build()
    model = DistributedDataParallel(model, process_group=job.group)
    job.restore(model, optimizer)
    r = job.restored
    restored = r.step if r.version is not None else None
    moved = r.plan_stats.get("intra_host_bytes", 0) + r.plan_stats.get("inter_host_bytes", 0)
    rec.write("start", world=job.world_id, size=job.world_size, restored_step=restored, restore_s=r.seconds,
              bytes_read=state_bytes(model, optimizer) if restored is not None else 0, moved_bytes=moved)
    dp, rank = job.config.dp, job.coords["dp"]
    while job.step < args.steps:
        check_device(args.faults, job.host, device)
        batch = job.batch()
        loss = train_step(model, batch.data.long(), args.step_ms)
        optimizer.step()
        optimizer.zero_grad()
        rec.write("step", step=job.step + 1, loss=loss, n=len(batch.ids), dp=dp, rank=rank, world=job.world_id)
        job.step_done()
    job.finish()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("tenplex", "dcp", "torchft", "reference"))
    p.add_argument("--data", required=True, help="packed dataset directory")
    p.add_argument("--record", type=Path, required=True, help="folder of the ranks' JSON lines")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-ms", type=float, default=500.0, help="emulated accelerator time per step")
    p.add_argument("--global-batch", type=int, default=840)
    p.add_argument("--faults", type=Path, default=None, help="folder of the broken devices' files")
    p.add_argument("--checkpoints", type=Path, default=None, help="dcp: the checkpoint folder (shared storage)")
    p.add_argument("--lighthouse", default=None, help="torchft: the lighthouse's address")
    p.add_argument("--timeout", type=float, default=5.0, help="torchft: the process group's timeout")
    args = p.parse_args()
    if args.mode == "reference":
        run_reference(args)
    elif args.mode == "tenplex":
        run_tenplex(args)
    elif args.mode == "dcp":
        from tenplex.bench.goodput_peers import run_dcp

        run_dcp(args)
    else:
        from tenplex.bench.goodput_peers import run_torchft

        run_torchft(args)


if __name__ == "__main__":
    main()
