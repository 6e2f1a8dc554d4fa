"""Staging one host's new shards: link what can be linked, queue the pulls, batches and fan-out copies, run them.

May import: ``tenplex.store`` (its contract, wire helpers and transformer types; never its protobuf),
``tenplex.transfer_plan``, ``tenplex.layout``, ``tenplex.box``, ``tenplex.devices``, ``tenplex.errors`` and
the standard library. The order of work is described in ``tenplex.transform.host``.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..box import Box, subtract_all
from ..devices import host_of
from ..errors import TransformError
from ..layout import Layout
from ..transfer_plan import Transfer
from ..store import CorruptShard, FileBackedReader, LinkingWriter, ShardEntry, ShardTarget, StoreReader, \
    StoreWriter, wire
from .completion import Completion, FanOutCopy
from .linking import linkable
from .progress import Counters
from .schedule import LOCAL, Pull, Schedule
from .sources import Sources

PIECE_BYTES = 16 << 20          # one pull call; several chunks each; small enough for replicas to share the tail
SMALL_BYTES = 1 << 20           # remote regions below this travel in batches (ReadBoxes): one call for many
BATCH_BYTES = 2 << 20           # small: they go first, and a slow source must not hold a big one
BATCH_REGIONS = 512

log = logging.getLogger(__name__)


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


def stage(host: str, transfers, uninitialised: set[str], new: Layout, writer: StoreWriter,
           reader: StoreReader | None, sources: Sources, counters: Counters, cancelled: threading.Event,
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
               reader: FileBackedReader, sources: Sources, work: _Work, counters: Counters,
               cancelled: threading.Event) -> bool:
    """Hard-link the shard when one old shard of this host holds all of it: a whole file now, a slice of one (a
    contiguous run of its bytes, read once to verify it) by a local pull that runs alongside the others; True
    if so. A fan-out copy may read the shard's regions from the old file from the start."""
    device, tensor, box = key
    entry = linkable(host, fills, box, reader, sources.old, work.sliced)
    if entry is None:
        return False
    spec = new.tensors[tensor]
    nbytes = box.volume * spec.itemsize
    if entry.box == box:
        try:
            writer.link(device, reader, entry)
        except (CorruptShard, OSError) as e:  # the old file is gone (copy from a replica) or cannot be linked
            # (EXDEV: the old version on another mount): nothing was linked, so copy the shard
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
                 sources: Sources, work: _Work, counters: Counters, cancelled: threading.Event) -> None:
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


def _queue_batches(work: _Work, sources: Sources, counters: Counters, cancelled: threading.Event) -> None:
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


def _job(sources: Sources, device: str, holders: dict[str, str], tensor: str, piece: Box, target: ShardTarget,
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


def _batch_job(sources: Sources, batch: list, holders: list[dict[str, str]], advance, cancelled,
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
