"""Save and restore a parallel PyTorch job's state through the per-host tensor stores.

May import: every layer below it (``tenplex.store``, ``tenplex.transform``,
``tenplex.planner``, ``tenplex.layout``, …), torch and torch.distributed.

Save (every rank, collectively):

1. map model and optimizer state to pieces (:mod:`.pieces`);
2. all-gather every rank's tensor specs and boxes as JSON (no pickles); within
   a host, only the first rank holding a given box writes it (replicas on one
   host would be identical copies); a replicated buffer is written with the
   lowest holding rank's values on every host (:mod:`.canonical`);
3. each rank stages its shards as one part of version N+1 in its host's store
   (memory-mapped, no network); the first rank of each host adds the whole
   layout and the non-tensor state (``tenplex.torch_state``);
4. once every rank prepared its part, each host commits. A failure anywhere
   aborts the staged version everywhere and raises on every rank;
5. the version records every host's store address (``tenplex.stores``), and the
   first rank of each host starts pulling, in the background, its copies of
   the regions that only one other host holds (``replicas``; see
   :mod:`tenplex.replication`).

Restore (every rank, collectively):

1. the new layout comes from the ranks' own model and optimizer (or is given);
2. the newest version that the available hosts can assemble completely is
   chosen; its layout and state document are broadcast from a rank whose host
   has it. Available: the hosts of the job that hold it, and hosts that left
   but whose recorded store still answers with it. When a host of the version
   is gone (it left and its store does not answer, or it is back in the job
   with an empty store), its regions come from the copies the job's hosts
   hold: they first put together a new version from their own shards and
   those copies (hard links, :mod:`tenplex.replication.promote`). A version
   some region of which no available host holds is skipped; when no version
   is left and a host that left took regions with it,
   :class:`~tenplex.replication.LostStateError` names what was lost;
3. mismatches (a tensor missing on either side, a shape or dtype change, an
   optimizer of another kind) raise StateMismatchError on every rank;
4. if every box a rank needs can be assembled from shards stored on its own
   host, the rank reads them straight from the store files; otherwise every
   rank plans the change (``tenplex.planner``, deterministic). When no region is
   fanned out and every host the plan reads from is in the job, every rank
   reads its own transfers of the plan into its tensors, locally or from other
   hosts' stores (:mod:`.readthrough`), and no version is made; otherwise, or
   when such a read fails, the stores run the plan (``tenplex.transform``) into
   a new version on the job's hosts, and every rank reads from it;
5. non-tensor state is applied (what happens to each kind: the README, "Saving and restoring PyTorch state").

The pieces live in :mod:`.savedoc` (the save's JSON documents and what every rank derives from them),
:mod:`.commit` (stage, then commit on every host or on none), :mod:`.layouts` (steps 1-3 of both),
:mod:`.versions` (step 2 of the restore), :mod:`.restoring` (steps 4-5) and :mod:`.moves` (step 4's
read-through and transformation).
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from concurrent.futures import Future
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..devices import host_of, parse_host_addresses
from ..errors import ConfigError
from ..layout import Layout
from ..replication.copier import Replicator, held_versions
from ..replication.stores import STORES_DOC, stores_doc
from ..store import Store
from .annotate import Annotations
from .canonical import canonical_buffers
from .commit import stage_and_commit
from .durable import DurableTier
from .exchange import agree, all_gather_json
from .layouts import check_and_build, check_optimizer, specs_of, state_pieces
from .pieces import Piece, init_optimizer_state, state_owners
from .memory import Kept
from .restoring import Reach, RestoreInfo, apply_state, bring_within_reach, read_local
from .rollforward import PARTS_DOC, parts_doc, roll_forward
from .savedoc import SaveRound, coord_key, rank_doc, replica_count, state_doc
from .shardio import write_piece
from .snapshot import Snapshotter
from .versions import STATE_DOC, VersionFinder

log = logging.getLogger(__name__)
_LIVE: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()  # their background copies are cancelled at exit


class Checkpointer:
    """Where this rank's state goes: its host's store directory, its device id, the other hosts' stores.

    Every argument has an environment default, so that whatever launches the
    workers configures the job and the training script only calls
    :func:`tenplex.save` / :func:`tenplex.restore`: ``tenplex run``
    (:mod:`tenplex.elastic.launcher`, in each worker pod of the Kubernetes
    operator too), :func:`tenplex.runtime.launch.run_job` (``tenplex demo``),
    or any torchrun wrapper that sets the variables:

    * ``store_root``: ``TENPLEX_STORE_ROOT`` — this host's store directory;
    * ``host``: ``TENPLEX_HOST`` (default ``h0``);
    * ``device``: ``TENPLEX_DEVICE`` (default ``HOST/LOCAL_RANK``);
    * ``store_address``: ``TENPLEX_STORE_ADDRESS`` — this host's store server
      (``tenplex run`` sets it). Every save records the address of every host's
      store, so a restore that moves data between hosts, and replication, find
      them without a list;
    * ``stores``: ``TENPLEX_STORES`` = ``h0=127.0.0.1:5000,h1=…`` — an override:
      addresses of hosts' store processes, preferred to the recorded ones;
    * ``replicas``: copies of every region that only one host holds, kept on
      the next hosts of a ring (see :mod:`tenplex.replication`) and pulled in
      the background after each save. None (default): one copy when the job
      spans two or more hosts; 0: off. :meth:`wait_replicated` waits for them.
      The next save and the process's exit cancel copies still running: wait
      after the last save before a planned exit, or that save has no copies;
    * ``coords``: this rank's parallel coordinates, for example
      ``{"pp": 0, "dp": 1, "tp": 0}``; RNG states are keyed by them (default: the rank);
    * ``keep``: committed versions kept per store after a save (default 2);
    * ``group``: the process group (default: the world);
    * ``token``: ``TENPLEX_TOKEN`` — the shared token of stores bound beyond loopback;
    * ``durable``: ``TENPLEX_DURABLE`` = ``s3://BUCKET/PREFIX`` — flush saved versions to a bucket in the
      background and restore from it when it holds a newer version than every host (see :mod:`.durable`).
    """

    def __init__(self, store_root: str | os.PathLike | None = None, host: str | None = None,
                 device: str | None = None, stores: Mapping[str, str] | None = None,
                 coords: Mapping[str, int] | None = None, keep: int = 2, group=None, token: str | None = None,
                 store_address: str | None = None, replicas: int | None = None, durable: str | None = None):
        env = os.environ
        root = store_root or env.get("TENPLEX_STORE_ROOT")
        if not root:
            raise ConfigError("no store directory: pass store_root= or set TENPLEX_STORE_ROOT")
        self.host = host or env.get("TENPLEX_HOST", "h0")
        self.device = device or env.get("TENPLEX_DEVICE") or f"{self.host}/{env.get('LOCAL_RANK', '0')}"
        if host_of(self.device) != self.host:
            raise ConfigError(f"device {self.device} is not on host {self.host}; device ids are HOST/INDEX")
        self.store = Store(root, self.host)
        self.stores = (dict(stores) if stores is not None
                       else parse_host_addresses(env.get("TENPLEX_STORES", ""), "TENPLEX_STORES"))
        self.coords = dict(coords) if coords is not None else None
        self.keep = keep
        self.group = group
        self.token = token or env.get("TENPLEX_TOKEN")
        self.store_address = store_address or env.get("TENPLEX_STORE_ADDRESS") or self.stores.get(self.host)
        if replicas is not None and replicas < 0:
            raise ConfigError(f"replicas must be >= 0 (0: no copies) or None (the default), got {replicas}")
        self.replicas = replicas
        self.last_restore = RestoreInfo()
        self._replicator: Replicator | None = None
        self._replicated_version: int | None = None  # the last saved version, once replication was set up
        self.last_replication: list[dict] = []  # every host's copier status, as the last wait_replicated saw it
        self._snapshots: Snapshotter | None = None  # made by the first async_save
        self.durable = DurableTier.from_env(durable, self.store)  # s3://BUCKET/PREFIX, or TENPLEX_DURABLE
        _LIVE.add(self)

    # ------------------------------------------------------------------ save
    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int,
             extra: Any = None, scheduler=None, scaler=None, annotations: Annotations | None = None,
             rng: bool = True) -> int:
        """Save the state at ``step`` as a new version on every host; returns the version. Collective."""
        rank = dist.get_rank(self.group)
        if self._snapshots is not None:
            self._snapshots.settle()  # a snapshot in flight is committed (or dropped) first: versions stay ordered
            self._snapshots.resync()  # the next snapshot numbers its version after this one
        self._cancel_replication()  # the new version supersedes the one still being copied
        pieces = [p for p in state_pieces(model, optimizer, annotations) if not p.box.is_empty()]
        docs = all_gather_json(self.rank_doc(pieces, rank, rng, model, optimizer), self.group)
        round_ = agree("save: check tensors", lambda: SaveRound.of(docs, self.host, self.stores), self.group)
        canonical = canonical_buffers(pieces, docs, round_.writers, rank, self.group)  # replicas may differ
        version = round_.next_version()
        leader = rank == round_.leader
        replicas = agree("save: check the replicas", lambda: self.replica_count(round_), self.group)
        saved: list[Layout] = []

        def stage():
            with self.store.begin(version, part=f"rank{rank}") as writer:
                for piece in pieces:
                    if round_.writers[(self.host, piece.name, piece.box)] == rank:
                        write_piece(writer, self.device, canonical.get((piece.name, piece.box), piece))
                if leader:
                    saved.append(round_.layout())
                    writer.put_layout(saved[0])
                    writer.put_json(STATE_DOC, state_doc(docs, step, extra, scheduler, scaler, optimizer))
                    writer.put_json(STORES_DOC, stores_doc(version, {h: round_.addresses.get(h) for h in round_.ring},
                                                           replicas, round_.ring))
                    writer.put_json(PARTS_DOC, parts_doc(round_.all_parts()))
                writer.prepare()

        # Name the parts: a crashed earlier attempt may have left other ranks' parts of this version staged.
        stage_and_commit(self.store, self.group, f"save of step {step}", version, stage, round_.parts, leader)
        if leader:
            self.store.gc(self.keep)
            if self.durable is not None:
                self.durable.saved()
            if replicas:
                self._replicator = Replicator(self.store, version, saved[0], replicas, round_.addresses,
                                              token=self.token, keep=self.keep).start()
        self._replicated_version = version
        return version

    def rank_doc(self, pieces: list[Piece], rank: int, rng: bool, model, optimizer) -> dict:
        """This rank's save document (:func:`.savedoc.rank_doc`): where it is, what it holds, its RNG."""
        return rank_doc(pieces, device=self.device, host=self.host, latest=self.store.latest(),
                        store=self.store_address, coord=self.coord_key(rank), rng=rng, model=model,
                        optimizer=optimizer)

    def replica_count(self, round_: SaveRound) -> int:
        """Copies of each single-host region for this save (:func:`.savedoc.replica_count`)."""
        return replica_count(self.replicas, round_.addresses, round_.ring, dist.get_rank(self.group))

    def coord_key(self, rank: int) -> str:
        """The key of this rank's RNG streams in the state document."""
        return coord_key(self.coords, rank)

    # -------------------------------------------------------------- snapshots
    def async_save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int,
                   extra: Any = None, scheduler=None, scaler=None, annotations: Annotations | None = None,
                   rng: bool = True) -> Future:
        """Snapshot the state at ``step``: stage it in host memory and return; a background thread stores it as a
        new version and commits it on every host or on none. Collective (every rank calls it at the same step).

        The state is copied before the next ``optimizer.step()`` can change it, so the training loop goes on at
        once: buffers, GPU tensors and every tensor of a snapshot that exchanges are copied before the call returns;
        between exchanges, the CPU tensors only the optimizer changes (parameters, optimizer states) are copied by
        the background thread while the next forward and backward run, and that step's ``optimizer.step()`` waits
        for those copies (a step pre-hook; a change made elsewhere in place meanwhile fails that snapshot:
        :mod:`tenplex.integration.snapshot_defer`). At
        most one snapshot is in flight per rank: the call first waits until this rank's previous snapshot is
        written, and settles it (committed everywhere, or dropped everywhere and logged). The returned future
        resolves when it is settled, at the next ``async_save``, :meth:`save` or :meth:`wait_snapshot`: to the
        version, or to :class:`~tenplex.integration.snapshot.SnapshotError` (training goes on). Protocol, and
        what a reader sees meanwhile: :mod:`tenplex.integration.snapshot`; :meth:`snapshot_stats` reports the
        blocking and background seconds and the staging memory (at most one copy of the rank's state)."""
        if self._snapshots is None:
            self._snapshots = Snapshotter(self)
        return self._snapshots.snapshot(model, optimizer, step=step, extra=extra, scheduler=scheduler,
                                        scaler=scaler, annotations=annotations, rng=rng)

    def wait_snapshot(self) -> int | None:
        """Settle the snapshot in flight (wait for its write; commit or drop it on every host); returns the newest
        committed snapshot's version (None: none yet). Collective."""
        return None if self._snapshots is None else self._snapshots.settle()

    def snapshot_stats(self) -> dict:
        """This rank's snapshots: counts (snapshots, committed, failed), the seconds the training loop was blocked
        (total, last, of which waiting for the previous write), the last background write and commit seconds,
        the staging bytes, the last snapshot's bytes linked unchanged from the previous one (``linked_bytes``), the
        snapshots committed a boundary late because the job's key-value store did not answer (``late_commits``),
        the newest committed and replicated steps and the replication lag in steps, whether the last committed
        snapshot holds every region on two hosts or more (``spread``) and its copies per region (``copies``),
        and ``protected_step``: the newest committed step that survives the loss of any one host as this rank
        sees it (the committed one when ``spread``; else the newest whose copies this rank pulled; None: none).
        ``step_waited_s`` (and ``last_step_wait_s``): the seconds ``optimizer.step()`` waited for the background
        thread's copies, ``deferred_bytes``: the staging bytes that thread copies (:mod:`.snapshot_defer`)."""
        if self._snapshots is None:
            return {}
        stats = dict(self._snapshots.stats)
        stats["replication_lag"] = self._snapshots.replication_lag()
        return stats

    # ----------------------------------------------------------- replication
    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) for the copies of the last saved version. Collective.

        True on every rank when every copy the replication rule asks for is
        committed on its host (trivially so when it asks for none: ``replicas=0``
        or one host); False when some copy failed, was cancelled, is not done in
        time, or nothing was saved yet. :meth:`replication_status` says why.
        """
        if self._snapshots is not None:
            self._snapshots.wait_copies(timeout)  # the newest committed snapshot's copy, retries included, is done
        replicator = self._replicator
        ok = self._replicated_version is not None and (replicator is None or replicator.wait(timeout))
        reports = all_gather_json({"host": self.host, "ok": ok,
                                   "status": None if replicator is None else replicator.status()}, self.group)
        self.last_replication = [r for r in reports if r["status"] is not None]
        return all(r["ok"] for r in reports)

    def replication_status(self) -> dict | None:
        """This process's copies of the last saved version: version, state (pending, running, replicated,
        failed, cancelled), copies, bytes, seconds, error; None when this rank pulls none."""
        return None if self._replicator is None else self._replicator.status()

    def close(self) -> None:
        """Cancel background replication (its staged copy is dropped; committed copies stay) and stop waiting for a
        snapshot's commit decision (a snapshot not settled stays uncommitted)."""
        if self._snapshots is not None:
            self._snapshots.close()
        self._cancel_replication()
        if self.durable is not None:
            self.durable.close()

    def _cancel_replication(self) -> None:
        if self._replicator is not None:
            self._replicator.cancel()

    # --------------------------------------------------------------- restore
    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                extra: dict | None = None,
                scheduler=None, scaler=None, annotations: Annotations | None = None, rng: bool = True,
                layout: Layout | None = None, version: int | None = None, memory: Kept | None = None) -> int | None:
        """Load the newest saved state into ``model`` and ``optimizer`` (in place); return its step. Collective.

        Returns None when no state was saved yet (the optimizer then holds its
        fresh, zeroed state). ``extra``, if given, is updated with the saved
        ``extra`` dict. Without an optimizer only the model is restored and the
        saved optimizer state is ignored. ``layout`` is a new
        layout made in advance (by partition rules) to plan with instead of
        the one gathered from the ranks; it must give every rank what it needs. ``memory``: this rank's state
        kept from the world before (a survivor in place, :mod:`.memory`); the regions it still holds of the
        restored version are copied from it, not read from a store (``last_restore.bytes`` counts each kind).
        """
        rank = dist.get_rank(self.group)
        if self._snapshots is not None:
            self._snapshots.wait_staged()  # the writer thread's copies of the tensors this changes are made
            self._snapshots.resync()  # the state and the newest version may change here
        roll_forward(self.store, self.group)  # a version whose commit decision was lost with a host

        def pieces_for(saved_tensors, scalars) -> list[Piece]:
            if optimizer is not None:  # state for exactly the parameters that had some when saved
                init_optimizer_state(optimizer, state_owners(saved_tensors, scalars), model)
            return [p for p in state_pieces(model, optimizer, annotations) if not p.box.is_empty()]
        if self.durable is not None and version is None:
            self.durable.restore_if_newer(self.host, self.device, pieces_for, layout, optimizer is not None, self.group)
        mine = {"device": self.device, "host": self.host, "versions": self.store.versions(),
                "copies": held_versions(self.store.root, self.host), "store": self.store_address}
        docs = all_gather_json(mine, self.group)
        found = VersionFinder(self.store, self.host, self.stores, self.token, self.group).find(docs, version)
        if found is None:
            if optimizer is not None:
                init_optimizer_state(optimizer)
            return None

        pieces = agree("restore: map the state to tensors",
                       lambda: pieces_for(found.layout.tensors, found.state["scalars"]), self.group)
        held = all_gather_json({"tensors": specs_of(pieces), "boxes": [[p.name, list(p.box.offsets),
                                                                       list(p.box.lengths)] for p in pieces]},
                               self.group)
        docs = [{**d, **h} for d, h in zip(docs, held)]
        new = agree("restore: check the new layout",
                    lambda: check_and_build(found.layout, docs, layout, self.device, pieces,
                                            with_optimizer=optimizer is not None), self.group)
        if optimizer is not None:
            agree("restore: check the optimizer", lambda: check_optimizer(optimizer, model, found.state), self.group)
        info = RestoreInfo(version=found.version, saved_version=found.version, step=found.state["step"],
                           lost_hosts=found.lost_hosts, skipped=found.skipped,
                           replica_devices={d: list(v) for d, v in found.replica_devices.items()})
        # A survivor in place: what it still holds of this version comes from its memory (every rank takes part)
        own = None if memory is None else memory.usable(found.version, found.layout.tensors)
        agree("restore: copying the regions kept in memory", lambda: None if own is None else own.fill(pieces),
              self.group)
        info.bytes["memory"] = own.bytes if own is not None else 0
        sources = bring_within_reach(Reach(self.store, self.device, self.token, self.group, self.stores), found, new,
                                     docs, pieces, info, own)
        if sources is not None:
            tiles, counts = sources.get(self.device, {}), None if info.plan_stats else info.bytes  # None: counted
            version = info.version
            assert version is not None
            agree(f"restore: reading version {version}",
                  lambda: read_local(self.store, version, tiles, pieces, own, counts), self.group)
        apply_state(found.state, model, optimizer, scheduler, scaler, extra, rng, self.coord_key(rank))
        self.last_restore = info
        return found.state["step"]


@atexit.register
def _cancel_replication_at_exit() -> None:
    for ckpt in list(_LIVE):
        ckpt.close()
