"""The copies of committed snapshots on the ring's next hosts, one at a time, the newest first.

May import: ``tenplex.layout``, ``tenplex.replication`` and the standard library.

A host leader's commit of a snapshot (:mod:`.snapshot`) queues its copy; a copy still running is not cancelled by
a newer snapshot, and of the snapshots committed meanwhile only the newest is copied next. Each host commits on
its own once every rank prepared, so the origin's commit may come a moment after ours: a copy is retried for
about 5 s (the origin's store answers NOT_FOUND until then).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..layout import Layout
from ..replication.copier import Replicator

_COPY_TRIES, _COPY_RETRY_S = 20, 0.25


class SnapshotCopies:
    """One snapshotter's copier thread (started by the first copy) and what it reports into ``stats``."""

    def __init__(self, ckpt, stats: dict[str, Any]) -> None:
        self.ckpt, self.stats = ckpt, stats
        self._next: tuple[int, int, Layout, dict, int] | None = None  # newest committed, not yet copied
        self._copying_step: int | None = None
        self._busy = False  # a copy is running or will be retried (wait waits for it)
        self._wanted = threading.Condition()
        self.thread: threading.Thread | None = None
        self._closed = False

    def queue(self, version: int, step: int, layout: Layout, addresses: dict, replicas: int) -> None:
        """Have this committed snapshot copied next (replacing one queued and not started)."""
        with self._wanted:
            self._next = (version, step, layout, addresses, replicas)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="tenplex-snapshot-copies", daemon=True)
                self.thread.start()
            self._wanted.notify()

    def _loop(self) -> None:
        while True:
            with self._wanted:
                while self._next is None and not self._closed:
                    self._wanted.wait()
                if self._closed:
                    return
                assert self._next is not None
                version, step, layout, addresses, replicas = self._next
                self._next = None
                self._copying_step = step
                self._busy = True
            self._copy_with_retries(version, step, layout, addresses, replicas)
            with self._wanted:
                self._busy = False
                self._wanted.notify_all()

    def _copy_with_retries(self, version: int, step: int, layout: Layout, addresses: dict, replicas: int) -> None:
        ckpt = self.ckpt
        for _ in range(_COPY_TRIES):
            with self._wanted:
                if self._closed or self._next is not None:
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
            time.sleep(_COPY_RETRY_S)

    def wait(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` seconds until the newest committed snapshot's copy is done, its retries
        included (a first try that fails because the origin has not committed yet is not the answer)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wanted:
            while (self._next is not None or self._busy) and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._wanted.wait(0.05 if left is None else min(0.05, left))

    def lag(self) -> int:
        """Steps between the newest committed snapshot and the newest one whose copies are committed on this
        host (0 when this rank pulls no copies)."""
        committed, replicated = self.stats["committed_step"], self.stats["replicated_step"]
        if committed is None or self._copying_step is None:
            return 0
        return committed - (replicated if replicated is not None else 0)

    def close(self) -> None:
        """Stop after the copy in progress (the thread ends at its next item)."""
        with self._wanted:
            self._closed = True
            self._wanted.notify()
