"""A file descriptor that several threads use and one owner closes, exactly once.

May import: the standard library.

A number handed to the kernel after it was closed fails with EBADF, or, when
the process has meanwhile reused the number for another file, socket or
gRPC's own poller, acts on that one. So nobody reads the number outside
:meth:`SharedDescriptor.use`: a ``close`` while a thread uses it only marks
it, and the last user's block closes it; the number is set to -1 under the
same lock that hands it out, so it is closed once.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Callable, Iterator


class SharedDescriptor:
    """``fd``, used by any thread through :meth:`use` and closed once.

    :meth:`release` closes it when nobody uses it (at once, or when the last
    user is done); the next :meth:`use` opens it again with ``reopen`` (a shard
    file that holds no descriptor between writes). :meth:`close` is for good:
    later uses raise ``closed()`` (a reader of a deleted version)."""

    def __init__(self, fd: int, closed: Callable[[], BaseException], reopen: Callable[[], int] | None = None):
        self._fd = fd
        self._closed_error = closed
        self._reopen = reopen
        self._users = 0
        self._close_when_idle = False
        self._final = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """Closed for good (:meth:`close`)."""
        return self._final

    @contextmanager
    def use(self) -> Iterator[int]:
        """The open descriptor, valid until the block ends (reopened after a release when it can be)."""
        with self._lock:
            if self._final or (self._fd < 0 and self._reopen is None):
                raise self._closed_error()
            if self._fd < 0:
                self._fd = self._reopen()  # type: ignore[misc]
            self._users += 1
            fd = self._fd
        try:
            yield fd
        finally:
            with self._lock:
                self._users -= 1
                if not self._users and self._close_when_idle:
                    self._close_now()

    def release(self) -> None:
        """Close the descriptor once nobody uses it; a later :meth:`use` opens it again."""
        with self._lock:
            self._close_when_idle = True
            if not self._users:
                self._close_now()

    def close(self) -> None:
        """Close the descriptor for good (once nobody uses it); later uses raise. Any thread, any number of times."""
        with self._lock:
            self._final = True
            self._close_when_idle = True
            if not self._users:
                self._close_now()

    def _close_now(self) -> None:  # with the lock held
        fd, self._fd = self._fd, -1
        self._close_when_idle = False
        if fd >= 0:
            os.close(fd)
