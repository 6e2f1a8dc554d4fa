"""``tenplex bench restore``: save and restore the reference GPT's state across a configuration change, vs DCP.

May import: every tenplex layer, torch and the standard library. The model
is the reference GPT, :mod:`tenplex.models.gpt`.

One run, two ranks (gloo), one ``tenplex store serve`` process per host; the
state lives on the CPU, or with ``--device cuda`` in GPU memory (both ranks
share the first GPU: gloo carries CUDA tensors, NCCL would need one GPU per
rank):

the model under the old configuration (default ``tp=2``) takes one training
step so that Adam's moments are real (on CUDA they are filled from the
parameters instead: gloo may lack CUDA versions of the step's collectives). Every restore goes into a fresh model
and optimizer under the new configuration (default FSDP2 over dp=2), as after a
restart, so each one also creates the optimizer's state. In this order:

* ``tenplex_save_s``: ``tenplex.save`` of the old model into the host's store (tmpfs);
* ``tenplex_restore_s``: ``tenplex.restore`` into the new model: plan, the
  transformation through the store process, loading every rank's boxes;
* ``dcp_tmpfs_save_s`` / ``dcp_tmpfs_load_s``: ``dcp.save`` of
  ``get_state_dict(model, optimizer)`` into a tmpfs directory, then
  ``dcp.load`` with resharding plus ``set_state_dict`` into the new model;
* ``dcp_disk_save_s`` / ``dcp_disk_load_s``: the same on disk.

With ``--new-hosts 2`` the new configuration's second rank runs on another
(simulated) host whose store is empty, so the restore moves state between
hosts: that rank reads its regions from h0's store over the data plane
(``tenplex_read_through``), or, when the plan fans a region out, the stores
transform it (``tenplex_transformed``). Each store or DCP directory
is deleted once measured, so that tmpfs holds one
copy of the state at a time.

With ``--device cuda`` the same run also measures, on the same state:

* ``tenplex_restore_pageable_s`` / ``tenplex_save_pageable_s``: a restore and a
  save staged through pageable instead of pinned host buffers
  (``tenplex.integration.staging``);
* ``copy_{d2h,h2d}_{pinned,pageable}_s``: the floor, a plain ``copy_`` of
  each rank's bytes between the GPU and one host buffer of their size, both
  ranks at once as in the save and restore;
* every ``*_s`` above as ``*_gbps`` (``state_bytes`` / seconds / 1e9), and
  ``tenplex_{save,restore}_over_{d2h,h2d}_floor``: tenplex's rate over the
  pinned floor's (the targets are 0.7 or more).

Each timed step is preceded by a barrier and ends with one (on CUDA, after
waiting for the device), so it measures the slowest rank. ``state_bytes`` is
the global size of parameters and Adam states.

Repeats. One round times every method once; ``--warmup`` untimed rounds
(default 1: imports, thread pools, allocator) come first, then ``--repeat``
timed rounds (default 5). Every ``*_s`` key is the median over the rounds, and
``spread`` gives its ``[min, max]``; ``rounds`` lists every round's seconds.
A ``*_over_tenplex`` ratio is the median of the rounds' ratios (each round's
DCP time over the same round's tenplex time), with its spread too. The
methods' order turns by one each round, so none always runs first.

Every method starts alike (``protocol`` in the JSON says so): right before
each timed step of every method, rank 0 writes and frees ``--warm-gb`` GiB
(default: the state's size, so that the step writes tmpfs pages into memory
the machine has backed, see :mod:`.warm`; 0: off); before each save, the
previous round's store versions and DCP directories are deleted, so every
save writes fresh tmpfs or disk pages; each load reads what its save just
wrote, from tmpfs (memory: the page cache is the file), except the disk
checkpoint, whose page cache is dropped (``fsync`` + ``posix_fadvise``)
before loading, so that the disk load reads the disk, as after a restart on
another machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..runtime.hosts import Hosts
from ..runtime.launch import run_spec_job
from .warm import add_warm_argument, warm

DESCRIPTION = "save + restore of the reference GPT's state (>= 1 GB) across a config change, vs torch DCP"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--old", default="tp=2", help="configuration that saves (default tp=2)")
    parser.add_argument("--new", default="dp=2,fsdp=1", help="configuration that restores (default dp=2,fsdp=1)")
    parser.add_argument("--tmpfs", type=Path, default=Path("/dev/shm"), help="tmpfs directory (tenplex store, DCP)")
    parser.add_argument("--disk", type=Path, default=Path("/var/tmp"), help="disk directory for DCP")
    parser.add_argument("--no-disk", action="store_true", help="skip DCP on disk (tmpfs only)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the state lives (cuda: both ranks on the first GPU, plus the copy floors and "
                             "pageable staging)")
    add_warm_argument(parser, None, "; default: the state's size")
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed rounds of every method (median and [min, max] reported; default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds of every method first (default 1)")
    parser.add_argument("--new-hosts", type=int, default=1,
                        help="1: both ranks on host h0 throughout (default); 2: the new configuration's rank 1 runs "
                             "on a second host h1 with an empty store: its state comes from h0's store (read through "
                             "over the data plane, or transformed by the stores when a region fans out)")


def run(args: argparse.Namespace) -> dict:
    if args.new_hosts not in (1, 2):
        raise UsageError(f"--new-hosts must be 1 or 2 (the benchmark has 2 ranks), got {args.new_hosts}")
    if args.repeat < 1 or args.warmup < 0:
        raise UsageError(f"--repeat must be at least 1 and --warmup at least 0, got {args.repeat} and {args.warmup}")
    if args.device == "cuda" and not _cuda_available():
        raise UsageError("--device cuda needs a CUDA device, and torch sees none here; use --device cpu")
    work = Path(tempfile.mkdtemp(prefix="tenplex-bench-restore-", dir=args.tmpfs))
    disk = Path(tempfile.mkdtemp(prefix="tenplex-bench-restore-", dir=args.disk))
    hosts = [f"h{i}" for i in range(args.new_hosts)]
    try:
        with Hosts(work) as stores:
            stores.start(*hosts)
            spec = {"model": {"hidden": args.hidden, "layers": args.layers, "ffn": args.ffn, "vocab": args.vocab,
                              "heads": 16, "seq": 8},
                    "old": args.old, "new": args.new, "roots": {h: str(stores.root(h)) for h in hosts},
                    "stores": dict(stores.addresses), "dcp_tmpfs": str(work / "dcp"), "dcp_disk": str(disk / "dcp"),
                    "result": str(work / "result.json"), "warm_gb": args.warm_gb, "device": args.device,
                    "repeat": args.repeat, "warmup": args.warmup,
                    "dcp_where": ["tmpfs"] if args.no_disk else ["tmpfs", "disk"]}
            # Both ranks launch on h0; each worker takes its store root and host from the spec.
            run_spec_job([sys.executable, "-m", "tenplex.bench.restore"], spec, work / "spec.json", ["h0/0", "h0/1"],
                         {"h0": stores.root("h0")}, dict(stores.addresses), work / "logs")
        return json.loads((work / "result.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------ worker
class _Timed:
    """Timings of collective steps: a barrier before and after each, so a step measures the slowest rank."""

    def __init__(self, result: dict, spec: dict, warm_gb: float) -> None:
        self.result, self.spec, self.warm_gb = result, spec, warm_gb
        self.samples: dict[str, list[float]] = {}  # key -> seconds of each timed round
        self.recording = False                     # False during the warm-up rounds

    def __call__(self, key: str, fn) -> None:
        import torch.distributed as dist

        if dist.get_rank() == 0:
            warm(self.warm_gb)  # the same for every step of every method
        dist.barrier()
        start = time.perf_counter()
        fn()
        if self.spec["device"] == "cuda":
            import torch

            torch.cuda.synchronize()  # a restore returns with copies still queued: count them
        dist.barrier()
        if self.recording:
            self.samples.setdefault(key, []).append(round(time.perf_counter() - start, 4))

    def restore(self, key: str, load) -> None:
        """Time ``load(trainer)`` into a fresh model and optimizer under the new configuration, as after a restart."""
        from tenplex.models.gpt import GPTConfig, Parallel, Trainer

        cfg = GPTConfig(**self.spec["model"])
        self(key, partial(load, Trainer(cfg, Parallel.parse(self.spec["new"]), global_batch=8,
                                        device=self.spec["device"])))


def _worker(spec_path: str) -> None:
    import torch.distributed as dist

    from tenplex.integration.process_group import init_process_group, leave_process_group
    from tenplex.models.gpt import GPTConfig, Parallel, Trainer

    spec = json.loads(Path(spec_path).read_text())
    if spec["device"] == "cuda":
        import torch

        torch.cuda.set_device(0)
        torch.cuda.init()  # initialised: DeviceMesh then keeps device 0 instead of taking LOCAL_RANK's
    init_process_group("gloo")
    result: dict = {"old": spec["old"], "new": spec["new"], "model": spec["model"],
                    "tenplex_new_hosts": len(spec["roots"]), "device": spec["device"]}
    old = Trainer(GPTConfig(**spec["model"]), Parallel.parse(spec["old"]), global_batch=8, device=spec["device"])
    old.train_step(0) if spec["device"] == "cpu" else _fill_moments(old)
    result["state_bytes"] = _state_bytes(old)
    warm_gb = spec["warm_gb"] if spec["warm_gb"] is not None else round(result["state_bytes"] / (1 << 30), 2)
    result["protocol"] = {"repeat": spec["repeat"], "warmup_rounds": spec["warmup"], "warm_gb": warm_gb,
                          "before_each_step": "barrier; rank 0 writes and frees warm_gb GiB",
                          "before_each_save": "the previous round's versions and DCP directories deleted",
                          "before_each_load": "tmpfs: as saved (in memory); disk: page cache dropped",
                          "order": "the methods' order turns by one each round"}
    timed = _Timed(result, spec, warm_gb)
    methods = [partial(_time_tenplex, timed, old, spec)]
    methods += [partial(_time_dcp, timed, old, spec, where) for where in spec["dcp_where"]]
    if spec["device"] == "cuda":
        methods.append(partial(_time_copies, timed, result["state_bytes"]))
    for round_ in range(spec["warmup"] + spec["repeat"]):
        timed.recording = round_ >= spec["warmup"]
        turn = round_ % len(methods)
        for method in methods[turn:] + methods[:turn]:
            method()
    if dist.get_rank() == 0:
        _summarise(result, timed.samples, spec["dcp_where"])
        if spec["device"] == "cuda":
            _rates(result)
        Path(spec["result"]).write_text(json.dumps(result))
    leave_process_group()


def _summarise(result: dict, samples: dict[str, list[float]], dcp_where: list[str]) -> None:
    """Median and [min, max] of every measure, and of each round's DCP-over-tenplex ratio."""
    ratios = {f"dcp_{where}_{key}_over_tenplex": [round(d / max(t, 1e-9), 2) for d, t in zip(
        samples[f"dcp_{where}_{key}_s"], samples[f"tenplex_{what}_s"])]
        for what, key in (("save", "save"), ("restore", "load")) for where in dcp_where}
    result["rounds"] = samples
    result["spread"] = {}
    for key, values in {**samples, **ratios}.items():
        result[key] = round(statistics.median(values), 4)
        result["spread"][key] = [min(values), max(values)]


