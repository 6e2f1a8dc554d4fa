"""The job's progress on each host, so that the next world knows how many steps a failure lost.

May import: ``tenplex.integration.exchange``, ``tenplex.integration.jobstore``, torch.distributed and the standard
library.

A worker does not know how far the previous world got: a host or a worker
that dies between two saves takes the steps since the last committed save
with it. So the first training rank of each host writes the step its world
finished into ``progress.json`` in its host's store root at every step
boundary (:class:`ProgressRecord`), and the next world's ranks gather the
records of their hosts when they restore (:func:`furthest`). A host whose
store root was wiped, or a new host, holds no record and contributes nothing.

Each world's records carry a generation, one more than the newest it
gathered, and the world writes its restored step at once: a record left by
an older world on a host that sat out a newer one (it reached steps whose
loss the newer world already counted) never counts again, and neither does
a world that died before its first step boundary.

The records only tell how far a host's own worlds got. A host whose ranks idled holds no snapshot of the world it
idled in, so when the training host hangs or dies its store is the only one that holds the newest state: every
host's store address is therefore also kept in the job's key-value store (:func:`known_stores`), and a restore
asks the stores of the hosts that left for newer versions (:mod:`tenplex.integration.versions`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

log = logging.getLogger(__name__)
FILE = "progress.json"
STORES_KEY = "tenplex/{job}/stores"  # appended: "HOST=ADDRESS;" per host and restore, the newest last
CONNECT_S = 5.0
FORMAT = "tenplex.progress/1"


@dataclass(frozen=True)
class Progress:
    """One host's record: the furthest ``step`` world ``world`` (of ``generation``) finished on it, and the steps
    the job had lost in all, counting that world's restore (``lost_total``)."""

    step: int
    world: str
    generation: int
    lost_total: int

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "step": self.step, "world": self.world, "generation": self.generation,
                "lost_total": self.lost_total}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "Progress":
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, not {FORMAT}")
        return cls(int(doc["step"]), str(doc["world"]), int(doc["generation"]), int(doc["lost_total"]))


def read(root: str | os.PathLike) -> Progress | None:
    """The record in store root ``root``; None when there is none or it is unreadable (logged: it only counts)."""
    path = Path(root) / FILE
    try:
        return Progress.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("ignoring the progress record %s: %s", path, e)
        return None


def furthest(records: Iterable[Progress | None]) -> Progress | None:
    """The furthest record of the newest generation among the hosts' ``records`` (None: no host has one)."""
    found = [r for r in records if r is not None]
    if not found:
        return None
    newest = max(r.generation for r in found)
    return max((r for r in found if r.generation == newest), key=lambda r: r.step)


def lost_steps(previous: Progress | None, restored_step: int) -> int:
    """Steps an earlier world finished beyond the one restored (0 for a fresh job, or the furthest restored)."""
    return 0 if previous is None else max(0, previous.step - restored_step)


class ProgressRecord:
    """Writes this host's record (only the first training rank of each host holds one).

    Atomic: the record is written aside and renamed over the old one, so a reader sees the old or the new
    record, never a half-written one. Not fsynced: a record lost with its host's file system only counts fewer
    lost steps; the store's commits are what must survive. An unchanged step is not written again.
    """

    def __init__(self, root: str | os.PathLike, world: str, generation: int, lost_total: int):
        self.path = Path(root) / FILE
        self._aside = self.path.with_name(f".{FILE}.{os.getpid()}")
        self.world, self.generation, self.lost_total = world, generation, lost_total
        self._written: int | None = None

    def write(self, step: int) -> None:
        if step == self._written:
            return
        doc = Progress(step, self.world, self.generation, self.lost_total).to_dict()
        try:
            self._aside.write_text(json.dumps(doc))
            os.replace(self._aside, self.path)
        except OSError as e:  # the record only counts lost steps: it must never stop training
            log.warning("cannot record the progress in %s: %s", self.path, e)
            return
        self._written = step


