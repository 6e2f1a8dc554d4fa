"""Snapshots: a save that returns once the state is staged in host memory; a background thread stores and commits it.

May import: ``tenplex.box``, ``tenplex.store``, ``tenplex.replication``, ``tenplex.layout``, ``tenplex.errors``,
``tenplex.integration`` (pieces, layouts, canonical, snapshot_buffers, snapshot_agree, snapshot_copies, exchange,
jobstore, nontensor, rollforward, savedoc, snapshot_pieces, snapshot_round, versions), torch,
torch.distributed and the standard library.

A snapshot is a version like any other: the same parts, manifest and commit
as :meth:`Checkpointer.save`, so a restore (into any layout) reads it
unchanged. What differs is when the work happens (README, "Snapshots every step"):

1. **At the step boundary** (the training thread): the rank waits until its previous snapshot's write is done
   and, once every rank reaches the job's key-value store, until its commit is decided (back-pressure: at most
   one snapshot in flight per rank; its future resolves here). It copies the pieces it writes into reused
   staging buffers (:mod:`.snapshot_buffers`), reads its RNG streams and optimizer scalars, and returns. A
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
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..box import Box
from ..errors import TenplexError
from ..layout import Layout
from ..replication.stores import STORES_DOC, stores_doc
from ..store import CorruptShard
from ..store.contract import LinkingWriter
from .exchange import agree, all_gather_json
from .jobstore import JobKeyValue
from .nontensor import capture_rng
from .pieces import Piece, optimizer_scalars
from .rollforward import PARTS_DOC, parts_doc
from .savedoc import SaveRound, refresh_state_doc, state_doc
from .snapshot_agree import ABORT, COMMIT, Aborted, Agreement, GaveUp, poll
from .snapshot_copies import SnapshotCopies
from .snapshot_pieces import PiecesCache
from .snapshot_round import RoundCache
from .shardio import _as_storage
from .canonical import canonical_buffers
from .snapshot_buffers import SnapshotBuffers
from .versions import STATE_DOC

log = logging.getLogger(__name__)
CLOSE_JOIN_S = 10.0  # how long close() waits for the writer and copier threads to end (each finishes its item)
DECISION_S = 120.0  # how long a rank that prepared waits for the others before it calls the snapshot undecided
LINK_WAIT_S = 30.0  # how long a write waits for its host to commit the version it links from
_ABORTED = "aborted by another rank"  # a rank's report when it did not prepare because another rank decided abort


class SnapshotError(TenplexError, RuntimeError):
    """A snapshot was not committed (its write failed on some rank); training goes on, the next one is tried."""


@dataclass
class _InFlight:
    """One rank's snapshot between its staging and its settlement."""

    version: int
    step: int
    rank: int
    leader: bool
    parts: list[str]
    world: int
    world_key: str                   # where its keys lie in the job's key-value store (:mod:`.snapshot_agree`)
    layout: Layout | None            # leaders: the saved layout (replication), made by the background thread
    addresses: dict[str, str]
    replicas: int
    fingerprints: dict[tuple[str, Box], tuple]  # of every piece this rank writes (staged or linked)
    linked: list[tuple[str, Box]]    # the pieces unchanged since version - 1: linked from there, not staged
    exchanged: bool = True           # staged after an exchange; else its step document travels through the store
    step_doc: dict | None = None     # not exchanged: this rank's RNG streams and optimizer scalars at the boundary
    changed: str | None = None       # not exchanged: why this rank cannot write its part (its structure changed)
    previous: int | None = None      # the version staged before it in the same world (its keys are deleted)
    future: Future = field(default_factory=Future)
    called_at: float = field(default_factory=time.monotonic)  # when async_save was called
    written: threading.Event = field(default_factory=threading.Event)
    give_up: threading.Event = field(default_factory=threading.Event)
    decided: threading.Event = field(default_factory=threading.Event)  # the agreement through the store is over
    done: threading.Event = field(default_factory=threading.Event)  # the writer thread is through with it
    error: str | None = None         # why this rank did not prepare its part (it decides abort)
    prepared: bool = False
    decision: bytes | None = None    # what the job's store decided (None: unknown; the next exchange settles it)
    abort_reason: str | None = None  # "rank R: why", when the store decided abort
    store_error: Exception | None = None  # why the job's store gave no decision (a lost peer: faults.classify)
    committed: bool = False
    spread: bool = False             # every region is on two hosts or more: it survives the loss of one
    write_s: float = 0.0
    commit_s: float | None = None    # seconds from the call until this host committed


