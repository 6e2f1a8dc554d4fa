"""Snapshots: a save that returns once the state is staged in host memory; a background thread stores and commits it.

May import: ``tenplex.box``, ``tenplex.store``, ``tenplex.replication``, ``tenplex.layout``, ``tenplex.errors``,
``tenplex.integration`` (pieces, layouts, canonical, snapshot_buffers, exchange, jobstore, nontensor, rollforward,
savedoc, snapshot_pieces, snapshot_round, versions), torch,
torch.distributed and the standard library.

A snapshot is a version like any other: the same parts, manifest and commit
as :meth:`Checkpointer.save`, so a restore (into any layout) reads it
unchanged. What differs is when the work happens (README, "Snapshots every step"):

1. **At the step boundary** (the training thread, collective): the rank waits
   until its previous snapshot's write is done (back-pressure: at most one
   snapshot in flight per rank), then one small all-gather of JSON carries
   every rank's tensors and boxes, RNG state and optimizer scalars, *and the
   outcome of the previous snapshot* (settled below). The rank copies the
   pieces it writes into reused staging buffers (:mod:`.snapshot_buffers`) and returns. A piece unchanged
   since the previous snapshot, which committed and is the newest version (same storage, same in-place
   version counters, :attr:`Piece.version`: frozen parameters), is not staged at all.
2. **In the background** (one thread per rank, no collective): the rank
   writes its buffers as its part of version N, hard-links the unchanged pieces' files from version N-1
   (a link that fails, EXDEV say, copies the file's bytes) and prepares the part; the first
   rank of each host adds the state document (made at the boundary) and the layout and stores
   documents (made here, from the all-gather's answers).
3. **The commit, through the job's key-value store** (the c10d TCPStore at
   ``MASTER_ADDR:MASTER_PORT``; a client connection of the thread's own, not
   the process group): each rank that prepared adds 1 to the version's
   counter; the rank that brings it to the world size writes the decision
   ``commit``; a rank whose write failed writes ``abort``. The first rank of
   each host polls the decision and commits (or drops) its host's parts. No
   rank commits before every rank prepared, so a rank killed during its
   write leaves the version uncommitted everywhere.
4. **Settled at the next boundary** (or :meth:`Checkpointer.wait_snapshot`, or
   a blocking save): the thread stops polling, the outcomes travel in that
   boundary's all-gather; hosts that did not commit yet commit then (an
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
from ..replication.copier import Replicator
from ..replication.stores import STORES_DOC, stores_doc
from ..store import CorruptShard
from ..store.contract import LinkingWriter
from .exchange import agree, all_gather_json
from .jobstore import JobKeyValue, committed_key
from .pieces import Piece
from .rollforward import PARTS_DOC, parts_doc
from .savedoc import SaveRound, state_doc
from .snapshot_pieces import PiecesCache
from .snapshot_round import RoundCache
from .shardio import _as_storage
from .canonical import canonical_buffers
from .snapshot_buffers import SnapshotBuffers
from .versions import STATE_DOC

log = logging.getLogger(__name__)
_POLL_S = 0.005  # how often a host's first rank looks for the commit decision (one small request each)
CLOSE_JOIN_S = 10.0  # how long close() waits for the writer and copier threads to end (each finishes its item)
_COPY_TRIES, _COPY_RETRY_S = 20, 0.25  # a snapshot's copy is retried for ~5 s: other hosts commit a moment later


class SnapshotError(TenplexError, RuntimeError):
    """A snapshot was not committed (its write failed on some rank); training goes on, the next one is tried."""


@dataclass
class _InFlight:
    """One rank's snapshot between its staging and its settlement."""

    version: int
    step: int
    leader: bool
    parts: list[str]
    world: int
    key: str                         # the version's keys in the job's key-value store
    layout: Layout | None            # leaders: the saved layout (replication), made by the background thread
    addresses: dict[str, str]
    replicas: int
    fingerprints: dict[tuple[str, Box], tuple]  # of every piece this rank writes (staged or linked)
    linked: list[tuple[str, Box]]    # the pieces unchanged since version - 1: linked from there, not staged
    future: Future = field(default_factory=Future)
    called_at: float = field(default_factory=time.monotonic)  # when async_save was called
    written: threading.Event = field(default_factory=threading.Event)
    give_up: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)  # the writer thread is through with it
    error: str | None = None
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
        self.rounds = RoundCache(ckpt)
        self.pieces = PiecesCache()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # snapshots for the writer thread; None: stop
        self._writer: threading.Thread | None = None
        self._unchanged_base: tuple[int, dict[tuple[str, Box], tuple]] | None = None  # newest committed, its pieces
        self._next_copy: tuple[int, int, Layout, dict, int] | None = None  # newest committed, not yet copied
        self._copying_step: int | None = None
        self._copy_busy = False  # a snapshot's copy is running or will be retried (wait_copies waits for it)
        self._copy_wanted = threading.Condition()
        self._copier: threading.Thread | None = None
        self._closed = False
        self._gc_due = False  # a commit at the boundary left retention to the writer thread
        self._own_cache: tuple[Any, dict, int, list[int], list[tuple[str, Box]]] | None = None  # see _own
        self.stats: dict[str, Any] = {"snapshots": 0, "committed": 0, "failed": 0, "blocking_s": 0.0,
                                      "waited_s": 0.0, "last_blocking_s": 0.0, "write_s": 0.0, "last_write_s": 0.0,
                                      "last_commit_s": None, "staging_bytes": 0, "linked_bytes": 0, "late_commits": 0,
                                      "committed_step": None, "replicated_step": None,
                                      "protected_step": None, "spread": False, "copies": 0}

    # ------------------------------------------------------------------ boundary
    def snapshot(self, model, optimizer, *, step: int, extra, scheduler, scaler, annotations, rng: bool) -> Future:
        """Stage the state at ``step`` and start its background write; returns its future. Collective."""
        ckpt, group = self.ckpt, self.ckpt.group
        begin = time.monotonic()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        previous = self._stop_background()
        waited = time.monotonic() - begin
        pieces = self.pieces.pieces(model, optimizer, annotations)
        docs = self.rounds.exchange(pieces, rank, rng, model, optimizer, pieces_key=self.pieces.generation,
                                    named=self.pieces.named_params(model, optimizer),
                                    previous=previous, nonce=uuid.uuid4().hex)
        self._settle(docs, gc=False)  # a late commit's retention runs in the writer thread, before this write
        round_ = self.rounds.round(docs)  # the same on every rank: a mismatch raises everywhere
        writers = round_.writers
        canonical = canonical_buffers(pieces, docs, writers, rank, group,  # replicas may differ: see .canonical
                                      self.rounds.canonical_sends(round_))
        version = round_.next_version([d["previous"]["version"] for d in docs if d["previous"]])
        leader = round_.leader
        replicas = ckpt.replica_count(round_)
        indices, keys = self._own(pieces, writers, rank)
        own = [canonical.get(key, pieces[i]) for i, key in zip(indices, keys)] if canonical else \
            [pieces[i] for i in indices]
        fingerprints = {key: self.pieces.fingerprint(p) for key, p in zip(keys, own)}
        unchanged = self._unchanged(fingerprints, version)
        self.staging.stage([p for key, p in zip(keys, own) if key not in unchanged] if unchanged else own,
                           self.pieces.generation)
        documents: dict[str, Any] = {}
        leader_docs: SaveRound | None = None
        if rank == leader:
            # The state document reads the scheduler, scaler and optimizer now (they change at the next step);
            # the layout and the stores document depend only on the all-gather's answers: built in the background.
            documents = {STATE_DOC: state_doc(docs, step, extra, scheduler, scaler, optimizer),
                         PARTS_DOC: parts_doc(round_.all_parts())}
            leader_docs = round_
        job = self.inflight = _InFlight(
            version, step, rank == leader, round_.parts, world,
            f"tenplex/snapshot/{docs[0]['nonce']}", None, round_.addresses, replicas,
            {k: f for k, f in fingerprints.items() if f is not None},
            [key for key in keys if key in unchanged] if unchanged else [], called_at=begin,
            spread=self.rounds.spread)
        self._hand_off(job, ({p.name: p.spec for p in own}, documents, leader_docs, rank))
        blocking = time.monotonic() - begin
        self.stats.update(snapshots=self.stats["snapshots"] + 1, blocking_s=self.stats["blocking_s"] + blocking,
                          staged_version=version, staged_step=step,
                          waited_s=self.stats["waited_s"] + waited, last_blocking_s=blocking,
                          staging_bytes=self.staging.nbytes,
                          linked_bytes=sum(p.box.volume * p.local.element_size() for key, p in zip(keys, own)
                                           if key in unchanged) if unchanged else 0)
        return job.future

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
        """Finish the snapshot in flight (wait for its write, commit or drop it everywhere); the newest committed
        snapshot's version, or None. Collective."""
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
        return {"version": job.version, "error": job.error, "committed": job.committed, "leader": job.leader}

    def _settle(self, docs: list[dict], gc: bool = True) -> None:
        job, self.inflight = self.inflight, None
        reports = [d["previous"] for d in docs if d["previous"]]
        if job is None or not reports:
            return
        self.stats["write_s"] += job.write_s
        failed = [(r, d["previous"]["error"]) for r, d in enumerate(docs) if d["previous"] and d["previous"]["error"]]
        store = self.ckpt.store
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
            self._unchanged_base = None  # the next snapshot stages every piece
            if job.leader:
                store.abort(job.version)
                store.delete(job.version)  # committed on this host, not on another: take it back
            self.stats["failed"] += 1
            rank, error = failed[0]
            job.future.set_exception(SnapshotError(f"snapshot of step {job.step} (version {job.version}) was not "
                                                   f"committed: rank {rank}: {error}"))
            return
        self.stats.update(committed=self.stats["committed"] + 1, committed_step=job.step,
                          committed_version=job.version, last_write_s=job.write_s, last_commit_s=job.commit_s,
                          spread=job.spread, copies=job.replicas)
        if job.spread:
            self.stats["protected_step"] = job.step
        self.ckpt._replicated_version = job.version
        self._unchanged_base = (job.version, job.fingerprints)
        job.future.set_result(job.version)

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
            finally:
                job.written.set()
                job.done.set()

    def _write(self, job: _InFlight, specs, documents: dict[str, Any], leader_docs: SaveRound | None,
               rank: int) -> None:
        """Write and prepare this rank's part, then take part in the commit (see the module docstring)."""
        ckpt, store = self.ckpt, self.ckpt.store
        begin = time.monotonic()
        try:
            if self._gc_due:  # the previous snapshot was committed at the boundary, its retention left to here
                self._gc_due = False
                store.gc(ckpt.keep)
            if leader_docs is not None:
                job.layout = leader_docs.layout()
                documents[STORES_DOC] = stores_doc(job.version, {h: job.addresses.get(h) for h in leader_docs.ring},
                                                   job.replicas, leader_docs.ring)
            self.staging.wait_copied()
            with store.begin(job.version, part=f"rank{rank}") as writer:
                for name, box, buffer in self.staging.buffers():
                    spec = specs[name]
                    writer.put(ckpt.device, name, box, _as_storage(buffer, spec.dtype).numpy(), spec.dtype, spec.shape)
                if job.linked:
                    self._link_unchanged(job, writer)
                if job.layout is not None:
                    writer.put_layout(job.layout)
                for doc_name, doc in documents.items():
                    writer.put_json(doc_name, doc)
                writer.prepare()
        except Exception as e:  # noqa: BLE001 -- training goes on; the boundary settles it
            job.error = f"{type(e).__name__}: {e}"
            log.error("tenplex: snapshot of step %d (version %d) failed on rank %d: %s; training goes on, the next "
                      "snapshot is tried", job.step, job.version, rank, job.error)
        job.write_s = time.monotonic() - begin
        job.written.set()
        kv = self._kv.get(job.give_up)  # connected off the training thread; None until it answers
        if kv is not None:
            try:
                self._agree_through_store(job, kv)
            except Exception as e:  # noqa: BLE001 -- the boundary's all-gather settles it instead
                log.warning("tenplex: snapshot of step %d (version %d): %s: %s; it is settled at the next step "
                            "boundary", job.step, job.version, type(e).__name__, e)

    def _link_unchanged(self, job: _InFlight, writer) -> None:
        """Put the unchanged pieces into this part as hard links to their files in version - 1 (no byte copied); a
        link that fails (EXDEV: another mount; a file gone) copies the stored bytes instead."""
        device, reader = self.ckpt.device, self.ckpt.store.open(job.version - 1)
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

    def _agree_through_store(self, job: _InFlight, kv) -> None:
        decision = f"{job.key}/decision"
        if job.error is not None:
            kv.set(decision, "abort")
            return
        if kv.add(f"{job.key}/prepared", 1) == job.world:
            kv.set(decision, "commit")  # every rank prepared its part
            kv.set(committed_key(), str(job.step))  # a restore that cannot reach it counts it lost
        if not job.leader:
            return
        while not job.give_up.is_set():
            if kv.check([decision]):
                if kv.get(decision) == b"commit":
                    self._commit(job)
                return
            time.sleep(_POLL_S)

    def _commit(self, job: _InFlight, gc: bool = True) -> None:
        store = self.ckpt.store
        store.commit(job.version, parts=job.parts)
        job.committed = True
        job.commit_s = time.monotonic() - job.called_at
        if gc:  # retention, off the training thread: a boundary that had to commit leaves it to the next write
            store.gc(self.ckpt.keep)
        else:
            self._gc_due = True
        self._queue_copy(job)
        if self.ckpt.durable is not None:  # the durable tier flushes snapshots like saves (its own policy)
            self.ckpt.durable.saved()

    # ----------------------------------------------------------- replication
    def _queue_copy(self, job: _InFlight) -> None:
        """Have the newest committed snapshot copied to the ring's next hosts (see :meth:`_copy_loop`)."""
        if not (job.leader and job.replicas and job.layout is not None):
            return
        with self._copy_wanted:
            self._next_copy = (job.version, job.step, job.layout, job.addresses, job.replicas)
            if self._copier is None:
                self._copier = threading.Thread(target=self._copy_loop, name="tenplex-snapshot-copies", daemon=True)
                self._copier.start()
            self._copy_wanted.notify()

    def _copy_loop(self) -> None:
        """Copy one snapshot at a time, the newest first: a copy still running is not cancelled by a newer
        snapshot, and of the snapshots committed meanwhile only the newest is copied next."""
        while True:
            with self._copy_wanted:
                while self._next_copy is None and not self._closed:
                    self._copy_wanted.wait()
                if self._closed:
                    return
                assert self._next_copy is not None
                version, step, layout, addresses, replicas = self._next_copy
                self._next_copy = None
                self._copying_step = step
                self._copy_busy = True
            self._copy_with_retries(version, step, layout, addresses, replicas)
            with self._copy_wanted:
                self._copy_busy = False
                self._copy_wanted.notify_all()

    def _copy_with_retries(self, version: int, step: int, layout: Layout, addresses: dict, replicas: int) -> None:
        ckpt = self.ckpt
        for _ in range(_COPY_TRIES):
            with self._copy_wanted:
                if self._closed or self._next_copy is not None:
                    return  # superseded: copy the newer one instead
                # Started before it is published: wait_replicated (the training thread) may join it at once.
                replicator = Replicator(ckpt.store, version, layout, replicas, addresses, token=ckpt.token,
                                        keep=ckpt.keep).start()
                ckpt._replicator = replicator
            if replicator.wait():
                self.stats["replicated_step"] = step
                if (self.stats["protected_step"] or -1) < step:
                    self.stats["protected_step"] = step  # its copies are committed on the ring's next hosts
                return
            if replicator.state == "cancelled":
                return
            # Each host commits on its own once every rank prepared: the origin's commit may come a moment
            # after ours (its store answers NOT_FOUND until then).
            time.sleep(_COPY_RETRY_S)

    def wait_copies(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` seconds until the newest committed snapshot's copy is done, its retries
        included (a first try that fails because the origin has not committed yet is not the answer)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._copy_wanted:
            while (self._next_copy is not None or self._copy_busy) and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._copy_wanted.wait(0.05 if left is None else min(0.05, left))

    def replication_lag(self) -> int:
        """Steps between the newest committed snapshot and the newest one whose copies are committed on this
        host (0 when this rank pulls no copies)."""
        committed, replicated = self.stats["committed_step"], self.stats["replicated_step"]
        if committed is None or self._copying_step is None:
            return 0
        return committed - (replicated if replicated is not None else 0)

    def close(self) -> None:
        """Stop polling for a decision and copying (the process is going away); what was staged stays
        uncommitted."""
        if self.inflight is not None:
            self.inflight.give_up.set()
        self._queue.put(None)
        with self._copy_wanted:
            self._closed = True
            self._copy_wanted.notify()
        # A running thread's bound target keeps this snapshotter, its cached pieces (a DTensor's mesh: the old
        # world's process groups and sockets) alive until it ends; in place the groups must go with the world
        # (leave_process_group's gc.collect), else a survivor still in a collective with this rank waits for the
        # group's timeout (issue 36). Both threads end at their next item: bounded, not a whole copy's wait.
        for thread in (self._writer, self._copier):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=CLOSE_JOIN_S)
