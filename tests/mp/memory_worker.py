"""A worker of tests/test_elastic_inplace_memory.py: restores from memory between layouts, one rank of two.

Usage: ``python memory_worker.py DIR RANK``. Rank r is device hr/0 of host hr, whose store (DIR/hr) it serves
itself; the two ranks form a gloo group (file:// under DIR). A float64 model {w: [8, 6], b: [8]} with Adam
(foreach off: elementwise, so a shard trains exactly as its part of the whole) goes through six restores, each
from a new Checkpointer as a new world's would be, with the state the rank kept of the old "world" in memory
(:class:`tenplex.integration.memory.Kept`):

A. tp=2 (rows split by annotations) -> every rank the whole (dp=2): half from memory, half from the other host;
B. dp=2 -> dp=2 (pure data parallelism): everything from memory;
C. as B, but the kept ``w`` was changed after the capture: everything from this host's store;
D. memory of another version: nothing from memory;
E. dp=2 -> tp=2: a rank needs half of what it holds: everything from memory;
F. rows sharded by DTensor placements (holding B's version, stored whole on each host) -> every rank the whole:
   half from memory, half from this host's store.

After each restore the state is compared bit for bit with an uninterrupted run's. Prints one JSON line:
{"bytes": {case: RestoreInfo.bytes}, "equal": {case: bool}, "read_through": {case: bool}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tenplex.integration import Annotation, Checkpointer
from tenplex.integration.exchange import all_gather_json
from tenplex.integration.memory import Kept
from tenplex.integration.process_group import init_process_group, leave_process_group
from tenplex.store import Store
from tenplex.store.server import serve

ROWS, COLS = 8, 6


class Model(torch.nn.Module):
    """The rows [lo, hi) of w and b."""

    def __init__(self, lo: int = 0, hi: int = ROWS):
        super().__init__()
        rows = torch.arange(lo, hi, dtype=torch.float64)
        self.w = torch.nn.Parameter(rows[:, None] * 0.1 + torch.arange(COLS, dtype=torch.float64) * 0.01)
        self.b = torch.nn.Parameter(rows * -0.05)
        self.lo, self.hi = lo, hi

    def annotations(self) -> dict[str, Annotation]:
        return {"w": Annotation((ROWS, COLS), (self.lo, 0)), "b": Annotation((ROWS,), (self.lo,))}


def dtensor_model() -> Model:
    """The whole model's w and b as DTensors sharded by rows over both ranks (each holds its half)."""
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    mesh, model = DeviceMesh("cpu", [0, 1]), Model()
    model.w = torch.nn.Parameter(distribute_tensor(model.w.detach(), mesh, [Shard(0)]))
    model.b = torch.nn.Parameter(distribute_tensor(model.b.detach(), mesh, [Shard(0)]))
    return model


def train(model: Model, optimizer: torch.optim.Optimizer, steps: range) -> None:
    """Gradients that depend only on the global element and the step: every layout trains the same values."""
    for step in steps:
        rows = torch.arange(model.lo, model.hi, dtype=torch.float64)
        model.w.grad = torch.sin(rows[:, None] * 0.7 + torch.arange(COLS, dtype=torch.float64) * 0.3 + step)
        model.b.grad = torch.cos(rows * 0.9 + step)
        optimizer.step()


def adam(model: Model) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)


def state(model: Model, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {name: p.detach() for name, p in (("w", model.w), ("b", model.b))}
    for name, p in (("w", model.w), ("b", model.b)):
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}.{name}"] = optimizer.state[p][key]
    return out


def equal_to_reference(model: Model, optimizer, steps: int) -> bool:
    reference = Model()
    ref_optimizer = adam(reference)
    train(reference, ref_optimizer, range(steps))
    mine, ref = state(model, optimizer), state(reference, ref_optimizer)
    return all(torch.equal(v, ref[k][model.lo:model.hi]) for k, v in mine.items())


def main() -> None:
    base, rank = Path(sys.argv[1]), int(sys.argv[2])
    init_process_group("gloo", init_method=f"file://{base / 'init'}", rank=rank, world_size=2)
    host = f"h{rank}"
    server, port = serve(Store(base / host, host))

    def checkpointer() -> Checkpointer:
        return Checkpointer(store_root=base / host, host=host, device=f"{host}/0", replicas=0,
                            store_address=f"127.0.0.1:{port}", coords={"dp": 0, "tp": rank})

    half = (rank * ROWS // 2, (rank + 1) * ROWS // 2)
    report: dict = {"bytes": {}, "equal": {}, "read_through": {}}

    def restore(case: str, model: Model, kept: Kept | None, steps: int, sharded: bool) -> torch.optim.Optimizer:
        ckpt, optimizer = checkpointer(), adam(model)
        assert ckpt.restore(model, optimizer, annotations=model.annotations() if sharded else None,
                            memory=kept) == steps
        report["bytes"][case] = ckpt.last_restore.bytes
        report["read_through"][case] = ckpt.last_restore.read_through
        report["equal"][case] = equal_to_reference(model, optimizer, steps)
        return optimizer

    # the old world: tp=2, two steps, saved
    sharded = Model(*half)
    optimizer = adam(sharded)
    train(sharded, optimizer, range(2))
    v1 = checkpointer().save(sharded, optimizer, step=2, annotations=sharded.annotations())
    kept_v1 = Kept.capture(sharded, optimizer, sharded.annotations(), v1)
    whole = Model()
    optimizer = restore("A", whole, kept_v1, 2, False)
    train(whole, optimizer, range(2, 3))
    v2 = checkpointer().save(whole, optimizer, step=3)
    kept_v2 = Kept.capture(whole, optimizer, None, v2)
    again = Model()
    b_optimizer = restore("B", again, kept_v2, 3, False)
    kept_b = Kept.capture(again, b_optimizer, None, v2)
    with torch.no_grad():
        again.w.add_(1.0)  # changed after the capture: no longer the saved version's values
    restore("C", Model(), kept_b, 3, False)
    restore("D", Model(), kept_v1, 3, False)
    restore("E", Model(*half), kept_v2, 3, True)
    distributed = dtensor_model()  # rows sharded by a DTensor's placements, holding v2 (restored from the stores)
    d_optimizer = adam(distributed)
    assert checkpointer().restore(distributed, d_optimizer) == 3
    restore("F", Model(), Kept.capture(distributed, d_optimizer, None, v2), 3, False)
    print(json.dumps(report), flush=True)
    all_gather_json(None)  # both ranks done with the other's store before it stops
    server.stop(None)
    leave_process_group()


if __name__ == "__main__":
    main()