def _fill_moments(trainer) -> None:
    """Adam's moments from the parameters (exp_avg = p / 2, exp_avg_sq = p * p): local, equal on replicas."""
    import torch

    from tenplex.integration.pieces import init_optimizer_state

    init_optimizer_state(trainer.optimizer)
    with torch.no_grad():
        for param, state in trainer.optimizer.state.items():
            state["exp_avg"].copy_(param * 0.5)
            state["exp_avg_sq"].copy_(param * param)


def _time_tenplex(timed: _Timed, old, spec: dict) -> None:
    """tenplex.save into h0's store, tenplex.restore under the new configuration; then free the tmpfs."""
    import torch.distributed as dist

    import tenplex

    rank, roots = dist.get_rank(), spec["roots"]
    ckpt = tenplex.Checkpointer(store_root=roots["h0"], host="h0", device=f"h0/{rank}", stores=spec["stores"])
    host = f"h{rank % len(roots)}"
    new_ckpt = tenplex.Checkpointer(store_root=roots[host], host=host, stores=spec["stores"],
                                    device=f"{host}/{rank // len(roots)}")
    timed("tenplex_save_s", partial(tenplex.save, old.model, old.optimizer, step=1, scheduler=old.scheduler,
                                    checkpointer=ckpt))
    timed.restore("tenplex_restore_s", lambda new: tenplex.restore(new.model, new.optimizer,
                                                                   scheduler=new.scheduler, checkpointer=new_ckpt))
    timed.result["tenplex_transformed"] = new_ckpt.last_restore.transformed
    timed.result["tenplex_read_through"] = new_ckpt.last_restore.read_through
    if spec["device"] == "cuda":  # the same restore and save, staged through pageable host memory
        from tenplex.integration import staging

        staging.use_pinned(False)
        timed.restore("tenplex_restore_pageable_s", lambda new: tenplex.restore(
            new.model, new.optimizer, scheduler=new.scheduler, checkpointer=new_ckpt))
        timed("tenplex_save_pageable_s", partial(tenplex.save, old.model, old.optimizer, step=2,
                                                 scheduler=old.scheduler, checkpointer=ckpt))
        staging.use_pinned(True)
    dist.barrier()
    if rank < len(roots):  # free the tmpfs before DCP writes there (the machine's memory is the limit)
        for version in new_ckpt.store.versions():
            new_ckpt.store.delete(version)


