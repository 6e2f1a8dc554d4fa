"""Where one host part reads regions of the old version: this host's files straight from disk, peer stores over
the network, and the other replicas when a source fails.

May import: ``tenplex.store`` (its contract, client and wire helpers; never its protobuf), ``tenplex.layout``,
``tenplex.box``, ``tenplex.devices``, ``tenplex.errors`` and the standard library.
"""

from __future__ import annotations

import logging
import threading

from ..box import Box, split_by
from ..devices import host_of
from ..errors import StoreError, TransformError
from ..layout import Layout
from ..store import CorruptShard, FileBackedReader, ShardTarget, StoreReader, wire
from ..store._buffers import thread_buffer
from ..store.client import StoreClient

log = logging.getLogger(__name__)
_COPY_BUFFER = threading.local()  # each thread's slab buffer for local copies

COPY_PIECE_BYTES = 4 << 20      # a local region that is not one run of both files is copied in slabs of this size
CALL_TIMEOUT_S = 60.0           # overall deadline base of calls to peers; stalls are caught much earlier


class Sources:
    """Reads regions of old shards: locally from disk, or from peer stores, with replica fallback."""

    def __init__(self, host: str, old: Layout, version: int, reader: StoreReader | None,
                 peers: dict[str, str], token: str | None, root_certificates: bytes | None, streams: int,
                 chunk_bytes: int, stall: float):
        self.host, self.old, self.version, self.reader = host, old, version, reader
        self._files = reader if isinstance(reader, FileBackedReader) else None  # checked once: isinstance is slow
        self.failed: dict[str, str] = {}  # host -> first failure, not asked again
        self._lock = threading.Lock()
        self._clients: dict[str, list[StoreClient]] = {}
        self._peers, self._token, self._roots, self._streams = peers, token, root_certificates, streams
        self._chunk_bytes, self._stall = chunk_bytes, stall
        self._turn = 0

    def client(self, host: str) -> StoreClient:
        with self._lock:
            pool = self._clients.get(host)
            if pool is None:
                address = self._peers.get(host)
                if address is None:
                    raise StoreError(f"no store address for host {host} (peers: {sorted(self._peers)})")
                # One connection per stream: streams sharing a connection share one socket and one
                # receiving thread in gRPC, which caps throughput well below the link's.
                pool = [StoreClient(address, token=self._token, root_certificates=self._roots, peer_host=self.host,
                                    chunk_bytes=self._chunk_bytes, timeout=CALL_TIMEOUT_S, stall_timeout=self._stall,
                                    own_connection=True) for _ in range(self._streams)]
                self._clients[host] = pool
            self._turn += 1
            return pool[self._turn % len(pool)]

    def close(self) -> None:
        for pool in self._clients.values():
            for client in pool:
                client.close()

    def read_with_fallback(self, device: str, tensor: str, box: Box, target: ShardTarget) -> int:
        """Write ``box`` of ``device``'s old shard into ``target``; return the bytes that came from other replicas."""
        try:
            self._read_from(device, tensor, box, target)
            return 0
        except Exception as first:  # noqa: BLE001 - any source failure: try the replicas
            self._mark_failed(host_of(device), first)
            causes = [f"{device}: {first}"]
        remaining = [box]
        refetched = 0
        itemsize = target.itemsize
        # This host's replicas first (no network), then the others in layout order.
        candidates = sorted(self.old.shards_of(tensor), key=lambda db: host_of(db[0]) != self.host)
        for other, held in candidates:
            if other == device or host_of(other) in self.failed or not remaining:
                continue
            inside, remaining = split_by(remaining, held)
            for common in inside:
                try:
                    self._read_from(other, tensor, common, target)
                    refetched += common.volume * itemsize
                except Exception as e:  # noqa: BLE001
                    self._mark_failed(host_of(other), e)
                    causes.append(f"{other}: {e}")
                    remaining.append(common)
        if remaining:
            raise TransformError(f"host {self.host}: region {box} of tensor {tensor!r} could not be read from "
                                 f"{device} and no surviving replica covers {remaining[0]}; causes: "
                                 + "; ".join(causes))
        return refetched

    def read_batch(self, items: list[tuple[str, str, Box, ShardTarget]]) -> list[int]:
        """``read_with_fallback`` for many small regions of old shards on one remote host, in one call when it works;
        returns the re-fetched bytes per item."""
        source_host = host_of(items[0][0])
        if source_host not in self.failed:
            try:
                self.client(source_host).read_boxes_to(
                    self.version, [(device, tensor, box, target.itemsize, target.write)
                                   for device, tensor, box, target in items], digests=True)
                return [0] * len(items)
            except Exception as e:  # noqa: BLE001 - each region then goes its own way, replicas included
                self._mark_failed(source_host, e)
        return [self.read_with_fallback(device, tensor, box, target) for device, tensor, box, target in items]

    def _read_from(self, device: str, tensor: str, box: Box, target: ShardTarget) -> None:
        source_host = host_of(device)
        if source_host in self.failed:
            raise StoreError(f"host {source_host} already failed: {self.failed[source_host]}")
        if source_host == self.host:
            if self.reader is None:
                raise StoreError(f"host {self.host} has no committed version {self.version}")
            if self._files is None or not _copy_run(self._files, device, tensor, box, target):
                _copy_pieces(self.reader, device, tensor, box, target)
            return
        self.client(source_host).read_box_to(self.version, device, tensor, box, target.itemsize, target.write,
                                             digests=True)

    def _mark_failed(self, host: str, error: Exception) -> None:
        if _damaged_shard(error):
            return  # one stored shard failed its checksums: its host still serves the others
        with self._lock:
            if host not in self.failed:
                log.warning("host %s: source host %s failed, reading from replicas: %s", self.host, host, error)
            self.failed.setdefault(host, str(error))

    def holders(self, tensor: str, box: Box) -> dict[str, str]:
        """host -> a device of that host (not this one) whose old box of ``tensor`` contains ``box``."""
        found: dict[str, str] = {}
        for device, held in self.old.shards_of(tensor):
            host = host_of(device)
            if host != self.host and host not in found and held.contains(box):
                found[host] = device
        return found


