"""Per-block checksums of shard data, and verified reads of stored shards with ``pread``.

May import: xxhash, this package's ``_safetensors`` and ``manifest``, ``tenplex.errors`` and the standard library.

Format (a manifest row's optional ``block_bytes`` and ``blocks``): the shard's
data (the safetensors payload, C order) is cut into blocks of ``block_bytes``
(``BLOCK_BYTES`` = 1 MiB; the last block may be shorter) and ``blocks`` lists
the xxh3_64 of each block as 16 hex digits. Such a row's ``xxh3`` is the
xxh3_64 of the concatenated 8-byte big-endian block digests
(:func:`root_digest`), so the whole-shard fingerprint costs no extra pass over
the data. A row without ``blocks`` (written before block checksums) carries the
xxh3_64 of its whole data; such a shard is verified whole the first time a
reader touches it.

1 MiB blocks keep a small read cheap (it hashes at most two partial blocks
besides its own bytes) while the per-block bookkeeping stays negligible
(1,024 digests per GiB, 20 KB of manifest).

Reads never memory-map a committed file: a file truncated under a map kills the
process with SIGBUS on the next access. :class:`ShardFile` opens the file for
each read, checks its size against the manifest and ``pread``s, so a bad file
fails only its own reads, with a :class:`CorruptShard` that names it.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable

import xxhash

from .manifest import CorruptShard, ShardEntry

BLOCK_BYTES = 1 << 20
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header


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
    ``opener(name, flags)`` opens a file of the version (relative to the version
    directory the reader opened, so a replaced version is never read by mistake)."""

    def __init__(self, entry: ShardEntry, opener: Callable[[str], int], where: str):
        self.entry, self._open, self.where = entry, opener, where
        self.data_offset: int | None = None
        self.whole_verified = False  # rows without blocks: verified once, whole

    def _fail(self, what: str) -> CorruptShard:
        return CorruptShard(f"{self.where}: {what}; the stored shard is damaged: read it from another replica, or "
                            f"delete this version")

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

    def _pread_into(self, fd: int, view: memoryview, offset: int) -> None:
        while view.nbytes:
            n = os.preadv(fd, [view], offset)
            if n <= 0:
                raise self._fail(f"truncated while reading (ended at data byte {offset - self.data_offset})")
            view, offset = view[n:], offset + n

    def _check(self, index: int, data) -> None:
        expected = self.entry.blocks[index]
        actual = f"{xxhash.xxh3_64_intdigest(data):016x}"
        if actual != expected:
            start = index * self.entry.block_bytes
            raise self._fail(f"block {index} (data bytes {start}-{start + len(data)}) has xxh3 {actual}, "
                             f"the manifest {expected}")

    def read_into(self, start: int, dest: memoryview, edges: dict | None = None) -> None:
        """Fill ``dest`` with data bytes [start, start + len(dest)), verifying every block they touch.

        Whole blocks are read straight into ``dest`` and hashed there; the (at most two) partial blocks at
        the ends are read whole into a scratch buffer. ``edges`` (a dict the caller keeps for consecutive
        reads of one shard) remembers verified partial blocks so the next read does not fetch them again."""
        dest = dest.cast("B") if dest.format != "B" else dest
        length = dest.nbytes
        if not length:
            return
        if start < 0 or start + length > self.entry.nbytes:
            raise ValueError(f"{self.where}: data bytes {start}-{start + length} outside 0-{self.entry.nbytes}")
        fd = self._open(self.entry.file)
        try:
            offset = self._check_size(fd)
            if self.entry.blocks is None:
                self._verify_whole(fd, offset)
                self._pread_into(fd, dest, offset + start)
                return
            size = self.entry.block_bytes
            end = start + length
            first, last = start // size, (end - 1) // size
            inner_lo = first if start % size == 0 else first + 1           # first whole block inside dest
            inner_hi = last if end % size == 0 or end == self.entry.nbytes else last - 1  # last whole one
            if inner_lo <= inner_hi:
                lo, hi = inner_lo * size, min((inner_hi + 1) * size, self.entry.nbytes)
                view = dest[lo - start:hi - start]
                self._pread_into(fd, view, offset + lo)
                for index in range(inner_lo, inner_hi + 1):
                    a = index * size - lo
                    self._check(index, view[a:a + size])
            for index in sorted({first, last}):
                if inner_lo <= index <= inner_hi:
                    continue
                block = self._edge(fd, offset, index, edges)
                lo, hi = max(start, index * size), min(end, (index + 1) * size)
                dest[lo - start:hi - start] = block[lo - index * size:hi - index * size]
        except FileNotFoundError:
            raise CorruptShard(f"{self.where}: the file is gone (the version was deleted meanwhile?)") from None
        finally:
            os.close(fd)

    def _edge(self, fd: int, offset: int, index: int, edges: dict | None) -> memoryview:
        if edges is not None and index in edges:
            return edges[index]
        size = self.entry.block_bytes
        block = memoryview(bytearray(min(size, self.entry.nbytes - index * size)))
        self._pread_into(fd, block, offset + index * size)
        self._check(index, block)
        if edges is not None:
            if len(edges) >= 4:
                edges.pop(next(iter(edges)))
            edges[index] = block
        return block

    def _verify_whole(self, fd: int, offset: int) -> None:
        if self.whole_verified:
            return
        digest = xxhash.xxh3_64()
        buffer = memoryview(bytearray(min(self.entry.nbytes, 16 << 20)))
        for lo in range(0, self.entry.nbytes, buffer.nbytes):
            view = buffer[:min(buffer.nbytes, self.entry.nbytes - lo)]
            self._pread_into(fd, view, offset + lo)
            digest.update(view)
        if f"{digest.intdigest():016x}" != self.entry.xxh3:
            raise self._fail(f"the whole shard has xxh3 {digest.intdigest():016x}, the manifest {self.entry.xxh3} "
                             f"(a version written without block checksums: verified whole)")
        self.whole_verified = True

    def verify(self) -> str | None:
        """Check every byte of the shard; a description of the first problem, or None."""
        try:
            if self.entry.blocks is None:
                fd = self._open(self.entry.file)
                try:
                    self.whole_verified = False
                    self._verify_whole(fd, self._check_size(fd))
                finally:
                    os.close(fd)
                return None
            step = self.entry.block_bytes * 16
            buffer = memoryview(bytearray(min(step, self.entry.nbytes)))
            for lo in range(0, self.entry.nbytes, step):
                self.read_into(lo, buffer[:min(step, self.entry.nbytes - lo)])
        except (CorruptShard, OSError) as e:
            return str(e)
        return None
