"""Per-block checksums of shard data: the format, and computing them while a shard is written.

May import: numpy, xxhash, this package's ``_buffers`` and the standard library.

Format (a manifest row's optional ``block_bytes`` and ``blocks``): the shard's
data (the safetensors payload, C order) is cut into blocks of ``block_bytes``
(``BLOCK_BYTES`` = 1 MiB; the last block may be shorter) and ``blocks`` lists
the xxh3_64 of each block as 16 hex digits. Such a row's ``xxh3`` is the
xxh3_64 of the concatenated 8-byte big-endian block digests
(:func:`root_digest`), so the whole-shard fingerprint costs no extra pass over
the data. A row without ``blocks`` (written before block checksums) carries the
xxh3_64 of its whole data; such a shard is verified whole the first time a
reader touches it.

Writers compute the digests as the data arrives (:class:`BlockTally`): a block
is hashed as soon as its last byte is written, from the written buffer when the
block lies inside one write, so preparing a version needs no pass over its data.

1 MiB blocks keep a small read cheap (it hashes at most two partial blocks
besides its own bytes) while the per-block bookkeeping stays negligible
(1,024 digests per GiB, 20 KB of manifest). Reads verify them in
``shardfile``.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import xxhash

from ._buffers import thread_buffer

BLOCK_BYTES = 1 << 20


def block_digests(data, block_bytes: int = BLOCK_BYTES) -> list[str]:
    """xxh3_64 of each ``block_bytes`` block of ``data`` (a bytes-like object), as 16 hex digits each."""
    view = memoryview(data).cast("B")
    return [f"{xxhash.xxh3_64_intdigest(view[i:i + block_bytes]):016x}" for i in range(0, view.nbytes, block_bytes)]


def root_digest(blocks: list[str]) -> str:
    """The shard's ``xxh3``: xxh3_64 of the concatenated 8-byte big-endian block digests."""
    return f"{xxhash.xxh3_64_intdigest(bytes.fromhex(''.join(blocks))):016x}"


_SCRATCH = threading.local()  # each thread's buffer for blocks read back


