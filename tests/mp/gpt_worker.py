"""One rank of a multi-process tenplex test: runs the phases of a JSON spec in one torch.distributed job (gloo).

Usage: ``python gpt_worker.py SPEC.json`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (``tenplex.runtime.launch.run_spec_job`` does that). Results go to files under each
phase's ``out`` directory: safetensors for tensors, JSON for the rest. Nothing
is pickled.

Phase kinds:

* ``save``: train ``steps`` steps under ``parallel`` from the seed, save with
  tenplex at that step, dump the full saved state (``saved_r{rank}.safetensors``),
  then keep training ``more`` steps (an uninterrupted run under this config);
* ``restore``: restore under ``parallel`` with tenplex, dump the full restored
  state, train ``more`` steps; then build a second model under the same
  config, load the saved full state into it independently (DTensor's
  ``distribute_tensor`` and plain copies, the saved scheduler state and step),
  and train the same steps: the reference run;
* ``mismatch``: restore a model that differs from the saved one and record
  the error's type and message;
* ``annotated_save`` / ``annotated_restore``: a Megatron-style model of plain
  local tensors (padded vocabulary, fused q|k weight) saved under tp=world with
  annotations, restored whole by one rank.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import tenplex
from tenplex.integration.process_group import init_process_group, leave_process_group
from tenplex.models.gpt import GPTConfig, Parallel, Trainer

GLOBAL_BATCH = 8


def checkpointer(phase: dict, trainer: Trainer | None, rank: int) -> tenplex.Checkpointer:
    device = phase["devices"][rank]
    host = device.split("/")[0]
    return tenplex.Checkpointer(store_root=phase["roots"][host], host=host, device=device, stores=phase["stores"],
                                coords=trainer.coords if trainer else None)


def rand_by_coord(trainer: Trainer) -> dict[str, list[float]]:
    """Every rank's next three torch.rand values, keyed like tenplex keys RNG states ("dp=0,pp=0,tp=1")."""
    from tenplex.integration.exchange import all_gather_json

    key = ",".join(f"{k}={v}" for k, v in sorted(trainer.coords.items()))
    return dict(all_gather_json([key, torch.rand(3).tolist()]))


def dump_full(trainer: Trainer, path: Path, rank: int) -> None:
    state = trainer.full_state()  # collective: every rank calls it
    if trainer.coords["dp"] == 0 and trainer.coords["tp"] == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / f"r{rank}.safetensors"))


def load_saved(out: Path) -> dict[str, torch.Tensor]:
    full = {}
    for f in sorted((out / "saved").glob("r*.safetensors")):
        full.update(load_file(str(f)))
    return full


def run_save(phase: dict, rank: int) -> dict:
    out = Path(phase["out"])
    trainer = Trainer(GPTConfig(), Parallel(**phase["parallel"]), GLOBAL_BATCH)
    ckpt = checkpointer(phase, trainer, rank)
    losses = [trainer.train_step(s) for s in range(phase["steps"])]
    version = tenplex.save(trainer.model, trainer.optimizer, step=phase["steps"], scheduler=trainer.scheduler,
                           extra={"samples_seen": phase["steps"] * GLOBAL_BATCH}, checkpointer=ckpt)
    rand_after = rand_by_coord(trainer)
    (out / "saved").mkdir(parents=True, exist_ok=True)
    dump_full(trainer, out / "saved", rank)
    meta = {"version": version, "losses": losses, "coords": trainer.coords, "rand_after_save": rand_after,
            "scheduler": trainer.scheduler.state_dict(), "lr": trainer.optimizer.param_groups[0]["lr"]}
    meta["continued"] = [trainer.train_step(s) for s in range(phase["steps"], phase["steps"] + phase["more"])]
    return meta


