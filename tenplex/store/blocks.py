"""Per-block checksums of shard data, and verified reads of stored shards with ``pread``.

May import: numpy, xxhash, this package's ``manifest`` and the standard library.

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
(1,024 digests per GiB, 20 KB of manifest).

Reads never memory-map a committed file: a file truncated under a map kills the
process with SIGBUS on the next access. :class:`ShardFile` opens the file for
each read, checks its size against the manifest and ``pread``s it piece by
piece through a small buffer, so a bad file fails only its own reads, with a
:class:`CorruptShard` that names it.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import xxhash

from .manifest import CorruptShard, ShardEntry

BLOCK_BYTES = 1 << 20
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header
_PIECE = 1 << 20  # reads go through a buffer this big: it stays in the CPU cache between pread, hash and copy


def block_digests(data, block_bytes: int = BLOCK_BYTES) -> list[str]:
    """xxh3_64 of each ``block_bytes`` block of ``data`` (a bytes-like object), as 16 hex digits each."""
    view = memoryview(data).cast("B")
    return [f"{xxhash.xxh3_64_intdigest(view[i:i + block_bytes]):016x}" for i in range(0, view.nbytes, block_bytes)]


def root_digest(blocks: list[str]) -> str:
    """The shard's ``xxh3``: xxh3_64 of the concatenated 8-byte big-endian block digests."""
    return f"{xxhash.xxh3_64_intdigest(bytes.fromhex(''.join(blocks))):016x}"