def _time_dcp(timed: _Timed, old, spec: dict, where: str) -> None:
    """dcp.save and dcp.load (with resharding) on tmpfs, or on disk with its page cache dropped; then delete it."""
    import torch.distributed as dist

    path = spec[f"dcp_{where}"]
    timed(f"dcp_{where}_save_s", partial(_dcp_save, old, path))
    if dist.get_rank() == 0 and where == "disk":
        _drop_page_cache(Path(path))
    timed.restore(f"dcp_{where}_load_s", partial(_dcp_load, path=path))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()  # gone before the next method writes (tmpfs holds one copy of the state at a time)


def _time_copies(timed: _Timed, state_bytes: int) -> None:
    """The floor: each rank copies its share of ``state_bytes`` between the GPU and one host buffer of that size,
    pinned and pageable, both ways, both ranks at once (as they save and restore)."""
    import torch
    import torch.distributed as dist

    share = state_bytes // dist.get_world_size()
    on_gpu = torch.empty(share, dtype=torch.uint8, device="cuda").fill_(1)
    for kind in ("pinned", "pageable"):
        host = torch.empty(share, dtype=torch.uint8, pin_memory=kind == "pinned")
        host.fill_(2)  # touched: the copy measures the link, not page faults
        timed(f"copy_d2h_{kind}_s", partial(host.copy_, on_gpu, non_blocking=True))
        timed(f"copy_h2d_{kind}_s", partial(on_gpu.copy_, host, non_blocking=True))
        del host


