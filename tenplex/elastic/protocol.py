"""The in-place protocol: how workers move from one world (a *generation*) to the next without restarting.

May import: the standard library only (pure: no torch, no store, no clock; callers pass the time in).

With ``tenplex run --in-place`` each node's torchrun supervises only its own
workers (a crash restarts them, counted against ``--max-restarts``); the
training world across the nodes is formed by the workers themselves, once per
generation, through the job's rendezvous store (``tenplex rendezvous serve``,
which no agent owns). This module is the protocol's logic: the states of one
worker, the events that move it, the store's key names, and the decisions
every worker takes the same way from what it reads there. The I/O lives in
:mod:`tenplex.elastic.reform`.

A worker's states and the events between them (:data:`TRANSITIONS`)::

    STARTING --registered--> WARM --published_in--> FORMING --formed--> TRAINING --finished--> DONE
                              ^  \\--published_out--> WARM  \\--form_failed--> WARM (arrives at N+1)
                              |                           TRAINING --change_agreed--> DRAINING --drained--> WARM
                              |                           TRAINING --peer_lost--> FAILED --drained--> WARM
                              +-----------------------------------(DRAINING --peer_lost--> FAILED)
                                                          DRAINING --left--> LEAVING (a planned leave: exit 0)

The sequence of one change from generation N to N+1:

1. **detect**: each worker's watch thread bumps its heartbeat counter
   (``hb/W``) and reads the others' (:class:`Liveness`); it flags a change
   when a warm worker registered that is not a member (a join), when a
   member's heartbeat stopped or its process is known gone (a lost peer: the
   rendezvous server saw the process's connection close, see
   :mod:`tenplex.elastic.closewatch`; the heartbeat covers what that cannot
   see), or when a member asked to leave.
   Joiners are admitted **by host**: a node's launcher starts all its workers
   at once, and each announces how many (``local_world``); the running world
   flags the join only once every worker of the joining host registered
   (:func:`warming_up`), so a node of k workers costs one change, not k. The
   same holds for the first world: it waits for the hosts it has workers of,
   and, as torchrun's rendezvous does, for a *last call*: until no worker
   registered for ``last_call`` seconds or every worker the job may have
   (``max_workers``) registered (:func:`last_call_over`), so that nodes
   launched together start in one world instead of one world and a join.
   A sibling that hangs in its start (never registers, never dies) holds its
   host back at most ``batch_wait`` seconds (:func:`overdue`); one that
   crashes makes its launcher restart the node's workers, whose heartbeats
   stop: no wait for it either.
2. **agree**: at the next step boundary the ranks all-reduce the flags
   (``Job.step_done``); every rank then saves the step (a planned change) and
   leaves the group. A collective that fails because a peer is gone skips the
   save (the newest committed snapshot is restored) and leaves the broken group.
3. **arrive**: every worker that stays writes ``arrive/N+1/W``; a warm joiner
   arrived there before it registered. Once every expected worker (members of
   N and registered joiners) arrived, left, or is dead (gone or by heartbeat)
   (:func:`ready_to_propose`), any arrived worker proposes generation N+1 =
   the arrived workers in node order (:func:`propose`), with ``compare_set``
   on ``gen/N+1``: the first proposal wins and every worker reads that one.
4. **re-form**: each member of N+1 creates a fresh process group on the
   store under ``pg/N+1/`` (a ``PrefixStore``: nothing of N's group is reused)
   with its rank (its place in the member list) and the world size; a member
   that does not arrive within the timeout fails the formation everywhere, and
   the others arrive at N+2 without it (a second failure is one more change).
5. **restore**, then the **first step** of N+1.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Set
from dataclasses import dataclass, field


class ProtocolError(RuntimeError):
    """An event that the worker's state does not allow: a bug in the caller, never a peer's failure."""


class State(str, enum.Enum):
    STARTING = "starting"   # importing, mounting the dataset view, connecting to the stores
    WARM = "warm"           # registered and heart-beating; waiting for a generation that includes it
    FORMING = "forming"     # a generation includes it: creating that generation's process group
    TRAINING = "training"
    DRAINING = "draining"   # the ranks agreed to change at a step boundary: saving and leaving the group
    FAILED = "failed"       # a peer is gone: the group is broken, leaving it without saving
    LEAVING = "leaving"     # a planned leave: drained, exits 0
    DONE = "done"           # training finished


class Event(str, enum.Enum):
    REGISTERED = "registered"
    PUBLISHED_IN = "published_in"
    PUBLISHED_OUT = "published_out"
    FORMED = "formed"
    FORM_FAILED = "form_failed"
    CHANGE_AGREED = "change_agreed"
    PEER_LOST = "peer_lost"
    DRAINED = "drained"
    LEFT = "left"
    FINISHED = "finished"


S, E = State, Event
TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.STARTING, E.REGISTERED): S.WARM,
    (S.WARM, E.PUBLISHED_IN): S.FORMING,
    (S.WARM, E.PUBLISHED_OUT): S.WARM,
    (S.FORMING, E.FORMED): S.TRAINING,
    (S.FORMING, E.FORM_FAILED): S.WARM,
    (S.TRAINING, E.CHANGE_AGREED): S.DRAINING,
    (S.TRAINING, E.PEER_LOST): S.FAILED,
    (S.TRAINING, E.FINISHED): S.DONE,
    (S.DRAINING, E.DRAINED): S.WARM,
    (S.DRAINING, E.PEER_LOST): S.FAILED,
    (S.DRAINING, E.LEFT): S.LEAVING,
    (S.FAILED, E.DRAINED): S.WARM,
}


class Worker:
    """One worker's protocol state; :meth:`on` applies an event or raises :class:`ProtocolError`."""

    def __init__(self) -> None:
        self.state = State.STARTING
        self.history: list[tuple[State, Event, State]] = []

    def on(self, event: Event) -> State:
        after = TRANSITIONS.get((self.state, event))
        if after is None:
            allowed = sorted(e.value for (s, e) in TRANSITIONS if s == self.state)
            raise ProtocolError(f"event {event.value!r} in state {self.state.value!r}; allowed there: {allowed}")
        self.history.append((self.state, event, after))
        self.state = after
        return after


