"""``tenplex bench snapshot``: how long the training loop is blocked per save, tenplex's snapshot vs its baselines.

May import: every tenplex layer, torch and the standard library. The model is
the reference GPT (:mod:`tenplex.models.gpt`).

One run, two ranks (gloo, CPU) on one host, the state after one training
step (parameters and Adam moments, ``state_bytes`` in all), stores and DCP
directories on tmpfs. Each measure is the median of ``--repeat`` rounds, each
round the slowest rank (barriers around it):

* ``memcpy_s``: each rank copies its local tensors into preallocated buffers
  (the floor of any staging), measured in the same rounds as the snapshot;
* ``tenplex_save_s``: ``tenplex.save``, blocking (the store's write path);
* ``tenplex_snapshot_blocking_s``: ``Checkpointer.async_save`` until it
  returns (staging buffers reused; ``tenplex_snapshot_first_blocking_s`` is the
  first call, which allocates them); ``tenplex_snapshot_commit_s``: from the
  call until the host committed the version (in the background); ``tenplex_snapshot_staged_s``: from the call
  until the writer thread's copies of the optimizer's tensors are made (:mod:`tenplex.integration.snapshot_defer`:
  what an ``optimizer.step()`` right after the boundary would wait for);
* ``dcp_save_s``: ``torch.distributed.checkpoint.save``;
  ``dcp_async_blocking_s``: ``dcp.async_save`` (on a gloo group of its own, as
  its documentation asks) until it returns; ``dcp_async_commit_s``: until its
  future is done;
* ``tenplex_snapshot_fixed_s``: the blocking seconds of a snapshot of the same model's structure with tiny
  tensors (``tenplex_snapshot_fixed_state_bytes`` in all): what a snapshot costs whatever the state's size (the
  structure check, RNG and optimizer scalars, the hand-off to the writer thread, the bookkeeping; no collective
  between exchanges); ``tenplex_snapshot_exchange_fixed_s`` (and ``…_cpu_s``): the same for a snapshot that
  exchanges, as the first one and the one after a blocking save do (the all-gather at the boundary: every
  snapshot's cost before issue 40's second round), measured in the same run; ``tenplex_snapshot_s_per_mb``: the rest of
  ``tenplex_snapshot_blocking_s`` per MB a rank stages; the same three in CPU seconds of the training thread
  (``time.thread_time``: ``tenplex_snapshot_blocking_cpu_s``, ``tenplex_snapshot_fixed_cpu_s``,
  ``tenplex_snapshot_cpu_s_per_mb``), which a loaded machine's scheduling does not inflate as it does wall time;
* memory: ``tenplex_staging_bytes`` (the snapshot's buffers, all ranks; before each round every parameter and
  moment is changed in place, as by a step, so only what no step changes is linked,
  ``tenplex_snapshot_linked_bytes``) and
  ``dcp_async_extra_rss_bytes`` (resident memory grown during ``async_save``,
  all ranks);
* ``snapshot_interval_at_20ms_steps``: the interval between snapshots that ``tenplex.elastic.Job``'s 5% budget
  rule takes with this blocking time and steps of 20 ms (1: every step; ``…_cpu``: with the blocking CPU time),
  plus what an ``optimizer.step()`` 20 ms after the call would still wait for the writer thread's copies
  (``tenplex_snapshot_staged_s`` beyond 20 ms);
* ``paced_20ms_blocking_s``: snapshots every step of 20 ms (a sleep standing in for the forward and backward, then
  a real ``optimizer.step()``), the median seconds ``async_save`` blocked, its wait for the previous snapshot's
  commit decision included, plus what the optimizer's step waited for the previous snapshot's background copies
  (``paced_20ms_step_wait_s`` alone), and ``paced_20ms_interval``, the interval the 5% budget takes with it (1:
  every step);
* the end-to-end cost on this machine: ``train_step_s`` without saving and
  ``train_step_snapshot_s`` with a snapshot after every step (the background
  writer shares the CPU with training), and their ratio ``snapshot_slowdown``.
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
from pathlib import Path
from concurrent.futures import Future
from typing import Any, Callable, cast

from ..runtime.launch import run_spec_job

DESCRIPTION = "seconds a save blocks training: tenplex snapshot vs tenplex save, DCP save/async_save, memcpy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--config", default="tp=2", help="parallel configuration of the two ranks (default tp=2)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per measure (median; default 3)")
    parser.add_argument("--steps", type=int, default=4, help="training steps for the end-to-end cost (default 4)")
    parser.add_argument("--tmpfs", type=Path, default=Path("/dev/shm"), help="tmpfs directory (stores, DCP)")


def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="tenplex-bench-snapshot-", dir=args.tmpfs))
    try:
        spec = {"model": {"hidden": args.hidden, "layers": args.layers, "ffn": args.ffn, "vocab": args.vocab,
                          "heads": 16, "seq": 8},
                "config": args.config, "repeat": args.repeat, "steps": args.steps, "work": str(work),
                "result": str(work / "result.json")}
        run_spec_job([sys.executable, "-m", "tenplex.bench.snapshot"], spec, work / "spec.json", ["h0/0", "h0/1"],
                     {"h0": work / "store"}, {}, work / "logs")
        return json.loads((work / "result.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------ worker
def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _summed(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def _rounds(repeat: int, fn: Callable[[int], tuple[float, ...]]) -> list[float]:
    """Median over ``repeat`` rounds of each of ``fn(round)``'s seconds, each the slowest rank's."""
    import torch.distributed as dist

    samples: list[list[float]] = []
    for i in range(repeat):
        dist.barrier()
        samples.append([_slowest(s) for s in fn(i)])
    return [round(statistics.median(column), 5) for column in zip(*samples)]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _local_tensors(trainer) -> list:
    """This rank's parameters and optimizer moments, as local tensors (what a step changes)."""
    return [t.to_local() if hasattr(t, "to_local") else t
            for t in [*trainer.model.parameters(),
                      *(v for s in trainer.optimizer.state.values() for v in s.values() if v.dim() > 0)]]


