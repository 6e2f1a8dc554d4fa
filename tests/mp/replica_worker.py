"""One rank of a replication test job: a small row-sharded model, saved and restored through tenplex.

Usage: ``python replica_worker.py SPEC.json`` under ``tenplex.runtime.launch.run_job``
(RANK, WORLD_SIZE, TENPLEX_HOST, TENPLEX_DEVICE, TENPLEX_STORE_ROOT are set; TENPLEX_STORES
is empty). The rank learns only its own host's store address, as ``tenplex run`` gives it
(``TENPLEX_STORE_ADDRESS``); every other address must come from what saves recorded.

The model: ``w`` of global shape [ROWS, COLS], split by rows over the ranks (annotated
plain tensors, Megatron-style), and ``b`` of shape [COLS] on every rank; Adam. The parameters named in
``spec["frozen"]`` are frozen (no gradient, no optimizer state). Gradients
are a pure function of (step, global position), so the state after N steps is the same
under every world size. Ops (``spec["ops"]``, run in order):

* ``train``: ``steps`` optimizer steps;
* ``save``: save at the current step; dump the rank's local state (``saved_step{S}_r{R}``);
* ``wait_replicated``: record ``Checkpointer.wait_replicated`` and this rank's copier status;
* ``snapshot``: ``Checkpointer.async_save`` at the current step, dump the local state
  (``snap_step{S}_r{R}``), then train one step at once (the tensors change while the write runs);
  record the snapshot stats, the live snapshot threads and the earlier futures' versions. With
  ``slow_write: SECONDS`` every shard write sleeps first; with ``die_in_write_on_rank: R`` rank R
  dies (exit 9) a second after its first shard write, before its part is prepared;
* ``wait_snapshot``: ``Checkpointer.wait_snapshot``; record the futures' outcomes and the store's versions;
* ``fill_disk`` / ``free_disk`` (on rank ``rank``): fill the file system with the file ``path``, delete it;
* ``leave_unsettled``: write the results, wait for this rank's write, linger, exit without settling;
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
import threading
import time
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
    if model.w.requires_grad:
        model.w.grad = torch.sin((rows * COLS + cols + 1) * (step + 1)).float()
    if model.b.requires_grad:
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


def slow_writes(seconds: float) -> None:
    """Make this rank's shard writes slow (a busy disk)."""
    from tenplex.store.writer import VersionWriter

    put = VersionWriter.put

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return put(self, *args, **kwargs)
    VersionWriter.put = slow  # type: ignore[method-assign]


def die_in_write() -> None:
    """Kill this rank in the middle of its background write: after its first shard, before its part is prepared."""
    from tenplex.store.writer import VersionWriter

    put = VersionWriter.put

    def die(self, *args, **kwargs):
        put(self, *args, **kwargs)
        time.sleep(1.0)  # the other ranks prepare meanwhile: they must not commit without this one
        os._exit(9)
    VersionWriter.put = die  # type: ignore[method-assign]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = os.environ["TENPLEX_HOST"]
    if host in spec["stores"]:
        os.environ["TENPLEX_STORE_ADDRESS"] = spec["stores"][host]
    out = Path(spec["out"])
    rows = ROWS // world
    model = RowSharded(rank * rows, (rank + 1) * rows)
    for name in spec.get("frozen", []):
        getattr(model, name).requires_grad_(False)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt = tenplex.Checkpointer(replicas=spec.get("replicas"), keep=spec.get("keep", 2))
    step, results, futures = 0, [], []
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
        elif kind == "snapshot":
            if op.get("slow_write"):  # back-pressure: this rank's background write takes a while
                slow_writes(op["slow_write"])
            if op.get("die_in_write_on_rank") == rank:
                die_in_write()
            future = ckpt.async_save(model, optimizer, step=step, annotations=model.annotations())
            snapped = step
            save_file(local_state(model, optimizer), str(out / f"snap_step{snapped}_r{rank}.safetensors"))
            train_step(model, optimizer, step)  # the tensors change at once, in place, while the write runs
            step += 1
            stats = ckpt.snapshot_stats()
            results.append({"op": kind, "step": snapped, "stats": stats,
                            "threads": sorted(t.name for t in threading.enumerate()
                                              if t.name.startswith("tenplex-snapshot") and t.is_alive()),
                            "previous_done": [f.done() and f.exception() is None and f.result() for f in futures]})
            futures.append(future)
        elif kind == "wait_snapshot":
            version = ckpt.wait_snapshot()
            outcomes = [None if not f.done() else (f.result() if f.exception() is None else str(f.exception()))
                        for f in futures]
            results.append({"op": kind, "version": version, "outcomes": outcomes, "stats": ckpt.snapshot_stats(),
                            "versions": Store(os.environ["TENPLEX_STORE_ROOT"], host).versions()})
        elif kind == "fill_disk" and rank == op["rank"]:  # the store's file system full: writes get ENOSPC
            with open(op["path"], "wb", buffering=0) as filler:
                try:
                    while True:
                        filler.write(b"\0" * 4096)
                except OSError:
                    pass
        elif kind == "free_disk" and rank == op["rank"]:
            os.unlink(op["path"])
        elif kind in ("fill_disk", "free_disk"):
            pass
        elif kind == "leave_unsettled":  # a killed job: nothing settles what is in flight
            (out / f"result_r{rank}.json").write_text(json.dumps(results))
            if ckpt._snapshots is not None and ckpt._snapshots.inflight is not None:
                ckpt._snapshots.inflight.written.wait(60)
                time.sleep(op.get("linger", 1.0))  # time for a wrong commit to happen
            os._exit(0)
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