# ----------------------------------------------------------------- the store's keys (under the job's prefix)
class Keys:
    """Key names in the rendezvous store, all under ``tenplex/inplace/JOB/``."""

    def __init__(self, job: str):
        self.prefix = f"tenplex/inplace/{job}/"
        self.slots = self.prefix + "slots"     # a counter: the next worker id
        self.latest = self.prefix + "latest"   # the newest published generation's number

    def slot(self, wid: int) -> str:            # a registered worker's Member (JSON)
        return f"{self.prefix}slot/{wid}"

    def heartbeat(self, wid: int) -> str:       # a counter its watch thread bumps
        return f"{self.prefix}hb/{wid}"

    def leaving(self, wid: int) -> str:         # a counter: > 0 once it left or finished
        return f"{self.prefix}leave/{wid}"

    @property
    def gone(self) -> str:                      # "W," per worker whose process ended (tenplex.elastic.closewatch)
        return f"{self.prefix}gone"

    def arrived(self, number: int, wid: int) -> str:
        return f"{self.prefix}arrive/{number}/{wid}"

    def generation(self, number: int) -> str:   # the winning proposal (JSON)
        return f"{self.prefix}gen/{number}"

    def group(self, number: int) -> str:        # the PrefixStore of that generation's process group
        return f"{self.prefix}pg/{number}/"


# ----------------------------------------------------------------- members and generations
@dataclass(frozen=True)
class Member:
    """A registered worker: its id (the slot it took), node, local rank, pid, and how many workers its node's
    launcher started with it (``local_world``: torchrun's ``LOCAL_WORLD_SIZE``)."""

    wid: int
    host: str
    local_rank: int
    pid: int
    local_world: int = 1

    def to_json(self) -> str:
        return json.dumps({"wid": self.wid, "host": self.host, "local_rank": self.local_rank, "pid": self.pid,
                           "local_world": self.local_world})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Member":
        d = json.loads(text)
        return cls(int(d["wid"]), str(d["host"]), int(d["local_rank"]), int(d["pid"]), int(d.get("local_world", 1)))


