"""The job every mode of ``tenplex bench goodput`` trains: model, data shares, records, the emulated GPU.

Every mode trains the same model (seeded), on the same global batches (the packed dataset's order, split into
equal contiguous shares as :mod:`tenplex.dataset.state` defines them), and sleeps ``--step-ms`` per step: the
emulated accelerator time, so that two shared cores do not decide the result. Each rank appends JSON lines to
``RECORD/rank-HOST-DEVICE-PID.jsonl`` (``start``, ``step`` with its local loss and share, ``saved``, ``heal``) that
:mod:`tenplex.bench.goodput_account` reads. A GPU fault is the file ``FAULTS/HOST-DEVICE``: the worker on that
device raises the CUDA error torch would raise, and the device stays broken.

May import: torch, numpy, ``tenplex.dataset``, ``tenplex.elastic`` (``faults``, ``devices``; the Job it is given)
and the standard library.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

VOCAB = 64
IMPORTED = time.time()  # this module's imports (torch's the bulk) are done: a start-up phase


def process_started() -> float:
    """When this process started (wall clock), from the kernel's record of it: the first start-up phase."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # since boot
    uptime = float(Path("/proc/uptime").read_text().split()[0])  # 10 ms resolution (/proc/stat's btime: 1 s)
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


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
        if event == "start":  # this process's start-up phases (wall clock), for the accounting's breakdown
            doc["phases"] = {"process": process_started(), "imported": IMPORTED, **doc.get("phases", {}),
                             "started": time.time()}
        self.file.write(json.dumps({"event": event, "time": time.time(), **self.base, **doc}) + "\n")
        self.file.flush()


def run_worlds(args, job, train_world) -> None:
    """The tenplex modes' loop form (``for world in job.worlds(): with world: ...``) around ``train_world(args,
    job, world, record, device)``: one world per process under ``tenplex run`` (a change restarts the workers), a
    new world per change in the same process under ``tenplex run --in-place``; every save recorded."""
    from tenplex.elastic.devices import worker_device

    device = worker_device() or os.environ.get("LOCAL_RANK", "0")
    rec = Record(args.record, args.mode, job.host, device)
    job.on_save = lambda info: rec.write("saved", step=info["step"], blocked_s=info.get("seconds", 0.0),
                                         why=info.get("why"))
    for world in job.worlds():
        with world:
            train_world(args, job, world, rec, device)
    job.finish()


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