@dataclass(frozen=True)
class Gathered:
    """What :func:`gather` found: the steps this restore lost, the job's lost steps in all, this host's record
    (None on every rank but the first training rank of each host)."""

    lost: int
    lost_total: int
    record: ProgressRecord | None


def gather(root: str | os.PathLike, host: str, world: str, restored_step: int, group=None, decided: int | None = None
           ) -> Gathered:
    """Gather the records of the hosts of ``group`` at a restore of ``restored_step`` (collective); the first
    rank of each host then starts this world's record at the restored step. ``decided``: the newest step whose
    snapshot commit the job's key-value store decided (:func:`decided_step`, read before the restore): the steps
    beyond the restored one were lost too, although no host of the group recorded them (they trained elsewhere)."""
    import torch.distributed as dist

    from ..integration.exchange import all_gather_json

    mine = read(root)
    docs = all_gather_json({"host": host, "progress": None if mine is None else mine.to_dict()}, group)
    # Every rank of the group read its host's record before this returns: no rank overwrites one unread.
    previous = furthest(Progress.from_dict(d["progress"]) for d in docs if d["progress"] is not None)
    lost = max(lost_steps(previous, restored_step), 0 if decided is None else decided - restored_step)
    total = lost + (0 if previous is None else previous.lost_total)
    record = None
    if [d["host"] for d in docs].index(host) == dist.get_rank(group):
        record = ProgressRecord(root, world, 1 + (0 if previous is None else previous.generation), total)
        record.write(restored_step)
    return Gathered(lost, total, record)



def job_key_value():
    """A client of the job's key-value store (the rendezvous store in place: ``MASTER_ADDR:MASTER_PORT``), or None
    without one or when it does not answer (logged: it only widens a restore's search and its count)."""
    from datetime import timedelta

    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port):
        return None
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=CONNECT_S))
    except Exception as e:  # noqa: BLE001 -- without it a restore sees the job's hosts only, as before
        log.warning("cannot reach the job's key-value store at %s:%s: %s", addr, port, e)
        return None


def known_stores(kv, host: str, address: str | None, publish: bool) -> dict[str, str]:
    """host -> store address of every host that published one in the job's key-value store ``kv`` (None: {}),
    the newest per host; first publishes this host's when ``publish``."""
    if kv is None:
        return {}
    key = STORES_KEY.format(job=os.environ.get("TENPLEX_RDZV_ID", "default"))
    try:
        if publish and address:
            kv.append(key, f"{host}={address};")
        raw = kv.get(key).decode() if kv.check([key]) else ""
    except Exception as e:  # noqa: BLE001 -- see job_key_value
        log.warning("cannot read the store addresses from the job's key-value store: %s", e)
        return {}
    return dict(entry.split("=", 1) for entry in raw.split(";") if "=" in entry)


def decided_step(kv) -> int | None:
    """The step of the newest snapshot whose commit the job's key-value store ``kv`` decided (None: none, or no
    store): a host that died with it took its committed state along when no store that answers holds it."""
    from ..integration.jobstore import committed_key

    try:
        return int(kv.get(committed_key())) if kv is not None and kv.check([committed_key()]) else None
    except Exception as e:  # noqa: BLE001 -- see job_key_value
        log.warning("cannot read the committed step from the job's key-value store: %s", e)
        return None


def settle_decided(kv, restored_step: int, first: bool) -> None:
    """The first rank of a restored world sets the decided step back to the restored one: the steps beyond it were
    counted by this restore, and a later restore counts only what this world's commits decide."""
    from ..integration.jobstore import committed_key

    if kv is not None and first:
        try:
            kv.set(committed_key(), str(restored_step))
        except Exception as e:  # noqa: BLE001 -- see job_key_value
            log.warning("cannot reset the committed step in the job's key-value store: %s", e)
