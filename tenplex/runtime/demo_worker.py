"""One rank of the ``tenplex demo`` job: train the reference GPT on a packed dataset, save or restore with tenplex.

May import: torch, safetensors, ``tenplex`` (``save``, ``restore``, ``Checkpointer``),
``tenplex.integration.process_group``, ``tenplex.dataset``, the reference model ``tenplex.models.gpt`` and the
standard library.

Usage: ``python -m tenplex.runtime.demo_worker SPEC.json`` with the environment
that :func:`tenplex.runtime.launch.run_job` sets. The spec says the parallel
configuration, the dataset, ``save_at`` (train to this step, then save) and
``until`` (keep training to this step without saving: in the first phase this
is the uninterrupted reference run). Every rank restores first: a fresh job
starts at the dataset state of the spec, a restarted one from the state it saved
(``extra["dataset"]``). With ``mount`` in the spec it reads its samples from
that FUSE view of the dataset, after checking that the view shows exactly the
restored state; otherwise it computes the same view in process. Results,
written to ``out``:

* ``rank{r}.json``: coordinates, restored step and transformation, and per step
  the loss and the sample ids this rank trained on;
* ``params-r{r}.safetensors`` (ranks with dp = tp = 0): the full parameters and
  Adam moments right after the save, or right after the restore;
* ``progress.jsonl`` (rank 0): one line per step, for the progress display.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import tenplex
from tenplex.dataset import DatasetError, DatasetState
from tenplex.dataset.reader import open_mounted
from tenplex.dataset.torch_data import RankBatchSampler, RankDataset
from tenplex.integration.process_group import init_process_group, leave_process_group
from tenplex.models.gpt import GPTConfig, Parallel, Trainer


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    init_process_group("gloo")
    rank = dist.get_rank()
    par = Parallel.parse(spec["parallel"])
    # A fresh job and a restarted one start from different weights: only a correct restore makes them equal.
    trainer = Trainer(GPTConfig(), par, spec["global_batch"], seed=spec["init_seed"])
    ckpt = tenplex.Checkpointer(coords=trainer.coords)
    step, state, record = _restore(trainer, ckpt, spec, rank)
    if record["restored_step"] is not None:
        _dump(trainer, out, rank)
    data = _open_data(spec, state, par.dp, trainer.coords["dp"])
    record["reader"] = "fuse" if spec.get("mount") else "in-process"
    _train(trainer, ckpt, data, spec, step, state, record, out, rank)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    leave_process_group()


def _restore(trainer: Trainer, ckpt: tenplex.Checkpointer, spec: dict,
             rank: int) -> tuple[int, DatasetState, dict[str, Any]]:
    """Restore (collective); returns the step, the dataset state to continue from, and this rank's record."""
    extra: dict = {}
    step = tenplex.restore(trainer.model, trainer.optimizer, scheduler=trainer.scheduler, extra=extra,
                           checkpointer=ckpt)
    state = DatasetState.from_dict(extra["dataset"] if step is not None else spec["dataset_state"])
    info = ckpt.last_restore
    record = {"rank": rank, "coords": trainer.coords, "restored_step": (step or 0) if info.version else None,
              "transformed": info.transformed, "read_through": info.read_through, "plan_stats": info.plan_stats,
              "start_state": state.to_dict(), "steps": []}
    return step or 0, state, record


def _open_data(spec: dict, state: DatasetState, dp: int, dp_rank: int) -> RankDataset:
    """This rank's data-parallel share: the FUSE view at ``spec["mount"]`` (checked against ``state``) or in process."""
    if not spec.get("mount"):
        return RankDataset.fallback(spec["dataset"], state, dp, dp_rank)
    reader = open_mounted(spec["mount"], dp_rank)
    if reader.state != state or reader.doc.get("dp") != dp:
        raise DatasetError(f"the dataset view at {spec['mount']} shows {reader.state} for dp {reader.doc.get('dp')}, "
                           f"but this job restored {state} under dp {dp}; switch the view (tenplex vfs switch) "
                           "before starting the workers")
    return RankDataset(reader)


def _train(trainer: Trainer, ckpt: tenplex.Checkpointer, data: RankDataset, spec: dict, step: int,
           state: DatasetState, record: dict[str, Any], out: Path, rank: int) -> None:
    """Train to ``spec["until"]``, saving at ``spec["save_at"]``; every step goes into ``record``."""
    # This rank reads its dp coordinate's micro-batch of every global batch (the tp and pp peers read the same).
    batches, start = iter(RankBatchSampler(data)), step
    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(open(out / "progress.jsonl", "a")) if rank == 0 else None

        def report(line: dict) -> None:
            if progress:
                progress.write(json.dumps({"phase": spec["phase"], "step": step, **line}) + "\n")
                progress.flush()

        while step < spec["until"]:
            positions = next(batches)
            tokens = torch.stack([data[i] for i in positions]).long()  # (micro-batch, seq + 1)
            loss = trainer.train_step(step, (tokens[:, :-1], tokens[:, 1:]))
            step += 1
            record["steps"].append({"step": step, "loss": loss, "ids": data.sample_ids[positions].tolist()})
            report({"loss": loss})
            if step == spec.get("save_at"):
                done = state.advance(step - start)  # the dataset position goes with the state
                record["saved_version"] = tenplex.save(trainer.model, trainer.optimizer, step=step,
                                                       scheduler=trainer.scheduler,
                                                       extra={"dataset": done.to_dict()}, checkpointer=ckpt)
                record["saved_state"] = done.to_dict()
                report({"saved": record["saved_version"]})
                _dump(trainer, out, rank)


def _dump(trainer: Trainer, out: Path, rank: int) -> None:
    """Write this pipeline stage's full parameters and Adam moments (collective: every rank calls it)."""
    state = trainer.full_state()
    if trainer.coords["dp"] == 0 and trainer.coords["tp"] == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / f"params-r{rank}.safetensors"))


if __name__ == "__main__":
    main()
