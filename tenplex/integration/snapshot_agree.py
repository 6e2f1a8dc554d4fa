"""A snapshot's agreement through the job's key-value store, from the writer and decider threads (no collective).

May import: ``tenplex.files`` (compact JSON), this package's :mod:`.jobstore` and the standard library.

Every key of one snapshot lies under its own prefix, ``<world>/<version>``, where ``<world>`` is
``tenplex/snapshot/<nonce>`` with a nonce agreed in the last exchange of the snapshotter's ranks (:mod:`.snapshot`):

* ``step/<rank>``: what a rank read at the step boundary that the host leaders need to write the version's state
  document (:func:`.savedoc.refresh_state_doc`): its optimizer scalars and the generation of its RNG streams;
  the streams themselves lie under ``<world>/rng/<rank>/<generation>``, written only when they changed (a loop without
  dropout or shuffling leaves them alone), so a leader reads them once per change, not once per step;
* ``canonical/<i>``: the bytes of the round's ``i``-th replicated buffer box that a writer on another host than
  its source writes (:mod:`.canonical`), posted by the source rank from its staging buffer;
* ``prepared``: a counter; the rank that brings it to the world size decides ``commit``;
* ``error``: the first failure (its rank and message), written before the rank decides ``abort``;
* ``decision``: ``commit`` or ``abort``, set once (compare-and-set: the first decision stands, a later one
  cannot replace it), so every rank reads the same.

Waiting polls (``check``: one small request, never a blocking ``wait``, whose timeouts the c10d client logs as
warnings) every 0.5 ms for the first 20 ms, then every 5 ms, and stops when ``give_up`` is set.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..files import dumps, loads
from .jobstore import committed_key

COMMIT, ABORT = b"commit", b"abort"
_FAST_POLL_S, _FAST_FOR_S, _SLOW_POLL_S = 0.0005, 0.020, 0.005


class GaveUp(Exception):
    """A wait on the key-value store was given up (the snapshotter is closing or settling)."""


class Aborted(Exception):
    """Another rank decided ``abort`` while this one waited for its documents."""


def poll(ready, give_up: threading.Event) -> None:
    """Return once ``ready()`` is true; raise :class:`GaveUp` once ``give_up`` is set."""
    begin = time.monotonic()
    while not ready():
        if give_up.is_set():
            raise GaveUp()
        time.sleep(_FAST_POLL_S if time.monotonic() - begin < _FAST_FOR_S else _SLOW_POLL_S)


class Agreement:
    """One rank's view of one snapshot's keys (see the module docstring)."""

    def __init__(self, kv, world_key: str, version: int, rank: int, world: int) -> None:
        self.kv, self.world_key, self.rank, self.world = kv, world_key, rank, world
        self.prefix = f"{world_key}/{version}"

    def post_step(self, scalars: dict, rng_generation: int | None, rng: Any, rng_is_new: bool) -> str | None:
        """This rank's step document; its RNG streams too when they are a new generation (their key, returned)."""
        key = None
        if rng_is_new and rng_generation is not None:
            key = f"{self.rng_prefix(self.rank)}/{rng_generation}"
            self.kv.set(key, dumps(rng))
        self.kv.set(f"{self.prefix}/step/{self.rank}", dumps({"scalars": scalars, "rng": rng_generation}))
        return key

    def rng_prefix(self, rank: int) -> str:
        """Where a rank's RNG streams lie: under the world's prefix (a generation outlives a snapshot)."""
        return f"{self.world_key}/rng/{rank}"

    def step_docs(self, give_up: threading.Event, known_rng: dict[int, tuple[int, Any]]) -> list[dict]:
        """Every rank's step document, its RNG streams filled in (``known_rng``: rank -> (generation, streams),
        read before; updated here). Waits until every rank posted."""
        keys, decided = [f"{self.prefix}/step/{r}" for r in range(self.world)], [f"{self.prefix}/decision"]
        poll(lambda: self.kv.check(keys) or self.kv.check(decided), give_up)
        if not self.kv.check(keys):
            raise Aborted("another rank aborted the snapshot before it sent its step document")
        docs = [loads(raw) for raw in self.kv.multi_get(keys)]
        missing = [r for r, d in enumerate(docs) if d["rng"] is not None
                   and (r not in known_rng or known_rng[r][0] != d["rng"])]
        if missing:
            raws = self.kv.multi_get([f"{self.rng_prefix(r)}/{docs[r]['rng']}" for r in missing])
            for r, raw in zip(missing, raws):
                known_rng[r] = (docs[r]["rng"], loads(raw))
        for r, d in enumerate(docs):
            d["rng"] = None if d["rng"] is None else known_rng[r][1]
        return docs

    def post_canonical(self, index: int, data: bytes) -> None:
        """The bytes of the ``index``-th canonical buffer box of the round (:mod:`.canonical`), from its source."""
        self.kv.set(f"{self.prefix}/canonical/{index}", data)

    def canonical(self, index: int, give_up: threading.Event) -> bytes:
        """The bytes its source posted (waits for them; :class:`Aborted` when another rank decided abort)."""
        key, decided = f"{self.prefix}/canonical/{index}", f"{self.prefix}/decision"
        poll(lambda: self.kv.check([key]) or self.kv.check([decided]), give_up)
        if not self.kv.check([key]):
            raise Aborted("another rank aborted the snapshot before it sent a canonical buffer")
        return self.kv.get(key)

    def prepared(self, step: int) -> None:
        """This rank prepared its part; the last one to do so decides ``commit``."""
        if self.kv.add(f"{self.prefix}/prepared", 1) == self.world:
            if self.kv.compare_set(f"{self.prefix}/decision", "", COMMIT) == COMMIT:
                self.kv.set(committed_key(), str(step))  # a restore that cannot reach it counts it lost

    def abort(self, error: str) -> None:
        """This rank cannot take part: record why (the first reason stands) and decide ``abort``."""
        self.kv.compare_set(f"{self.prefix}/error", "", dumps({"rank": self.rank, "error": error}))
        self.kv.compare_set(f"{self.prefix}/decision", "", ABORT)

    def decision(self, give_up: threading.Event) -> bytes:
        """``commit`` or ``abort``, once decided."""
        key = f"{self.prefix}/decision"
        poll(lambda: self.kv.check([key]), give_up)
        return self.kv.get(key)

    def error(self) -> tuple[int, str]:
        """The rank and message of the failure that aborted the snapshot."""
        found = loads(self.kv.get(f"{self.prefix}/error"))
        return found["rank"], found["error"]

    def forget(self, stale_rng_key: str | None, previous: str | None, canonical: tuple[int, ...] = ()) -> None:
        """Once this snapshot is decided, delete what nobody reads any more (the job's store keeps what it is
        given): this rank's step document and ``canonical`` buffers, its RNG streams' key before the one it posted
        now, and, on rank 0, the shared keys of the ``previous`` snapshot (its prefix: every rank read its decision
        before it staged this one, and this one's decision needed every rank)."""
        self.kv.delete_key(f"{self.prefix}/step/{self.rank}")
        for index in canonical:
            self.kv.delete_key(f"{self.prefix}/canonical/{index}")
        if stale_rng_key is not None:
            self.kv.delete_key(stale_rng_key)
        if self.rank == 0 and previous is not None:
            for name in ("prepared", "decision", "error"):
                self.kv.delete_key(f"{previous}/{name}")
