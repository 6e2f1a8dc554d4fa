"""One worker's side of the in-place protocol: register, heart-beat, arrive, propose, re-form the process group.

May import: ``tenplex.elastic.protocol`` (the protocol's logic), ``tenplex.elastic.closewatch`` (announcing this
process to the rendezvous server's close watch), ``tenplex.integration.process_group`` (leaving a
group), torch.distributed and the standard library.

:class:`Membership` does the I/O that :mod:`tenplex.elastic.protocol` decides,
on the job's rendezvous store (``tenplex rendezvous serve``: a ``TCPStore``
no agent owns; several jobs share it under their own key prefixes). Each
generation's process group is the default group, created by
``init_process_group`` on a ``PrefixStore`` of that generation alone, so
nothing of an old group (its keys, its connections) is reused; leaving it
destroys it and joins its gloo threads (:func:`leave_process_group`).

What bounds every wait, measured with torch 2.13 and gloo on loopback:

* a peer SIGKILLed in the middle of an all-reduce: its sockets close and every
  survivor's collective raises "Connection reset by peer" at once;
  ``destroy_process_group`` then returns in microseconds (it does not wait for
  the dead peer), and a new group forms in a few milliseconds;
* a peer that hangs or is cut off sends no reset: the group's ``timeout``
  (:class:`Membership`'s ``timeout``) ends the collective;
* a peer whose process ends (SIGKILL, a crash, its node killed) closes its
  connection to the rendezvous server's close watch
  (:mod:`tenplex.elastic.closewatch`): the server marks it gone and the watch
  threads count it dead at their next read (``heartbeat_s``), so the
  survivors of a failed collective propose the next generation without
  waiting out its heartbeat (the generation's ``lost_by`` says which
  evidence counted each lost peer dead);
* a peer that hangs or is cut off between collectives stops its heartbeat
  (or, cut off, its heartbeat stops reaching the store): the watch thread
  counts it dead after ``dead_after`` seconds and flags a change for the
  next step boundary (:attr:`Membership.wanted`);
* a member of a proposed generation that never forms it (a second failure):
  the formation fails after ``timeout`` on every other member, which arrive
  at the next generation without it.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..integration.process_group import import_world_capturing_modules, leave_process_group
from . import closewatch
from .protocol import (Event, Generation, Keys, Liveness, Member, Worker, change_wanted, last_call_over, overdue,
                       propose, ready_to_propose, warming_up)

log = logging.getLogger(__name__)


class FormationFailed(RuntimeError):
    """A member of the generation did not join its process group in time: arrive at the next one."""


def connect(endpoint: str, timeout: float = 30.0) -> dist.TCPStore:
    """A client of the rendezvous store at ``HOST:PORT``."""
    host, _, port = endpoint.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))


class Membership:
    """This worker's membership in an in-place job (see the module docstring and :mod:`.protocol`).

    ``min_workers``: how many workers the first generation waits for; then,
    until no worker registered for ``last_call`` seconds or ``max_workers``
    (the most the job may have; None: unknown) registered.
    ``timeout``: each generation's process-group timeout (a hung collective,
    a member that never forms). ``dead_after``: seconds of a still heartbeat
    after which a worker counts as dead; ``heartbeat_s``: the watch thread's
    period. ``local_world``: how many workers this node's launcher started
    (default: torchrun's ``LOCAL_WORLD_SIZE``); a joining node's workers are
    admitted together once all of them registered, or ``batch_wait`` seconds
    after one was first seen (a sibling that hangs in its start).
    :attr:`timeline` records when this worker registered and each generation
    it formed (wall-clock seconds, for start-up accounting).
    """

    def __init__(self, endpoint: str, job: str, host: str, local_rank: int, *, min_workers: int = 1,
                 timeout: float = 10.0, dead_after: float = 2.0, heartbeat_s: float = 0.1, backend: str = "gloo",
                 local_world: int | None = None, batch_wait: float = 30.0, last_call: float = 0.0,
                 max_workers: int | None = None):
        self.keys = Keys(job)
        self.endpoint, self.min_workers, self.timeout, self.backend = endpoint, min_workers, timeout, backend
        self.last_call, self.max_workers = last_call, max_workers
        self._quiet: tuple[frozenset[int], float] = (frozenset(), time.monotonic())  # registered, since when
        self.heartbeat_s, self.batch_wait = heartbeat_s, batch_wait
        self.timeline: dict[str, float] = {"connecting": time.time()}
        self.protocol = Worker()
        self.current: Generation | None = None   # the generation whose group this worker is in
        self._seen: Generation | None = None     # the newest one it read (it may have been left out of it)
        self.liveness = Liveness(dead_after)
        self._store = connect(endpoint)
        self._members: dict[int, Member] = {}    # every registered worker seen so far
        self._leaving: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.wanted: tuple[str, ...] = ()        # the watch thread's flag: why the world should change
        self._announced: socket.socket | None = None  # this process's connection to the close watch, if served
        self.held_back: set[int] = set()         # joiners it saw whose host still starts others (no change yet)
        wid = self._store.add(self.keys.slots, 1) - 1
        if local_world is None:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.me = Member(wid, host, local_rank, os.getpid(), local_world)
        self._watcher = threading.Thread(target=self._watch, name="tenplex-membership", daemon=True)

    # ----------------------------------------------------------------- registration and the watch thread
    def register(self) -> Member:
        """Announce this worker as warm (call it once it imported, mounted and connected: the running world is
        asked to change only now) and start heart-beating."""
        import_world_capturing_modules()  # before any group exists (see tenplex.integration.process_group)
        # The heartbeat is a Python thread: a full garbage collection holds the GIL for it, and one over torch's
        # import-time objects takes ~1 s on a busy machine (measured), long enough to be taken for dead. Frozen
        # objects are never traversed again; what the worlds create later (groups included) still is.
        gc.freeze()
        self._store.set(self.keys.slot(self.me.wid), self.me.to_json())
        self._store.add(self.keys.heartbeat(self.me.wid), 1)
        self._announce()
        self._watcher.start()
        self.protocol.on(Event.REGISTERED)
        self.timeline["registered"] = time.time()
        return self.me

    def _announce(self) -> None:
        """Ask the rendezvous server's close watch to mark this worker gone when its process ends (a store
        served otherwise has none: the heartbeat alone notices then)."""
        if self._store.check([closewatch.PORT_KEY]):
            port = int(self._store.get(closewatch.PORT_KEY))
            host = self.endpoint.rpartition(":")[0].strip("[]")
            self._announced = closewatch.announce(host, port, self.keys.gone, f"{self.me.wid},")

    def _gone(self, store) -> set[int]:
        """The workers the close watch marked gone."""
        if not store.check([self.keys.gone]):
            return set()
        return {int(w) for w in store.get(self.keys.gone).decode().split(",") if w.strip()}

    def _watch(self) -> None:
        store = connect(self.endpoint)
        try:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    store.add(self.keys.heartbeat(self.me.wid), 1)
                    self._observe(store)
                except Exception as e:  # noqa: BLE001 -- the rendezvous store is unreachable: nothing to flag
                    log.warning("membership watch: %s: %s", type(e).__name__, e)
        finally:
            del store

    def _observe(self, store) -> None:
        """Read the registered workers, their heartbeats and leave marks; update :attr:`wanted`."""
        gone = self._gone(store)  # before the leave marks: a worker that left says so before its process ends
        count = store.add(self.keys.slots, 0)
        now = time.monotonic()
        for wid in range(count):
            if wid not in self._members:
                if not store.check([self.keys.slot(wid)]):  # took its slot, not yet registered (warming up)
                    continue
                with self._lock:
                    self._members[wid] = Member.from_json(store.get(self.keys.slot(wid)))
            if wid in self._leaving:
                continue
            if store.add(self.keys.leaving(wid), 0) > 0:
                with self._lock:
                    self._leaving.add(wid)
                self.liveness.forget(wid)
                continue
            self.liveness.observe(wid, store.add(self.keys.heartbeat(wid), 0), now)
            if wid in gone:
                self.liveness.gone(wid)
        current = self.current
        if current is not None:
            members, leaving, dead = self.view()
            # a registered worker counts once seen heart-beating: a stale slot of a dead one is no joiner
            registered = set(members) & (self.liveness.alive() | set(current.members))
            held = self.warming(current, members, registered, leaving | dead)
            wanted = change_wanted(current, registered, leaving, dead, held)
            if self.current is current:  # not re-formed meanwhile
                self.wanted, self.held_back = wanted, held

    def warming(self, current: Generation | None, members: dict[int, Member], registered: set[int],
                gone: set[int]) -> set[int]:
        """The registered joiners whose host still starts other workers (see :func:`.protocol.warming_up`)."""
        present = {w: members[w] for w in registered - gone}
        late = overdue(self.liveness.first_seen(), time.monotonic(), self.batch_wait)
        return warming_up(present, set(current.members) if current else set(), late)

    def view(self) -> tuple[dict[int, Member], set[int], set[int]]:
        """(registered workers, leaving, dead) as the watch thread saw them last."""
        with self._lock:
            members, leaving = dict(self._members), set(self._leaving)
        return members, leaving, self.liveness.dead() - leaving

    # ----------------------------------------------------------------- generations
    def latest(self) -> Generation | None:
        """The newest published generation (None before the first)."""
        number = int(self._store.get(self.keys.latest)) if self._store.check([self.keys.latest]) else 0
        return Generation.from_json(self._store.get(self.keys.generation(number))) if number else None

    def next_generation(self, deadline: float | None = None) -> Generation:
        """Arrive at the generation after :attr:`current` (or after the newest one, for a worker that never
        was a member), propose it once everyone expected arrived, and return the published one; it may leave
        this worker out (it then stays warm: call again). Raises TimeoutError past ``deadline``."""
        previous = self._seen if self._seen is not None else self.latest()
        number = previous.number + 1 if previous is not None else 1
        self._store.add(self.keys.arrived(number, self.me.wid), 1)
        while True:
            key = self.keys.generation(number)
            if self._store.check([key]):
                return self._published(Generation.from_json(self._store.get(key)))
            members, leaving, dead = self.view()
            arrived = {w: m for w, m in members.items() if self._store.add(self.keys.arrived(number, w), 0)}
            # expected: the previous generation's members and the joiners seen heart-beating (not stale slots)
            registered = set(members) & (self.liveness.alive() | set(previous.members if previous else ()))
            # an arrival proves a worker alive before its heartbeat does: an arrived joiner's host is warming too
            warming = self.warming(previous, members, registered | set(arrived), leaving | dead) \
                if previous is None else set()
            if ready_to_propose(previous, registered, set(arrived), leaving, dead, self.min_workers, warming) \
                    and self._last_call_over(previous, registered | set(arrived)):
                proposal = propose(previous, arrived, leaving)
                if previous is not None and dead & set(previous.members):
                    lost_by = tuple((w, self.liveness.how_dead(w)) for w in sorted(dead & set(previous.members)))
                    proposal = dataclasses.replace(proposal, lost_by=lost_by)
                    log.warning("generation %d: proposing %s without %s (closed: its process is gone; heartbeat: "
                                "none for %.1f s)", number, list(proposal.members), dict(lost_by),
                                self.liveness.timeout)
                won = self._store.compare_set(key, "", proposal.to_json())
                if won.decode() == proposal.to_json():  # this proposal (or an identical one) was published:
                    self._store.set(self.keys.latest, str(number))  # its proposers set the same number, in order
                return self._published(Generation.from_json(won))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"generation {number}: still waiting for workers "
                                   f"{sorted(registered - set(arrived) - leaving - dead)} to arrive")
            time.sleep(self.heartbeat_s / 2)

    def _last_call_over(self, previous: Generation | None, registered: set[int]) -> bool:
        """:func:`.protocol.last_call_over` on this worker's clock: quiet since the registered set last changed."""
        now = time.monotonic()
        if registered != self._quiet[0]:
            self._quiet = (frozenset(registered), now)
        return last_call_over(previous, len(registered), self.max_workers, now - self._quiet[1], self.last_call)

    def _published(self, generation: Generation) -> Generation:
        self._seen = generation
        self.protocol.on(Event.PUBLISHED_OUT if generation.rank_of(self.me.wid) is None else Event.PUBLISHED_IN)
        return generation

    def form(self, generation: Generation) -> None:
        """Create ``generation``'s process group (the default group) with this worker's rank in it."""
        rank = generation.rank_of(self.me.wid)
        if rank is None:
            raise ValueError(f"worker {self.me.wid} is not a member of generation {generation.number}")
        store = dist.PrefixStore(self.keys.group(generation.number), self._store)
        try:
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=len(generation.members),
                                    timeout=timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 -- a member did not come: the next generation goes on without it
            self.protocol.on(Event.FORM_FAILED)
            raise FormationFailed(f"generation {generation.number}: the process group did not form "
                                  f"({type(e).__name__}: {e})") from e
        self.current = generation
        self.wanted = ()
        self.protocol.on(Event.FORMED)
        self.timeline.setdefault("formed", time.time())  # the first generation this worker trained in

    def join(self, deadline: float | None = None) -> Generation:
        """Wait for the next generation that includes this worker and form its group; a formation that fails
        (a member died meanwhile) moves on to the one after. Returns the generation this worker is in."""
        while True:
            generation = self.next_generation(deadline)
            if generation.rank_of(self.me.wid) is None:
                continue  # left out (it arrived late, or was taken for dead): the members will see it as a join
            try:
                self.form(generation)
                return generation
            except FormationFailed as e:
                log.warning("%s; arriving at the next generation", e)

    def leave_group(self, event: Event = Event.DRAINED) -> None:
        """Leave the current generation's group (after draining, or a failure): destroy it and free its threads;
        the caller drops its own references to subgroups first."""
        if dist.is_initialized():
            leave_process_group(together=False)
        self.current = None
        self.wanted = ()
        self.protocol.on(event)

    def mark_leaving(self) -> None:
        """Tell the others this worker leaves (a planned leave, or the end of training): no change waits for it."""
        self._store.add(self.keys.leaving(self.me.wid), 1)

    def close(self) -> None:
        """Stop heart-beating (the others count this worker dead unless it marked itself leaving)."""
        self._stop.set()
        if self._watcher.is_alive():
            self._watcher.join(timeout=5)
        if self._announced is not None:
            closewatch.withdraw(self._announced)
            self._announced = None
