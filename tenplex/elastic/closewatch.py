"""Positive evidence that a worker's process is gone: the kernel closes a dead process's sockets at once.

May import: the standard library only (the rendezvous store is passed in).

The rendezvous server (``tenplex rendezvous serve``) listens on a second port beside its store
(:class:`CloseWatch`) and publishes it in the store under :data:`PORT_KEY`. Each in-place worker, once registered,
connects to it (:func:`announce`) and sends one line, ``KEY VALUE``; it never sends again and keeps the connection
open while it lives. When the connection ends (the process died: SIGKILL, a crash, the OOM killer, its node's
process group killed), the server appends ``VALUE`` to ``KEY`` in the store. The other workers' watch threads read
``KEY`` and count that worker dead at once (:class:`tenplex.elastic.protocol.Liveness`), instead of after
``TENPLEX_DEAD_AFTER`` seconds of a still heartbeat. This is evidence, not a guess: a live worker that is merely
slow (a busy machine, a long garbage collection) keeps its connection open and is never taken for dead by it. What
it cannot see (a hung process, a cut link, a whole host lost without a reset reaching the server) the heartbeat
still notices.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading

log = logging.getLogger(__name__)

PORT_KEY = "tenplex/closewatch/port"  # the watch's port; its host is the rendezvous store's
KEY_PREFIX = "tenplex/"               # the only keys a closed connection may append to
MAX_LINE = 1024


class CloseWatch:
    """The server side: accept connections on ``bind`` (any free port), read each one's ``KEY VALUE`` line, and
    append ``VALUE`` to ``KEY`` with ``append(key, value)`` when the connection ends. Serves from a daemon thread
    until :meth:`close`."""

    def __init__(self, append, bind: str = "127.0.0.1"):
        self._append = append
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind, 0))
        self._listener.listen(1024)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tenplex-closewatch", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(timeout=0.5):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._read(key.fileobj, key.data)  # type: ignore[arg-type]
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ, bytearray())

    def _read(self, conn: socket.socket, line: bytearray) -> None:
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset: the peer's process is gone just the same
            data = b""
        if data and len(line) + len(data) <= MAX_LINE:
            line += data
            return
        self._selector.unregister(conn)
        conn.close()
        key, _, value = bytes(line).decode("utf-8", "replace").strip().partition(" ")
        if data or not key.startswith(KEY_PREFIX) or not value:
            log.warning("closewatch: dropped a connection that did not announce itself properly")
            return
        try:
            self._append(key, value)
        except Exception as e:  # noqa: BLE001 -- the store is shutting down: nobody is left to tell
            log.warning("closewatch: could not record %s: %s: %s", key, type(e).__name__, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()


_announced: list[socket.socket] = []


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) must not hold its parent's announcement open after the parent died."""
    while _announced:
        _announced.pop().close()


os.register_at_fork(after_in_child=_close_in_child)


def announce(host: str, port: int, key: str, value: str, timeout: float = 10.0) -> socket.socket:
    """The worker side: connect to the watch at ``host:port`` and ask it to append ``value`` to ``key`` once this
    process is gone. Keep the returned socket open for the process's life (:func:`withdraw` closes it)."""
    conn = socket.create_connection((host, port), timeout=timeout)
    conn.sendall(f"{key} {value}\n".encode())
    _announced.append(conn)
    return conn


def withdraw(conn: socket.socket) -> None:
    """Close an announcement (the process is leaving and said so first: the closed connection is no news)."""
    if conn in _announced:
        _announced.remove(conn)
    conn.close()
