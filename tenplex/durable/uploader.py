"""The background flush of one host's store: which versions go to the bucket, when, and what happens on failure.

May import: this package's ``bucket`` and ``flush``, ``tenplex.store`` and the standard library.

Policy. A committed version is flushed when its number is a multiple of ``every_versions`` (the same
choice on every host, with no coordination), or, with ``every_s``, when that many seconds passed since the
last flush began: the first host of the layout decides by its clock and says so with an ``intent`` object,
which the other hosts follow. Newest first: only the newest qualifying version is flushed; a newer one
committed during an upload cancels the rest of it (superseded), and an older version is never flushed
after a newer one. After a version becomes durable, ``gc`` keeps the newest ``keep`` in the bucket.

Faults. The bucket unreachable: training goes on (the flush runs in its own thread and nobody waits for
it), the flush retries with exponential back-off (``backoff_s`` doubling up to ``max_backoff_s``), and one
warning says so until it works again. Credentials refused: one error line naming the bucket, and the
flusher stops (only a change of configuration helps).
"""

from __future__ import annotations

import logging
import threading
import time

from ..store import Store
from .bucket import Bucket, BucketDenied, BucketUnreachable
from .flush import Superseded, durable_versions, flush_host, gc, version_key

log = logging.getLogger(__name__)


class Flusher:
    """Flushes this host's share of committed versions of ``store`` to ``bucket`` in a background thread."""

    def __init__(self, store: Store, bucket: Bucket, *, every_versions: int = 1, every_s: float | None = None,
                 keep: int = 2, poll_s: float = 1.0, backoff_s: float = 1.0, max_backoff_s: float = 60.0):
        self.store, self.bucket = store, bucket
        self.every_versions, self.every_s, self.keep = every_versions, every_s, keep
        self.poll_s, self.backoff_s, self.max_backoff_s = poll_s, backoff_s, max_backoff_s
        self.done = 0                 # the newest version this host flushed (or skipped: older ones never go)
        self.durable: int | None = None
        self.state = "idle"           # idle, uploading, retrying, stopped (credentials), closed
        self.error: str | None = None
        self.attempts = 0             # uploads begun
        self.failures = 0             # of those, how many failed and wait to be retried (back-off)
        self.outages = 0              # times the bucket went from reachable to unreachable (one warning each)
        self._last_start = time.monotonic()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"tenplex-flush-{store.host}", daemon=True)

    def start(self) -> "Flusher":
        self._thread.start()
        return self

    def notify(self) -> None:
        """A version was committed: look now instead of at the next poll."""
        self._wake.set()

    def close(self, timeout: float | None = 10.0) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout)

    def status(self) -> dict:
        return {"host": self.store.host, "bucket": self.bucket.url, "state": self.state, "flushed": self.done,
                "durable": self.durable, "error": self.error, "attempts": self.attempts,
                "failures": self.failures, "outages": self.outages}

    def _qualifies(self, version: int, leader: bool) -> bool:
        if self.every_versions and version % self.every_versions == 0:
            return True
        if self.every_s is None:
            return False
        if leader:
            return time.monotonic() - self._last_start >= self.every_s
        return self.bucket.exists(version_key(version, "intent"))

    def _next(self) -> int | None:
        """The newest committed version newer than the last flushed that qualifies."""
        for version in reversed(self.store.versions()):
            if version <= self.done:
                return None
            try:
                reader = self.store.open(version)
                leader = self.store.host == min(reader.layout().hosts())
                reader.close()
            except Exception:  # noqa: BLE001 - deleted meanwhile (gc after a newer save): look at the next
                continue
            if self._qualifies(version, leader):
                if leader and self.every_s is not None:
                    self.bucket.put(version_key(version, "intent"), b"{}")
                return version
        return None

    def _run(self) -> None:
        delay, outage = self.backoff_s, False
        while not self._closed:
            try:
                version = self._next()
                if version is not None:
                    self._flush(version)
                if outage:
                    log.warning("durable tier: bucket %s reachable again", self.bucket.name)
                self.state, self.error, delay, outage = "idle", None, self.backoff_s, False
                self._wake.wait(self.poll_s)
            except BucketUnreachable as e:
                if not outage:  # one line per outage, not one per attempt
                    log.warning("durable tier: %s; training goes on, uploads retry with back-off", e)
                    self.outages += 1
                self.state, self.error, outage = "retrying", str(e), True
                self.failures += 1
                self._wake.wait(delay)
                delay = min(2 * delay, self.max_backoff_s)
            except BucketDenied as e:
                log.error("durable tier: %s; no more uploads from host %s", e, self.store.host)
                self.state, self.error = "stopped", str(e)
                return
            except Exception as e:  # noqa: BLE001 - a bug or a damaged local version: say it, try again later
                log.warning("durable tier: flushing from host %s failed: %s", self.store.host, e)
                self.state, self.error = "retrying", str(e)
                self.failures += 1
                self._wake.wait(delay)
                delay = min(2 * delay, self.max_backoff_s)
            self._wake.clear()
        self.state = "closed"

    def _flush(self, version: int) -> None:
        self.state = "uploading"
        self.attempts += 1
        self._last_start = time.monotonic()
        try:
            result = flush_host(self.store, version, self.bucket,
                                cancelled=lambda: self._closed or (self.store.latest() or 0) > version
                                and self._newer_qualifies(version))
        except Superseded:
            log.info("durable tier: version %d superseded while uploading; the newer one goes instead", version)
            return
        if result.durable:
            gc(self.bucket, self.keep)
            self.durable = version
        elif self.durable is None:
            known = durable_versions(self.bucket)
            self.durable = known[-1] if known else None
        self.done = version  # last: whoever waits for it sees the bucket tidied

    def _newer_qualifies(self, version: int) -> bool:
        return any(v > version and self.every_versions and v % self.every_versions == 0
                   for v in self.store.versions())