def _copy_run(reader: FileBackedReader, device: str, tensor: str, box: Box, target: ShardTarget) -> bool:
    """Copy a local region that is one contiguous run of both the old and the new shard file: each verified piece
    goes from the reader's reused piece buffer straight into the new file, with no array allocated (and
    page-faulted) per region. False, with nothing copied, when the region is not such a run."""
    entry = reader.find(device, tensor, box)
    start, span, _ = reader.byte_span(entry, box)
    into = target.run_offset(box)
    if into is None or span != box.volume * target.itemsize:
        return False
    shard = reader.shard_file(entry)
    # a piece that is one whole stored block was verified against its stored digest before it is consumed: the
    # new file's block there (when the two line up) takes that digest instead of hashing the bytes again
    shard.read_into(start, None, span, consume=lambda at, data: target.write_at(
        into + at, data, shard.block_digest(start + at, data.nbytes)))
    return True


def _copy_pieces(reader: StoreReader, device: str, tensor: str, box: Box, target: ShardTarget) -> None:
    """Copy a local region in slabs of at most ``COPY_PIECE_BYTES`` through this thread's reused buffer: no
    array of the region's size is allocated and page-faulted per region (a 100 MB column block of a
    tensor-parallel split, say), and each slab is still in cache when it is written."""
    for sub in wire.split_box(box, target.itemsize, COPY_PIECE_BYTES):
        buffer = thread_buffer(_COPY_BUFFER, sub.volume * target.itemsize, COPY_PIECE_BYTES)
        reader.readinto(device, tensor, sub, buffer)
        target.write(sub, buffer)


def _damaged_shard(error: Exception) -> bool:
    """A source shard whose stored bytes failed verification (here or on its store server)."""
    code = getattr(error, "code", None)
    return isinstance(error, CorruptShard) or getattr(code, "name", None) == "DATA_LOSS"
