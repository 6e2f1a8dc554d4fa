"""One host part's byte counters, reported to the coordinator as progress, and the heartbeat that says it is alive.

May import: ``tenplex.store`` (its transformer types) and the standard library.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..store.transformer import TransformProgress

PROGRESS_EVERY_BYTES = 64 << 20  # progress messages are throttled to this granularity
PROGRESS_EVERY_S = 0.25
HEARTBEAT_S = 1.0               # a progress message at least this often, even when no bytes arrive


@dataclass
class Counters:
    """This part's byte counters; ``add`` reports them to ``progress``, throttled."""

    progress: Callable[[TransformProgress], None]
    total: int = 0
    done: int = 0
    kept: int = 0
    linked: int = 0
    sliced: int = 0  # of linked
    local: int = 0
    remote: int = 0
    refetched: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    _reported: tuple[int, float] = field(default_factory=lambda: (0, time.monotonic()))  # bytes done, when

    def message(self, done: bool = False) -> TransformProgress:
        return TransformProgress(bytes_done=self.done, bytes_total=self.total, kept_bytes=self.kept,
                                 local_bytes=self.local, remote_bytes=self.remote, refetched_bytes=self.refetched,
                                 linked_bytes=self.linked, sliced_bytes=self.sliced, done=done)

    def add(self, nbytes: int, kind: str, sliced: bool = False) -> None:
        """``nbytes`` more are in place, got there as ``kind`` (kept, linked, local, remote, refetched); ``sliced``:
        linked as a slice (counted in ``sliced`` as well, under the same lock)."""
        with self.lock:
            self.done += nbytes
            setattr(self, kind, getattr(self, kind) + nbytes)
            if sliced:
                self.sliced += nbytes
            now = time.monotonic()
            if self.done - self._reported[0] >= PROGRESS_EVERY_BYTES or now - self._reported[1] >= PROGRESS_EVERY_S:
                self._reported = (self.done, now)
                self.progress(self.message())

    def report(self) -> None:
        with self.lock:
            self.progress(self.message())


def heartbeat(counters: Counters, stop: threading.Event) -> None:
    """Tell the coordinator this host is alive while it works (allocating, pulling, checksumming)."""
    while not stop.wait(HEARTBEAT_S):
        with counters.lock:
            if not stop.is_set():
                counters.progress(counters.message())
