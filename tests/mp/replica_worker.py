"""One rank of a replication test job: a small row-sharded model, saved and restored through tenplex.

Usage: ``python replica_worker.py SPEC.json`` under ``tenplex.runtime.launch.run_job``
(RANK, WORLD_SIZE, TENPLEX_HOST, TENPLEX_DEVICE, TENPLEX_STORE_ROOT are set; TENPLEX_STORES
is empty). The rank learns only its own host's store address, as ``tenplex run`` gives it
(``TENPLEX_STORE_ADDRESS``); every other address must come from what saves recorded.

The model: ``w`` of global shape [ROWS, COLS], split by rows over the ranks (annotated
plain tensors, Megatron-style), and ``b`` of shape [COLS] on every rank; Adam. Gradients
are a pure function of (step, global position), so the state after N steps is the same
under every world size. Ops (``spec["ops"]``, run in order):

* ``train``: ``steps`` optimizer steps;
* ``save``: save at the current step; dump the rank's local state (``saved_step{S}_r{R}``);
* ``wait_replicated``: record ``Checkpointer.wait_replicated`` and this rank's copier status;
* ``restore``: restore; record the returned step and ``last_restore``, or the error's type and
  message; dump the local state afterwards (``restored_r{R}``) and the store's versions. With
  ``break_read_through_on_rank: R``, rank R's reads from other hosts' stores fail first.

Results: ``result_r{R}.json`` and safetensors files under ``spec["out"]``. Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import tenplex
from tenplex.integration.process_group import init_process_group, leave_process_group
from tenplex.store import Store

ROWS, COLS = 8, 6


class RowSharded(torch.nn.Module):
    def __init__(self, start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop
        rows = torch.arange(start, stop, dtype=torch.float32)[:, None]
        self.w = torch.nn.Parameter(rows * COLS + torch.arange(COLS, dtype=torch.float32))
        self.b = torch.nn.Parameter(torch.zeros(COLS))

    def annotations(self) -> dict:
        return {"w": tenplex.Annotation((ROWS, COLS), (self.start, 0))}


def train_step(model: RowSharded, optimizer, step: int) -> None:
    rows = torch.arange(model.start, model.stop, dtype=torch.float64)[:, None]
    cols = torch.arange(COLS, dtype=torch.float64)
    model.w.grad = torch.sin((rows * COLS + cols + 1) * (step + 1)).float()
    model.b.grad = torch.cos((cols + 1) * (step + 1)).float()
    optimizer.step()


def local_state(model: RowSharded, optimizer) -> dict[str, torch.Tensor]:
    state = {"w": model.w.detach().clone(), "b": model.b.detach().clone()}
    for name, param in (("w", model.w), ("b", model.b)):
        for key in ("exp_avg", "exp_avg_sq"):
            if key in optimizer.state.get(param, {}):
                state[f"{key}.{name}"] = optimizer.state[param][key].clone()
    return state


def break_read_through() -> None:
    """Make this rank's reads from other hosts' stores fail (the rest of the job stays real)."""
    from tenplex.integration.readthrough import RemoteVersion
    from tenplex.store.client import RemoteStoreError

    def fail(self, device, tensor, box, dest):
        raise RemoteStoreError(f"store {self.client.address}: injected read failure ({tensor!r} {box})")
    RemoteVersion.readinto = fail  # type: ignore[method-assign]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = os.environ["TENPLEX_HOST"]
    os.environ["TENPLEX_STORE_ADDRESS"] = spec["stores"][host]
    out = Path(spec["out"])
    rows = ROWS // world
    model = RowSharded(rank * rows, (rank + 1) * rows)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt = tenplex.Checkpointer(replicas=spec.get("replicas"), keep=spec.get("keep", 2))
    step, results = 0, []
    for op in spec["ops"]:
        kind = op["op"]
        if kind == "train":
            for _ in range(op["steps"]):
                train_step(model, optimizer, step)
                step += 1
            results.append({"op": kind, "step": step})
        elif kind == "save":
            version = ckpt.save(model, optimizer, step=step, annotations=model.annotations())
            save_file(local_state(model, optimizer), str(out / f"saved_step{step}_r{rank}.safetensors"))
            results.append({"op": kind, "step": step, "version": version, "rows": [model.start, model.stop]})
        elif kind == "wait_replicated":
            ok = ckpt.wait_replicated(op.get("timeout", 60))
            results.append({"op": kind, "ok": ok, "status": ckpt.replication_status(),
                            "hosts": ckpt.last_replication})
        elif kind == "restore":
            record = {"op": kind, "rows": [model.start, model.stop]}
            if op.get("break_read_through_on_rank") == rank:
                break_read_through()
            try:
                restored = ckpt.restore(model, optimizer, annotations=model.annotations())
                step = restored or 0
                record.update(step=restored, info=dataclasses.asdict(ckpt.last_restore))
            except Exception as e:  # noqa: BLE001 - the test checks the error
                record.update(error=type(e).__name__, message=str(e), trace=traceback.format_exc())
            save_file(local_state(model, optimizer), str(out / f"restored_r{rank}.safetensors"))
            record["versions"] = Store(os.environ["TENPLEX_STORE_ROOT"], host).versions()
            results.append(record)
        else:
            raise ValueError(f"unknown op {kind!r}")
    (out / f"result_r{rank}.json").write_text(json.dumps(results))
    ckpt.close()
    leave_process_group()


if __name__ == "__main__":
    main()
