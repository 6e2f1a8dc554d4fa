"""Restore by reading the plan's transfers straight into the model: no new version in the stores.

May import: ``tenplex.store``, ``tenplex.transfer_plan``, ``tenplex.box``,
``tenplex.devices``, ``tenplex.dtypes``, this package's ``pieces``,
``shardio`` and ``staging``, numpy and the standard library.

A restore whose new layout needs state from other hosts has two ways to get
it. The stores can run the plan (``tenplex.transform``) and commit a new
version, from which every rank then reads; that writes every new shard into
the stores and reads it back. Or every rank runs its own device's transfers of
the same plan into its tensors: regions on its host from the store files
(``pread``, verified), regions on other hosts from their store (the data
plane for regions of ``DATA_PLANE_MIN_BYTES`` or more, gRPC ``ReadBox`` below;
verified per frame or chunk). The second moves exactly the plan's bytes and
writes nothing. The checkpointer takes it when it crosses hosts no more than
the plan does: when no transfer reads a new shard (``"from": "new"``, the
local fan-out of a region that crosses once per host and is then copied to
the host's other devices; reading per device would send such a region once per
device), and when every host it reads from belongs to the job (else the job
would depend on a departed host's store until its next save).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import numpy as np

from ..box import Box
from ..devices import host_of
from ..dtypes import numpy_storage
from ..store.client import StoreClient
from ..store.wire import split_box
from ..transfer_plan import Plan, Transfer
from . import staging
from .pieces import Piece
from .shardio import RegionReader, read_piece

THREADS = 4  # regions read at once per rank: waits on the network overlap with local reads and checksums
SLAB_BYTES = staging.SLAB_BYTES  # regions are read in slabs of at most this (a GPU piece stages each one)


def fans_out(plan: Plan) -> bool:
    """Whether some transfer reads a region that an earlier transfer wrote (the local fan-out)."""
    return any(t.source == "new" for t in plan.transfers)


def read_hosts(plan: Plan) -> set[str]:
    """The hosts whose old shards some transfer of ``plan`` reads."""
    return {host_of(t.src) for t in plan.transfers if t.source == "old"}


def source_hosts(plan: Plan, device: str) -> set[str]:
    """The hosts whose stores ``device``'s transfers read from (its own among them when it reads locally)."""
    return {host_of(t.src) for t in plan.transfers if t.dst == device}


class RemoteVersion:
    """A version on another host's store, read region by region with the reader calls ``read_piece`` makes."""

    def __init__(self, client: StoreClient, version: int, dtypes: dict[str, str]):
        self.client, self.version, self.dtypes = client, version, dtypes

    def read(self, device: str, tensor: str, box: Box) -> np.ndarray:
        return self.client.read_box(self.version, device, tensor, box, self.dtypes[tensor])

    def readinto(self, device: str, tensor: str, box: Box, dest: Any) -> None:
        if not isinstance(dest, np.ndarray):  # C-order bytes (read_piece's buffer for a GPU tensor)
            dest = np.frombuffer(dest, numpy_storage(self.dtypes[tensor])).reshape(box.lengths)
        self.client.read_box_into(self.version, device, tensor, box, dest)


def read_through(plan: Plan, device: str, pieces: list[Piece], readers: Mapping[str, RegionReader],
                 threads: int = THREADS) -> int:
    """Run ``device``'s transfers of ``plan`` (none reading new shards) into ``pieces``; return the bytes read.

    ``readers[host]`` reads the source version on ``host`` (this device's own
    host: its store files; others: a :class:`RemoteVersion`). Transfers into
    no piece are skipped (a layout given in advance may hold more than the
    model needs). Regions are read in slabs of at most ``SLAB_BYTES``, larger
    regions first, up to ``threads`` at once; after the first failure the
    slabs not started yet are dropped and the failure is raised. Pieces on
    a GPU: each slab read into a pinned buffer is copied to the device on a
    side stream while the threads read on; the caller's current stream waits
    for every copy (:mod:`.staging`)."""
    by_tensor: dict[str, list[Piece]] = {}
    for p in pieces:
        by_tensor.setdefault(p.name, []).append(p)
    jobs: list[tuple[str, Box, Piece]] = []
    for transfer in sorted((t for t in plan.transfers if t.dst == device), key=lambda t: -t.box.volume):
        into = _containing(transfer, by_tensor.get(transfer.tensor, []))
        if into is not None:
            slabs = split_box(transfer.box, into.local.element_size(), SLAB_BYTES)
            jobs += [(transfer.src, slab, into) for slab in slabs]
    failed = threading.Event()

    def run(job: tuple[str, Box, Piece]) -> int:
        src, slab, piece = job
        if failed.is_set():
            return 0
        try:
            read_piece(readers[host_of(src)], [(src, slab)], piece)
        except BaseException:
            failed.set()
            raise
        return slab.volume * piece.local.element_size()

    devices = {p.local.device for p in pieces}
    staging.begin(devices)  # the worker threads' copies come after the caller's work on these tensors so far
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="read-through") as pool:
        done = sum(pool.map(run, jobs))
    staging.publish(devices)
    return done


def _containing(transfer: Transfer, pieces: list[Piece]) -> Piece | None:
    for piece in pieces:
        if piece.box.ndim == transfer.box.ndim and piece.box.contains(transfer.box):
            return piece
    return None