def as_a_step(local: list) -> None:
    """Change every tensor in place, as a training step would (their version counters move; values stay)."""
    import torch

    with torch.no_grad():
        for t in local:
            t.mul_(1)


def _tenplex_saves(ckpt, trainer, repeat: int) -> dict:
    """``tenplex_save_s``, the snapshot's blocking and commit seconds, the memcpy floor, staging memory."""
    import torch

    import tenplex

    local = _local_tensors(trainer)
    buffers = [torch.empty_like(t) for t in local]

    def memcpy() -> float:
        begin = time.perf_counter()
        with torch.no_grad():
            for b, t in zip(buffers, local):
                b.copy_(t)
        return time.perf_counter() - begin

    def save(i: int) -> tuple[float]:
        begin = time.perf_counter()
        tenplex.save(trainer.model, trainer.optimizer, step=i, scheduler=trainer.scheduler, checkpointer=ckpt)
        return (time.perf_counter() - begin,)

    def snapshot(i: int) -> tuple[float, float, float, float, float]:
        import torch.distributed as dist

        floor = memcpy()  # the floor, measured next to each snapshot: this machine's load varies
        # Every parameter and moment changes: the snapshot stages them all (only what no step changes, buffers, is
        # linked from the last one).
        as_a_step(local)
        dist.barrier()
        begin, cpu = time.perf_counter(), time.thread_time()
        ckpt.async_save(trainer.model, trainer.optimizer, step=100 + i, scheduler=trainer.scheduler)
        returned, cpu = time.perf_counter(), time.thread_time() - cpu
        ckpt._snapshots.wait_staged()  # what an optimizer.step() at once would wait for: the writer thread's copies
        staged = time.perf_counter()
        ckpt.wait_snapshot()
        # From the call until this host committed (the first rank of the host; the others report 0).
        return floor, returned - begin, ckpt.snapshot_stats()["last_commit_s"] or 0.0, cpu, staged - begin

    result: dict[str, Any] = {}
    result["tenplex_save_s"], = _rounds(repeat, save)
    _, result["tenplex_snapshot_first_blocking_s"], _, _, _ = _rounds(1, snapshot)
    (result["memcpy_s"], result["tenplex_snapshot_blocking_s"], result["tenplex_snapshot_commit_s"],
     result["tenplex_snapshot_blocking_cpu_s"], result["tenplex_snapshot_staged_s"]) = _rounds(repeat, snapshot)
    stats = ckpt.snapshot_stats()
    result["tenplex_staging_bytes"] = int(_summed(stats["staging_bytes"]))
    result["tenplex_snapshot_linked_bytes"] = int(_summed(stats["linked_bytes"]))
    result["tenplex_snapshot_failed"] = int(_summed(stats["failed"]))
    return result