@dataclass(frozen=True)
class Generation:
    """One world: its number, its members in rank order, and why it was formed (``start``, ``join``, …)."""

    number: int
    members: tuple[int, ...]
    reasons: tuple[str, ...] = ()
    hosts: tuple[str, ...] = field(default=(), compare=False)  # each member's host, in the same order
    # the previous members left out as dead, with the evidence: "closed" (process gone) or "heartbeat"
    lost_by: tuple[tuple[int, str], ...] = field(default=(), compare=False)

    def rank_of(self, wid: int) -> int | None:
        return self.members.index(wid) if wid in self.members else None

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": list(self.members), "reasons": list(self.reasons),
                           "hosts": list(self.hosts), "lost_by": [list(p) for p in self.lost_by]})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Generation":
        d = json.loads(text)
        return cls(int(d["number"]), tuple(d["members"]), tuple(d["reasons"]), tuple(d.get("hosts", ())),
                   tuple((int(w), str(how)) for w, how in d.get("lost_by", ())))


def node_order(previous: Generation | None, members: dict[int, Member]) -> tuple[int, ...]:
    """The members in rank order: hosts in the order the previous generation had them (new hosts after, by
    their first worker's id), each host's workers by local rank. Each host's ranks stay consecutive, as the
    configuration policy expects, and a survivor's rank changes only where a host before it left."""
    known = list(dict.fromkeys(previous.hosts)) if previous is not None else []
    by_id = sorted(members.values(), key=lambda m: m.wid)
    hosts = [h for h in known if any(m.host == h for m in by_id)]
    hosts += [h for h in dict.fromkeys(m.host for m in by_id) if h not in hosts]
    ranked = sorted(by_id, key=lambda m: (hosts.index(m.host), m.local_rank, m.wid))
    return tuple(m.wid for m in ranked)


def reasons(previous: Generation | None, members: set[int], leaving: set[int]) -> tuple[str, ...]:
    """Why the world changes: ``start``, or any of ``join``, ``leave`` (asked to), ``lost`` (gone unasked)."""
    if previous is None:
        return ("start",)
    old = set(previous.members)
    return _why(join=members - old, leave=(old - members) & leaving, lost=(old - members) - leaving)


def expected(previous: Generation | None, registered: set[int], leaving: set[int]) -> set[int]:
    """The workers a proposal for the next generation waits for: every registered worker not leaving."""
    return (set(registered) | set(previous.members if previous else ())) - leaving


def ready_to_propose(previous: Generation | None, registered: set[int], arrived: set[int], leaving: set[int],
                     dead: set[int], min_workers: int = 1, warming: Set[int] = frozenset()) -> bool:
    """Whether the next generation can be proposed: every expected worker arrived, left or is dead, and enough
    arrived (``min_workers`` applies to the first generation only: later ones go on with the survivors). The
    first generation also waits while a host it has workers of still starts others (``warming``, from
    :func:`warming_up`); a later one never does: its change was agreed already (a loss must not wait for a
    joiner's sibling)."""
    waiting = expected(previous, registered, leaving) - arrived - dead
    live = arrived - leaving
    if previous is None and warming - leaving - dead:
        return False
    return not waiting and bool(live) and (previous is not None or len(live) >= min_workers)


def last_call_over(previous: Generation | None, registered: int, max_workers: int | None, quiet_s: float,
                   last_call: float) -> bool:
    """Whether the first generation may be proposed as far as late starters go: ``registered`` workers reached
    ``max_workers`` (when the job knows it), or none registered for ``quiet_s`` >= ``last_call`` seconds. Later
    generations never wait: their change was agreed already."""
    if previous is not None or (max_workers is not None and registered >= max_workers):
        return True
    return quiet_s >= last_call


def propose(previous: Generation | None, arrived: dict[int, Member], leaving: set[int]) -> Generation:
    """The next generation: the arrived workers that are not leaving, in node order. An arrival proves a worker
    alive, so a slow heartbeat never drops it; one that dies after arriving fails the formation instead."""
    members = {w: m for w, m in arrived.items() if w not in leaving}
    order = node_order(previous, members)
    number = previous.number + 1 if previous is not None else 1
    return Generation(number, order, reasons(previous, set(order), leaving), tuple(members[w].host for w in order))


