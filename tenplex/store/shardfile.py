"""Verified reads of one committed shard file with ``pread``.

May import: numpy, xxhash, this package's ``_buffers`` and ``manifest``, and the standard library.

Reads never memory-map a committed file: a file truncated under a map kills the
process with SIGBUS on the next access. :class:`ShardFile` opens the file for
each read, checks its size against the manifest and ``pread``s it piece by
piece, checking every block of ``tenplex.store.blocks`` the read touches, so a
bad file fails only its own reads, with a :class:`CorruptShard` that names it.
A slice row's data start ``file_start`` bytes into its file's data; its blocks
are its own (counted from that start).

A row written before block checksums (no ``blocks``) has one checksum, of the
whole data. The first read through a :class:`ShardFile` checks the whole file
against it and, in the same pass, hashes every ``_PIECE`` of it: those digests
are then the row's blocks, and every later read checks the blocks it touches,
as for a row written with blocks. Trusting the first check for later reads
would serve (and let a transformation commit, with fresh checksums) a byte
damaged on disk after it; re-reading the whole file on every read would cost
a whole-shard read per small read; a file's mtime or identity misses damage
that does not go through ``write`` (the medium, a restored mtime). Derived
digests are as good as the manifest's: they hash the bytes that matched it.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from typing import Callable

import numpy as np
import xxhash

from ._buffers import thread_buffer
from .manifest import CorruptShard, ShardEntry

_MAX_HEADER = 100 << 20  # safetensors' own limit on a header
_PIECE = 1 << 20  # reads go piece by piece: small enough to stay in the CPU cache between pread and hash
_scratch = threading.local()  # one piece buffer per thread, shared by every shard file (see ``_buffers``)


class ShardFile:
    """One committed shard file, read with ``pread`` and verified against its manifest row.

    ``where`` names the shard in errors (version, host, device, tensor, file).
    ``opener(name)`` opens a file of the version (relative to the version
    directory the reader opened, so a replaced version is never read by mistake).

    Reads go piece by piece (``_PIECE``, small enough to stay in the CPU cache):
    each piece is ``pread`` straight into the destination (or, at the ragged
    ends of a range and when the caller only verifies, into a per-thread
    buffer), then hashed into its block's digest while it is
    still in cache: verifying adds one hash of cached data to the read. A row
    without block checksums is verified whole on the first read through this
    object, which derives its block digests (see the module's docstring)."""

    def __init__(self, entry: ShardEntry, opener: Callable[[str], int], where: str):
        self.entry, self._open, self.where = entry, opener, where
        self.data_offset: int | None = None  # the file offset of the row's first data byte, once checked
        # (block bytes, digests): the row's, or for a row without blocks those derived by its first read
        self._grid: tuple[int, tuple[str, ...]] | None = \
            None if entry.blocks is None else (entry.block_bytes, tuple(entry.blocks))
        self._derived = entry.blocks is None

    def _fail(self, what: str) -> CorruptShard:
        return CorruptShard(f"{self.where}: {what}; the stored shard is damaged: read it from another replica, or "
                            f"delete this version")

    def _open_file(self) -> int:
        try:
            return self._open(self.entry.file)
        except FileNotFoundError:
            raise CorruptShard(f"{self.where}: the file is gone (deleted from the committed version)") from None

    def open_checked(self) -> tuple[int, int]:
        """Open the file and check its header and size (``CorruptShard`` otherwise): (descriptor, file offset of
        the row's first data byte); the caller closes the descriptor. For a sender that hands stored blocks to
        the kernel (``os.sendfile``) unread, and a receiver that checks them against their stored digests."""
        fd = self._open_file()
        try:
            return fd, self._check_size(fd)
        except BaseException:
            os.close(fd)
            raise

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
            entry = self.entry
            expected = entry.file_data_bytes
            if end - begin != expected:
                raise self._fail(f"safetensors header declares {end - begin} data bytes, the manifest "
                                 f"{expected}" + (" (the file of this slice)" if entry.is_slice else ""))
            self.data_offset = 8 + n + begin + entry.file_start  # a slice row's data starts inside the file's
        if size < self.data_offset + self.entry.nbytes:
            raise self._fail(f"truncated: {size} bytes, the data needs {self.data_offset + self.entry.nbytes}")
        return self.data_offset

    @staticmethod
    def _piece_buffer() -> memoryview:
        return thread_buffer(_scratch, _PIECE)

    def _pread(self, fd: int, view: memoryview, offset: int) -> None:
        while view.nbytes:
            n = os.preadv(fd, [view], offset)
            if n <= 0:
                raise self._fail(f"truncated while reading (ended at data byte {offset - (self.data_offset or 0)})")
            view, offset = view[n:], offset + n

    def read_into(self, start: int, dest: memoryview | None, length: int | None = None, verified: set | None = None,
                  digest=None, consume: Callable[[int, memoryview], None] | None = None) -> int:
        """Read data bytes [start, start + length) (``length`` defaults to ``len(dest)``) into ``dest``,
        verifying every block they touch; return the file offset of ``start``.

        ``dest`` None: only verify. ``digest``: an
        ``xxhash.xxh3_64`` fed the bytes in order (a frame checksum at no extra pass). ``verified``: a set
        the caller keeps over consecutive reads of one request; blocks in it are not read outside the
        range again, and the blocks verified here are added. ``consume(offset from start, bytes)``: called
        with each piece's bytes of the range while they are in cache."""
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
            return self._scan(fd, start, end, dest, verified, digest, consume)
        finally:
            os.close(fd)

    def block_digest(self, start: int, length: int) -> int | None:
        """The stored xxh3_64 of data bytes [start, start + length) when they are exactly one checksum block of
        this shard (a row with block checksums), else None: a frame that is one block needs no checksum of
        its own, and the reader checks the bytes against the digest from the time they were committed."""
        if self._derived or self._grid is None or length <= 0:
            return None
        size, blocks = self._grid
        if start % size or length != min(size, self.entry.nbytes - start):
            return None
        return int(blocks[start // size], 16)

    def read_rows(self, start: int, stride: int, out: np.ndarray, verified: set | None = None) -> None:
        """Read ``len(out)`` rows of ``out.shape[1]`` data bytes, the first at ``start`` and each ``stride`` bytes after
        the one before, into the rows of ``out`` (a writable uint8 array, any row stride), verifying every
        block the rows' span touches (``verified``: see :meth:`read_into`). Each piece is copied from the piece
        buffer while it is in cache: one pass, no buffer of the span."""
        rows, run = out.shape
        if not rows or not run:
            return

        def scatter(lo: int, view: memoryview) -> None:
            """Copy the parts of rows that lie in span bytes [lo, lo + len(view)) from ``view``."""
            hi = lo + view.nbytes
            first, last = max(0, (lo - run) // stride + 1), min(rows - 1, (hi - 1) // stride)
            whole_first = -(-lo // stride)
            whole_last = min(last, (hi - run) // stride) if hi >= run else -1
            piece = np.frombuffer(view, np.uint8)
            if whole_first <= whole_last:
                n = whole_last - whole_first + 1
                out[whole_first:whole_last + 1] = np.lib.stride_tricks.as_strided(
                    piece[whole_first * stride - lo:], (n, run), (stride, 1), writeable=False)
            cut = {r for r in (first, last) if not whole_first <= r <= whole_last}  # rows cut by the piece's ends
            for r in cut:
                a, b = max(r * stride, lo), min(r * stride + run, hi)
                if a < b:
                    out[r, a - r * stride:b - r * stride] = piece[a - lo:b - lo]

        self.read_into(start, None, (rows - 1) * stride + run, verified, consume=scatter)

    def _scan(self, fd: int, start: int, end: int, dest: memoryview | None, verified: set | None, digest,
              consume: Callable[[int, memoryview], None] | None) -> int:
        """Stream data bytes [start, end) through the piece buffer: verify, copy, digest (see read_into), and
        hand each piece's wanted bytes to ``consume(offset from start, bytes)`` while they are in cache. A
        block of one piece (blocks of up to ``_PIECE``: 1 MiB, the default) is checked before its bytes are
        copied, digested or consumed; a larger one only after its last piece."""
        verified = set() if verified is None else verified
        offset = self._check_size(fd)
        size, blocks = self._grid if self._grid is not None else self._derive(fd, offset)
        scratch = self._piece_buffer()
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
                view = dest[piece - start:piece_end - start] if dest is not None and inside else \
                    scratch[:piece_end - piece]
                self._pread(fd, view, offset + piece)
                if hasher is not None:
                    hasher.update(view)
                    if piece_end == hi:  # the block's last piece: check it before its bytes go anywhere else
                        actual = f"{hasher.intdigest():016x}"
                        if actual != blocks[index]:
                            raise self._fail(self._mismatch(index, size, blocks[index], actual))
                        verified.add(index)
                a, b = max(piece, start), min(piece_end, end)
                if a < b:
                    if dest is not None and not inside:
                        dest[a - start:b - start] = view[a - piece:b - piece]
                    if digest is not None:
                        digest.update(view[a - piece:b - piece])
                    if consume is not None:
                        consume(a - start, view[a - piece:b - piece])
        return offset + start

    def _derive(self, fd: int, offset: int) -> tuple[int, tuple[str, ...]]:
        """Check the whole data of a row without blocks against its checksum, hashing each ``_PIECE`` of it on
        the way; keep and return (``_PIECE``, those digests) as the row's blocks."""
        scratch = self._piece_buffer()
        whole, blocks = xxhash.xxh3_64(), []
        for piece in range(0, self.entry.nbytes, _PIECE):
            view = scratch[:min(_PIECE, self.entry.nbytes - piece)]
            self._pread(fd, view, offset + piece)
            whole.update(view)
            blocks.append(xxhash.xxh3_64_hexdigest(view))
        if whole.hexdigest() != self.entry.xxh3:
            raise self._fail(f"the whole shard has xxh3 {whole.hexdigest()}, the manifest {self.entry.xxh3} (a "
                             f"version written without block checksums: verified whole)")
        self._grid = (_PIECE, tuple(blocks))
        return self._grid

    def _mismatch(self, index: int, size: int, expected: str, actual: str) -> str:
        start = index * size
        source = ("the digest derived when the whole shard last matched the manifest (a version written without "
                  "block checksums)") if self._derived else "the manifest"
        return (f"block {index} (data bytes {start}-{min(start + size, self.entry.nbytes)}) has xxh3 {actual}, "
                f"{source} {expected}")

    def verify(self) -> str | None:
        """Check every byte of the shard (a row without blocks against its whole checksum again); a description
        of the first problem, or None."""
        try:
            if not self._derived:
                self.read_into(0, None, self.entry.nbytes)
                return None
            fd = self._open_file()
            try:
                self._derive(fd, self._check_size(fd))
            finally:
                os.close(fd)
        except (CorruptShard, OSError) as e:
            return str(e)
        return None
