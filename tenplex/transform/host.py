"""One destination host's part of a transformation: stage version N+1 from N and prepare it.

May import: numpy, ``tenplex.store`` (its contract, client and transformer types; never its protobuf),
``tenplex.transfer_plan``, ``tenplex.layout``, ``tenplex.box``, ``tenplex.devices``, ``tenplex.errors``
and the standard library. Runs inside the host's store server (the
``Transform`` RPC), so it reads this host's old shards straight from disk.

Order of work, per new shard of this host's devices:

1. A shard kept whole (same device, or another device of this host, same
   box) is hard-linked to the old file: no bytes are copied. So is a shard
   that one old shard of this host holds as a contiguous run of its bytes
   (a dim-0 slab: what ZeRO and FSDP keep of a replica), as a slice row of
   the linked file, by a local pull of step 2 that first reads the run once
   to verify it (a damaged run is copied instead, from a replica if need
   be); slices of one change share files where replicas allow (see
   ``_linkable``). (A store that cannot link, see
   ``tenplex.store.contract``, gets them copied in step 2.)
2. Every other ``"from": "old"`` region is written straight into the new
   shard's file (``ShardTarget``): from this host's old files (memory-mapped)
   without gRPC, or pulled from the source host by ``streams`` concurrent
   pulls (one connection each): large regions in pieces of up to 16 MiB over
   the source's bulk data plane (plain TCP, ``tenplex.store.dataplane``; gRPC
   ReadBox streams when the source has none or TLS is on), small ones
   batched many to a gRPC call (``ReadBoxes``). The new files' space is
   reserved by a thread of its own while the pulls run, so a full disk
   fails early. The order of the pulls keeps every source link busy at once
   and lets replicas take over a slow source's pieces (``schedule``).
3. ``"from": "new"`` regions (the local fan-out) are copied from the new
   shards that step 2 fills, by one more thread, each as soon as every byte
   of its source region has landed (``completion``): during the pulls, not
   after them; from a linked shard (whole or slice), they read the old file.

A local region that is one contiguous run of both the old and the new shard
file goes from the verified read buffer straight into the new file. Every new
shard is finished (fsynced, its block checksums collected) by the thread
that wrote its last region, so that work overlaps the other pulls instead of
running serially in ``prepare``.

A region whose source fails (host down, cut off, corrupted data after
retries, missing version) is fetched again from the other replicas the old
layout lists, this host's own first; only when no replica covers it does the
part fail, naming the tensor, region and every cause. A source counts as
failed when a pull from it delivers nothing for ``request.stall_timeout_s`` seconds
(the stall limit): a partitioned peer sends no reset, so waiting for a
deadline would take minutes. While it works, the part sends the coordinator a
progress message at least every ``HEARTBEAT_S``, so that the coordinator can
tell a silent host from a busy one in the same way.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..box import Box, split_by, subtract_all
from ..devices import host_of
from ..errors import StoreError, TransformError
from ..layout import Layout
from ..transfer_plan import Transfer
from ..store import (LAYOUT_DOC, CorruptShard, FileBackedReader, LinkingWriter, ShardEntry, ShardTarget, StoreReader,
                     StoreWriter, TensorStore, wire)
from ..store._buffers import thread_buffer
from ..store.client import StoreClient
from ..store.transformer import TransformProgress, TransformRequest
from .completion import Completion, FanOutCopy
from .schedule import LOCAL, Pull, Schedule
from ..store.manifest import TRANSFORM_PART

log = logging.getLogger(__name__)
_COPY_BUFFER = threading.local()  # each thread's slab buffer for local copies

MAX_DEFAULT_STREAMS = 4  # pulls per host when the request names none: one per CPU the store may use, 2 to 4
PIECE_BYTES = 16 << 20          # one pull call; several chunks each; small enough for replicas to share the tail
SMALL_BYTES = 1 << 20           # remote regions below this travel in batches (ReadBoxes): one call for many
BATCH_BYTES = 2 << 20           # small: they go first, and a slow source must not hold a big one
BATCH_REGIONS = 512
PROGRESS_EVERY_BYTES = 64 << 20  # progress messages are throttled to this granularity
PROGRESS_EVERY_S = 0.25
HEARTBEAT_S = 1.0               # a progress message at least this often, even when no bytes arrive
STALL_S = 5.0                   # default stall limit of pulls (request.stall_timeout_s)
COPY_PIECE_BYTES = 4 << 20      # a local region that is not one run of both files is copied in slabs of this size
CALL_TIMEOUT_S = 60.0           # overall deadline base of calls to peers; stalls are caught much earlier


@dataclass
class _Counters:
    """This part's byte counters; ``add`` reports them to ``progress``, throttled."""

    progress: Callable[[TransformProgress], None]
    total: int = 0
    done: int = 0
    kept: int = 0
    linked: int = 0
    sliced: int = 0  # of linked
    local: int = 0
    remote: int = 0
    refetched: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    _reported: tuple[int, float] = field(default_factory=lambda: (0, time.monotonic()))  # bytes done, when

    def message(self, done: bool = False) -> TransformProgress:
        return TransformProgress(bytes_done=self.done, bytes_total=self.total, kept_bytes=self.kept,
                                 local_bytes=self.local, remote_bytes=self.remote, refetched_bytes=self.refetched,
                                 linked_bytes=self.linked, sliced_bytes=self.sliced, done=done)

    def add(self, nbytes: int, kind: str, sliced: bool = False) -> None:
        """``nbytes`` more are in place, got there as ``kind`` (kept, linked, local, remote, refetched); ``sliced``:
        linked as a slice (counted in ``sliced`` as well, under the same lock)."""
        with self.lock:
            self.done += nbytes
            setattr(self, kind, getattr(self, kind) + nbytes)
            if sliced:
                self.sliced += nbytes
            now = time.monotonic()
            if self.done - self._reported[0] >= PROGRESS_EVERY_BYTES or now - self._reported[1] >= PROGRESS_EVERY_S:
                self._reported = (self.done, now)
                self.progress(self.message())

    def report(self) -> None:
        with self.lock:
            self.progress(self.message())