class BlockTally:
    """Block digests of a shard being written in any order and from several threads, each computed once the
    block is complete: from the written bytes when one write covers the whole block; from a running hash when
    the block's writes came in order from its first byte (a region copied piece by piece to an offset that is
    not block-aligned); else by reading the block back (``read_block(index, view)``, from the page cache).
    Blocks written more than once (overlapping writes) or through a map the tally cannot see (:meth:`forget`)
    are hashed again by :meth:`digests`."""

    def __init__(self, nbytes: int, read_block: Callable[[int, memoryview], None], block_bytes: int = BLOCK_BYTES):
        self.nbytes, self.block_bytes, self._read = nbytes, block_bytes, read_block
        count = -(-nbytes // block_bytes)
        self._full = np.full(count, block_bytes, np.int64)
        if count:
            self._full[-1] = nbytes - (count - 1) * block_bytes
        self._filled = np.zeros(count, np.int64)
        self._digests: list[str | None] = [None] * count
        self._stale: set[int] = set()
        self._running: dict[int, list] = {}  # block -> [bytes hashed so far, xxh3_64 state]: in-order writes
        self._lock = threading.Lock()

    def wrote(self, start: int, data: memoryview, digest: int | None = None) -> None:
        """Data bytes [start, start + len(data)) were written with the contents ``data``. ``digest``: the
        xxh3_64 of ``data`` when the caller has it already (a chunk checked on arrival); it stands for the
        block's digest when ``data`` is exactly one whole block, which then is not hashed again."""
        length = data.nbytes
        if not length:
            return
        size = self.block_bytes
        first, last = start // size, (start + length - 1) // size
        known = digest if first == last and start == first * size and length == self._full[first] else None
        done = []
        with self._lock:
            for index in range(first, last + 1):
                lo, hi = max(start, index * size), min(start + length, index * size + int(self._full[index]))
                part = data[lo - start:hi - start]
                whole = lo == index * size and hi - lo == self._full[index]
                running = None if whole else self._follow(index, lo - index * size, part)
                self._filled[index] += hi - lo
                if self._filled[index] == self._full[index]:
                    done.append((index, part if whole else None, running))
                elif self._filled[index] > self._full[index]:
                    self._stale.add(index)
        for index, block, running in done:
            if known is not None and index == first:
                running = known  # data was this whole block, its digest known
            self._digests[index] = f"{running:016x}" if running is not None else self._hash(index, block)

    def _follow(self, index: int, at: int, part: memoryview) -> int | None:
        """Feed ``part`` (written at byte ``at`` of block ``index``) to the block's running hash when the block's
        writes so far came in order from its first byte; the block's digest once that makes it whole, else
        None. Called with the lock held, so the order of updates is the order of the writes."""
        running = self._running.get(index)
        if at == 0 and not self._filled[index]:
            running = self._running[index] = [0, xxhash.xxh3_64()]
        elif running is None or running[0] != at:
            self._running.pop(index, None)  # out of order: read back once complete
            return None
        running[1].update(part)
        running[0] += part.nbytes
        if running[0] < self._full[index]:
            return None
        del self._running[index]
        return running[1].intdigest()

    def wrote_runs(self, starts: np.ndarray, run: int) -> None:
        """Many runs of ``run`` bytes (each shorter than a block) were written at data offsets ``starts``."""
        size, count = self.block_bytes, len(self._full)
        starts = np.asarray(starts, np.int64)
        first = starts // size
        head = np.minimum(run, (first + 1) * size - starts)  # bytes in the first block; the rest in the next
        added = np.bincount(first, weights=head, minlength=count + 1)
        added[1:] += np.bincount(first + 1, weights=run - head, minlength=count + 1)[1:]
        with self._lock:
            before = self._filled.copy()
            self._filled += added[:count].astype(np.int64)
            done = np.nonzero((before < self._full) & (self._filled == self._full))[0]
            self._stale.update(int(i) for i in np.nonzero(self._filled > self._full)[0])
        for index in done:
            self._digests[int(index)] = self._hash(int(index), None)

    def forget(self) -> None:
        """The data may have been written behind the tally's back: hash every block again at the end."""
        with self._lock:
            self._stale.update(range(len(self._full)))

    def _hash(self, index: int, block: memoryview | None) -> str:
        if block is None:
            # One buffer per thread for every tally: a fresh (zeroed, page-faulted) block per shard file cost
            # about a tenth of a transformation that reads blocks back.
            block = thread_buffer(_SCRATCH, int(self._full[index]), self.block_bytes)
            self._read(index, block)
        return f"{xxhash.xxh3_64_intdigest(block):016x}"

    def digests(self) -> list[str]:
        """Every block's digest (hashing now the ones not complete, stale or never seen); call after the
        last write."""
        with self._lock:
            redo = [i for i, d in enumerate(self._digests) if d is None or i in self._stale]
            self._stale.clear()
        for index in redo:
            self._digests[index] = self._hash(index, None)
        return list(self._digests)  # type: ignore[arg-type]  # the loop above set every one


def slice_digests(source, start: int, nbytes: int, block_bytes: int = BLOCK_BYTES) -> list[str]:
    """Block digests of data bytes [start, start + nbytes) of a stored shard, as the blocks of a shard of their own
    (a slice row, ``VersionWriter.link``). ``source`` is the shard's ``shardfile.ShardFile`` (a row with block
    checksums). The range is read once, in one verified read (``CorruptShard`` on damage): its bytes reach the
    hashers only after their stored block was checked, so a slice never certifies unchecked bytes. A block that
    is one stored block takes the stored digest; any other is hashed as it is read."""
    count = -(-nbytes // block_bytes)
    known = [source.block_digest(start + i * block_bytes, min(block_bytes, nbytes - i * block_bytes))
             for i in range(count)]
    hashers = {i: xxhash.xxh3_64() for i, digest in enumerate(known) if digest is None}

    def feed(at: int, data: memoryview) -> None:
        """Hash ``data`` (slice bytes from ``at``) into the slice blocks it covers that need hashing."""
        while data.nbytes:
            index = at // block_bytes
            take = min(data.nbytes, (index + 1) * block_bytes - at)
            if index in hashers:
                hashers[index].update(data[:take])
            at, data = at + take, data[take:]

    source.read_into(start, None, nbytes, consume=feed if hashers else None)
    return [f"{hashers[i].intdigest() if digest is None else digest:016x}" for i, digest in enumerate(known)]
