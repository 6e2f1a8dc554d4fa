"""Ranks the policy leaves idle in an elastic job: how they wait, and how the training ranks tell them a world ended.

May import: ``tenplex.elastic`` (policy, faults, reform), ``tenplex.errors``, torch.distributed and the standard
library.

:class:`IdleRanks` is that part of :class:`~tenplex.elastic.job.Job` (which inherits it): an idle rank's
:meth:`~IdleRanks.wait_idle`, its wait through a world in place (:meth:`~IdleRanks._idle_through_world`, which
:meth:`Job.worlds` runs so that the loop's body never sees a world this rank idles in), and the training ranks'
word to the idle ones.

The word lives in the job's c10d store under ``tenplex/WORLD_ID/idle`` (gloo's point-to-point receive cannot be
polled, and idle ranks are in no collective of the training ranks): ``done`` (the training ranks finished: the
idle rank exits 0), ``stop`` (the training ranks stopped: it exits as they do; in place a leaving first training
rank writes it, and the idle rank goes on to the next world), ``change`` (in place: the world ended at a step
boundary or lost a peer; the idle rank leaves it and joins the next generation, in which it may train). In place
an idle rank also ends its wait on its own heartbeat's view (:attr:`Membership.wanted
<tenplex.elastic.reform.Membership.wanted>`: a join, a leave, a lost peer), so a change whose word nobody wrote
(the training rank that would have written it died) ends the wait too.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..errors import ConfigError
from .faults import EXIT_PEER_LOST

if TYPE_CHECKING:
    from .policy import Choice

log = logging.getLogger("tenplex.elastic.job")  # a Job's own records keep its logger's name
WORDS = ("done", "stop", "change")


class IdleRanks:
    """The idle ranks' wait and the word they wait for. The job provides the attributes declared below,
    ``_exit`` (end the process at a step boundary) and ``_end_world`` (in place: end this world)."""

    if TYPE_CHECKING:
        choice: Choice
        rank: int
        world_id: str
        world: Any
        _membership: Any
        _kept: Any
        _step_finished_at: float

        @property
        def idle(self) -> bool: ...

        @property
        def _in_place(self) -> bool: ...

        @property
        def stop_requested(self) -> bool: ...

        def _exit(self, code: int, why: str) -> None: ...

        def _end_world(self, why: str) -> None: ...

    idle_worlds: list[int]  # the generations this process idled through (in place), in order

    def wait_idle(self) -> None:
        """An idle rank's whole job in the script form: wait until the training ranks finish (exit 0) or stop, or
        in place the world changes (exit as they do: the agent starts this worker again). A SIGTERM from the
        agent ends the wait too (exit 0). The loop form (:meth:`Job.worlds`) waits by itself, and in place
        goes on to the next world instead of exiting."""
        self._check_idle()
        word = self._idle_wait()
        if word in ("done", "sigterm"):
            self._idle_exit(word)
        if self._membership is not None:  # none of the next worlds waits for this worker: its agent restarts it
            self._membership.mark_leaving()
        self._exit(EXIT_PEER_LOST, "the training ranks stopped" if word == "stop" else "the world changes")

    def _idle_through_world(self) -> None:
        """In place (the loop over worlds): wait through this world, in which this rank trains nothing, and end
        it when the training ranks end it (their word, or this rank's heartbeat sees the change); the caller
        enters the next generation. Ends the process when the training ranks finish or on SIGTERM."""
        self._check_idle()
        self.idle_worlds.append(self.world.generation)
        self._kept = None  # an idle rank holds nothing of the model: no memory to restore from later
        log.info("rank %d idles in world %d (%s)", self.rank, self.world.generation, self.choice.reason)
        word = self._idle_wait()
        if word in ("done", "sigterm"):
            self._idle_exit(word)
        self._step_finished_at = time.monotonic()  # this rank's pause into the next world starts here
        self._end_world("lost" if word == "lost" else "change")

    def _check_idle(self) -> None:
        if not self.idle:
            raise ConfigError(f"rank {self.rank} trains in this world ({self.choice.degrees()}); wait_idle() is for "
                              f"the ranks the policy left idle")

    def _idle_exit(self, word: str) -> None:
        if self._membership is not None:  # no later world waits for this worker
            self._membership.mark_leaving()
        self._exit(0, "the training ranks finished" if word == "done" else "stopped by SIGTERM while idle")

    def _idle_wait(self) -> str:
        """The word that ends this idle rank's wait: one of :data:`WORDS`, ``sigterm``, or in place ``change``
        or ``lost`` from this rank's heartbeat view. Rank 0 of torchrun's world hosts the store outside in place:
        an idle rank 0 keeps it up until every idle rank read the word."""
        store, key = self._idle_store(), self._idle_key()
        while not self.stop_requested:
            try:
                if store.check([key]):
                    return self._read_word(store, key)
            except Exception:  # noqa: BLE001 -- rank 0 and its store are gone: the world is over
                return "stop"
            wanted = self._membership.wanted if self._membership is not None else ()
            if wanted:  # the word may have come meanwhile ("done" before the finished ranks marked leaving)
                return self._read_word(store, key) if store.check([key]) else (
                    "lost" if "lost" in wanted else "change")
            time.sleep(0.1)
        return "sigterm"

    def _read_word(self, store, key: str) -> str:
        word = store.get(key).decode()
        if self._membership is None:  # torchrun's store, hosted by rank 0: acknowledge (see _tell_idle)
            store.set(f"{key}/ack{self.rank}", "1")
            if self.rank == 0:
                store.wait([f"{key}/ack{r}" for r in self.choice.idle], timedelta(seconds=10))
        return word

    def _idle_key(self) -> str:
        return f"tenplex/{self.world_id}/idle"

    def _idle_store(self):
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=30))

    def _tell_idle(self, word: str) -> None:
        """Leave ``word`` (:data:`WORDS`) for this world's idle ranks: the first training rank says ``done`` and
        ``stop``; any training rank says ``change`` (the first may be the peer that was lost)."""
        if not self.choice.idle or self.idle or (word != "change" and self.rank != self.choice.ranks[0]):
            return
        key = self._idle_key()
        try:
            store = self._idle_store()
            store.set(key, word)
            if self._membership is None:
                # Rank 0 hosts torchrun's store (when it trains): keep it up until every idle rank read the word.
                # In place the store is the rendezvous store, which outlives every worker.
                store.wait([f"{key}/ack{r}" for r in self.choice.idle], timedelta(seconds=10))
        except Exception:  # noqa: BLE001 -- idle ranks stopped by SIGTERM need no word
            pass
