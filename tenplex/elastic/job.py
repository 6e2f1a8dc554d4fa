"""The training-loop API of an elastic job: configuration, one-call restore, data share, step boundaries.

May import: ``tenplex`` (save, restore, Checkpointer), ``tenplex.elastic``
(policy, envsettings, faults, devices, dataview, progress, worlds, batches, idle, saves), ``tenplex.integration``,
``tenplex.dataset``, ``tenplex.parallel``, ``tenplex.errors``, ``tenplex.ops``, torch, torch.distributed and the
standard library.

:class:`Job` inherits four parts that live in modules of their own: the worlds in place
(:class:`~tenplex.elastic.worlds.InPlaceWorlds`: :meth:`Job.worlds`, ``job.reconfigurations``), the data
(:class:`~tenplex.elastic.batches.JobData`: :meth:`Job.batch`, :meth:`Job.loader`, :attr:`Job.data_state`), the
idle ranks (:class:`~tenplex.elastic.idle.IdleRanks`: :meth:`Job.wait_idle`) and the saves' accounting
(:class:`~tenplex.elastic.saves.SaveAccounting`: :meth:`Job.save_cost`).
With ``tenplex run --data-mount``, :meth:`Job.restore` switches the node's dataset view and
:meth:`Job.batch` reads through it (:mod:`tenplex.elastic.dataview`).

A script started by ``tenplex run`` (torchrun) is the same in every world::

    job = tenplex.elastic.Job(dataset="ds/", global_batch=64, max_tp=8)   # joins the process group
    model, optimizer, scheduler = build(job.config)                         # dp/tp/pp of this world
    job.restore(model, optimizer, scheduler=scheduler)                      # state, RNG, data position
    while job.step < total_steps:
        batch = job.batch()                     # this rank's share of the global batch job.step
        train_step(batch.data)
        job.step_done()                         # periodic save; on SIGTERM: agree, save, exit

What happens at ``step_done`` (collective; every rank calls it after its optimizer step):

1. ``step`` and the data position advance by one global batch;
2. the ranks all-reduce (max) whether any of them got SIGTERM, and the
   durations of their last step and last save (so every rank takes the same
   decisions from the same numbers);
3. if any rank got SIGTERM (torchrun stops the workers for a membership
   change), every rank saves and exits: with 0 where SIGTERM arrived (its
   agent is stopping it), with :data:`~tenplex.elastic.faults.EXIT_PEER_LOST`
   elsewhere, so that the agents of the other nodes restart their workers in
   the next world instead of ending the job;
4. otherwise it saves when the interval is due: ``save_every`` steps, or,
   with ``save_every=None``, the smallest interval that keeps saving at most
   ``save_budget`` (5%) of training time (:func:`auto_interval`), measured as
   the job runs (:meth:`Job.save_cost` reports it). Periodic saves are
   snapshots (``snapshots=True``, the default: :meth:`tenplex.Checkpointer.async_save`):
   only their staging blocks the loop and counts against the budget, so the
   interval is one step unless staging alone exceeds 5% of a step; the write
   and the commit run in the background. Stopping saves block (after the
   snapshot in flight is settled), so a planned leave loses nothing;
5. if a collective fails because a peer is gone (a node died), the rank
   exits at once without saving, with ``EXIT_PEER_LOST`` (``EXIT_DEVICE_FAULT``
   when its own device failed: :mod:`tenplex.elastic.faults`): the next world
   restores the newest version that was committed completely.

A signal only sets a flag, so a SIGTERM in the middle of a step never
interrupts it: the save happens at the next boundary, and a save is committed
on every host or on none (the store's atomic commit), so a rank killed in the
middle of one leaves the previous version as the newest.

``TORCHELASTIC_RESTART_COUNT`` is per agent, not per job, so it identifies
nothing here; the restored step does.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..integration.process_group import init_process_group, leave_process_group
from ..ops import logs
from ..ops.metrics import JobMetrics
from ..parallel import ParallelConfig
from .devices import worker_device
from .envsettings import settings_from_env
from .faults import DEVICE, EXIT_DEVICE_FAULT, EXIT_PEER_LOST, PEER, classify, inject_device_fault
from . import dataview, progress, worlds
from .batches import Batch as Batch, JobData  # Batch: tenplex.elastic.Batch, reached through this module
from .idle import IdleRanks
from .saves import SaveAccounting
from .policy import Choice, choose

if TYPE_CHECKING:
    from ..dataset import DatasetState
    from ..dataset.torch_data import RankDataset

log = logging.getLogger(__name__)
DATASET_KEY = "tenplex.dataset"  # where the data position travels in the saved ``extra``
EXTRA_KEY = "user"               # the user's own ``extra`` dict


def auto_interval(save_s: float, step_s: float, budget: float = 0.05) -> int:
    """The smallest number of steps between saves with ``save_s <= budget * interval * step_s`` (at least 1)."""
    if save_s <= 0 or step_s <= 0:
        return 1
    return max(1, math.ceil(save_s / (budget * step_s) - 1e-9))


@dataclass
class Restored:
    """What :meth:`Job.restore` found: the step (0 for a fresh start), the version, whether data moved, timing."""

    step: int
    version: int | None
    transformed: bool
    plan_stats: dict
    seconds: float
    saved_version: int | None = None   # the version that was saved (``version`` may be a transformed copy of it)
    read_through: bool = False         # the ranks read the plan's regions from other hosts' stores (no new version)
    lost_steps: int = 0                # steps an earlier world finished beyond ``step`` (:mod:`.progress`)
    lost_steps_total: int = 0          # the job's lost steps in all, this restore's included
    bytes: dict = field(default_factory=dict)  # this rank's tensor bytes by source: memory, this_host, other_hosts


class Job(worlds.InPlaceWorlds, JobData, IdleRanks, SaveAccounting):
    """One rank of an elastic job (see the module docstring).

    ``dataset``: a packed tenplex dataset directory (``tenplex data pack``), or
    None if the script reads its data itself (the position is then the step).
    ``seed``: the seed of the dataset's sample order, used when the job starts
    fresh (a restored job keeps the order it saved). ``group``: the process
    group of the training ranks when the policy leaves ranks idle, else None,
    which ``torch.distributed`` takes as the default group (all ranks train).
    Arguments left at None take the settings the launcher put in the
    environment (``TENPLEX_MAX_TP``, ``TENPLEX_PP``, ``TENPLEX_PINNED``,
    ``TENPLEX_REPLICAS``, ``TENPLEX_SAVE_INTERVAL``, ``TENPLEX_DATASET``: the
    operator's worker pods; :mod:`tenplex.elastic.envsettings`); explicit
    arguments win.
    ``max_tp`` (default 8), ``pp``, ``pinned``, ``policy``: the configuration policy
    (:func:`tenplex.elastic.policy.choose`). ``save_every``: steps between
    periodic saves (None: automatic, at most ``save_budget`` of the time; 0:
    only when stopping). ``timeout``: how long a collective may wait for a
    peer before the rank gives up (a dead node that sent no reset; gloo's
    point-to-point receives, as in pipelining, ignore it and wait until the
    host's TCP gives up on the peer: see ``net.ipv4.tcp_retries2``).
    ``snapshots`` (default True): periodic saves are snapshots, staged at the
    boundary and committed in the background (a failed one is logged, training
    goes on). ``on_save(info)`` runs on every rank after each committed save,
    and after each snapshot is staged (``info``: step, version, why — periodic,
    snapshot, stopping, final, requested —, seconds the loop was blocked, and the
    replication lag in steps), for example to log it; ``on_exit(code, why)``
    runs before the job exits at a step boundary (stopping, or a peer gone). ``replicas``: copies
    of each region that no other host holds, made in the background after
    each save (None: one when there are two or more hosts; see
    :class:`tenplex.Checkpointer`); a stopping job waits up to
    ``replication_wait`` seconds for the copies of its last save.
    ``checkpointer_options`` go to :class:`tenplex.Checkpointer` (``keep``,
    ``token``, …).
    """

    def __init__(self, *, global_batch: int, dataset: str | os.PathLike | None = None, seed: int = 0,
                 drop_last: bool = True, max_tp: int | None = None, pp: int | None = None,
                 pinned: Mapping[int, ParallelConfig | str] | None = None,
                 policy: Callable | None = None, save_every: int | None = None, save_budget: float = 0.05,
                 replicas: int | None = None, backend: str = "gloo", timeout: float = 120.0,
                 checkpointer_options: Mapping[str, Any] | None = None, on_save: Callable[[dict], None] | None = None,
                 on_exit: Callable[[int, str], None] | None = None, replication_wait: float = 10.0,
                 snapshots: bool = True):
        # Arguments left out (None) take the launcher's settings: the operator's pods set them (envsettings).
        given: dict[str, Any] = {"max_tp": max_tp, "pp": pp, "pinned": pinned, "replicas": replicas,
                                 "save_every": save_every, "dataset": dataset}
        given.update({k: v for k, v in settings_from_env(os.environ).items() if given[k] is None})
        caps = {} if given["max_tp"] is None else {"max_tp": given["max_tp"]}  # else choose()'s default
        pp, pinned = given["pp"], given["pinned"]
        replicas, save_every, dataset = given["replicas"], given["save_every"], given["dataset"]
        if save_every is not None and save_every < 0:
            raise ConfigError(f"save_every must be None (automatic), 0 (only when stopping) or positive, got "
                              f"{save_every}")
        self._policy: dict[str, Any] = {"caps": caps, "pp": pp, "pinned": pinned, "policy": policy}
        self.started = time.time()
        self.global_batch, self.dataset, self.seed, self.drop_last = global_batch, dataset, seed, drop_last
        self.save_every, self.save_budget, self.on_save, self.on_exit = save_every, save_budget, on_save, on_exit
        self.checkpointer_options = dict(checkpointer_options or {}, replicas=replicas)
        self.replication_wait = replication_wait
        self.snapshots = snapshots
        self._init_state()
        self.metrics = JobMetrics.from_environment()  # served when tenplex run --metrics-port set the port
        # tenplex run --in-place: the worlds form on the rendezvous store, in this process (tenplex.elastic.worlds)
        self._membership = worlds.membership_from_environment(timeout, backend)
        if self._membership is None:
            if not dist.is_initialized():
                init_process_group(backend, timeout=timeout)
            self._enter_world(None)
        else:
            self._membership.register()  # warm: imported, connected; only now may the running world change
            self._enter_world(self._membership.join())
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _enter_world(self, generation) -> None:
        """This rank's place in the world that just formed (torchrun's, or generation ``generation`` in place):
        rank, hosts, the configuration the policy chose, the training ranks' group."""
        from ..integration.exchange import all_gather_json

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.host = os.environ.get("TENPLEX_HOST", f"h{self.rank // per_node}")
        # Node order is rank order, as torchrun numbers them. (Store addresses need no exchange here: every save
        # records them, from each rank's TENPLEX_STORE_ADDRESS, which tenplex run sets.)
        peers = all_gather_json({"host": self.host, "token": f"{time.time_ns():x}-{os.getpid()}"})
        self.hosts = list(dict.fromkeys(p["host"] for p in peers))
        self.world_id = peers[0]["token"]  # names this world (rank 0's token) in logs; the same on every rank
        sizes, names = _node_shape(peers, self.hosts, per_node)
        p = self._policy
        self.choice: Choice = choose(self.world_size, sizes, **p["caps"], pp=p["pp"], pinned=p["pinned"],
                                     policy=p["policy"], hosts=names)
        # Ranks left idle by the policy train nothing: the others save, restore and agree within their own group
        # (every rank drops it before the world's groups are destroyed: InPlaceWorlds._next_world, Job._leave).
        self.group = dist.new_group(list(self.choice.ranks)) if self.choice.idle else None
        logs.from_environment(host=self.host, world=self.world_id)
        self.metrics.observe_world(self.world_size, self.config)
        self.world = worlds.generation_world(generation, self.rank, self.world_size, self.config)
        log.info("rank %d of %d in world %s: %s", self.rank, self.world_size, self.world_id, self.config.describe())

    def _init_state(self) -> None:
        """What the job carries from world to world: the step, the data position, the save schedule, costs."""
        self.step = 0
        self.extra: dict = {}
        self.restored: Restored | None = None
        self._saved_step: int | None = None
        self._committed_blocking: int | None = None
        self._tracked: dict[str, Any] | None = None
        self._progress: progress.ProgressRecord | None = None  # this host's record, on its first training rank
        # (first step, RankDataset, micro-batches) of the current stretch
        self._data: tuple[int, RankDataset, list[list[int]]] | None = None
        self._data_start = 0
        self._state0: DatasetState | None = None
        # This rank's directory of the node's dataset view, switched to this world (tenplex run --data-mount)
        self._data_view: Path | None = None
        self._terminated_at: float | None = None
        self._last_boundary = time.monotonic()
        self._step_s = 0.0            # agreed (max over ranks) duration of the last step, without saving
        self._save_s = 0.0            # agreed duration of the last save
        self._save_s_local = 0.0      # this rank's duration of its last save, until the next boundary shares it
        self._step_waited = 0.0       # the checkpointer's step_waited_s at the last boundary (_snapshot_boundary)
        self._next_save: int | None = None
        self._cost = {"saves": 0, "save_s": 0.0, "steps": 0, "train_s": 0.0}
        self._replication_lag = 0     # agreed (max over ranks), in steps
        self.idle_worlds: list[int] = []  # in place: the generations this process idled through
        self._init_worlds()

    # ----------------------------------------------------------------- configuration
    @property
    def config(self) -> ParallelConfig:
        """The parallel configuration of the ranks that train in this world."""
        return self.choice.config

    @property
    def idle(self) -> bool:
        return self.choice.is_idle(self.rank)

    @property
    def coords(self) -> dict[str, int]:
        """This rank's (pp, dp, tp) coordinates in :attr:`config`."""
        pp, dp, tp = self.config.coords(self.choice.position(self.rank))
        return {"pp": pp, "dp": dp, "tp": tp}

    # ----------------------------------------------------------------- restore
    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, scheduler=None,
                scaler=None, annotations=None, coords: Mapping[str, int] | None = None) -> int:
        """Restore model, optimizer, scheduler, scaler, RNG and the data position in one call; returns the step.

        A fresh job (nothing saved) keeps its state and starts at step 0. The
        same objects are saved at every later step boundary. Collective. A second call settles the snapshot in
        flight and closes the earlier call's checkpointer first.
        """
        import tenplex

        if self.idle:
            raise ConfigError(f"rank {self.rank} is idle in this world ({self.choice.reason}); idle ranks train "
                              f"nothing: call job.wait_idle() instead")
        self._check_model_is_parallel(model, annotations)
        begin = time.monotonic()
        if self._tracked is not None:  # restored before: its snapshot in flight is the newest state, then stop it
            self._tracked["checkpointer"].wait_snapshot()
            self._tracked["checkpointer"].close()
        ckpt = tenplex.Checkpointer(coords=dict(coords or self.coords), group=self.group, **self.checkpointer_options)
        # Hosts outside this world (hung, or gone) whose stores may hold newer versions (tenplex.elastic.progress)
        kv = progress.job_key_value()
        known, decided = progress.known_stores(kv, self.host, ckpt.store_address, self.local_rank == 0), \
            progress.decided_step(kv)
        ckpt.stores = {**{h: a for h, a in known.items() if h not in self.hosts}, **ckpt.stores}
        extra: dict = {}
        # In place, a survivor's old model and optimizer may hold the restored version: taken from memory
        step = ckpt.restore(model, optimizer, scheduler=scheduler, scaler=scaler, annotations=annotations,
                            extra=extra, memory=self._kept)
        self._kept = None  # the old world's tensors go now; kept for the next world when a peer died meanwhile
        info = ckpt.last_restore
        self.step = step or 0
        self.extra = dict(extra.get(EXTRA_KEY) or {})
        self._tracked = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler,
                         "annotations": annotations, "checkpointer": ckpt}
        self._saved_step = step
        self._committed_blocking = step  # the restored version is committed
        self._remember_save(info.version)  # the tensors hold it now
        gathered = progress.gather(ckpt.store.root, self.host, self.world_id, self.step, self.group, decided)
        progress.settle_decided(kv, self.step, dist.get_rank(self.group) == 0)  # a loss is counted once
        self._progress = gathered.record
        if self.dataset is not None:
            self._open_data(extra.get(DATASET_KEY))
            # tenplex run --data-mount: switch this node's view to this world before anyone reads (collective)
            self._data_view = dataview.follow(self, self.data_state)
        self.restored = Restored(self.step, info.version, info.transformed, dict(info.plan_stats),
                                 time.monotonic() - begin, info.saved_version, info.read_through,
                                 gathered.lost, gathered.lost_total, dict(info.bytes))
        self.metrics.observe_restore_bytes(info.bytes)
        self._last_boundary = time.monotonic()
        self.metrics.observe_restore(self.step, self._last_committed_step, gathered.lost, self._protected_step)
        if self.save_every:
            self._next_save = self.step + self.save_every
        elif self.save_every is None:
            self._next_save = self.step + 1  # measure a save early; the interval follows from it
        return self.step

    def _check_model_is_parallel(self, model: torch.nn.Module, annotations) -> None:
        """Under tp or pp > 1, fail fast when the model has no such structure (collective over the training ranks).

        A plain data-parallel script under the default ``max_tp`` would silently get tp > 1: its tp peers read
        the same batch, so every sample is trained more than once per step. Structure is a DTensor parameter,
        annotations, or ranks that hold different parameters (pipeline stages); the ranks compare a digest of
        their parameter names, shapes and dtypes (a tensor, never a pickle).
        """
        c = self.config
        if c.tp == 1 and c.pp == 1:
            return
        from torch.distributed.tensor import DTensor

        state = model.state_dict()
        structured = annotations is not None or any(isinstance(v, DTensor) for v in state.values())
        names = "\n".join(f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in sorted(state.items()))
        digest = int.from_bytes(hashlib.sha256(names.encode()).digest()[:7], "big")  # fits an int64
        seen = torch.tensor([int(structured), digest, -digest], dtype=torch.int64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.group)  # [any structured, max digest, -min digest]
        if not seen[0] and seen[1] == -seen[2]:
            raise ConfigError(
                f"the policy chose {self.choice.degrees()} for {self.world_size} ranks, but every rank holds the "
                f"same full model (no DTensor, no annotations, no pipeline stages), so each sample would be trained "
                f"{c.tp * c.pp} times per step: pass max_tp=1 to Job (TENPLEX_MAX_TP=1; spec.parallel.maxTp: 1 "
                f"on Kubernetes) for a data-parallel script, or build the model for job.config")

    # ----------------------------------------------------------------- step boundary
    def _on_sigterm(self, signum, frame) -> None:
        if self._terminated_at is None:
            self._terminated_at = time.time()

    @property
    def stop_requested(self) -> bool:
        """Whether this rank got SIGTERM (the ranks agree on it at the next :meth:`step_done`)."""
        return self._terminated_at is not None

    def step_done(self) -> None:
        """Mark the end of a step (collective): advance, agree on stopping, save when due or when stopping."""
        if self._tracked is None:
            raise ConfigError("call Job.restore(model, optimizer, …) before the first step_done()")
        inject_device_fault(self.host, worker_device(), self.step)  # tests: TENPLEX_INJECT_DEVICE_FAULT
        now = self._step_finished_at = time.monotonic()
        step_s = now - self._last_boundary
        self.step += 1
        leaving = self.stop_requested  # read once: a SIGTERM during the all-reduce counts at the next boundary
        try:
            change = 1.0 if self._in_place and self._membership.wanted else 0.0  # type: ignore[union-attr]
            lag, waited = self._snapshot_boundary()
            self._save_s_local += waited  # the last snapshot's background copies the step waited for
            self._cost["save_s"] += waited
            self.metrics.save_step_wait.inc(waited)
            flags = torch.tensor([1.0 if leaving else 0.0, step_s, self._save_s_local, float(lag), change],
                                 dtype=torch.float64)
            self._save_s_local = 0.0
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as e:  # noqa: BLE001 -- a peer is gone: nothing can be agreed, nothing is saved
            # tenplex's own collective: its failure is a lost peer, or this rank's device (faults.classify)
            if classify(e) == DEVICE:
                if self._membership is not None:  # in place the others go on at once, without this worker
                    self._membership.mark_leaving()
                self._die(f"step {self.step}: this rank's device failed ({type(e).__name__}: {e})",
                          EXIT_DEVICE_FAULT)
            if self._in_place:  # the world is over, not the process: the loop goes on in the next world
                log.warning("step %d: a peer is gone (%s: %s); leaving world %d", self.step, type(e).__name__, e,
                            self.world.generation)
                self._end_world("lost")
                return
            self._die(f"step {self.step}: the ranks cannot agree ({type(e).__name__}: {e}); a peer is gone, "
                      f"exiting without saving")
        stop, self._step_s, last_save = bool(flags[0] > 0 or flags[4] > 0), float(flags[1]), float(flags[2])
        self._replication_lag = int(flags[3])
        if self._progress is not None:  # the world finished this step: a failure from now on loses it
            self._progress.write(self.step)
        self._cost["train_s"] += self._step_s
        self._cost["steps"] += 1
        self.metrics.observe_step(self._step_s, self.step)
        if last_save > 0:
            self._save_s = last_save
            if self.save_every is None:
                # The mean step so far, not the last one alone: single steps vary a lot on a busy machine.
                mean_step = self._cost["train_s"] / self._cost["steps"]
                self._next_save = (self._saved_step or 0) + auto_interval(self._save_s, mean_step, self.save_budget)
        if stop:
            self._save("stopping")
            if self._change_in_place(leaving):  # only this world ends: the process goes on in the next one
                return
            if not self._in_place:  # a worker leaving a world in place: the others do not wait for its copies
                # The copies of this last save protect the next world against losing a host; torchrun's kill
                # timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s) bounds how long they may take. Collective.
                self._tracked["checkpointer"].wait_replicated(self.replication_wait)
            if self._membership is not None:  # none of the next worlds waits for this worker
                self._membership.mark_leaving()
            self._exit(0 if self.stop_requested else EXIT_PEER_LOST,
                       "stopped by SIGTERM" if self.stop_requested else "a peer was stopped")
        if self._next_save is not None and self.step >= self._next_save:
            self._save("snapshot" if self.snapshots else "periodic")
            if not self.world.active:  # in place, a peer died during the save
                return
            if self.save_every:
                self._next_save = self.step + self.save_every
        self._last_boundary = time.monotonic()
        if self.world.pause and "pause_s" not in self.world.pause:
            self._first_step_done()

    def save(self) -> int:
        """Save now (collective), outside the schedule; returns the version."""
        return self._save("requested")

    def _save(self, why: str) -> int:
        import tenplex

        t = self._tracked
        if t is None:
            raise ConfigError("save() before restore(): call job.restore(model, optimizer, …) first")
        extra = {EXTRA_KEY: self.extra}
        if self._state0 is not None:
            extra[DATASET_KEY] = self.data_state.to_dict()
        if self._data_view is not None:  # the operator's status.dataView reads it from the committed state
            extra[dataview.SAVED_KEY] = dataview.saved_doc(self)
        ckpt = t["checkpointer"]
        begin = time.monotonic()
        try:
            if why == "snapshot":
                # Returns once the state is staged; a write that fails later is logged and the next one is tried.
                ckpt.async_save(t["model"], t["optimizer"], step=self.step, scheduler=t["scheduler"],
                                scaler=t["scaler"], annotations=t["annotations"], extra=extra)
                version = ckpt.snapshot_stats()["staged_version"]
            else:
                version = tenplex.save(t["model"], t["optimizer"], step=self.step, scheduler=t["scheduler"],
                                       scaler=t["scaler"], annotations=t["annotations"], extra=extra,
                                       checkpointer=ckpt)
        except Exception as e:  # noqa: BLE001 -- the save was not committed anywhere (atomic commit)
            if self._in_place and classify(e) == PEER and self.world.active:  # the world is over, not the process
                log.warning("step %d: a peer is gone during the %s save (%s: %s)", self.step, why, type(e).__name__, e)
                self._end_world("lost")
                return -1
            self._die(f"step {self.step}: the {why} save failed ({type(e).__name__}: {e}); nothing was committed, "
                      f"exiting")
        seconds = time.monotonic() - begin
        self._remember_save(version)
        self._save_s_local = seconds
        self._saved_step = self.step
        self._cost["saves"] += 1
        self._cost["save_s"] += seconds
        self.last_save = {"step": self.step, "version": version, "why": why, "seconds": seconds,
                          "replication_lag": self._replication_lag, "committed_step": self._last_committed_step(),
                          "protected_step": self._protected_step()}
        if why != "snapshot":
            self._committed_blocking = self.step
        self.metrics.observe_save(blocking=seconds, background=self._background_s(), reason=why)
        logs.set_context(version=version, step=self.step)
        if self.on_save is not None:
            self.on_save(dict(self.last_save))
        return version

    def _exit(self, code: int, why: str) -> None:
        if self.on_exit is not None:
            self.on_exit(code, why)
        if not self.idle:
            self._tell_idle("stop")
        try:
            self._leave(together=self._membership is None)  # in place, the others stay: no barrier with them
        except Exception as e:  # noqa: BLE001 -- in place, the others may have left the group first: exit anyway
            if self._membership is None:
                raise
            log.warning("leaving world %d: %s: %s", self.world.generation, type(e).__name__, e)
        finally:
            if self._membership is not None:
                self._membership.close()
            sys.stdout.flush()
            sys.stderr.flush()
        raise SystemExit(code)

    def _die(self, message: str, code: int = EXIT_PEER_LOST) -> NoReturn:
        print(f"tenplex job (rank {self.rank}): {message}", file=sys.stderr, flush=True)
        if self.on_exit is not None:
            self.on_exit(code, message)
        # No destroy_process_group: with a peer gone it may wait forever. Exit now; torchrun restarts the world.
        os._exit(code)

    def finish(self) -> None:
        """End of training: a final save unless the last step is committed already (collective), and the process
        group's teardown."""
        if self._tracked is not None:
            ckpt = self._tracked["checkpointer"]
            ckpt.wait_snapshot()  # the snapshot in flight is committed, or dropped everywhere
            if self._last_committed_step() != self.step:
                self._save("final")
            self._tracked["checkpointer"].wait_replicated(self.replication_wait)
        self._tell_idle("done")
        if self._membership is not None:
            self._membership.mark_leaving()
        self._leave()
        if self._membership is not None:
            self._membership.close()

    def _leave(self, together: bool = True) -> None:
        """Leave together (unless a worker leaves a world in place alone) and free the process groups before the
        interpreter exits (see :mod:`tenplex.integration.process_group`). Idle ranks already waited for
        rank 0's word in ``_tell_idle``."""
        if not self.idle and together:
            dist.barrier(group=self.group)
        self.group = None  # freeing a group joins its gloo threads: drop every reference first
        if self._tracked is not None:
            self._tracked["checkpointer"].group = None
        leave_process_group(together=False)


def _node_shape(peers: list[dict], hosts: list[str], per_node: int) -> tuple[int | list[int], list[str] | None]:
    """(ranks per node, host names) for :func:`choose`: each host's number of ranks when every host's ranks are
    consecutive, as torchrun numbers them (nodes may run different numbers of workers, e.g. one with a failed
    GPU); else this node's ``LOCAL_WORLD_SIZE`` for every node and the default host names."""
    order = [p["host"] for p in peers]
    sizes = [order.count(h) for h in hosts]
    if sum(1 for a, b in zip(order, order[1:]) if a != b) == len(hosts) - 1:  # each host's ranks in one run
        return sizes, hosts
    return per_node, None
