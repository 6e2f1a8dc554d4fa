"""Ranks the policy leaves idle in an elastic job: how they wait, and how the training ranks tell them to end.

May import: ``tenplex.elastic`` (policy, faults), ``tenplex.errors``, torch.distributed and the standard library.

:class:`IdleRanks` is that part of :class:`~tenplex.elastic.job.Job` (which inherits it): an idle rank's
:meth:`~IdleRanks.wait_idle`, and the first training rank's word to the idle ones when the job stops or finishes.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..errors import ConfigError
from .faults import EXIT_PEER_LOST

if TYPE_CHECKING:
    from .policy import Choice


class IdleRanks:
    """The idle ranks' wait and the word they wait for. The job provides the attributes declared below and
    ``_exit`` (end the process at a step boundary)."""

    if TYPE_CHECKING:
        choice: Choice
        rank: int
        world_id: str

        @property
        def idle(self) -> bool: ...

        @property
        def stop_requested(self) -> bool: ...

        def _exit(self, code: int, why: str) -> None: ...

    def wait_idle(self) -> None:
        """An idle rank's whole job: wait until the training ranks finish (exit 0) or stop (exit as they do).

        Rank 0 leaves the word in the job's c10d store (``MASTER_ADDR:MASTER_PORT``;
        gloo's point-to-point receive cannot be polled), and waits briefly for
        each idle rank to acknowledge it; a SIGTERM from torchrun ends the wait too.
        """
        if not self.idle:
            raise ConfigError(f"rank {self.rank} trains in this world ({self.choice.degrees()}); wait_idle() is for "
                              f"the ranks the policy left idle")
        store, key = self._idle_store(), f"tenplex/{self.world_id}/idle"
        while not self.stop_requested:
            try:
                if store.check([key]):
                    word = store.get(key).decode()
                    store.set(f"{key}/ack{self.rank}", "1")
                    if self.rank == 0:  # an idle rank 0 hosts the store: keep it up until every idle rank read it
                        store.wait([f"{key}/ack{r}" for r in self.choice.idle], timedelta(seconds=10))
                    break
            except Exception:  # noqa: BLE001 -- rank 0 and its store are gone: the world is over
                word = "stop"
                break
            time.sleep(0.1)
        else:
            self._exit(0, "stopped by SIGTERM while idle")
        if word == "done":
            self._exit(0, "the training ranks finished")
        self._exit(EXIT_PEER_LOST, "the training ranks stopped")

    def _idle_store(self):
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=30))

    def _tell_idle(self, stopping: bool) -> None:
        if not self.choice.idle or self.rank != self.choice.ranks[0]:  # the first training rank tells
            return
        key = f"tenplex/{self.world_id}/idle"
        try:
            store = self._idle_store()
            store.set(key, "stop" if stopping else "done")
            # Rank 0 hosts that store (when it trains): keep it up until every idle rank has read the word.
            store.wait([f"{key}/ack{r}" for r in self.choice.idle], timedelta(seconds=10))
        except Exception:  # noqa: BLE001 -- idle ranks stopped by SIGTERM need no word
            pass
