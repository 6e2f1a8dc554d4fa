"""The order of one destination host's pulls: every source link busy at once, a slow source asked for less.

May import: the standard library only.

A plan balances the bytes each source sends in total, but not over time: if
every destination drained its sources one after another, in the same order,
one source's link would carry everything while the others idled. Instead a
destination's pieces wait in one queue per source host (its local copies in a
queue of their own, under ``LOCAL``), and a free pull thread takes:

1. the next piece of the source with the fewest pulls in flight from this
   destination, so the destination's streams spread over all its sources;
   ties go in a round whose start differs per destination (``start``), so
   destinations that need the same sources do not all begin with the same one;
2. when that source has no piece of its own left, a piece queued for another
   source that it holds as well (a replica), taken from the source with the
   most bytes still queued. A slow link keeps its queue while the fast ones
   empty theirs; then they take over its pieces, so it is asked for less.

A source that failed (``failed(host)``) is given no more pieces; replicas take
over its queue, and pieces no replica holds still run as planned, where the
reader falls back or names what was lost.

Local copies take at most one stream while pieces from other hosts are still
queued: the links are the scarce resource, and one thread copies at memory
speed, well ahead of any link, while more threads would only take the CPU that
receiving needs.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

LOCAL = ""  # the queue of this host's local copies (no network)


@dataclass(eq=False)
class Pull:
    """One pull: ``run(server)`` reads it from host ``server`` (``source`` or one of ``replicas``)."""

    source: str
    nbytes: int
    run: Callable[[str], None]
    replicas: frozenset[str] = field(default_factory=frozenset)


class Schedule:
    """Hands out pieces to pull threads (thread-safe); ``done(server)`` after each piece ran."""

    def __init__(self, pieces: list[Pull], start: int = 0, failed: Callable[[str], bool] = lambda host: False):
        self._queues: dict[str, deque[Pull]] = {}
        self._queued: dict[str, int] = {}  # bytes still queued per source
        for piece in pieces:
            self._queues.setdefault(piece.source, deque()).append(piece)
            self._queued[piece.source] = self._queued.get(piece.source, 0) + piece.nbytes
        hosts = sorted({p.source for p in pieces} | {r for p in pieces for r in p.replicas})
        first = start % len(hosts) if hosts else 0
        self._rank = {h: i for i, h in enumerate(hosts[first:] + hosts[:first])}
        self._in_flight = {h: 0 for h in hosts}
        self._failed = failed
        self._lock = threading.Lock()

    def take(self) -> tuple[Pull, str] | None:
        """The next piece and the host to read it from, or None when every piece has been handed out."""
        with self._lock:
            usable = [h for h in self._rank if not self._failed(h)]
            remote_queued = any(queue for source, queue in self._queues.items() if source != LOCAL)
            for host in sorted(usable, key=lambda h: (self._in_flight[h], self._rank[h])):
                if host == LOCAL and self._in_flight[LOCAL] and remote_queued:
                    continue  # one stream copies locally while pulls wait (see the module docstring)
                piece = self._pop(host) or self._steal(host)
                if piece is not None:
                    self._in_flight[host] += 1
                    return piece, host
            for source, queue in self._queues.items():  # left: failed sources' pieces that no replica holds
                left = self._pop(source) if queue else None
                if left is not None:
                    self._in_flight[source] += 1
                    return left, source
            return None

    def done(self, server: str) -> None:
        with self._lock:
            self._in_flight[server] -= 1

    def _pop(self, source: str, index: int = 0) -> Pull | None:
        queue = self._queues.get(source)
        if not queue:
            return None
        piece = queue[index]
        del queue[index]
        self._queued[source] -= piece.nbytes
        return piece

    def _steal(self, server: str) -> Pull | None:
        """A piece queued for another source that ``server`` also holds, from the fullest queue, from its end
        (its own source works from the front)."""
        for source in sorted(self._queues, key=lambda s: -self._queued[s]):
            queue = self._queues[source]
            if source == server or not queue:
                continue
            for index in range(len(queue) - 1, -1, -1):
                if server in queue[index].replicas:
                    return self._pop(source, index)
        return None
