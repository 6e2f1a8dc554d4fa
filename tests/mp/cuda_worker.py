"""One rank of a save-then-restore job with the state on a chosen device (CPU or CUDA).

Usage: ``python cuda_worker.py SPEC.json`` under ``run_spec_job`` (RANK, WORLD_SIZE, LOCAL_RANK, … set).
The spec names the device type (``cpu``/``cuda``), the backend (``gloo``: CUDA tensors too, which is how two
ranks share one GPU; ``nccl``: one GPU per rank), the old and new configurations of the reference GPT and the
host's store root. The rank builds the model under the old configuration and gives Adam's moments values
(``spec["train"]``: by one training step; otherwise filled from the parameters, with no collective: gloo may
lack CUDA versions of the collectives a step needs), saves with tenplex, restores into a fresh model under the
new one, and dumps every piece it held before and after (``{when}_r{rank}.safetensors``, keys
``NAME@OFFSETS@LENGTHS``), the device types the restored tensors live on and the global shapes (``r{rank}.json``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import tenplex
from tenplex.integration.layouts import state_pieces
from tenplex.integration.pieces import init_optimizer_state
from tenplex.integration.process_group import init_process_group, leave_process_group
from tenplex.models.gpt import GPTConfig, Parallel, Trainer


def dump(trainer: Trainer, path: Path) -> dict:
    """Every piece's region, copied to the host; returns the device types the pieces live on and their shapes."""
    pieces = state_pieces(trainer.model, trainer.optimizer, None)
    save_file({f"{p.name}@{list(p.box.offsets)}@{list(p.box.lengths)}": p.read() for p in pieces}, str(path))
    return {"devices": sorted({p.local.device.type for p in pieces}),
            "shapes": {p.name: list(p.spec.shape) for p in pieces}}


@torch.no_grad()
def fill_moments(trainer: Trainer) -> None:
    """Adam's moments from the parameters (exp_avg = p / 2, exp_avg_sq = p * p): local, and equal on replicas."""
    init_optimizer_state(trainer.optimizer)
    for param, state in trainer.optimizer.state.items():
        state["exp_avg"].copy_(param * 0.5)
        state["exp_avg_sq"].copy_(param * param)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank, out = int(os.environ["RANK"]), Path(spec["out"])
    if spec["device"] == "cuda":  # ranks beyond the GPU count share one (gloo moves CUDA tensors through the host)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.init()  # initialised: DeviceMesh then keeps this device instead of taking LOCAL_RANK's
    init_process_group(spec["backend"])
    cfg = GPTConfig(**spec["model"])
    ckpt = tenplex.Checkpointer(store_root=spec["root"], host="h0", device=f"h0/{rank}", stores={})
    old = Trainer(cfg, Parallel.parse(spec["old"]), global_batch=4, device=spec["device"])
    old.train_step(0) if spec["train"] else fill_moments(old)
    saved = dump(old, out / f"saved_r{rank}.safetensors")
    tenplex.save(old.model, old.optimizer, step=1, checkpointer=ckpt)
    new = Trainer(cfg, Parallel.parse(spec["new"]), global_batch=4, device=spec["device"])
    step = tenplex.restore(new.model, new.optimizer, checkpointer=ckpt)
    restored = dump(new, out / f"restored_r{rank}.safetensors")
    (out / f"r{rank}.json").write_text(json.dumps({"step": step, "devices": restored["devices"],
                                                   "shapes": saved["shapes"]}))
    del old, new
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
