"""A whole-file lock between processes whose wait is bounded: a holder that is stopped or hung cannot block us.

May import: ``tenplex.errors`` and the standard library.

``flock`` is dropped by the kernel when its holder dies, but not when it is
stopped (SIGSTOP, a debugger) or hung: a plain ``LOCK_EX`` then waits for
good. :func:`held` polls ``LOCK_NB`` until a deadline and then raises one
line naming the lock file and its holder (the holder writes its pid into the
file once it holds it) and that holder's state (running, stopped, ...).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Iterator

from .errors import TemporaryError


class LockTimeout(TemporaryError, TimeoutError):
    """A lock was held by another process for longer than the caller waits (the message names it and its holder)."""


_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped", "t": "stopped by a tracer",
           "Z": "a zombie"}


def holder(path: str | os.PathLike) -> str:
    """Who the lock file says holds it: ``pid N (state)``, or ``an unknown process`` when it does not say."""
    try:
        pid = int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return "an unknown process"
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return f"pid {pid} (not visible here: another pid namespace, or gone)"
    return f"pid {pid} ({_STATES.get(state, state)})"


@contextlib.contextmanager
def held(path: str | os.PathLike, timeout: float, what: str,
         error: type[Exception] = LockTimeout) -> Iterator[None]:
    """Hold the exclusive ``flock`` of ``path`` (created if missing), waiting at most ``timeout`` seconds for
    it; past that, raise ``error`` naming ``what`` waited, the file and its holder."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + timeout
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise error(f"{what}: gave up after {timeout:g} s waiting for the lock {path}, held by "
                                f"{holder(path)}; a process stopped or hung while holding it keeps it until it "
                                f"resumes or dies") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message of whoever waits on us
        yield
    finally:
        os.close(fd)  # drops the lock
