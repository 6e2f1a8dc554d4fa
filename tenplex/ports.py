"""A free TCP port for a server that another process binds later, without racing the kernel's ephemeral ports.

May import: ``tenplex.flock`` (the record's bounded lock) and the standard library.

The usual trick (``bind(0)``, read the port, close, hand it to a child) loses a race under load: the kernel
takes that port from its ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), the same range it draws
the source port of every outgoing connection from, so between the close and the child's ``bind`` any
connection on the machine (a gRPC client, a torch TCPStore client, another job) may take it, and the child
fails with EADDRINUSE. CI saw exactly that (a job's TCPStore on port 35355).

So :func:`free_port` draws at random from the ports *below* the ephemeral range (``[LOWEST, ephemeral_low)``,
above it where the range leaves no room below), which no outgoing connection uses, checks that the port can be
bound on every address, and records it for ``REMEMBER_S`` seconds in a small file per user under the
temporary directory (``tenplex-ports-<uid>.json``, under the bounded lock of ``tenplex.flock``), so that two
callers on this machine are never handed the same port while the first one's server may still be starting.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterator

from .flock import LockTimeout, held

LOWEST = 15000          # well-known service ports (8080, 9090, 7070...) stay below
REMEMBER_S = 120.0      # a handed-out port is not handed out again for this long
ATTEMPTS = 200
LOCK_WAIT_S = 5.0       # the record's lock is held for microseconds; a holder this slow is stopped or hung
_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port that nothing on this machine holds now and that no other caller is given for ``REMEMBER_S``.

    ``address`` is where the server will bind; the port is checked on it and on the wildcard addresses."""
    low, high = candidate_range()
    rng = random.SystemRandom()
    with _record() as given:
        for _ in range(ATTEMPTS):
            port = rng.randrange(low, high)
            if port not in given and bindable(port, address):
                given[port] = time.time() + REMEMBER_S
                return port
    # Everything tried was held or handed out: fall back to the kernel's pick (may race, but never loops).
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def candidate_range() -> tuple[int, int]:
    """``[low, high)`` of the ports :func:`free_port` draws from: below the ephemeral range, else above it."""
    try:
        first, last = (int(x) for x in _PORT_RANGE.read_text().split())
    except (OSError, ValueError):
        first, last = 32768, 60999          # Linux's default
    if first - LOWEST >= 1000:
        return LOWEST, first
    if 65535 - last >= 1000:
        return last + 1, 65536
    return 1024, 65536                      # no room outside it: the bind check and the record still help


def bindable(port: int, address: str = "127.0.0.1") -> bool:
    """True if ``port`` can be bound now on ``address`` and on the IPv4 and IPv6 wildcard addresses."""
    for family, host in ((socket.AF_INET, address), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        if family == socket.AF_INET and ":" in host:
            family = socket.AF_INET6
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                continue                    # no IPv6 here, or an address of another host: nothing to clash with
            return False
    return True


@contextlib.contextmanager
def _record() -> Iterator[dict[int, float]]:
    """The ports handed out in the last ``REMEMBER_S`` seconds on this machine (by this user), port -> expiry; what
    the caller adds is written back. Locked while open; a holder stopped past ``LOCK_WAIT_S`` (it needs
    microseconds) leaves the caller the bind check alone, never a hang."""
    path = Path(tempfile.gettempdir()) / f"tenplex-ports-{os.getuid()}.json"
    with contextlib.ExitStack() as lock:
        try:
            lock.enter_context(held(path.with_suffix(".lock"), LOCK_WAIT_S, "handing out a port"))
        except LockTimeout:
            yield {}
            return
        now, given = time.time(), {}
        try:
            given = {int(p): float(t) for p, t in json.loads(path.read_text()).items() if float(t) > now}
        except (OSError, ValueError, TypeError, AttributeError):
            pass                            # none yet, or a torn or foreign file: start afresh
        yield given
        path.write_text(json.dumps({str(p): t for p, t in given.items()}))
