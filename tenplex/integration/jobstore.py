"""The job's c10d key-value store (torchrun's TCPStore at ``MASTER_ADDR:MASTER_PORT``), for snapshot commits.

May import: torch.distributed and the standard library.

Snapshots agree on their commit through this store (:mod:`.snapshot`, step 3). The client connects off the
training thread, on a thread of its own, and after a failed attempt it tries again with back-off (0.25 s,
doubling up to 8 s between attempts): one slow start under load must not leave every later snapshot of the
world to commit a step boundary late. A snapshot whose write finished while no client was connected commits
at the next boundary instead (counted in ``snapshot_stats()["late_commits"]``). The step of the newest decided
commit stays there (:func:`committed_key`), so that a restore whose hosts lack it counts the steps lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)
CONNECT_S = 10.0  # one connection attempt's limit (the client retries inside it)
FIRST_DELAY_S, MAX_DELAY_S = 0.25, 8.0  # between failed attempts: doubling from the first to the most


class JobKeyValue:
    """A client of the job's key-value store, connected in the background and retried with back-off."""

    def __init__(self) -> None:
        self._client: Any = None
        self._connected = threading.Event()
        self._lock = threading.Lock()
        self._attempting = False
        self._next_try = 0.0
        self._delay = FIRST_DELAY_S
        self.failed_attempts = 0

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def connect_soon(self) -> None:
        """Start connecting now, in the background (a snapshotter does so when it is made, so that its first
        exchange can already tell whether every rank reaches the store)."""
        address = _address()
        if address is not None and not self._connected.is_set():
            self._attempt_if_due(address)

    def wait_connected(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the attempt :meth:`connect_soon` started (False: not connected)."""
        return self._connected.wait(timeout) if _address() is not None else False

    def get(self, give_up: threading.Event) -> Any:
        """The connected client; until then, start attempts as back-off allows and wait for one to connect, until
        ``give_up`` is set. None: not connected (yet), or the job names no key-value store."""
        while not self._connected.is_set():
            address = _address()
            if address is None or give_up.is_set():
                return None
            self._attempt_if_due(address)
            self._connected.wait(0.01)
        return self._client

    def _attempt_if_due(self, address: tuple[str, int]) -> None:
        with self._lock:
            if self._attempting or time.monotonic() < self._next_try:
                return
            self._attempting = True
        threading.Thread(target=self._connect, args=(address,), name="tenplex-job-store", daemon=True).start()

    def _connect(self, address: tuple[str, int]) -> None:
        try:
            client = dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=CONNECT_S))
        except Exception as e:  # noqa: BLE001 -- tried again after the back-off; snapshots commit at the boundary
            with self._lock:
                self.failed_attempts += 1
                self._next_try = time.monotonic() + self._delay
                self._delay = min(2 * self._delay, MAX_DELAY_S)
                self._attempting = False
            log.info("tenplex: no key-value store at %s:%d yet (%s); snapshots commit at the next step boundary "
                     "until it answers (next attempt in %.2g s)", *address, e, self._next_try - time.monotonic())
            return
        self._client = client
        self._connected.set()
        with self._lock:
            self._attempting = False


def committed_key() -> str:
    """Where the job's key-value store keeps the step of the newest snapshot whose commit it decided (the deciding
    rank writes it; a restore compares it with the restored step: :mod:`tenplex.elastic.progress`)."""
    return f"tenplex/{os.environ.get('TENPLEX_RDZV_ID', 'default')}/committed-step"


def _address() -> tuple[str, int] | None:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (addr, int(port)) if addr and port else None