class _Sources:
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
                pool = [StoreClient(address, token=self._token, root_certificates=self._roots,
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


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD" (a pod's CPU limit)


def default_streams() -> int:
    """Concurrent pulls of a host whose request names no number: one per CPU this process may use (its CPU
    affinity, and its cgroup's CPU quota when it has one: a container's limit), at least 2 and at most
    ``MAX_DEFAULT_STREAMS``. Each pull receives, hashes and writes in the kernel; more pulls than cores only
    contend with each other, with the store's serving threads and with the local copies (measured on two cores,
    2026-12-04: 2 streams 5-10 % faster than 4 on the compare benchmark's cross-host changes)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 CPU controller here: the affinity alone
    return max(2, min(MAX_DEFAULT_STREAMS, cpus))


def run_host_part(store: TensorStore, request: TransformRequest, progress: Callable[[TransformProgress], None],
                  cancelled: threading.Event | None = None, token: str | None = None,
                  root_certificates: bytes | None = None) -> TransformProgress:
    """Stage ``request.new_version`` on this host and prepare it (the coordinator commits). Returns the final
    counters (``done`` set). A :class:`~tenplex.store.transformer.Transformer`."""
    host = request.host
    if host != store.host:
        raise StoreError(f"transform request for host {host} reached the store of host {store.host}")
    plan, old, new = request.plan, request.old_layout, request.new_layout
    cancelled = cancelled or threading.Event()
    streams = request.streams or default_streams()
    reader = store.open(request.old_version) if request.old_version in store.versions() else None
    sources = _Sources(host, old, request.old_version, reader, dict(request.peers), token, root_certificates,
                       streams, request.chunk_bytes or wire.DEFAULT_CHUNK_BYTES, request.stall_timeout_s or STALL_S)
    counters = _Counters(progress)
    beating = threading.Event()
    threading.Thread(target=_heartbeat, args=(counters, beating), name=f"heartbeat-{host}", daemon=True).start()
    log.info("host %s: staging version %s from %s (%d transfers, %d streams)", host, request.new_version,
             request.old_version, len(plan.transfers), streams)
    store.abort(request.new_version)  # leftovers of an earlier, interrupted attempt
    writer = store.begin(request.new_version, part=TRANSFORM_PART)
    try:
        _stage(host, plan.transfers, set(plan.new_tensors), new, writer, reader, sources, counters, cancelled,
               streams)
        _carry_json(host, request, old, writer, reader, sources)
        writer.put_layout(new)
        writer.prepare()
    except BaseException:
        writer.abort()
        raise
    finally:
        beating.set()
        sources.close()
    log.info("host %s: prepared version %s", host, request.new_version)
    return counters.message(done=True)


def _heartbeat(counters: _Counters, stop: threading.Event) -> None:
    """Tell the coordinator this host is alive while it works (allocating, pulling, checksumming)."""
    while not stop.wait(HEARTBEAT_S):
        with counters.lock:
            if not stop.is_set():
                counters.progress(counters.message())


ShardKey = tuple[str, str, Box]  # a new shard: (device, tensor, box)


@dataclass
class _Work:
    """What staging queued: the new shards' files, the shards linked whole, the pulls (and the small remote
    regions still to batch into pulls), the local fan-out, and the space reservations."""

    targets: dict[ShardKey, ShardTarget] = field(default_factory=dict)
    linked: dict[ShardKey, ShardEntry] = field(default_factory=dict)  # new shards linked (or being linked, slices)
    sliced: set[str] = field(default_factory=set)  # old files that slices of this change link
    pulls: list[Pull] = field(default_factory=list)
    small: dict[str, list[tuple[str, str, Box, ShardTarget]]] = field(default_factory=dict)  # source host -> regions
    fan_out: list[tuple[Transfer, ShardKey]] = field(default_factory=list)
    reserves: list[Callable[[], None]] = field(default_factory=list)
    completion: Completion = field(default_factory=Completion)


def _stage(host: str, transfers, uninitialised: set[str], new: Layout, writer: StoreWriter,
           reader: StoreReader | None, sources: _Sources, counters: _Counters, cancelled: threading.Event,
           streams: int) -> None:
    """Fill every new shard of this host: link whole kept shards, queue the pulls and the fan-out, run them."""
    fills_of = _fills_by_shard(host, transfers, uninitialised, new)
    counters.total = sum(key[2].volume * new.tensors[key[1]].itemsize for key in fills_of)
    work = _Work()
    # A store without the capability gets whole kept shards copied like any local region (checked once here:
    # a runtime protocol check costs tens of microseconds, and hosts stage thousands of shards).
    linking = (writer, reader) if isinstance(writer, LinkingWriter) and isinstance(reader, FileBackedReader) else None
    for key, fills in fills_of.items():
        _check_covered(key, fills)
        if linking is None or not _link_kept(host, key, fills, new, *linking, sources, work, counters, cancelled):
            _queue_fills(host, key, fills, new, writer, sources, work, counters, cancelled)
    _queue_fan_out(work, reader)
    _queue_batches(work, sources, counters, cancelled)
    # Destinations start their round of sources at different places (see schedule).
    schedule = Schedule(work.pulls, start=new.hosts().index(host) if host in new.hosts() else 0,
                        failed=lambda h: h in sources.failed)
    _run(host, work, schedule, streams, cancelled, lambda nbytes: counters.add(nbytes, "local"))
    # A cancel makes every pending job return early: the shards are then incomplete and must never be prepared.
    if cancelled.is_set():
        raise TransformError(f"host {host}: transformation cancelled")
    counters.report()


def _fills_by_shard(host: str, transfers, uninitialised: set[str], new: Layout) -> dict[ShardKey, list[Transfer]]:
    """Each new shard of this host's devices -> the transfers that fill it. Tensors new to this layout get no
    shards: the job initialises them."""
    by_shard: dict[ShardKey, list[Transfer]] = {}
    boxes_of: dict[tuple[str, str], list[Box]] = {}  # (device, tensor) -> its new boxes
    for device, shards in new.devices.items():
        if host_of(device) == host:
            for shard in shards:
                if shard.tensor not in uninitialised:
                    by_shard[(device, shard.tensor, shard.box)] = []
                    boxes_of.setdefault((device, shard.tensor), []).append(shard.box)
    for t in transfers:
        if host_of(t.dst) != host:
            continue
        owner = next(((t.dst, t.tensor, b) for b in boxes_of.get((t.dst, t.tensor), ()) if b.contains(t.box)), None)
        if owner is None:
            raise TransformError(f"plan sends {t.tensor!r} {t.box} to {t.dst}, but no box of {t.dst} in the new "
                                 f"layout contains it; the plan does not match the new layout")
        by_shard[owner].append(t)
    return by_shard


def _check_covered(key: ShardKey, fills: list[Transfer]) -> None:
    device, tensor, box = key
    covered = sum(t.box.volume for t in fills)
    if covered != box.volume or subtract_all(box, [t.box for t in fills]):
        raise TransformError(f"plan covers {covered} of {box.volume} elements of {tensor!r} {box} on {device}; "
                             f"every new box must be covered exactly once")


def _link_kept(host: str, key: ShardKey, fills: list[Transfer], new: Layout, writer: LinkingWriter,
               reader: FileBackedReader, sources: _Sources, work: _Work, counters: _Counters,
               cancelled: threading.Event) -> bool:
    """Hard-link the shard when one old shard of this host holds all of it: a whole file now, a slice of one (a
    contiguous run of its bytes, read once to verify it) by a local pull that runs alongside the others; True
    if so. A fan-out copy may read the shard's regions from the old file from the start."""
    device, tensor, box = key
    entry = _linkable(host, fills, box, reader, sources.old, work.sliced)
    if entry is None:
        return False
    spec = new.tensors[tensor]
    nbytes = box.volume * spec.itemsize
    if entry.box == box:
        try:
            writer.link(device, reader, entry)
        except CorruptShard as e:  # the old file is gone: copy the shard, from a replica
            log.warning("host %s: cannot link %s %s of %s: %s; copying it instead", host, tensor, box, device, e)
            return False
        work.linked[key] = entry
        counters.add(nbytes, "linked")
        return True
    work.linked[key] = entry
    work.sliced.add(entry.file)
    kind = "kept" if fills[0].kept else "local"

    def run(server: str) -> None:
        if cancelled.is_set():
            return
        try:
            writer.link(device, reader, entry, box)
        except (CorruptShard, OSError) as e:  # nothing was linked: copy the region, from a replica if need be
            log.warning("host %s: not linking %s %s of %s: %s; copying it instead", host, tensor, box, device, e)
            target = writer.create(device, tensor, box, spec.dtype, spec.shape)
            _job(sources, fills[0].src, {}, tensor, box, target, kind, counters.add, cancelled, work.completion)(server)
            return
        counters.add(nbytes, "linked", sliced=True)
    work.pulls.append(Pull(LOCAL, nbytes, run))
    return True


def _queue_fills(host: str, key: ShardKey, fills: list[Transfer], new: Layout, writer: StoreWriter,
                 sources: _Sources, work: _Work, counters: _Counters, cancelled: threading.Event) -> None:
    """Create the new shard's file and queue its regions: local copies and large remote regions as pulls of up
    to ``PIECE_BYTES``, small remote regions for batching, ``"from": "new"`` regions for the fan-out."""
    device, tensor, box = key
    spec = new.tensors[tensor]
    # Space is reserved by a thread of its own (``_run``) so that allocation overlaps the pulls.
    target = writer.create(device, tensor, box, spec.dtype, spec.shape, reserve=False)
    work.targets[key] = target
    work.reserves.append(target.reserve)
    for t in fills:
        if t.source == "new":
            work.fan_out.append((t, key))
            continue
        kind = "kept" if t.kept else ("local" if host_of(t.src) == host else "remote")
        for piece in wire.split_box(t.box, spec.itemsize, PIECE_BYTES):
            nbytes = piece.volume * spec.itemsize
            work.completion.expect(target)
            if kind != "remote":
                work.pulls.append(Pull(LOCAL, nbytes, _job(sources, t.src, {}, t.tensor, piece, target, kind,
                                                           counters.add, cancelled, work.completion)))
            elif nbytes < SMALL_BYTES:
                work.small.setdefault(host_of(t.src), []).append((t.src, t.tensor, piece, target))
            else:
                holders = sources.holders(t.tensor, piece)
                job = _job(sources, t.src, holders, t.tensor, piece, target, kind, counters.add, cancelled,
                           work.completion)
                work.pulls.append(Pull(host_of(t.src), nbytes, job, frozenset(holders) - {host_of(t.src)}))


def _queue_batches(work: _Work, sources: _Sources, counters: _Counters, cancelled: threading.Event) -> None:
    """Turn the small remote regions into pulls of many regions each (one ``ReadBoxes`` call), queued before the
    large pulls: a batch's many regions cost more per byte, and they often feed fan-out copies, which can then
    run while the large pulls keep the links busy instead of after them. Batches stay small (``BATCH_BYTES``):
    the first pull from each source is one, and a slow source must not be handed a large one (replicas take
    over only what is still queued)."""
    batches: list[Pull] = []
    for source_host, items in work.small.items():
        for batch in _batches(items):
            batch_holders = [sources.holders(tensor, piece) for _, tensor, piece, _ in batch]
            shared = frozenset.intersection(*(frozenset(h) for h in batch_holders)) - {source_host}
            batches.append(Pull(source_host, sum(i[2].volume * i[3].itemsize for i in batch),
                                _batch_job(sources, batch, batch_holders, counters.add, cancelled,
                                           work.completion), shared))
    work.pulls[:0] = batches


def _queue_fan_out(work: _Work, reader: StoreReader | None) -> None:
    """Register each ``"from": "new"`` region with the completion tracker: it is copied, during the pulls, as soon
    as its source region (in a new shard staged here, or in a hard-linked one) has landed."""
    staged: dict[tuple[str, str], list[tuple[Box, ShardTarget]]] = {}
    for (device, tensor, box), target in work.targets.items():
        staged.setdefault((device, tensor), []).append((box, target))
    for t, key in work.fan_out:
        describe = f"{t.tensor!r} {t.box} from {t.src}'s new shard to {t.dst}"
        source = next((target for box, target in staged.get((t.src, t.tensor), ()) if box.contains(t.box)), None)
        if source is not None:
            read = functools.partial(source.read, t.box)
        else:
            entry = next((e for (d, name, box), e in work.linked.items() if d == t.src and name == t.tensor
                          and box.contains(t.box)), None)
            if entry is None or reader is None:
                raise TransformError(f"plan fans out {describe}, but this host stages no such shard; the plan "
                                     f"does not match the new layout")
            read = functools.partial(reader.region, entry, t.box)
        work.completion.add_copy(FanOutCopy(t.box, work.targets[key], source, read, describe))


def _run(host: str, work: _Work, schedule: Schedule, streams: int, cancelled: threading.Event,
         copied: Callable[[int], None]) -> None:
    """Run the schedule's pieces on ``streams`` threads while one more thread reserves the new files' space
    (a full disk fails early, and the first pulls do not wait for it) and then runs the fan-out copies as
    their sources land; the first failure cancels the rest and is raised."""
    threads = max(1, streams)
    pulling = [threads]  # pull threads still running
    lock = threading.Lock()

    def worker() -> None:
        try:
            while not cancelled.is_set():
                got = schedule.take()
                if got is None:
                    return
                piece, server = got
                try:
                    piece.run(server)
                finally:
                    schedule.done(server)
        finally:
            with lock:
                pulling[0] -= 1

    def reserve_then_fan_out() -> None:
        for reserve in work.reserves:
            if cancelled.is_set():
                return
            reserve()
        work.completion.run_copies(lambda: pulling[0] == 0, cancelled, copied)

    with ThreadPoolExecutor(max_workers=threads + 1, thread_name_prefix=f"pull-{host}") as pool:
        running = [pool.submit(reserve_then_fan_out)] + [pool.submit(worker) for _ in range(threads)]
        done, _ = wait(running, return_when=FIRST_EXCEPTION)
        for future in done:
            error = future.exception()
            if error is not None:
                cancelled.set()  # the other threads stop after their current piece
                raise error


def _job(sources: _Sources, device: str, holders: dict[str, str], tensor: str, piece: Box, target: ShardTarget,
         kind: str, advance, cancelled, completion: Completion):
    """Read ``piece`` from ``device``, or from the device of ``holders[server]`` when the schedule gives the
    piece to a replica's host."""
    def run(server: str) -> None:
        if cancelled.is_set():
            return
        source = device if server in (LOCAL, host_of(device)) else holders[server]
        refetched = sources.read_with_fallback(source, tensor, piece, target)
        nbytes = piece.volume * target.itemsize
        if refetched:
            advance(refetched, "refetched")
        if nbytes > refetched:
            advance(nbytes - refetched, kind)
        completion.landed(target, piece)
    return run


def _batches(items: list) -> Iterator[list]:
    """Consecutive groups of at most BATCH_REGIONS regions and about BATCH_BYTES bytes."""
    batch, nbytes = [], 0
    for item in items:
        batch.append(item)
        nbytes += item[2].volume * item[3].itemsize
        if len(batch) >= BATCH_REGIONS or nbytes >= BATCH_BYTES:
            yield batch
            batch, nbytes = [], 0
    if batch:
        yield batch


def _batch_job(sources: _Sources, batch: list, holders: list[dict[str, str]], advance, cancelled,
               completion: Completion):
    """Read a batch of small regions from their planned host, or from ``server``'s devices (``holders``)."""
    def run(server: str) -> None:
        if cancelled.is_set():
            return
        items = batch if server == host_of(batch[0][0]) else \
            [(held[server], tensor, piece, target) for (_, tensor, piece, target), held in zip(batch, holders)]
        for (_, _, piece, target), refetched in zip(items, sources.read_batch(items)):
            nbytes = piece.volume * target.itemsize
            if refetched:
                advance(refetched, "refetched")
            if nbytes > refetched:
                advance(nbytes - refetched, "remote")
            completion.landed(target, piece)
    return run


def _linkable(host: str, fills: list[Transfer], box: Box, reader: FileBackedReader, old: Layout,
              sliced: set[str]) -> ShardEntry | None:
    """The old shard to hard-link when one old-version transfer from this host fills the whole new ``box``: an old
    shard of this host whose box is ``box`` (the planned source's first); else, for a slice, an old shard of this
    host with block checksums of which ``box`` is one contiguous run of bytes. Any replica on this host holds the
    same bytes: one whose file other slices already use (``sliced``) comes first, then the planned source's, so
    that a change which shards replicas (ZeRO, FSDP) keeps one file per region and the old version's other files
    are freed with it. None otherwise."""
    if len(fills) != 1:
        return None
    t = fills[0]
    if t.source != "old" or host_of(t.src) != host or t.box != box or box.is_empty():
        return None
    try:
        planned = reader.find(t.src, t.tensor, box)
    except StoreError:
        return None

    def sliceable(entry: ShardEntry) -> bool:  # block checksums, and ``box`` one contiguous run of its bytes
        return entry.blocks is not None and box.is_run_of(entry.box)

    if planned.box == box or (planned.file in sliced and sliceable(planned)):
        return planned  # without looking for replicas
    replicas = [planned] + _replicas_here(host, reader, old, t.src, t.tensor, box)
    whole = next((e for e in replicas if e.box == box), None)
    if whole is not None:
        return whole
    runs = [e for e in replicas if sliceable(e)]
    return next((e for e in runs if e.file in sliced), runs[0] if runs else None)


def _replicas_here(host: str, reader: FileBackedReader, old: Layout, device: str, tensor: str,
                   box: Box) -> list[ShardEntry]:
    """The stored old shards of ``tensor`` containing ``box`` on this host's devices other than ``device``: the
    old layout's index of the tensor says which devices hold one (as for replica fallback), the reader finds them."""
    found = []
    for other, held in old.shards_of(tensor):
        if other != device and host_of(other) == host and held.contains(box):
            try:
                found.append(reader.find(other, tensor, box))
            except StoreError:
                pass
    return found


def _carry_json(host: str, request: TransformRequest, old: Layout, writer, reader: StoreReader | None,
                sources: _Sources) -> None:
    """Copy the old version's JSON documents (step, RNG, dataset position…) into the new version.

    They come from ``request.json_from_host`` (this host itself when it held
    old state); if that host fails, from the other old hosts in turn."""
    origin = request.json_from_host or host
    candidates = [origin] + [h for h in old.hosts() if h != origin]
    causes = []
    for candidate in candidates:
        try:
            if candidate == host:
                if reader is None:
                    continue
                docs = {name: reader.get_json(name) for name in reader.json_names() if name != LAYOUT_DOC}
            else:
                if candidate in sources.failed:
                    continue
                client = sources.client(candidate)
                names = sorted(client.manifest(request.old_version)["json"])
                # not the old layout: the new version records its own, and a large one is tens of MB to fetch
                docs = {name: client.get_json(request.old_version, name) for name in names if name != LAYOUT_DOC}
        except Exception as e:  # noqa: BLE001 - try the next host that held the old version
            causes.append(f"{candidate}: {e}")
            continue
        for name, doc in docs.items():
            writer.put_json(name, doc)
        return
    if causes:
        raise TransformError(f"host {host}: could not read the JSON documents of version {request.old_version} "
                             f"from any old host: " + "; ".join(causes))