class Snapshotter:
    """The snapshots of one :class:`~tenplex.Checkpointer` (see the module docstring)."""

    def __init__(self, ckpt) -> None:
        self.ckpt = ckpt
        self.staging = SnapshotBuffers()
        self.inflight: _InFlight | None = None
        self._kv = JobKeyValue()
        self._kv.connect_soon()  # so that the first exchange may already find every rank connected
        self.rounds = RoundCache(ckpt)
        self.pieces = PiecesCache()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # snapshots for the writer thread; None: stop
        self._writer: threading.Thread | None = None
        self._unchanged_base: tuple[int, dict[tuple[str, Box], tuple]] | None = None  # newest committed, its pieces
        self._closed = False
        self._gc_due = False  # a commit at the boundary left retention to the writer thread
        self._own_cache: tuple[Any, dict, int, list[int], list[tuple[str, Box]]] | None = None  # see _own
        # Between exchanges (every rank reached the job's store at the last one): the world's key prefix, the
        # last staged version, the copies per region, this rank's last posted RNG streams and their generation,
        # and (leaders) every rank's RNG streams read from the store.
        self._fast = False  # the next snapshot may skip the exchange (set by each exchange: see _exchange)
        self._world_key: str | None = None
        self._version = 0
        self._replicas = 0
        self._rng_posted: tuple[int, Any] = (-1, None)
        self._known_rng: dict[int, tuple[int, Any]] = {}
        self.stats: dict[str, Any] = {"snapshots": 0, "committed": 0, "failed": 0, "dropped": 0, "exchanges": 0,
                                      "blocking_s": 0.0,
                                      "waited_s": 0.0, "last_blocking_s": 0.0, "write_s": 0.0, "last_write_s": 0.0,
                                      "last_commit_s": None, "staging_bytes": 0, "linked_bytes": 0, "late_commits": 0,
                                      "committed_step": None, "replicated_step": None,
                                      "protected_step": None, "spread": False, "copies": 0}
        self.copies = SnapshotCopies(ckpt, self.stats)

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
        if exchange:
            round_, docs, canonical, version = self._exchange(pieces, model, optimizer, rng, rank)
            step_doc, changed = None, None
        else:
            current = self.rounds.current
            assert current is not None
            round_, docs, canonical, version = current, current.docs, {}, self._version + 1
            named = self.pieces.named_params(model, optimizer)
            step_doc = {"rng": capture_rng() if rng else None,
                        "scalars": optimizer_scalars(model, optimizer, named) if optimizer is not None else {}}
            same = self.rounds.sent(self.rounds.static_key(pieces, model, optimizer, self.pieces.generation))
            changed = None if same else (f"the state's structure changed on rank {rank} (tensors, boxes or "
                                         f"parameter groups); the next snapshot exchanges it")
        previous, self._version = self._version, version
        leader = rank == round_.leader
        indices: list[int] = []
        keys: list[tuple[str, Box]] = []
        own: list[Piece] = []
        if not changed:
            indices, keys = self._own(pieces, round_.writers, rank)
            own = [canonical.get(key, pieces[i]) for i, key in zip(indices, keys)] if canonical else \
                [pieces[i] for i in indices]
        fingerprints = {key: self.pieces.fingerprint(p) for key, p in zip(keys, own)}
        unchanged = self._unchanged(fingerprints, version)
        self.staging.stage([p for key, p in zip(keys, own) if key not in unchanged] if unchanged else own,
                           self.pieces.generation)
        documents: dict[str, Any] = {}
        if leader and not changed:
            # The state document reads the scheduler, scaler and optimizer now (they change at the next step);
            # the layout and the stores document depend only on the round: built in the background.
            documents = {STATE_DOC: state_doc(docs, step, extra, scheduler, scaler, optimizer),
                         PARTS_DOC: parts_doc(round_.all_parts())}
        assert self._world_key is not None
        job = self.inflight = _InFlight(
            version, step, rank, leader, round_.parts, dist.get_world_size(group), self._world_key, None,
            round_.addresses, self._replicas, {k: f for k, f in fingerprints.items() if f is not None},
            [key for key in keys if key in unchanged] if unchanged else [], exchanged=exchange, step_doc=step_doc,
            changed=changed, previous=None if exchange else previous, called_at=begin, spread=self.rounds.spread)
        self._hand_off(job, ({p.name: p.spec for p in own}, documents, round_ if leader else None))
        blocking = time.monotonic() - begin
        self.stats.update(snapshots=self.stats["snapshots"] + 1, blocking_s=self.stats["blocking_s"] + blocking,
                          staged_version=version, staged_step=step,
                          waited_s=self.stats["waited_s"] + waited, last_blocking_s=blocking,
                          staging_bytes=self.staging.nbytes,
                          linked_bytes=sum(p.box.volume * p.local.element_size() for key, p in zip(keys, own)
                                           if key in unchanged) if unchanged else 0)
        return job.future

    def _exchange(self, pieces: list[Piece], model, optimizer, rng: bool,
                  rank: int) -> tuple[SaveRound, list[dict], dict, int]:
        """The all-gather that (re)starts the snapshots of a layout; settles the previous one. Collective."""
        ckpt, group = self.ckpt, self.ckpt.group
        previous = self._stop_background()
        docs = self.rounds.exchange(pieces, rank, rng, model, optimizer, pieces_key=self.pieces.generation,
                                    named=self.pieces.named_params(model, optimizer),
                                    previous=previous, nonce=uuid.uuid4().hex, kv=self._kv.connected)
        self._settle(docs, gc=False)  # a late commit's retention runs in the writer thread, before this write
        round_ = self.rounds.round(docs)  # the same on every rank: a mismatch raises everywhere
        sends = self.rounds.canonical_sends(round_)
        canonical = canonical_buffers(pieces, docs, round_.writers, rank, group, sends)  # see .canonical
        version = round_.next_version([d["previous"]["version"] for d in docs if d["previous"]])
        self._replicas = ckpt.replica_count(round_)
        # The snapshots that follow need no exchange while nothing below changes (the same on every rank).
        self._fast = all(d["kv"] for d in docs) and not sends
        self._world_key = f"tenplex/snapshot/{docs[0]['nonce']}"
        self._rng_posted, self._known_rng = (-1, None), {}
        self.stats["exchanges"] += 1
        return round_, docs, canonical, version

    def resync(self) -> None:
        """Exchange at the next snapshot: a blocking save or a restore made a version (or changed the state)."""
        self._fast = False

    def _wait_previous(self) -> _InFlight | None:
        """Back-pressure: wait for the previous snapshot's write and, between exchanges, for its decision."""
        job = self.inflight
        if job is None:
            return None
        job.written.wait()
        if self._fast:
            job.decided.wait()
        return job

    def _settle_decided(self, job: _InFlight | None) -> bool:
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

    def _own(self, pieces: list[Piece], writers: dict, rank: int) -> tuple[list[int], list[tuple[str, Box]]]:
        """Which of ``pieces`` this rank writes, and their (tensor, box) keys: worked out again only when the
        pieces' structure or the round's writers changed (the same objects while they stay)."""
        generation, known = self.pieces.generation, self._own_cache
        if generation is None or known is None or known[0] is not generation or known[1] is not writers \
                or known[2] != rank:
            host = self.ckpt.host
            indices = [i for i, p in enumerate(pieces) if writers[(host, p.name, p.box)] == rank]
            known = self._own_cache = (generation, writers, rank, indices,
                                       [(pieces[i].name, pieces[i].box) for i in indices])
        return known[3], known[4]

    def _unchanged(self, fingerprints: dict[tuple[str, Box], tuple | None], version: int) -> set[tuple[str, Box]]:
        """The pieces that the previous snapshot holds as they are now, when it is version - 1: no other version
        (a blocking save, a restore) came between, so its files are the newest committed ones."""
        if self._unchanged_base is None or self._unchanged_base[0] != version - 1:
            return set()
        before = self._unchanged_base[1]
        return {key for key, f in fingerprints.items() if f is not None and before.get(key) == f}

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
                    self._commit(job, gc=gc)
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

    def _succeeded(self, job: _InFlight) -> None:
        self.stats["write_s"] += job.write_s
        self.stats.update(committed=self.stats["committed"] + 1, committed_step=job.step,
                          committed_version=job.version, last_write_s=job.write_s, last_commit_s=job.commit_s,
                          spread=job.spread, copies=job.replicas)
        if job.spread:
            self.stats["protected_step"] = job.step
        self.ckpt._replicated_version = job.version
        self._unchanged_base = (job.version, job.fingerprints)
        job.future.set_result(job.version)

    def _failed(self, job: _InFlight, reason: str, dropped: bool = False) -> None:
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

    # ------------------------------------------------------------ background
    def _hand_off(self, job: _InFlight, args: tuple) -> None:
        """Give the snapshot to this snapshotter's writer thread (one for its life: starting a thread per snapshot
        costs the training thread more than the rest of a small snapshot)."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="tenplex-snapshot-writer", daemon=True)
            self._writer.start()
        self._queue.put((job, args))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, args = item
            try:
                self._write(job, *args)
                self._agree(job)
            finally:
                job.written.set()
                job.decided.set()
            try:
                self._retention()
            except Exception as e:  # noqa: BLE001 -- tried again after the next commit
                self._gc_due = True
                log.warning("tenplex: retention after version %d: %s: %s", job.version, type(e).__name__, e)
            finally:
                job.done.set()

    def _write(self, job: _InFlight, specs, documents: dict[str, Any], leader_docs: SaveRound | None) -> None:
        """Write and prepare this rank's part (see the module docstring)."""
        ckpt, store = self.ckpt, self.ckpt.store
        begin = time.monotonic()
        agreement = None if job.exchanged else Agreement(self._kv.get(job.give_up), job.world_key, job.version,
                                                         job.rank, job.world)
        try:
            if job.changed is not None:
                raise _Changed(job.changed)
            if agreement is not None:
                self._post_step(agreement, job)
            self._retention()  # the previous snapshot was committed at the boundary, its retention left to here
            if leader_docs is not None:
                job.layout = leader_docs.layout()
                documents[STORES_DOC] = stores_doc(job.version, {h: job.addresses.get(h) for h in leader_docs.ring},
                                                   job.replicas, leader_docs.ring)
            self.staging.wait_copied()
            with store.begin(job.version, part=f"rank{job.rank}") as writer:
                for name, box, buffer in self.staging.buffers():
                    spec = specs[name]
                    writer.put(ckpt.device, name, box, _as_storage(buffer, spec.dtype).numpy(), spec.dtype, spec.shape)
                if job.linked:
                    self._link_unchanged(job, writer)
                if job.layout is not None:
                    writer.put_layout(job.layout)
                if agreement is not None and leader_docs is not None:
                    steps = agreement.step_docs(_Deadline(job.give_up, DECISION_S), self._known_rng)
                    refresh_state_doc(documents[STATE_DOC], steps, leader_docs.docs)
                for doc_name, doc in documents.items():
                    writer.put_json(doc_name, doc)
                writer.prepare()
            job.prepared = True
        except Aborted:  # another rank decided abort: nothing to add
            pass
        except Exception as e:  # noqa: BLE001 -- training goes on; the decision (or the next exchange) settles it
            job.error = str(e) if isinstance(e, _Changed) else f"{type(e).__name__}: {e}"
            if isinstance(e, (_Changed, GaveUp)):
                log.info("tenplex: snapshot of step %d (version %d) dropped on rank %d: %s", job.step, job.version,
                         job.rank, job.error)
            else:
                log.error("tenplex: snapshot of step %d (version %d) failed on rank %d: %s; training goes on, the "
                          "next snapshot is tried", job.step, job.version, job.rank, job.error)
        job.write_s = time.monotonic() - begin
        job.written.set()

    def _post_step(self, agreement: Agreement, job: _InFlight) -> None:
        """Post this rank's step document; its RNG streams as a new generation when they changed."""
        assert job.step_doc is not None
        streams = job.step_doc["rng"]
        new = streams is not None and streams != self._rng_posted[1]
        if new:
            self._rng_posted = (self._rng_posted[0] + 1, streams)
        agreement.post_step(job.step_doc["scalars"], None if streams is None else self._rng_posted[0], streams, new)
        job.step_doc["posted"] = self._rng_posted[0] if new else None

    def _agree(self, job: _InFlight) -> None:
        """Take part in the decision through the job's key-value store; the host leader commits on ``commit``.
        Ends with the decision known, given up (the boundary settles it by an exchange), or the store gone."""
        kv = self._kv.get(job.give_up)  # connected off the training thread; None until it answers
        if kv is None:
            return
        agreement = Agreement(kv, job.world_key, job.version, job.rank, job.world)
        give_up = _Deadline(job.give_up, DECISION_S)
        try:
            if job.error is not None:
                agreement.abort(job.error)
            elif job.prepared:
                agreement.prepared(job.step)
            decision = agreement.decision(give_up)
            if decision == COMMIT and job.leader:
                self._commit(job, gc=False)
            elif decision == ABORT:
                rank, error = agreement.error()
                job.abort_reason = f"rank {rank}: {error}"
            job.decision = decision
            if not job.exchanged:
                agreement.forget(job.step_doc.get("posted") if job.step_doc else None, job.previous)
        except GaveUp:
            if give_up.expired:
                job.store_error = TimeoutError(f"no decision within {DECISION_S:.0f} s")
                log.warning("tenplex: snapshot of step %d (version %d): no decision within %.0f s", job.step,
                            job.version, DECISION_S)
        except Exception as e:  # noqa: BLE001 -- the boundary's exchange settles it instead
            job.store_error = e
            log.warning("tenplex: snapshot of step %d (version %d): %s: %s; it is settled at the next step "
                        "boundary", job.step, job.version, type(e).__name__, e)

    def _link_unchanged(self, job: _InFlight, writer) -> None:
        """Put the unchanged pieces into this part as hard links to their files in version - 1 (no byte copied); a
        link that fails (EXDEV: another mount; a file gone) copies the stored bytes instead."""
        device, store = self.ckpt.device, self.ckpt.store
        if not job.exchanged:  # decided, but this host's leader may not have committed it yet
            poll(lambda: (store.latest() or 0) >= job.version - 1, _Deadline(job.give_up, LINK_WAIT_S))
        reader = store.open(job.version - 1)
        try:
            for name, box in job.linked:
                entry = reader.find(device, name, box)
                if isinstance(writer, LinkingWriter):
                    try:
                        writer.link(device, reader, entry)
                        continue
                    except (CorruptShard, OSError) as e:
                        log.warning("tenplex: snapshot of step %d: cannot link %s %s from version %d: %s; copying it "
                                    "instead", job.step, name, box, job.version - 1, e)
                writer.put(device, name, box, reader.read(device, name, box), entry.dtype, entry.shape)
        finally:
            reader.close()

    def _commit(self, job: _InFlight, gc: bool = True) -> None:
        store = self.ckpt.store
        store.commit(job.version, parts=job.parts)
        job.committed = True
        job.commit_s = time.monotonic() - job.called_at
        if gc:  # retention, off the training thread: a boundary that had to commit leaves it to the writer thread
            store.gc(self.ckpt.keep)
        else:
            self._gc_due = True
        if job.leader and job.replicas and job.layout is not None:
            self.copies.queue(job.version, job.step, job.layout, job.addresses, job.replicas)
        if self.ckpt.durable is not None:  # the durable tier flushes snapshots like saves (its own policy)
            self.ckpt.durable.saved()

    def _retention(self) -> None:
        """The retention a commit left to the writer thread (after the decision: the boundary waits for that)."""
        if self._gc_due:
            self._gc_due = False
            self.ckpt.store.gc(self.ckpt.keep)

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
        self._queue.put(None)
        self._closed = True
        self.copies.close()
        # A running thread's bound target keeps this snapshotter, its cached pieces (a DTensor's mesh: the old
        # world's process groups and sockets) alive until it ends; in place the groups must go with the world
        # (leave_process_group's gc.collect), else a survivor still in a collective with this rank waits for the
        # group's timeout (issue 36). Both threads end at their next item: bounded, not a whole copy's wait.
        for thread in (self._writer, self.copies.thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=CLOSE_JOIN_S)


class _Changed(Exception):
    """This rank's state's structure changed since the last exchange: it cannot write its part of the old layout."""


class _Deadline(threading.Event):
    """``give_up`` for a wait, that is also set once ``seconds`` have passed (``expired``: that is why)."""

    def __init__(self, give_up: threading.Event, seconds: float) -> None:
        super().__init__()
        self._give_up, self._until = give_up, time.monotonic() + seconds
        self.expired = False

    def is_set(self) -> bool:
        if time.monotonic() >= self._until:
            self.expired = True
        return self.expired or self._give_up.is_set()
