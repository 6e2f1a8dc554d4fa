"""Snapshots: a save that returns once the state is staged in host memory; a background thread stores and commits it.

May import: ``tenplex.box``, ``tenplex.errors``, ``tenplex.integration`` (canonical, exchange, jobstore, nontensor,
pieces, rollforward, savedoc, snapshot_agree, snapshot_buffers, snapshot_copies, snapshot_defer, snapshot_pieces,
snapshot_round, snapshot_step, snapshot_writer, versions), torch.distributed and the standard library.

A snapshot is a version like any other: the same parts, manifest and commit
as :meth:`Checkpointer.save`, so a restore (into any layout) reads it
unchanged. What differs is when the work happens (README, "Snapshots every step"):

1. **At the step boundary** (the training thread): the rank waits until its previous snapshot's write is done
   and, once every rank reaches the job's key-value store, until its commit is decided (back-pressure: at most
   one snapshot in flight per rank; its future resolves here). It copies the pieces it writes into reused
   staging buffers (:mod:`.snapshot_buffers`), reads its RNG streams and optimizer scalars, and returns; between
   exchanges the CPU pieces only ``optimizer.step()`` changes, and the optimizer's scalars, are the writer
   thread's, before the next step (:mod:`.snapshot_defer`: a step pre-hook waits for them). A
   piece unchanged since the previous snapshot, which committed and is the newest version (same storage, same
   in-place version counters, :attr:`Piece.version`: frozen parameters), is not staged at all.
   No collective runs here while the world's layout stays: who writes which box, the host leaders and the
   version numbers follow from the last **exchange**, one small all-gather of JSON (every rank's tensors and
   boxes, RNG state, optimizer scalars, whether it reaches the store, and the outcome of the previous snapshot:
   settled below). The exchange runs at the first snapshot, and again after a snapshot was aborted, after a
   blocking save or a restore, while some rank cannot reach the job's store, and where replicated buffers
   must be made canonical (:mod:`.canonical`). A rank whose state's structure changed cannot write its part
   under the old layout: it aborts that snapshot (``snapshot_stats()["dropped"]``) and the next one exchanges.
2. **In the background** (one thread per rank): the rank posts its step document (scalars and RNG streams:
   :mod:`.snapshot_agree`) to the job's store, writes its buffers as its part of version N, hard-links the
   unchanged pieces' files from version N-1 (a link that fails, EXDEV say, copies the file's bytes) and
   prepares the part; the first rank of each host adds the state document (made at the boundary, its RNG
   streams and scalars from every rank's step document) and the layout and stores documents.
3. **The commit, through the job's key-value store** (the c10d TCPStore at
   ``MASTER_ADDR:MASTER_PORT``; a client connection of the thread's own, not
   the process group): each rank that prepared adds 1 to the version's
   counter; the rank that brings it to the world size decides ``commit``; a
   rank whose write failed decides ``abort`` (the first decision stands). Every rank reads
   the decision; the first rank of each host commits (or drops) its host's parts. No
   rank commits before every rank prepared, so a rank killed during its
   write leaves the version uncommitted everywhere.
4. **Settled at the next boundary** (or :meth:`Checkpointer.wait_snapshot`, or
   a blocking save) from the decision. Where some rank could not reach the store, the outcomes travel in that
   boundary's exchange instead; hosts that did not commit yet commit then (an
   ``agree`` that only runs when needed), a failure anywhere takes the version
   back on every host and is logged once, on the rank where it happened. The
   returned future resolves there: to the version, or to :class:`SnapshotError`.

Meanwhile a reader (a restore after a failure) sees the previous committed
version as the newest on a host until that host's commit; a version that
some host lacks is never restored from (the restore's version choice).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable

import torch.distributed as dist

from ..box import Box
from ..errors import TenplexError
from .canonical import canonical_buffers
from .exchange import agree, all_gather_json
from .jobstore import JobKeyValue
from .pieces import Piece
from .rollforward import PARTS_DOC, parts_doc
from .savedoc import SaveRound, state_doc, world_group_names
from .snapshot_agree import ABORT, COMMIT
from .snapshot_buffers import SnapshotBuffers
from .snapshot_copies import SnapshotCopies
from .snapshot_defer import Capture, DeferredStaging
from .snapshot_pieces import PiecesCache
from .snapshot_round import RoundCache
from .snapshot_step import ScalarReader, read_at_boundary
from .snapshot_writer import InFlight, SnapshotWriter
from .versions import STATE_DOC

log = logging.getLogger(__name__)
FIRST_CONNECT_S = 2.0  # how long the first exchange waits for the job's key-value store to answer
FULL_LOOK_EVERY = 16  # snapshots between two that fingerprint every piece (see Snapshotter._fingerprints)
CLOSE_JOIN_S = 10.0  # how long close() waits for the writer and copier threads to end (each finishes its item)
_ABORTED = "aborted by another rank"  # a rank's report when it did not prepare because another rank decided abort


class SnapshotError(TenplexError, RuntimeError):
    """A snapshot was not committed (its write failed on some rank); training goes on, the next one is tried."""


class Snapshotter:
    """The snapshots of one :class:`~tenplex.Checkpointer` (see the module docstring)."""

    def __init__(self, ckpt) -> None:
        self.ckpt = ckpt
        self.staging = SnapshotBuffers()
        self.inflight: InFlight | None = None
        self._kv = JobKeyValue()
        self._kv.connect_soon()  # so that the first exchange may already find every rank connected
        self.rounds = RoundCache(ckpt)
        self.pieces = PiecesCache()
        self.scalars = ScalarReader()
        # The newest committed snapshot, its pieces' fingerprints (those compared next time) and whether they are all
        self._unchanged_base: tuple[int, dict[tuple[str, Box], tuple], bool] | None = None
        self._closed = False  # close() was called
        self._own_cache: tuple[Any, dict, int, list[int], list[tuple[str, Box]], dict] | None = None  # see _own
        self._roles: tuple[dict, int, list, dict] | None = None  # see _canonical_roles
        self._names: tuple[list[dict], int, list[list[str]]] | None = None  # see _group_names
        # Between exchanges (every rank reached the job's store at the last one): the world's key prefix, the
        # last staged version and its keys' prefix, the copies per region.
        self._fast = False  # the next snapshot may skip the exchange (set by each exchange: see _exchange)
        self._world_key: str | None = None
        self._version = 0
        self._replicas = 0
        self._last_key: str | None = None
        self.stats: dict[str, Any] = {"snapshots": 0, "committed": 0, "failed": 0, "dropped": 0, "exchanges": 0,
                                      "blocking_s": 0.0,
                                      "waited_s": 0.0, "last_blocking_s": 0.0, "write_s": 0.0, "last_write_s": 0.0,
                                      "last_commit_s": None, "staging_bytes": 0, "linked_bytes": 0, "late_commits": 0,
                                      "committed_step": None, "replicated_step": None,
                                      "protected_step": None, "spread": False, "copies": 0,
                                      "step_waited_s": 0.0, "last_step_wait_s": 0.0, "deferred_bytes": 0}
        self.deferred = DeferredStaging(self.stats, self.staging)  # what the writer thread copies (see .snapshot_defer)
        self.copies = SnapshotCopies(ckpt, self.stats)
        self.writer = SnapshotWriter(ckpt, (self.staging, self.deferred.buffers), self._kv, self.copies)

    # ------------------------------------------------------------------ boundary
    def snapshot(self, model, optimizer, *, step: int, extra, scheduler, scaler, annotations, rng: bool) -> Future:
        """Stage the state at ``step`` and start its background write; returns its future. Collective (it runs a
        collective only when it exchanges: see the module docstring)."""
        group = self.ckpt.group
        begin = time.monotonic()
        rank = dist.get_rank(group)
        exchange = not self._settle_decided(self._wait_previous())
        waited = time.monotonic() - begin
        pieces = self.pieces.pieces(model, optimizer, annotations)
        structure = self.pieces.generation
        # Between exchanges, the copies of what only optimizer.step() changes are the writer thread's
        defer = not exchange and self.deferred.usable(optimizer, structure)
        step_doc: dict | None = None
        changed: str | None = None
        posts: list[tuple[int, tuple[str, Box]]] = []
        takes: dict[tuple[str, Box], int] = {}
        if exchange:
            round_, docs, canonical, version = self._exchange(pieces, model, optimizer, rng, rank)
        else:
            round_, docs, canonical, version = self._round(), self._round().docs, {}, self._version + 1
            step_doc, changed = self._step_doc(pieces, model, optimizer, rng, rank, scalars=not defer)
            posts, takes = self._canonical_roles(round_, rank)
        self._version = version
        leader = rank == round_.leader
        indices, keys, specs = ([], [], {}) if changed else self._own(pieces, round_.writers, rank)
        own = [canonical.get(key, pieces[i]) for i, key in zip(indices, keys)] if canonical else \
            [pieces[i] for i in indices]
        fingerprints, keep_all = self._fingerprints(keys, own, version)
        canonical_keys = {*takes, *(key for _, key in posts)}
        unchanged = self._unchanged(fingerprints, version, canonical_keys)
        capture = None if changed else self._stage(  # (a rank that cannot write keeps its buffers for the exchange)
            [p for key, p in zip(keys, own) if key not in unchanged] if unchanged else own, own, model, optimizer,
            defer, canonical_keys)
        documents: dict[str, Any] = {}
        if leader and not changed:
            # The state document reads the scheduler, scaler and optimizer now (they change at the next step);
            # the layout and the stores document depend only on the round: built in the background.
            documents = {STATE_DOC: state_doc(docs, step, extra, scheduler, scaler, optimizer,
                                              self._group_names(docs, optimizer)),
                         PARTS_DOC: parts_doc(round_.all_parts())}
        assert self._world_key is not None
        job = self.inflight = InFlight(
            version, step, rank, leader, round_.parts, dist.get_world_size(group), self._world_key, None,
            round_.addresses, self._replicas,
            {k: f for k, f in fingerprints.items() if f is not None and (keep_all or k in unchanged)},
            [key for key in keys if key in unchanged] if unchanged else [], exchanged=exchange, step_doc=step_doc,
            changed=changed, previous_key=self._last_key, canonical_posts=posts, canonical_takes=takes,
            every_fingerprint=keep_all, capture=capture,
            called_at=begin, spread=self.rounds.spread)
        self._last_key = f"{self._world_key}/{version}"
        if capture is None:  # else the writer thread reports the staging memory once it staged
            self.deferred.report()
        self.writer.hand_off(job, specs, documents, round_ if leader else None)
        blocking = time.monotonic() - begin
        self.stats.update(snapshots=self.stats["snapshots"] + 1, blocking_s=self.stats["blocking_s"] + blocking,
                          staged_version=version, staged_step=step,
                          waited_s=self.stats["waited_s"] + waited, last_blocking_s=blocking,
                          linked_bytes=sum(p.box.volume * p.local.element_size() for key, p in zip(keys, own)
                                           if key in unchanged) if unchanged else 0)
        return job.future

    def _stage(self, pieces: list[Piece], own: list[Piece], model, optimizer, defer: bool,
               canonical_keys: set) -> Capture | None:
        """Copy ``pieces`` (some of ``own``) into the staging buffers, or leave those only ``optimizer.step()``
        changes to the writer thread (``defer``: :mod:`.snapshot_defer`); what that thread is to do."""
        structure = self.pieces.generation
        now, later = self.deferred.split(pieces, optimizer, structure, own, canonical_keys)
        self.staging.stage(now, structure)
        if defer:
            return self.deferred.hand_over(later, optimizer, structure, self._scalars_later(model, optimizer))
        self.deferred.buffers.stage(later, structure)
        return None

    def _round(self) -> SaveRound:
        current = self.rounds.current
        assert current is not None
        return current

    def _step_doc(self, pieces: list[Piece], model, optimizer, rng: bool, rank: int,
                  scalars: bool) -> tuple[dict, str | None]:
        """Between exchanges: what this rank reads at the boundary for the state document (its RNG streams and,
        unless the writer thread reads them, its optimizer scalars), and why it cannot write its part (None: it
        can)."""
        doc = read_at_boundary(self.scalars if scalars else None, model, optimizer,
                               self.pieces.named_params(model, optimizer), self.pieces.generation, rng)
        if self.rounds.still_sent(pieces, rank, model, optimizer, self.pieces.generation):
            return doc, None
        return doc, (f"the state's structure changed on rank {rank} (tensors, boxes or parameter groups); the next "
                     f"snapshot exchanges it")

    def _group_names(self, docs: list[dict], optimizer) -> list[list[str]] | None:
        """:func:`.savedoc.world_group_names`, worked out once per exchange's documents."""
        if optimizer is None:
            return None
        known = self._names
        if known is None or known[0] is not docs or known[1] != len(optimizer.param_groups):
            known = self._names = (docs, len(optimizer.param_groups), world_group_names(docs, optimizer))
        return known[2]

    def _scalars_later(self, model, optimizer) -> Callable[[], dict]:
        """The optimizer's scalar states, read by the writer thread before the next ``optimizer.step()``."""
        named, structure, reader = self.pieces.named_params(model, optimizer), self.pieces.generation, self.scalars
        return lambda: reader.read(model, optimizer, named, structure)

    def _canonical_roles(self, round_: SaveRound, rank: int) -> tuple[list[tuple[int, tuple[str, Box]]],
                                                                      dict[tuple[str, Box], int]]:
        """Between exchanges, the canonical buffers (:mod:`.canonical`) travel through the job's store: the boxes
        this rank posts (it is their source) and those it writes from what their source posted, by their index in
        the round's sends; worked out once per round."""
        known = self._roles
        if known is None or known[0] is not round_.writers or known[1] != rank:
            sends, host = self.rounds.canonical_sends(round_), self.ckpt.host
            posts = [(i, (name, box)) for i, (src, name, box) in enumerate(sends) if src == rank]
            takes = {(name, box): i for i, (src, name, box) in enumerate(sends)
                     if src != rank and round_.writers.get((host, name, box)) == rank}
            known = self._roles = (round_.writers, rank, posts, takes)
        return known[2], known[3]

    def _exchange(self, pieces: list[Piece], model, optimizer, rng: bool,
                  rank: int) -> tuple[SaveRound, list[dict], dict, int]:
        """The all-gather that (re)starts the snapshots of a layout; settles the previous one. Collective."""
        ckpt, group = self.ckpt, self.ckpt.group
        previous = self._stop_background()
        if not self.stats["exchanges"]:  # the first: give the connection its first try (a few ms on a LAN)
            self._kv.wait_connected(FIRST_CONNECT_S)
        docs = self.rounds.exchange(pieces, rank, rng, model, optimizer, pieces_key=self.pieces.generation,
                                    named=self.pieces.named_params(model, optimizer),
                                    previous=previous, nonce=uuid.uuid4().hex, kv=self._kv.connected)
        self._settle(docs, gc=False)  # a late commit's retention runs in the decider thread, after this write
        round_ = self.rounds.round(docs)  # the same on every rank: a mismatch raises everywhere
        sends = self.rounds.canonical_sends(round_)
        canonical = canonical_buffers(pieces, docs, round_.writers, rank, group, sends)  # see .canonical
        version = round_.next_version([d["previous"]["version"] for d in docs if d["previous"]])
        self._replicas = ckpt.replica_count(round_)
        # The snapshots that follow need no exchange while nothing below changes (the same on every rank).
        self._fast = all(d["kv"] for d in docs)
        self._world_key = f"tenplex/snapshot/{docs[0]['nonce']}"
        self.writer.new_world()
        self.stats["exchanges"] += 1
        return round_, docs, canonical, version

    def wait_staged(self) -> None:
        """Until the writer thread copied what the last snapshot left to it (before anything changes tensors)."""
        self.deferred.wait()

    def resync(self) -> None:
        """Exchange at the next snapshot: a blocking save or a restore made a version (or changed the state)."""
        self._fast = False

    def _wait_previous(self) -> InFlight | None:
        """Back-pressure: wait for the previous snapshot's write and, between exchanges, for its decision."""
        job = self.inflight
        if job is None:
            return None
        job.written.wait()
        if self._fast:
            job.decided.wait()
        return job

    def _settle_decided(self, job: InFlight | None) -> bool:
        """Settle ``job`` from its decision, without an exchange; False when this snapshot must exchange."""
        if not self._fast:
            return False
        if job is None:
            return True
        if job.decision is None:  # every rank reached the store at the last exchange: this one no longer does
            # Its prepared part stays: a restore rolls it forward where every surviving rank prepared it.
            self.inflight, self._fast = None, False
            self.stats["failed"] += 1
            error = SnapshotError(f"snapshot of step {job.step} (version {job.version}): no commit decision from "
                                  f"the job's key-value store ({job.store_error or 'no answer'}); the ranks can no "
                                  f"longer agree on snapshots")
            job.future.set_exception(error)
            raise error from job.store_error
        if job.decision != COMMIT:
            return False  # aborted everywhere: the exchange settles it (the same on every rank)
        self.inflight = None
        self._succeeded(job)
        return True

    def _own(self, pieces: list[Piece], writers: dict, rank: int) -> tuple[list[int], list[tuple[str, Box]], dict]:
        """Which of ``pieces`` this rank writes, their (tensor, box) keys and their specs by tensor name: worked
        out again only when the pieces' structure or the round's writers changed (the same objects while they
        stay)."""
        generation, known = self.pieces.generation, self._own_cache
        if generation is None or known is None or known[0] is not generation or known[1] is not writers \
                or known[2] != rank:
            host = self.ckpt.host
            indices = [i for i, p in enumerate(pieces) if writers[(host, p.name, p.box)] == rank]
            known = self._own_cache = (generation, writers, rank, indices,
                                       [(pieces[i].name, pieces[i].box) for i in indices],
                                       {pieces[i].name: pieces[i].spec for i in indices})
        return known[3], known[4], known[5]

    def _fingerprints(self, keys: list[tuple[str, Box]], own: list[Piece],
                      version: int) -> tuple[dict[tuple[str, Box], tuple | None], bool]:
        """The fingerprints to compare with the previous snapshot's, and whether the next snapshot compares them all
        (else only the unchanged ones'). Only the pieces the previous snapshot kept are looked at: a piece that
        changed is staged without a look (a training step changes most of them every time). Every piece is
        looked at, and kept for the next snapshot to compare, when there is no previous one to compare with and
        every ``FULL_LOOK_EVERY`` snapshots (a piece may stop changing: frozen for fine-tuning)."""
        base = self._unchanged_base
        keep_all = base is None or base[0] != version - 1 or self.stats["snapshots"] % FULL_LOOK_EVERY == 0
        fingerprint = self.pieces.fingerprint
        if keep_all or base is None or base[2]:
            return {key: fingerprint(p) for key, p in zip(keys, own)}, keep_all
        if not base[1]:  # every piece changed last time (a training step changes them all): nothing to look at
            return {}, False
        return {key: fingerprint(p) for key, p in zip(keys, own) if key in base[1]}, False

    def _unchanged(self, fingerprints: dict[tuple[str, Box], tuple | None], version: int,
                   canonical: set[tuple[str, Box]]) -> set[tuple[str, Box]]:
        """The pieces that the previous snapshot holds as they are now, when it is version - 1: no other version
        (a blocking save, a restore) came between, so its files are the newest committed ones. Never the
        ``canonical`` buffers' (their values are their source's, and its piece may have changed)."""
        if self._unchanged_base is None or self._unchanged_base[0] != version - 1:
            return set()
        before = self._unchanged_base[1]
        return {key for key, f in fingerprints.items()
                if f is not None and before.get(key) == f and key not in canonical}

    def settle(self) -> int | None:
        """Finish the snapshot in flight (wait for its write and decision, commit or drop it everywhere); the newest
        committed snapshot's version, or None. Collective."""
        self._wait_previous()  # between exchanges: its decision, so that its host leaders commit in the background
        previous = self._stop_background()
        docs = all_gather_json({"previous": previous}, self.ckpt.group)
        self._settle(docs)
        return self.stats.get("committed_version")

    def _stop_background(self) -> dict | None:
        """Wait for this rank's write (back-pressure), stop its polling; what it did, for the all-gather."""
        job = self.inflight
        if job is None:
            return None
        job.written.wait()
        job.give_up.set()
        job.done.wait()
        return {"version": job.version, "error": job.error or (None if job.prepared or job.decision != ABORT else
                                                               _ABORTED),
                "committed": job.committed, "leader": job.leader, "changed": job.changed is not None}

    def _settle(self, docs: list[dict], gc: bool = True) -> None:
        job, self.inflight = self.inflight, None
        reports = [d["previous"] for d in docs if d["previous"]]
        if job is None or not reports:
            return
        failed = [(r, d["previous"]["error"]) for r, d in enumerate(docs) if d["previous"] and d["previous"]["error"]]
        if not failed and any(p["leader"] and not p["committed"] for p in reports):
            # Some host did not see the decision in time (or there is no key-value store): commit it now.
            def commit():
                if job.leader and not job.committed:
                    self.writer.commit(job, gc=gc)
            try:
                agree(f"snapshot of step {job.step} (committing version {job.version})", commit, self.ckpt.group)
                self.stats["late_commits"] += 1
            except Exception as e:  # noqa: BLE001 -- reported below, like a failed write
                failed = [(-1, f"{type(e).__name__}: {e}")]
        if failed:
            # The first reason the job's store recorded, else the lowest failed rank's; a structure change alone
            # drops the snapshot (counted apart from failures: nothing went wrong).
            rank, error = failed[0]
            dropped = rank >= 0 and all(docs[r]["previous"]["changed"] or e == _ABORTED for r, e in failed) \
                and any(docs[r]["previous"]["changed"] for r, _ in failed)
            self._failed(job, job.abort_reason or f"rank {rank}: {error}", dropped)
        else:
            self._succeeded(job)

    def _succeeded(self, job: InFlight) -> None:
        self.stats["write_s"] += job.write_s
        self.stats.update(committed=self.stats["committed"] + 1, committed_step=job.step,
                          committed_version=job.version, last_write_s=job.write_s, last_commit_s=job.commit_s,
                          spread=job.spread, copies=job.replicas)
        if job.spread:
            self.stats["protected_step"] = job.step
        self.ckpt._replicated_version = job.version
        self._unchanged_base = (job.version, job.fingerprints, job.every_fingerprint)
        job.future.set_result(job.version)

    def _failed(self, job: InFlight, reason: str, dropped: bool = False) -> None:
        """``job`` is not committed anywhere: take it back on this host, count it, fail its future."""
        self.stats["write_s"] += job.write_s
        self._unchanged_base = None  # the next snapshot stages every piece
        self._fast = False  # and exchanges (a structure change; its version number, taken back, is free again)
        if job.leader:
            self.ckpt.store.abort(job.version)
            self.ckpt.store.delete(job.version)  # committed on this host, not on another: take it back
        self.stats["dropped" if dropped else "failed"] += 1
        job.future.set_exception(SnapshotError(f"snapshot of step {job.step} (version {job.version}) was not "
                                               f"committed: {reason}"))

    # ----------------------------------------------------------- replication
    def wait_copies(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` seconds until the newest committed snapshot's copy is done."""
        self.copies.wait(timeout)

    def replication_lag(self) -> int:
        return self.copies.lag()

    def close(self) -> None:
        """Stop polling for a decision and copying (the process is going away); what was staged stays
        uncommitted."""
        if self.inflight is not None:
            self.inflight.give_up.set()
        self.writer.stop()
        self.deferred.wait(CLOSE_JOIN_S)  # (a copy in flight reads tensors that a restore may change next)
        self.deferred.remove_hook()  # the optimizer may outlive this world (in place): nothing of it stays hooked
        self._closed = True
        self.copies.close()
        # A running thread's bound target keeps this snapshotter, its cached pieces (a DTensor's mesh: the old
        # world's process groups and sockets) alive until it ends; in place the groups must go with the world
        # (leave_process_group's gc.collect), else a survivor still in a collective with this rank waits for the
        # group's timeout (issue 36). The threads end at their next item: bounded, not a whole copy's wait.
        for thread in (*self.writer.threads, self.copies.thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=CLOSE_JOIN_S)
