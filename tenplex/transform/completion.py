"""Which regions of a host's new shards have landed: finish each shard once, release fan-out copies early.

May import: ``tenplex.box``, ``tenplex.errors``, ``tenplex.store`` (``ShardTarget``) and the standard library.

A destination host fills its new shards with pulls (from its old shards or
from peers) and with local fan-out copies: a region that crossed into this
host once is copied from the new shard that received it into the other new
shards that need it (a plan's ``"from": "new"`` transfers). :class:`Completion`
counts the writes each new shard still expects:

* the thread that writes a shard's last region finishes it (fsync, block
  checksums), so that work overlaps the other pulls instead of running
  serially in ``prepare``;
* a fan-out copy becomes ready as soon as every byte of its source region has
  landed (or at once when it copies from a hard-linked old shard), so fan-out
  runs during the pulls rather than after all of them. A copy may read from a
  region that another copy fills (a chain); readiness is decided per region,
  not per shard, so two shards that feed each other different regions cannot
  wait on each other.

Cost: a landing in a shard that copies wait for is checked against those
copies only (``subtract_all`` over the shard's landed regions); other landings
cost one counter update.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..box import Box, subtract_all
from ..errors import TransformError
from ..store import ShardTarget

WAIT_S = 0.1  # how often a waiting fan-out thread looks at the cancel flag


@dataclass(eq=False)
class FanOutCopy:
    """Copy ``box`` into ``target`` from the new shard ``source`` (None: ``read`` needs no staged shard)."""

    box: Box
    target: ShardTarget
    source: ShardTarget | None
    read: Callable[[], object]  # the region's values (an array of box.lengths)
    describe: str               # names the tensor, region and devices in errors


class Completion:
    """Thread-safe bookkeeping of one host's staging; see the module docstring."""

    def __init__(self) -> None:
        self._left: dict[ShardTarget, int] = {}
        self._landed: dict[ShardTarget, list[Box]] = {}  # only shards that copies wait for
        self._waiting: dict[ShardTarget, list[FanOutCopy]] = {}
        self._ready: deque[FanOutCopy] = deque()
        self._copies_left = 0
        self._cond = threading.Condition()

    def expect(self, target: ShardTarget) -> None:
        """One more write will land in ``target`` (call before the writes start)."""
        self._left[target] = self._left.get(target, 0) + 1

    def add_copy(self, copy: FanOutCopy) -> None:
        """Register a fan-out copy (before the writes start); it runs once its source region has landed."""
        self.expect(copy.target)
        self._copies_left += 1
        if copy.source is None:
            self._ready.append(copy)
        else:
            self._waiting.setdefault(copy.source, []).append(copy)
            self._landed.setdefault(copy.source, [])

    def landed(self, target: ShardTarget, box: Box) -> None:
        """Region ``box`` of ``target`` has been written; finish the shard if that was its last write."""
        with self._cond:
            left = self._left.get(target)
            if left is not None:
                self._left[target] = left - 1
            waiting = self._waiting.get(target)
            if waiting:
                landed = self._landed[target]
                landed.append(box)
                ready = [c for c in waiting if not subtract_all(c.box, landed)]
                if ready:
                    self._waiting[target] = [c for c in waiting if c not in ready]
                    self._ready.extend(ready)
                    self._cond.notify_all()
        if left == 1:
            target.finish()

    def run_copies(self, pulls_done: Callable[[], bool], cancelled: threading.Event,
                   copied: Callable[[int], None]) -> None:
        """Run the fan-out copies as they become ready, until all are done or ``cancelled``; ``copied(nbytes)``
        after each. Raises when the pulls are done and a copy's source region can never be complete."""
        while True:
            copy = self._next_copy(pulls_done, cancelled)
            if copy is None:
                return
            copy.target.write(copy.box, copy.read())
            copied(copy.box.volume * copy.target.itemsize)
            with self._cond:
                self._copies_left -= 1
            self.landed(copy.target, copy.box)

    def _next_copy(self, pulls_done: Callable[[], bool], cancelled: threading.Event) -> FanOutCopy | None:
        with self._cond:
            while not cancelled.is_set():
                if self._ready:
                    return self._ready.popleft()
                if not self._copies_left:
                    return None
                if pulls_done():  # nothing in flight can complete a waiting copy's source any more
                    stuck = next(c for waiting in self._waiting.values() for c in waiting)
                    raise TransformError(f"plan fans out {stuck.describe}, but no transfer of the plan fills "
                                         f"that region of the source shard; the plan does not match the layout")
                self._cond.wait(WAIT_S)
            return None