def change_wanted(current: Generation, registered: set[int], leaving: set[int], dead: set[int],
                  warming: Set[int] = frozenset()) -> tuple[str, ...]:
    """What the watch thread flags for the next step boundary: a warm worker that is not a member (``join``;
    not while its host still starts others: ``warming``), a member that asked to leave (``leave``) or whose
    heartbeat stopped (``lost``); () when nothing changed."""
    members = set(current.members)
    return _why(join=registered - members - leaving - dead - warming, leave=members & leaving,
                lost=(members & dead) - leaving)


def warming_up(present: dict[int, Member], members: set[int], overdue: Set[int] = frozenset()) -> set[int]:
    """The joiners held back because their host still starts others: the workers of ``present`` (registered,
    alive, not leaving) that are not ``members``, on a host with fewer workers present than the largest
    ``local_world`` a joiner of it announces; except those waiting longer than the batching allows
    (``overdue``). When the last of a host's workers registers, the host's joiners are admitted together."""
    joiners = {w: m for w, m in present.items() if w not in members}
    count: dict[str, int] = {}
    for m in present.values():
        count[m.host] = count.get(m.host, 0) + 1
    want: dict[str, int] = {}
    for m in joiners.values():
        want[m.host] = max(want.get(m.host, 1), m.local_world)
    return {w for w, m in joiners.items() if count[m.host] < want[m.host] and w not in overdue}


def overdue(first_seen: dict[int, float], now: float, wait: float) -> set[int]:
    """The workers first seen more than ``wait`` seconds before ``now`` (on the observer's clock): a host whose
    other workers hang in their start holds these back no longer."""
    return {w for w, since in first_seen.items() if now - since > wait}


def _why(*, join: set[int], leave: set[int], lost: set[int]) -> tuple[str, ...]:
    """The labels of the non-empty sets, in the order ``join``, ``leave``, ``lost``."""
    return tuple(label for label, who in (("join", join), ("leave", leave), ("lost", lost)) if who)


class Liveness:
    """Who is dead, from heartbeat counters read at the caller's clock: a worker whose counter did not advance
    between observations that span ``timeout`` seconds. Counters, not timestamps, so that clocks of different
    hosts never compare; spans between observations, so that an observer that was itself starved of CPU (no
    observation for a while) counts nobody dead for it."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._seen: dict[int, tuple[int, float, float]] = {}  # wid -> (counter, when it last advanced, last seen)
        self._first: dict[int, float] = {}                     # wid -> when this observer first read it
        self._gone: dict[int, int] = {}                        # wid -> its counter when its connection closed

    def gone(self, wid: int) -> None:
        """Evidence that ``wid``'s process ended (:mod:`tenplex.elastic.closewatch`; call it after
        :meth:`observe` of the same round): dead now, without the timeout, as long as its counter stays where it
        was. A worker whose connection broke while it lives (a reset on the network) beats on: alive again, and
        only the timeout can count it dead from then on."""
        if wid in self._seen:
            self._gone.setdefault(wid, self._seen[wid][0])

    def observe(self, wid: int, counter: int, now: float) -> None:
        last = self._seen.get(wid)
        self._first.setdefault(wid, now)
        if last is None or counter != last[0]:
            self._seen[wid] = (counter, now, now)
        else:
            self._seen[wid] = (counter, last[1], now)

    def dead(self) -> set[int]:
        return {w for w, (counter, since, seen) in self._seen.items()
                if seen - since > self.timeout or self._gone.get(w) == counter}

    def how_dead(self, wid: int) -> str:
        """How ``wid`` was found dead: ``closed`` (its process's connection closed), else ``heartbeat``."""
        counter = self._seen[wid][0] if wid in self._seen else None
        return "closed" if counter is not None and self._gone.get(wid) == counter else "heartbeat"

    def alive(self) -> set[int]:
        """Workers seen heart-beating: their counter advanced since this observer first read it. A worker that
        died before this observer started (a stale slot) is neither alive nor, for ``timeout`` seconds, dead:
        it must not look like a joiner meanwhile."""
        return {w for w, (_, since, seen) in self._seen.items() if since > self._first[w]} - self.dead()

    def first_seen(self) -> dict[int, float]:
        """When this observer first read each worker's counter (its clock)."""
        return dict(self._first)

    def forget(self, wid: int) -> None:
        self._seen.pop(wid, None)
        self._first.pop(wid, None)
        self._gone.pop(wid, None)