def _fixed_cost(spec: dict, work: Path, result: dict) -> dict:
    """What a snapshot costs the training thread whatever the state's size: the median blocking seconds of a
    snapshot of the same model's structure with tiny tensors (``tenplex_snapshot_fixed_s``), and the rest per byte
    staged (``tenplex_snapshot_s_per_mb``, from the measured model's blocking seconds and staging bytes)."""
    import torch.distributed as dist

    import tenplex
    from tenplex.models.gpt import GPTConfig, Parallel, Trainer

    tiny_model = {**spec["model"], "hidden": 32, "ffn": 64, "vocab": 64}
    tiny = Trainer(GPTConfig(**tiny_model), Parallel.parse(spec["config"]), global_batch=8)
    tiny.train_step(0)
    ckpt = tenplex.Checkpointer(store_root=work / "tiny-store", host="h0", device=f"h0/{dist.get_rank()}",
                                replicas=0, keep=1)

    local = _local_tensors(tiny)

    def snapshot(i: int) -> tuple[float, float]:
        ckpt.wait_snapshot()
        as_a_step(local)  # every tensor changes, so every one is staged
        dist.barrier()
        begin, cpu = time.perf_counter(), time.thread_time()
        ckpt.async_save(tiny.model, tiny.optimizer, step=i, scheduler=tiny.scheduler)
        return time.perf_counter() - begin, time.thread_time() - cpu
    def exchanging(i: int) -> tuple[float, float]:
        ckpt._snapshots.resync()  # as after a blocking save: this snapshot runs the exchange (an all-gather)
        return snapshot(i)
    _rounds(2, snapshot)  # the first allocates its buffers and sends the static documents
    rounds = max(5, 3 * spec["repeat"])
    exchanges = [ckpt.snapshot_stats()["exchanges"]]
    exchange, exchange_cpu = _rounds(rounds, exchanging)
    exchanges.append(ckpt.snapshot_stats()["exchanges"])
    fixed, fixed_cpu = _rounds(rounds, snapshot)
    ckpt.wait_snapshot()
    exchanges.append(ckpt.snapshot_stats()["exchanges"])
    tiny_bytes = int(_summed(ckpt.snapshot_stats()["staging_bytes"]))
    ckpt.close()
    per_rank = (result["tenplex_staging_bytes"] - tiny_bytes) / dist.get_world_size() / 1e6
    per_mb = max(0.0, result["tenplex_snapshot_blocking_s"] - fixed) / max(per_rank, 1e-9)
    per_mb_cpu = max(0.0, result["tenplex_snapshot_blocking_cpu_s"] - fixed_cpu) / max(per_rank, 1e-9)
    return {"tenplex_snapshot_fixed_s": round(fixed, 5), "tenplex_snapshot_s_per_mb": round(per_mb, 6),
            "tenplex_snapshot_fixed_cpu_s": round(fixed_cpu, 5), "tenplex_snapshot_cpu_s_per_mb": round(per_mb_cpu, 6),
            "tenplex_snapshot_fixed_state_bytes": tiny_bytes,
            "tenplex_snapshot_exchange_fixed_s": round(exchange, 5),
            "tenplex_snapshot_exchange_fixed_cpu_s": round(exchange_cpu, 5),
            # How many of each measure's snapshots exchanged (all of the first measure's, none of the second's).
            "tenplex_snapshot_exchange_rounds": [exchanges[1] - exchanges[0], exchanges[2] - exchanges[1], rounds]}


