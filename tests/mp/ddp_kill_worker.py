"""One rank of the lost-host test: data-parallel training through tenplex.elastic.Job, snapshots every step.

Usage: ``python ddp_kill_worker.py OUT STEPS`` under ``tenplex run`` (one worker per node). The model is a float64
linear layer with SGD and momentum; the global batch of 6 samples at step ``s`` is a pure function of ``s``. Each
rank computes its samples' gradients; the ranks all-reduce them per sample (one sample's value plus zeros: exact)
and every rank adds them up in global sample order, so every update is bit for bit the same under any number of
ranks (what DDP computes, without its order-dependent sum). :func:`reference` is the same training in one process.

Per host it appends to ``OUT/{host}.jsonl``: one ``restored`` line per world (world, rank, step, version) and one
line per finished step (world, step, loss, the sample ids it trained, ``save_cost()``'s committed and protected
steps); rank 0 of each world dumps the state right
after restoring (``OUT/restored-{world}.safetensors``) and after every step (``OUT/state-{step}-{world}...``).
Before step ``s`` listed in ``OUT/holds`` every rank writes ``OUT/held-{s}-{host}`` (its world) and waits for
``OUT/go-{s}``: the test kills a node meanwhile. Two hooks put a kill where the test wants it, in the worlds that
restored an earlier step: the other ranks' hosts do not commit the snapshot of the step in ``OUT/late-commit``
(their commit waits 120 s: the decision was made, only the rank-0 host committed), and rank 0's snapshot writes
of the steps after the one in ``OUT/slow`` first mark ``OUT/writing`` and sleep 60 s (a kill in the middle of a
background write).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors.torch import save_file

BATCH, IN, OUT_F = 6, 4, 3


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(-2, 3, (BATCH, IN), generator=g).double()
    return x, torch.randint(-2, 3, (BATCH, OUT_F), generator=g).double()


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(IN, OUT_F).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for p in model.parameters():  # momentum buffers exist from the start: every saved state has them
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return model, optimizer


def train_step(model, optimizer, step: int, mine: list[int], reduce: Callable[[torch.Tensor], None]) -> float:
    """One step on the samples ``mine`` of the global batch; the global loss (sum over the batch)."""
    x, y = batch(step)
    grads = [torch.zeros(BATCH, *p.shape, dtype=torch.float64) for p in model.parameters()]
    losses = torch.zeros(BATCH, dtype=torch.float64)
    for i in mine:
        model.zero_grad()
        loss = (model(x[i]) - y[i]).square().sum()
        loss.backward()
        losses[i] = loss.detach()
        for g, p in zip(grads, model.parameters()):
            g[i] = p.grad
    for t in [*grads, losses]:
        reduce(t)
    for g, p in zip(grads, model.parameters()):
        p.grad = sum(g[i] for i in range(BATCH)) / BATCH  # in global sample order, on every rank
    optimizer.step()
    return float(sum(losses[i] for i in range(BATCH)))


def state(model, optimizer) -> dict[str, torch.Tensor]:
    found = {f"param.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        found[f"momentum.{i}"] = optimizer.state[p]["momentum_buffer"].clone()
    return found


def reference(steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses of steps 1..steps and the state after steps 0..steps, uninterrupted, in one process."""
    model, optimizer = build()
    losses, states = [], [state(model, optimizer)]
    for step in range(steps):
        losses.append(train_step(model, optimizer, step, list(range(BATCH)), lambda t: None))
        states.append(state(model, optimizer))
    return losses, states


def hooks(out: Path, job) -> None:
    """The test's hooks (see the module docstring), in a world that restored a step before theirs."""
    from tenplex.store import Store
    from tenplex.store.writer import VersionWriter

    late = out / "late-commit"
    if job.rank != 0 and late.exists() and job.step < int(late.read_text()):
        late_step, commit = int(late.read_text()), Store.commit

        def late_commit(self, version, *args, **kwargs):
            docs = list((self.root / "staging" / str(version)).glob("*/json/tenplex.torch_state.json"))
            if docs and json.loads(docs[0].read_text())["step"] == late_step:
                time.sleep(120)  # the test kills the rank-0 host meanwhile: this host never commits it
            return commit(self, version, *args, **kwargs)
        Store.commit = late_commit  # type: ignore[method-assign]
    slow = out / "slow"
    if job.rank == 0 and slow.exists() and job.step < int(slow.read_text()):
        after, put = int(slow.read_text()), VersionWriter.put

        def slow_put(self, *args, **kwargs):
            if job.step > after:
                (out / "writing").touch()
                time.sleep(60)
            return put(self, *args, **kwargs)
        VersionWriter.put = slow_put  # type: ignore[method-assign]


def main() -> None:
    import tenplex.elastic

    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    holds = [int(s) for s in (out / "holds").read_text().split(",")]
    job = tenplex.elastic.Job(global_batch=BATCH, max_tp=1, save_every=1, timeout=30)
    model, optimizer = build()
    job.restore(model, optimizer)
    dp, world = job.config.dp, job.world_id
    log = open(out / f"{job.host}.jsonl", "a")
    log.write(json.dumps({"restored": job.step, "world": world, "rank": job.rank, "at": time.time(),
                          "version": job.restored.version}) + "\n")
    log.flush()
    if job.rank == 0:
        save_file(state(model, optimizer), out / f"restored-{world}.safetensors")
    hooks(out, job)
    mine = list(range(job.coords["dp"] * BATCH // dp, (job.coords["dp"] + 1) * BATCH // dp))
    while job.step < steps:
        if job.step in holds:
            (out / f"held-{job.step}-{job.host}").write_text(world)
            deadline = time.monotonic() + 120
            while not (out / f"go-{job.step}").exists() and not job.stop_requested and time.monotonic() < deadline:
                time.sleep(0.05)
        loss = train_step(model, optimizer, job.step, mine, dist.all_reduce)
        job.step_done()
        cost = job.save_cost()
        log.write(json.dumps({"world": world, "step": job.step, "loss": loss,
                              "ids": [(job.step - 1) * BATCH + i for i in mine], "committed": cost["committed_step"],
                              "protected": cost["protected_step"]}) + "\n")
        log.flush()
        if job.rank == 0:
            save_file(state(model, optimizer), out / f"state-{job.step}-{world}.safetensors")
    job.finish()


if __name__ == "__main__":
    main()
