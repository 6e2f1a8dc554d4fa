"""A snapshotter's background threads: they write, prepare and agree on each snapshot (:mod:`.snapshot`, 2-3).

May import: torch, ``tenplex.box``, ``tenplex.layout``, ``tenplex.replication``, ``tenplex.store``, this package's
:mod:`.savedoc`, :mod:`.shardio`, :mod:`.snapshot_agree`, :mod:`.snapshot_buffers`, :mod:`.snapshot_copies`,
:mod:`.snapshot_defer`, :mod:`.jobstore`, :mod:`.nontensor`, :mod:`.versions` and the standard library.

Two threads per snapshotter take the snapshots over in order (starting a thread per snapshot costs the training
thread more than the rest of a small snapshot). The writer first makes the copies the boundary left to it
(:mod:`.snapshot_defer`: the next ``optimizer.step()`` waits for them), then posts the rank's step document (a
snapshot staged without an exchange), writes the staged buffers as the rank's part, hard-links the unchanged
pieces from the version before, lets the host leader add the documents and prepares the part; the decider then
takes part in the decision through the job's key-value store (:mod:`.snapshot_agree`), the host leader commits on
``commit``, and retention follows. So the next snapshot's step document and write need not wait for this one's
decision and commit (on the step's critical path every rank's post, write and the decision, not the commits); the
next boundary waits for the decision, not for the commit or the retention.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..box import Box
from ..layout import Layout
from ..replication.stores import STORES_DOC, stores_doc
from ..store import CorruptShard
from ..store.contract import LinkingWriter
from .jobstore import JobKeyValue
from .nontensor import rng_doc
from .savedoc import SaveRound, refresh_state_doc
from .shardio import _as_storage
from .snapshot_agree import ABORT, COMMIT, Aborted, Agreement, GaveUp, poll
from .snapshot_buffers import SnapshotBuffers
from .snapshot_copies import SnapshotCopies
from .snapshot_defer import Capture
from .versions import STATE_DOC

log = logging.getLogger(__name__)
DECISION_S = 120.0  # how long a rank that prepared waits for the others before it calls the snapshot undecided
LINK_WAIT_S = 30.0  # how long a write waits for its host to commit the version it links from


@dataclass
class InFlight:
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
    fingerprints: dict[tuple[str, Box], tuple]  # of the pieces it looked at that the next snapshot compares
    linked: list[tuple[str, Box]]    # the pieces unchanged since version - 1: linked from there, not staged
    exchanged: bool = True           # staged after an exchange; else its step document travels through the store
    step_doc: dict | None = None     # not exchanged: this rank's RNG streams and optimizer scalars at the boundary
    changed: str | None = None       # not exchanged: why this rank cannot write its part (its structure changed)
    previous_key: str | None = None  # the keys' prefix of the snapshot staged before it (deleted once decided)
    canonical_posts: list[tuple[int, tuple[str, Box]]] = field(default_factory=list)  # not exchanged: this rank
    canonical_takes: dict[tuple[str, Box], int] = field(default_factory=dict)  # posts them; takes its source's
    every_fingerprint: bool = True   # ``fingerprints`` holds every piece's (else only the unchanged ones')
    capture: Capture | None = None   # what the writer thread stages before it writes (.snapshot_defer)
    capture_error: Exception | None = None  # why that failed (this rank does not prepare its part)
    future: Future = field(default_factory=Future)
    called_at: float = field(default_factory=time.monotonic)  # when async_save was called
    written: threading.Event = field(default_factory=threading.Event)
    give_up: threading.Event = field(default_factory=threading.Event)
    decided: threading.Event = field(default_factory=threading.Event)  # the decision is known (or will not be)
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



class SnapshotWriter:
    """The writer and decider threads of one snapshotter (see the module docstring)."""

    def __init__(self, ckpt, staging: tuple[SnapshotBuffers, ...], kv: JobKeyValue, copies: SnapshotCopies) -> None:
        self.ckpt, self.kv, self.copies = ckpt, kv, copies
        self.staging = staging  # the buffers staged at the boundary, those this thread stages (.snapshot_defer)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # snapshots to write; None: stop
        self._decisions: queue.SimpleQueue = queue.SimpleQueue()  # written snapshots to agree on; None: stop
        self.threads: list[threading.Thread] = []
        self._gc_due = False  # a commit left retention to the decider thread
        # Between exchanges: this rank's last posted RNG streams, their generation and key; (leaders) every rank's
        # RNG streams read from the store.
        self._rng_posted: tuple[int, Any] = (-1, None)
        self._rng_key: str | None = None
        self._known_rng: dict[int, tuple[int, Any]] = {}

    def new_world(self) -> None:
        """An exchange started new keys: RNG generations start again (the threads are idle: the exchange waited)."""
        self._rng_posted, self._known_rng = (-1, None), {}

    def hand_off(self, job: InFlight, specs: dict, documents: dict[str, Any], leader_docs: SaveRound | None) -> None:
        if not self.threads:
            self.threads = [threading.Thread(target=self._write_loop, name="tenplex-snapshot-writer", daemon=True),
                            threading.Thread(target=self._decide_loop, name="tenplex-snapshot-decider", daemon=True)]
            for thread in self.threads:
                thread.start()
        self._queue.put((job, (specs, documents, leader_docs)))

    def stop(self) -> None:
        """End the threads after the snapshots in hand."""
        self._queue.put(None)

    def _write_loop(self) -> None:
        """Write and prepare each snapshot in turn, then hand it to the decider: the next one's write (its step
        document first) need not wait for this one's decision and commit."""
        while True:
            item = self._queue.get()
            if item is None:
                self._decisions.put(None)
                return
            job, args = item
            try:
                # First, apart from the write (which may wait): the next optimizer.step() waits for it
                job.capture_error = self._capture(job)
                self._write(job, *args)
            finally:
                if job.capture is not None:
                    job.capture.done.set()
                job.written.set()
                self._decisions.put(job)

    def _decide_loop(self) -> None:
        while True:
            job = self._decisions.get()
            if job is None:
                return
            try:
                self._agree(job)
            finally:
                job.decided.set()
            try:
                self._retention()
            except Exception as e:  # noqa: BLE001 -- tried again after the next commit
                self._gc_due = True
                log.warning("tenplex: retention after version %d: %s: %s", job.version, type(e).__name__, e)
            finally:
                job.done.set()

    def _write(self, job: InFlight, specs, documents: dict[str, Any], leader_docs: SaveRound | None) -> None:
        """Write and prepare this rank's part (see the module docstring)."""
        ckpt, store = self.ckpt, self.ckpt.store
        begin = time.monotonic()
        agreement = None if job.exchanged else Agreement(self.kv.get(job.give_up), job.world_key, job.version,
                                                         job.rank, job.world)
        try:
            if job.capture_error is not None:
                raise job.capture_error
            if job.changed is not None:
                raise _Changed(job.changed)
            if agreement is not None:
                self._post_step(agreement, job)
            if leader_docs is not None:
                job.layout = leader_docs.layout()
                documents[STORES_DOC] = stores_doc(job.version, {h: job.addresses.get(h) for h in leader_docs.ring},
                                                   job.replicas, leader_docs.ring)
            for buffers in self.staging:
                buffers.wait_copied()
            staged = {(name, box): buffer for buffers in self.staging for name, box, buffer in buffers.buffers()}
            for index, key in job.canonical_posts:
                assert agreement is not None
                # (flat first: a 0-dimensional buffer, BatchNorm's num_batches_tracked, has no byte view)
                agreement.post_canonical(index, staged[key].reshape(-1).view(torch.uint8).numpy().tobytes())
            with store.begin(job.version, part=f"rank{job.rank}") as writer:
                for (name, box), buffer in staged.items():
                    if (name, box) in job.canonical_takes:
                        assert agreement is not None
                        data = agreement.canonical(job.canonical_takes[(name, box)], _Deadline(job.give_up, DECISION_S))
                        buffer = torch.frombuffer(bytearray(data), dtype=buffer.dtype).reshape(buffer.shape)
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

    @staticmethod
    def _capture(job: InFlight) -> Exception | None:
        """The copies and scalars the boundary left to this thread (:mod:`.snapshot_defer`); why they failed."""
        if job.capture is None:
            return None
        try:
            scalars = job.capture.run()
        except Exception as e:  # noqa: BLE001 -- this rank does not prepare its part: it decides abort
            return e
        if scalars is not None:
            assert job.step_doc is not None
            job.step_doc["scalars"] = scalars
        return None

    def _post_step(self, agreement: Agreement, job: InFlight) -> None:
        """Post this rank's step document; its RNG streams as a new generation when they changed (the previous
        generation's key is deleted once this snapshot is decided)."""
        assert job.step_doc is not None
        streams = None if job.step_doc["rng"] is None else rng_doc(job.step_doc["rng"])
        new = streams is not None and streams != self._rng_posted[1]
        if new:
            self._rng_posted = (self._rng_posted[0] + 1, streams)
        generation = None if streams is None else self._rng_posted[0]
        key = agreement.post_step(job.step_doc["scalars"], generation, streams, new)
        if new:
            job.step_doc["stale_rng_key"], self._rng_key = self._rng_key, key

    def _agree(self, job: InFlight) -> None:
        """Take part in the decision through the job's key-value store; the host leader commits on ``commit``.
        Ends with the decision known, given up (the boundary settles it by an exchange), or the store gone."""
        kv = self.kv.get(job.give_up)  # connected off the training thread; None until it answers
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
            if decision == ABORT:
                rank, error = agreement.error()
                job.abort_reason = f"rank {rank}: {error}"
            job.decision = decision
            job.decided.set()  # the next boundary may go on: a decided version is restorable (roll forward)
            if decision == COMMIT and job.leader:
                self._commit_decided(job)
            agreement.forget(job.step_doc.get("stale_rng_key") if job.step_doc else None, job.previous_key,
                             tuple(i for i, _ in job.canonical_posts))
        except GaveUp:
            if give_up.expired:
                job.store_error = TimeoutError(f"no decision within {DECISION_S:.0f} s")
                log.warning("tenplex: snapshot of step %d (version %d): no decision within %.0f s", job.step,
                            job.version, DECISION_S)
        except Exception as e:  # noqa: BLE001 -- the boundary's exchange settles it instead
            job.store_error = e
            log.warning("tenplex: snapshot of step %d (version %d): %s: %s; it is settled at the next step "
                        "boundary", job.step, job.version, type(e).__name__, e)

    def _commit_decided(self, job: InFlight) -> None:
        try:
            self.commit(job, gc=False)
        except Exception as e:  # noqa: BLE001 -- the parts stay prepared: a restore rolls them forward
            log.error("tenplex: snapshot of step %d (version %d): every rank prepared it, but this host's commit "
                      "failed: %s: %s; its prepared parts stay for a restore", job.step, job.version,
                      type(e).__name__, e)

    def _link_unchanged(self, job: InFlight, writer) -> None:
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

    def commit(self, job: InFlight, gc: bool = True) -> None:
        """Commit this host's parts; retention now (``gc``) or after this thread's next decision; the copies."""
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