def _rates(result: dict) -> None:
    """GB/s of every timed step on ``state_bytes``, and tenplex's save and restore over the pinned floor."""
    for key in [k for k in result if k.endswith("_s")]:
        result[key.removesuffix("_s") + "_gbps"] = round(result["state_bytes"] / max(result[key], 1e-9) / 1e9, 2)
    for what, floor in (("save", "d2h"), ("restore", "h2d")):
        result[f"tenplex_{what}_over_{floor}_floor"] = round(result[f"tenplex_{what}_gbps"]
                                                             / max(result[f"copy_{floor}_pinned_gbps"], 1e-9), 2)


def _dcp_save(trainer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _dcp_load(trainer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # get_state_dict creates the fresh optimizer's state (DCP's own initialisation), inside the timing like ours.
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _state_bytes(trainer) -> int:
    """Global bytes of parameters and optimizer moments (each global tensor once; a DTensor's numel is global)."""
    from ..integration.exchange import all_gather_json

    names = {id(p): n for n, p in trainer.model.named_parameters()}
    sizes = {n: p.numel() * p.element_size() for n, p in trainer.model.named_parameters()}
    for p, state in trainer.optimizer.state.items():
        for key, value in state.items():
            if value.dim() > 0:
                sizes[f"{key}.{names[id(p)]}"] = value.numel() * value.element_size()
    merged: dict = {}
    for d in all_gather_json(sizes):  # pipeline stages hold different tensors
        merged.update(d)
    return sum(merged.values())


def _drop_page_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


if __name__ == "__main__":
    _worker(sys.argv[1])