class ShardFile:
    """One committed shard file, read with ``pread`` and verified against its manifest row.

    ``where`` names the shard in errors (version, host, device, tensor, file).
    ``opener(name)`` opens a file of the version (relative to the version
    directory the reader opened, so a replaced version is never read by mistake).

    Reads go piece by piece (``_PIECE``, small enough to stay in the CPU cache):
    each piece is ``pread`` straight into the destination (or, at the ragged
    ends of a range and when the caller only verifies before a ``sendfile``,
    into a per-thread buffer), then hashed into its block's digest while it is
    still in cache, so verifying costs little more than the read itself. A row without block checksums counts as one block: the whole shard is
    verified on the first read through this object, later reads trust it."""

    def __init__(self, entry: ShardEntry, opener: Callable[[str], int], where: str):
        self.entry, self._open, self.where = entry, opener, where
        self.data_offset: int | None = None
        if entry.blocks is None:  # written before block checksums: one block, the whole data
            self._size, self._blocks = max(entry.nbytes, 1), (entry.xxh3,)
        else:
            self._size, self._blocks = entry.block_bytes, entry.blocks
        self._trusted: set[int] = set()  # legacy rows: block 0 once verified
        self._scratch = threading.local()

    def _fail(self, what: str) -> CorruptShard:
        return CorruptShard(f"{self.where}: {what}; the stored shard is damaged: read it from another replica, or "
                            f"delete this version")

    def _open_file(self) -> int:
        try:
            return self._open(self.entry.file)
        except FileNotFoundError:
            raise CorruptShard(f"{self.where}: the file is gone (deleted from the committed version)") from None

    def _check_size(self, fd: int) -> int:
        """The data offset, after checking the header and that the file holds all of the data."""
        size = os.fstat(fd).st_size
        if self.data_offset is None:
            prefix = os.pread(fd, 8, 0)
            if len(prefix) != 8:
                raise self._fail(f"truncated to {size} bytes (no safetensors header)")
            (n,) = struct.unpack("<Q", prefix)
            if n > _MAX_HEADER or 8 + n > size:
                raise self._fail(f"safetensors header length {n} does not fit the file of {size} bytes")
            try:
                header = json.loads(os.pread(fd, n, 8))
                key = header[self.entry.tensor]
                begin, end = key["data_offsets"]
            except (ValueError, KeyError, TypeError) as e:
                raise self._fail(f"unreadable safetensors header ({type(e).__name__}: {e})") from None
            if end - begin != self.entry.nbytes:
                raise self._fail(f"safetensors header declares {end - begin} data bytes, the manifest "
                                 f"{self.entry.nbytes}")
            self.data_offset = 8 + n + begin
        if size < self.data_offset + self.entry.nbytes:
            raise self._fail(f"truncated: {size} bytes, the data needs {self.data_offset + self.entry.nbytes}")
        return self.data_offset

    def _piece_buffer(self) -> memoryview:
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None:
            buffer = self._scratch.buffer = memoryview(bytearray(_PIECE))
        return buffer

    def _pread(self, fd: int, view: memoryview, offset: int) -> None:
        while view.nbytes:
            n = os.preadv(fd, [view], offset)
            if n <= 0:
                raise self._fail(f"truncated while reading (ended at data byte {offset - self.data_offset})")
            view, offset = view[n:], offset + n

    def read_into(self, start: int, dest: memoryview | None, length: int | None = None, verified: set | None = None,
                  digest=None) -> int:
        """Read data bytes [start, start + length) (``length`` defaults to ``len(dest)``) into ``dest``,
        verifying every block they touch; return the file offset of ``start``.

        ``dest`` None: only verify (the caller sends the bytes from the file itself). ``digest``: an
        ``xxhash.xxh3_64`` fed the bytes in order (a frame checksum at no extra pass). ``verified``: a set
        the caller keeps over consecutive reads of one request; blocks in it are not read outside the
        range again, and the blocks verified here are added."""
        if dest is not None:
            dest = dest.cast("B") if dest.format != "B" else dest
            length = dest.nbytes
        if not length:
            return 0
        end = start + length
        if start < 0 or end > self.entry.nbytes:
            raise ValueError(f"{self.where}: data bytes {start}-{end} outside 0-{self.entry.nbytes}")
        fd = self._open_file()
        try:
            return self._scan(fd, start, end, dest, verified, digest)
        finally:
            os.close(fd)

    @contextmanager
    def verified_range(self, start: int, length: int, verified: set | None = None, digest=None) -> Iterator[int]:
        """Verify data bytes [start, start + length) (see :meth:`read_into`, without a destination) and yield
        an open descriptor of the file, to send the range from with ``os.sendfile`` at ``file_offset(start)``."""
        fd = self._open_file()
        try:
            self._scan(fd, start, start + length, None, verified, digest)
            yield fd
        finally:
            os.close(fd)

    def file_offset(self, start: int) -> int:
        """Where data byte ``start`` lies in the file (after a read or verification found the header)."""
        return self.data_offset + start

    def _scan(self, fd: int, start: int, end: int, dest: memoryview | None, verified: set | None, digest) -> int:
        """Stream data bytes [start, end) through the piece buffer: verify, copy, digest (see read_into)."""
        verified = self._trusted if self.entry.blocks is None else (set() if verified is None else verified)
        offset = self._check_size(fd)
        scratch = self._piece_buffer()
        size = self._size
        for index in range(start // size, (end - 1) // size + 1):
            lo, hi = index * size, min((index + 1) * size, self.entry.nbytes)
            check = index not in verified
            if not check:
                lo, hi = max(lo, start), min(hi, end)  # read only what the caller wants
            hasher = xxhash.xxh3_64() if check else None
            for piece in range(lo, hi, _PIECE):
                piece_end = min(piece + _PIECE, hi)
                inside = dest is not None and start <= piece and piece_end <= end
                # a piece the caller wants whole goes straight into its destination, else through the buffer
                view = dest[piece - start:piece_end - start] if inside else scratch[:piece_end - piece]
                self._pread(fd, view, offset + piece)
                if hasher is not None:
                    hasher.update(view)
                a, b = max(piece, start), min(piece_end, end)
                if a < b:
                    if dest is not None and not inside:
                        dest[a - start:b - start] = view[a - piece:b - piece]
                    if digest is not None:
                        digest.update(view[a - piece:b - piece])
            if hasher is not None:
                actual = f"{hasher.intdigest():016x}"
                if actual != self._blocks[index]:
                    raise self._fail(self._mismatch(index, actual))
                verified.add(index)
        return offset + start

    def _mismatch(self, index: int, actual: str) -> str:
        if self.entry.blocks is None:
            return (f"the whole shard has xxh3 {actual}, the manifest {self.entry.xxh3} (a version written "
                    f"without block checksums: verified whole)")
        start = index * self._size
        return (f"block {index} (data bytes {start}-{min(start + self._size, self.entry.nbytes)}) has xxh3 "
                f"{actual}, the manifest {self._blocks[index]}")

    def verify(self) -> str | None:
        """Check every byte of the shard; a description of the first problem, or None."""
        self._trusted.clear()
        try:
            self.read_into(0, None, self.entry.nbytes)
        except (CorruptShard, OSError) as e:
            return str(e)
        return None


class BlockTally:
    """Block digests of a shard being written in any order and from several threads, each computed once the
    block is complete: from the written bytes when one write covers the whole block, else by reading the
    block back (``read_block(index, view)``, from the page cache). Blocks written more than once (overlapping
    writes) or through a map the tally cannot see (:meth:`forget`) are hashed again by :meth:`digests`."""

    def __init__(self, nbytes: int, read_block: Callable[[int, memoryview], None], block_bytes: int = BLOCK_BYTES):
        self.nbytes, self.block_bytes, self._read = nbytes, block_bytes, read_block
        count = -(-nbytes // block_bytes)
        self._full = np.full(count, block_bytes, np.int64)
        if count:
            self._full[-1] = nbytes - (count - 1) * block_bytes
        self._filled = np.zeros(count, np.int64)
        self._digests: list[str | None] = [None] * count
        self._stale: set[int] = set()
        self._lock = threading.Lock()
        self._scratch = threading.local()

    def wrote(self, start: int, data: memoryview) -> None:
        """Data bytes [start, start + len(data)) were written with the contents ``data``."""
        length = data.nbytes
        if not length:
            return
        size = self.block_bytes
        first, last = start // size, (start + length - 1) // size
        done = []
        with self._lock:
            for index in range(first, last + 1):
                lo, hi = max(start, index * size), min(start + length, index * size + int(self._full[index]))
                self._filled[index] += hi - lo
                if self._filled[index] == self._full[index]:
                    whole = lo == index * size and hi - lo == self._full[index]
                    done.append((index, data[lo - start:hi - start] if whole else None))
                elif self._filled[index] > self._full[index]:
                    self._stale.add(index)
        for index, block in done:
            self._digests[index] = self._hash(index, block)

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
            scratch = getattr(self._scratch, "buffer", None)
            if scratch is None or len(scratch) < self._full[index]:
                scratch = self._scratch.buffer = bytearray(self.block_bytes)
            block = memoryview(scratch)[:int(self._full[index])]
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
        return list(self._digests)