def load_reference(trainer: Trainer, full: dict[str, torch.Tensor], saved: dict) -> None:
    """Put the saved full state into ``trainer`` without tenplex: the independent path."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.distributed.tensor import DTensor, distribute_tensor

    def put(target: torch.Tensor, value: torch.Tensor) -> None:
        with torch.no_grad():
            if isinstance(target, DTensor):
                target.to_local().copy_(distribute_tensor(value, target.device_mesh, target.placements).to_local())
            else:
                target.copy_(value)

    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for name, tensor in trainer.model.state_dict(keep_vars=True).items():
        put(tensor, full[name])
    _init_optim_state(trainer.optimizer)
    for p, state in trainer.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            put(state[key], full[f"optim.{key}.{names[id(p)]}"])
        state["step"].fill_(saved["steps"])
    trainer.scheduler.load_state_dict(saved["meta"]["scheduler"])
    for group in trainer.optimizer.param_groups:
        group["lr"] = saved["meta"]["lr"]


def run_restore(phase: dict, rank: int) -> dict:
    out = Path(phase["out"])
    par = Parallel(**phase["parallel"])
    trainer = Trainer(GPTConfig(), par, GLOBAL_BATCH, seed=99)
    ckpt = checkpointer(phase, trainer, rank)
    extra: dict = {}
    step = tenplex.restore(trainer.model, trainer.optimizer, scheduler=trainer.scheduler, extra=extra,
                           checkpointer=ckpt)
    rand_after = rand_by_coord(trainer)
    lr, scheduler = trainer.optimizer.param_groups[0]["lr"], trainer.scheduler.state_dict()
    (out / "restored").mkdir(parents=True, exist_ok=True)
    dump_full(trainer, out / "restored", rank)
    losses = [trainer.train_step(s) for s in range(step, step + phase["more"])]
    saved = {"steps": step, "meta": json.loads((out / "save.json").read_text())}
    reference = Trainer(GPTConfig(), par, GLOBAL_BATCH, seed=7)
    load_reference(reference, load_saved(out), saved)
    reference_losses = [reference.train_step(s) for s in range(step, step + phase["more"])]
    info = ckpt.last_restore
    return {"step": step, "extra": extra, "coords": trainer.coords, "rand_after_restore": rand_after,
            "transformed": info.transformed, "read_through": info.read_through, "version": info.version,
            "saved_version": info.saved_version, "versions_here": ckpt.store.versions(),
            "plan_stats": info.plan_stats, "losses": losses, "reference_losses": reference_losses,
            "lr": lr, "scheduler": scheduler}


def run_mismatch(phase: dict, rank: int) -> dict:
    cfg = GPTConfig(**phase.get("model", {}))
    trainer = Trainer(cfg, Parallel(**phase["parallel"]), GLOBAL_BATCH)
    optimizer = trainer.optimizer
    if phase.get("optimizer") == "adam":
        optimizer = torch.optim.Adam(trainer.model.parameters(), lr=1e-2)
    try:
        tenplex.restore(trainer.model, optimizer, checkpointer=checkpointer(phase, trainer, rank))
    except Exception as e:  # noqa: BLE001 -- the error is the result
        return {"error_type": type(e).__name__, "error": str(e)}
    return {"error_type": None, "error": None}


class Megatron(torch.nn.Module):
    """Plain local shards, Megatron style: a vocabulary padded to a multiple of tp and a fused (q|k) weight."""

    VOCAB, HIDDEN, BLOCK = 37, 4, 4  # embedding [37, 4]; fused [2 * BLOCK, 3]

    def __init__(self, tp: int, rank: int):
        super().__init__()
        rows = -(-self.VOCAB // tp)  # padded vocabulary / tp
        self.embed = torch.nn.Parameter(torch.full((rows, self.HIDDEN), -1.0))
        self.fused = torch.nn.Parameter(torch.zeros(2 * self.BLOCK // tp, 3))
        real = min(rows, self.VOCAB - rank * rows)
        gen = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            self.embed[:real] = torch.randn(real, self.HIDDEN, generator=gen)  # rows past ``real`` are padding
            self.fused.copy_(torch.randn(self.fused.shape, generator=gen))

    def annotations(self, tp: int, rank: int) -> dict:
        from tenplex.box import Box
        from tenplex.integration import annotations_from_layout
        from tenplex.layout import Layout, Shard, TensorSpec

        rows, part = self.embed.shape[0], self.BLOCK // tp
        fused = {f"h0/{r}": [Shard("fused", Box((r * part, 0), (part, 3))),
                             Shard("fused", Box((self.BLOCK + r * part, 0), (part, 3)))] for r in range(tp)}
        layout = Layout.build({"fused": TensorSpec((2 * self.BLOCK, 3), "float32")}, fused)
        return {"embed": tenplex.Annotation((self.VOCAB, self.HIDDEN), (rank * rows, 0)),
                **annotations_from_layout(layout, f"h0/{rank}")}


def run_annotated(phase: dict, rank: int) -> dict:
    """Save plain local shards (tp=world) with annotations, or restore them into whole tensors (world 1)."""
    out = Path(phase["out"])
    out.mkdir(parents=True, exist_ok=True)
    tp = dist.get_world_size()
    model = Megatron(tp, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = checkpointer(phase, None, rank)
    annotations = model.annotations(tp, rank) if tp > 1 else None
    if phase["kind"] == "annotated_save":
        (model.embed.square().sum() + model.fused.pow(3).sum()).backward()
        optimizer.step()
        tenplex.save(model, optimizer, step=1, annotations=annotations, checkpointer=ckpt)
        state = {"embed": model.embed, "fused": model.fused, **{f"{k}.{n}": optimizer.state[p][k]
                 for n, p in model.named_parameters() for k in ("exp_avg", "exp_avg_sq")}}
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / f"local_r{rank}.safetensors"))
        return {}
    tenplex.restore(model, optimizer, checkpointer=ckpt)
    state = {"embed": model.embed, "fused": model.fused, **{f"{k}.{n}": optimizer.state[p][k]
             for n, p in model.named_parameters() for k in ("exp_avg", "exp_avg_sq")}}
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "restored_whole.safetensors"))
    return {"transformed": ckpt.last_restore.transformed}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    init_process_group("gloo")
    rank = dist.get_rank()
    kinds = {"save": run_save, "restore": run_restore, "mismatch": run_mismatch,
             "annotated_save": run_annotated, "annotated_restore": run_annotated}
    for phase in spec["phases"]:
        try:
            result = kinds[phase["kind"]](phase, rank)
        except Exception:
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(3)  # the others would wait forever in a collective
        out = Path(phase["out"])
        out.mkdir(parents=True, exist_ok=True)
        name = f"{phase['kind']}.json" if phase["kind"] != "mismatch" else f"mismatch-{phase['name']}.json"

        if rank == 0:
            (out / name).write_text(json.dumps(result))
        dist.barrier()
    leave_process_group()


if __name__ == "__main__":
    main()