def _dcp_saves(trainer, work: Path, repeat: int) -> dict:
    """``dcp_save_s``, ``dcp.async_save``'s blocking and commit seconds and the resident memory it adds."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    state_dict = dict(zip(("model", "optim"), get_state_dict(trainer.model, trainer.optimizer)))
    dcp_group = dist.new_group(backend="gloo")

    def dcp_save(i: int) -> tuple[float]:
        begin = time.perf_counter()
        dcp.save(state_dict, checkpoint_id=str(work / f"dcp-{i}"))
        took = time.perf_counter() - begin
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work / f"dcp-{i}", ignore_errors=True)
        return (took,)
    extra_rss: list[int] = []

    def dcp_async(i: int) -> tuple[float, float]:
        before = _rss()
        begin = time.perf_counter()
        future = cast(Future, dcp.async_save(state_dict, checkpoint_id=str(work / f"dcp-async-{i}"),
                                             process_group=dcp_group))
        returned = time.perf_counter()
        extra_rss.append(_rss() - before)
        future.result()
        done = time.perf_counter()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work / f"dcp-async-{i}", ignore_errors=True)
        return returned - begin, done - begin

    result: dict[str, Any] = {}
    result["dcp_save_s"], = _rounds(repeat, dcp_save)
    result["dcp_async_blocking_s"], result["dcp_async_commit_s"] = _rounds(repeat, dcp_async)
    result["dcp_async_extra_rss_bytes"] = int(_summed(max(extra_rss)))
    dist.destroy_process_group(dcp_group)
    return result


def _training(ckpt, trainer, steps: int) -> dict:
    """Seconds per training step without saving and with a snapshot after every step, and their ratio."""
    import torch.distributed as dist

    def train(snapshots: bool) -> float:
        dist.barrier()
        begin = time.perf_counter()
        for step in range(steps):
            trainer.train_step(step)
            if snapshots:
                ckpt.async_save(trainer.model, trainer.optimizer, step=1000 + step, scheduler=trainer.scheduler)
        if snapshots:
            ckpt.wait_snapshot()
        return _slowest(time.perf_counter() - begin) / steps
    plain, snapshotting = round(train(False), 4), round(train(True), 4)
    return {"train_step_s": plain, "train_step_snapshot_s": snapshotting,
            "snapshot_slowdown": round(snapshotting / plain, 3)}


def _paced(ckpt, trainer, steps: int, step_s: float = 0.020) -> dict:
    """Snapshots every step of ``step_s`` seconds (a sleep standing in for the forward and backward's accelerator
    time, then the optimizer's step on the gradients of the last training step): the median seconds each
    ``async_save`` blocked, the wait for the previous snapshot's decision included, plus what the optimizer's step
    before it waited for the previous snapshot's background copies (the slowest rank's), and the interval the 5 %
    budget takes."""
    import statistics as stats

    import torch.distributed as dist

    from tenplex.elastic.job import auto_interval

    ckpt.wait_snapshot()
    dist.barrier()
    blocked, waits = [], []
    for step in range(steps):
        time.sleep(step_s)
        before = ckpt.snapshot_stats()["step_waited_s"]
        trainer.optimizer.step()  # changes every parameter and moment in place
        waited = ckpt.snapshot_stats()["step_waited_s"] - before
        begin = time.perf_counter()
        ckpt.async_save(trainer.model, trainer.optimizer, step=2000 + step, scheduler=trainer.scheduler)
        blocked.append(time.perf_counter() - begin + waited)
        waits.append(waited)
    ckpt.wait_snapshot()
    median = _slowest(stats.median(blocked[1:]))  # the first has no previous snapshot to wait for
    return {"paced_20ms_blocking_s": round(median, 5), "paced_20ms_steps": steps,
            "paced_20ms_step_wait_s": round(_slowest(stats.median(waits[1:])), 6),
            "paced_20ms_interval": auto_interval(median, step_s)}


def _ratios(result: dict) -> dict:
    from tenplex.elastic.job import auto_interval

    blocking = result["tenplex_snapshot_blocking_s"]
    # What a step of 20 ms loses besides the call: what its optimizer.step() (at the step's end, at the latest)
    # still waits for the writer thread's copies
    late = max(0.0, result["tenplex_snapshot_staged_s"] - 0.020)
    # The steps between snapshots that tenplex.elastic.Job's budget rule (5%) takes for 20 ms training steps.
    return {"snapshot_interval_at_20ms_steps": auto_interval(blocking + late, 0.020),
            "snapshot_interval_at_20ms_steps_cpu": auto_interval(result["tenplex_snapshot_blocking_cpu_s"] + late,
                                                                 0.020),
            "snapshot_over_memcpy": round(blocking / max(result["memcpy_s"], 1e-9), 2),
            "snapshot_over_dcp_async": round(blocking / max(result["dcp_async_blocking_s"], 1e-9), 2),
            "snapshot_commit_over_save": round(result["tenplex_snapshot_commit_s"]
                                               / max(result["tenplex_save_s"], 1e-9), 2)}


def _worker(spec_path: str) -> None:
    import torch.distributed as dist

    import tenplex
    from tenplex.integration.process_group import init_process_group, leave_process_group
    from tenplex.models.gpt import GPTConfig, Parallel, Trainer

    from .restore import _state_bytes

    spec = json.loads(Path(spec_path).read_text())
    init_process_group("gloo")
    rank, work, repeat = dist.get_rank(), Path(spec["work"]), spec["repeat"]
    trainer = Trainer(GPTConfig(**spec["model"]), Parallel.parse(spec["config"]), global_batch=8)
    trainer.train_step(0)
    result: dict[str, Any] = {"config": spec["config"], "model": spec["model"], "repeat": repeat,
                              "state_bytes": _state_bytes(trainer)}
    ckpt = tenplex.Checkpointer(store_root=work / "store", host="h0", device=f"h0/{rank}", replicas=0, keep=1)
    result.update(_tenplex_saves(ckpt, trainer, repeat))  # its memcpy buffers are freed before DCP takes memory
    result.update(_fixed_cost(spec, work, result))
    result.update(_dcp_saves(trainer, work, repeat))
    result.update(_training(ckpt, trainer, spec["steps"]))
    result.update(_paced(ckpt, trainer, max(20, 5 * spec["repeat"])))
    result.update(_ratios(result))
    ckpt.close()
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(result))
    leave_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
