"""One rank of the snapshot-boundary test: snapshots every step, the collectives each one runs at the boundary.

Usage: ``python snapshot_boundary_worker.py SPEC.json`` under ``tenplex.runtime.launch.run_job`` (three ranks on two
hosts). Every rank holds the whole model (a data-parallel replica: the first rank of each host writes it), trains
with Adam on gradients that are a pure function of the step (but for a frozen parameter), and draws from its RNG
every step (so its streams change, as dropout's would). At step boundary ``i`` it records its RNG streams and then
calls ``async_save``, counting the collectives it runs meanwhile (``all_gather``, ``all_reduce``, ``broadcast``,
``barrier``), and records its state (parameters and Adam moments, exactly: float32 values as JSON numbers). Before
snapshot ``spec["swap_at"]`` rank 2 (the writer of host h1) gives its bias new memory (``.data`` replaced, the same
values: the state's description does not change); before snapshot ``spec["change_at"]`` every rank registers a new
buffer (the state's structure changes), which from then on holds values of its own on every rank (as BatchNorm's
statistics under DDP). ``wait_snapshot`` after ``spec["settle_at"]`` snapshots and at the end; then it looks for
every key any snapshot of the run may have left in the job's key-value store (every version's, every RNG
generation's, under each key prefix the snapshots used). Results: ``result_r{R}.json`` under ``spec["out"]``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import tenplex
from tenplex.integration.nontensor import capture_rng
from tenplex.integration.process_group import init_process_group, leave_process_group

COUNTED = ("all_gather", "all_reduce", "broadcast", "barrier")


def count_collectives() -> dict[str, int]:
    """Count the calls of the collectives above from now on (the returned dict, updated in place)."""
    calls = {"n": 0}
    for name in COUNTED:
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            calls["n"] += 1
            return _original(*args, **kwargs)
        setattr(dist, name, counted)
    return calls


def candidate_keys(prefixes: list[str], snapshots: int) -> list[str]:
    """Every key the snapshots of this run may have written (:mod:`tenplex.integration.snapshot_agree`)."""
    names = ["prepared", "decision", "error", "canonical/0", *(f"step/{r}" for r in range(3))]
    keys = [f"{p}/{v}/{n}" for p in prefixes for v in range(1, snapshots + 1) for n in names]
    return keys + [f"{p}/rng/{r}/{g}" for p in prefixes for r in range(3) for g in range(snapshots + 1)]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # every rank's streams differ
    model = torch.nn.Linear(4, 3)
    model.frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)  # no step changes it: linked
    with torch.no_grad():
        model.weight.copy_(torch.arange(12, dtype=torch.float32).view(3, 4) / 10)
        model.bias.zero_()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt = tenplex.Checkpointer(replicas=0, keep=50)
    kv = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                       timeout=timedelta(seconds=30))
    calls = count_collectives()
    boundaries, settled, futures, prefixes = [], [], [], set()
    for i in range(1, spec["snapshots"] + 1):
        torch.rand(1)  # the step uses the RNG
        model.weight.grad = torch.sin(torch.arange(12, dtype=torch.float32).view(3, 4) * i)
        model.bias.grad = torch.cos(torch.arange(3, dtype=torch.float32) * i)
        optimizer.step()
        if i == spec["swap_at"] and rank == 2:
            model.bias.data = model.bias.data.clone()  # the same values in new memory
        if i == spec["change_at"]:
            model.register_buffer("seen", torch.zeros(2))
        if i >= spec["change_at"]:  # a buffer each rank updates from its own data (BatchNorm's statistics do)
            model.seen.fill_(10.0 * i + rank)
        rng, state = capture_rng(), {name: t.tolist() for name, t in model.state_dict().items()}
        for name, param in model.named_parameters():
            state.update({f"optim.{k}.{name}": v.tolist() for k, v in optimizer.state[param].items() if v.dim()})
        before = calls["n"]
        futures.append(ckpt.async_save(model, optimizer, step=i))
        stats = ckpt.snapshot_stats()
        prefixes.add(ckpt._snapshots._world_key)  # type: ignore[union-attr]
        boundaries.append({"step": i, "rng": rng, "state": state, "collectives": calls["n"] - before,
                           "version": stats["staged_version"], "exchanges": stats["exchanges"],
                           "previous_done": [f.done() for f in futures[:-1]]})
        if i in (spec["settle_at"], spec["snapshots"]):
            ckpt.wait_snapshot()
            settled.append({"after": i, "stats": ckpt.snapshot_stats()})
    left = [key for key in candidate_keys(sorted(prefixes), spec["snapshots"]) if kv.check([key])]
    outcomes = [f.result() if f.exception() is None else str(f.exception()) for f in futures]
    Path(spec["out"], f"result_r{rank}.json").write_text(json.dumps(
        {"boundaries": boundaries, "settled": settled, "outcomes": outcomes, "left": left,
         "newest_prefix": ckpt._snapshots._world_key}))  # type: ignore[union-attr]
    ckpt.close()
    del kv
    leave_process_group()


if __name__ == "__main__":
    main()
