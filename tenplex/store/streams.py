"""Admission and idle timeouts of the store server's bulk gRPC streams.

May import: ``tenplex.errors`` and the standard library (``context`` is any
object with ``cancel()``: a gRPC servicer context).

The gRPC server runs every call on one of a fixed pool of threads. A client
that opens a stream and then stalls (sends a WriteShard header and nothing
more, or stops reading a ReadBox) holds its thread. Bulk streams (WriteShard,
ReadBox, ReadBoxes, ReadFile) therefore take a slot: at most ``max_streams``
run at once, so the rest of the pool stays free for Health and control calls;
beyond the bound a stream is refused at once with :class:`Busy`
(RESOURCE_EXHAUSTED). A stream that makes no progress (no message received, or
no chunk taken by the client) for ``idle_s`` seconds is cancelled by a
watchdog, and its handler cleans up as for any broken stream.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from ..errors import StoreError

log = logging.getLogger(__name__)


class Busy(StoreError):
    """Too many bulk streams at once (gRPC RESOURCE_EXHAUSTED): retry later or elsewhere."""


class StreamLimits:
    def __init__(self, max_streams: int, idle_s: float):
        if max_streams < 1 or idle_s <= 0:
            raise StoreError(f"max_streams must be >= 1 and idle_s > 0, got {max_streams} and {idle_s}")
        self.max_streams, self.idle_s = max_streams, idle_s
        self._slots = threading.BoundedSemaphore(max_streams)
        self._active: dict[int, list] = {}  # id -> [context, last progress, what]
        self._ids = itertools.count()
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="stream-watchdog", daemon=True).start()

    @contextmanager
    def slot(self, context, what: str, wait_s: float = 0.0) -> Iterator[Callable[[], None]]:
        """Hold a slot while the stream runs; the yielded ``progress()`` marks that data moved. ``wait_s``: how
        long to wait for a slot when all are taken (0: refuse at once)."""
        if not (self._slots.acquire(timeout=wait_s) if wait_s > 0 else self._slots.acquire(blocking=False)):
            raise Busy(f"the store server already runs {self.max_streams} bulk streams (the most it admits); "
                       f"{what} refused, retry later")
        key = next(self._ids)
        record = [context, time.monotonic(), what]
        with self._lock:
            self._active[key] = record

        def progress() -> None:
            record[1] = time.monotonic()

        try:
            yield progress
        finally:
            with self._lock:
                del self._active[key]
            self._slots.release()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.idle_s / 4))
            now = time.monotonic()
            with self._lock:
                idle = [r for r in self._active.values() if now - r[1] > self.idle_s]
            for record in idle:
                context, last, what = record
                record[1] = float("inf")  # cancelled once; the handler ends and frees the slot
                log.warning("cancelling %s: no progress for %.0f s", what, now - last)
                if context is not None:
                    context.cancel()
