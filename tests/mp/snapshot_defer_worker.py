"""One rank of the deferred-staging test: snapshots every step whose copies the writer thread makes late.

Usage: ``python snapshot_defer_worker.py SPEC.json`` under ``tenplex.runtime.launch.run_job`` (two ranks on two
hosts: each is its host's writer of the replicated model). The model has a BatchNorm (its statistics change in
every forward), the optimizer is Adam, and every step's data are a pure function of the step. The writer thread's
work for a snapshot (:class:`tenplex.integration.snapshot_defer.Capture`) starts only once the training thread is
in the next ``optimizer.step()``'s hook (or done training), so the next step's forward and backward always come
before the copies are made, and that step always waits for them. At each
boundary the rank records its exact state (model state dict and optimizer state, cloned) before ``async_save``.
After the boundary of step ``spec["torn_at"]`` the loop changes a weight in place outside ``optimizer.step()``
(while that snapshot's copies wait). At the end every committed version is restored into a fresh model and
optimizer and compared with the recorded state of its step, tensor by tensor. Results: ``result_r{R}.json``.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

import tenplex
from tenplex.integration import snapshot_defer
from tenplex.integration.process_group import init_process_group, leave_process_group


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def train_step(model, optimizer, step: int) -> None:
    x = torch.sin(torch.arange(32, dtype=torch.float32).view(8, 4) * step)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def exact_state(model, optimizer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, param_state in optimizer.state_dict()["state"].items():
        state.update({f"optim.{i}.{k}": torch.as_tensor(v).clone() for k, v in param_state.items()})
    return state


def mismatches(expected: dict[str, torch.Tensor], model, optimizer) -> list[str]:
    found = exact_state(model, optimizer)
    if set(found) != set(expected):
        return sorted(set(found) ^ set(expected))
    return sorted(k for k in expected if not torch.equal(found[k], expected[k]))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_process_group("gloo")
    rank = dist.get_rank()
    in_hook = threading.Event()  # the training thread waits for a capture (the step hook), or trains no more
    capture, wait = snapshot_defer.Capture.run, snapshot_defer.DeferredStaging.wait

    def late(self):
        in_hook.wait(120)
        in_hook.clear()
        return capture(self)

    def waiting(self, timeout=None):
        in_hook.set()
        return wait(self, timeout)
    snapshot_defer.Capture.run = late  # type: ignore[method-assign]
    snapshot_defer.DeferredStaging.wait = waiting  # type: ignore[method-assign]

    model, optimizer = build()
    ckpt = tenplex.Checkpointer(replicas=0, keep=50)
    boundaries, futures, references = [], [], {}
    for step in range(1, spec["steps"] + 1):
        train_step(model, optimizer, step)
        references[step] = exact_state(model, optimizer)
        futures.append(ckpt.async_save(model, optimizer, step=step))
        if step == spec["torn_at"]:
            with torch.no_grad():  # outside optimizer.step(): an in-place change the copy must not mix in
                model[0].weight.mul_(1.5)
        stats = ckpt.snapshot_stats()
        boundaries.append({"step": step, "version": stats["staged_version"], "exchanges": stats["exchanges"]})
    in_hook.set()  # no next step: the last capture goes on
    ckpt.wait_snapshot()
    stats = ckpt.snapshot_stats()
    outcomes = [f.result() if f.exception() is None else str(f.exception()) for f in futures]
    hooked = len(optimizer._optimizer_step_pre_hooks)  # type: ignore[attr-defined]
    restored = []
    for step, outcome in enumerate(outcomes, start=1):
        if isinstance(outcome, int):
            fresh, fresh_optimizer = build()
            ckpt.restore(fresh, fresh_optimizer, version=outcome, rng=False)
            restored.append({"step": step, "version": outcome,
                             "mismatches": mismatches(references[step], fresh, fresh_optimizer)})
    ckpt.close()
    Path(spec["out"], f"result_r{rank}.json").write_text(json.dumps(
        {"boundaries": boundaries, "outcomes": outcomes, "restored": restored, "hooks_before_close": hooked,
         "hooks_after_close": len(optimizer._optimizer_step_pre_hooks),  # type: ignore[attr-defined]
         "stats": {k: stats[k] for k in ("step_waited_s", "deferred_bytes", "staging_bytes", "committed", "failed",
                                         "snapshots")}}))
    leave_process_group()


if __name__ == "__main__":
    main()
