"""A new shard file being filled region by region.

May import: numpy, xxhash, ``tenplex.box``, ``tenplex.dtypes``, ``tenplex.errors``, this package's
``_safetensors``, ``_descriptor`` and ``blocks``, and the standard library.

Threads write regions of one shard at once (the transformer's pulls), one more
reserves its space, and the thread that lands the last region finishes it: the
file's descriptor is a ``SharedDescriptor``, so a finish or release closes it
once, after the writes and the reservation under way.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import xxhash

from . import _safetensors as st
from ._descriptor import SharedDescriptor
from .blocks import BlockTally
from ..box import Box
from ..dtypes import itemsize
from ..errors import StoreError


def checksum(data) -> str:
    """xxh3_64 of a bytes-like object, as 16 hex digits (used for shards and chunks)."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


class ShardTarget:
    """A new shard file being filled region by region (by the transformer, from the network or local copies).

    ``write`` puts a region's C-order bytes straight into the file with
    ``pwrite`` when the region is made of long contiguous runs of the file,
    which avoids a page fault per 4 KiB page that writing through a memory map
    costs (notably on tmpfs); short runs go through a writable memory map.
    Each write feeds the block checksums (``BlockTally``), so ``finish`` has
    (almost) nothing left to hash.
    """

    _MIN_RUN = 64 << 10  # below this, per-run system calls cost more than page faults

    def __init__(self, path: Path, data_offset: int, box: Box, dtype: str):
        self.path, self.data_offset, self.box, self.dtype = path, data_offset, box, dtype
        self.itemsize = itemsize(dtype)
        self._file = SharedDescriptor(os.open(path, os.O_RDWR), self._finished_error,
                                      reopen=lambda: os.open(path, os.O_RDWR))
        self._array: np.ndarray | None = None
        self._blocks: list[str] | None = None  # set by finish()
        self._strides = st.c_strides(box.lengths, self.itemsize)  # byte stride of each dimension (C order)
        self._tally = BlockTally(box.volume * self.itemsize, self._read_block)

    def _map(self) -> np.ndarray:
        if self._array is None:
            self._array = st.map_array(self.path, self.data_offset, self.dtype, self.box.lengths, writable=True)
        return self._array

    @property
    def array(self) -> np.ndarray:
        """The whole shard as a writable memory map (created on first use); what is written through it is
        hashed at ``finish``."""
        self._tally.forget()
        return self._map()

    def read(self, region: Box) -> np.ndarray:
        """A read-only view of region ``region`` (global coordinates) as written so far. Safe from any thread,
        also after ``finish`` (the local fan-out reads regions of shards that are already finished)."""
        array = self._array
        if array is None:
            array = st.map_array(self.path, self.data_offset, self.dtype, self.box.lengths, writable=False)
        view = array[region.local(self.box).slices()]
        view.flags.writeable = False
        return view

    def _read_block(self, index: int, view: memoryview) -> None:
        offset = self.data_offset + index * self._tally.block_bytes
        with self._file.use() as fd:
            while view.nbytes:
                n = os.preadv(fd, [view], offset)
                if n <= 0:
                    raise StoreError(f"{self.path}: short read of block {index} while checksumming it")
                view, offset = view[n:], offset + n

    def write(self, region: Box, data, digest: int | None = None) -> None:
        """Store ``data`` (C-order bytes or an array of region.lengths) as ``region`` (global coordinates).
        ``digest``: the xxh3_64 of ``data`` when known (a chunk checked on arrival); spares hashing it again
        when the region is one whole checksum block of this shard."""
        local = region.local(self.box)
        buffer = memoryview(np.ascontiguousarray(data).reshape(-1)).cast("B") if isinstance(data, np.ndarray) \
            else memoryview(data).cast("B")
        if self._blocks is not None:
            raise StoreError(f"shard {self.path.name} was already finished; region {region} cannot be written")
        if buffer.nbytes != region.volume * self.itemsize:
            raise StoreError(f"region {region} needs {region.volume * self.itemsize} bytes, got {buffer.nbytes}")
        if region.is_empty():
            return
        # Dimensions after `inner` are whole in the shard, so each run spans dims inner.. contiguously.
        inner = self.box.ndim - 1
        while inner > 0 and local.lengths[inner] == self.box.lengths[inner]:
            inner -= 1
        run = local.lengths[inner] * self._strides[inner] if self.box.ndim else self.itemsize
        if run < self._MIN_RUN:
            # Allocate the span first: a store of a sparse file through a memory map on a full disk
            # would kill the process with SIGBUS; posix_fallocate fails with ENOSPC instead.
            first, span = st.c_span(self._strides, local.offsets, local.lengths, self.itemsize)
            with self._file.use() as fd:
                st.reserve_space(fd, span, self.data_offset + first)
            array = self._map()
            array[local.slices()] = np.frombuffer(buffer, dtype=array.dtype).reshape(region.lengths)
            starts = np.array([first], np.int64)  # data offset of every run: the outer dims' index grid
            for d in range(inner):
                starts = (starts[:, None] + np.arange(local.lengths[d], dtype=np.int64) * self._strides[d]).ravel()
            self._tally.wrote_runs(starts, run)
            return
        base = sum(o * s for o, s in zip(local.offsets, self._strides))
        outer = [range(n) for n in local.lengths[:inner]]
        whole = digest if run == buffer.nbytes else None  # the digest is of all of data: of one run only
        for i, index in enumerate(itertools.product(*outer)):
            offset = base + sum(j * s for j, s in zip(index, self._strides))
            piece = buffer[i * run:(i + 1) * run]
            self._pwrite(piece, self.data_offset + offset)
            self._tally.wrote(offset, piece, whole)

    def run_offset(self, region: Box) -> int | None:
        """The data offset of ``region`` (global coordinates) when its bytes are one contiguous run of this shard
        (C order: leading dimensions of length 1, then one partial dimension, then whole ones), else None."""
        if region.is_empty():
            return None
        local = region.local(self.box)
        start, span = st.c_span(self._strides, local.offsets, local.lengths, self.itemsize)
        return start if span == region.volume * self.itemsize else None

    def write_at(self, offset: int, data: memoryview, digest: int | None = None) -> None:
        """Store raw bytes at data offset ``offset`` (part of a run that :meth:`run_offset` found); feeds the
        block checksums like :meth:`write` (``digest`` likewise)."""
        if self._blocks is not None:
            raise StoreError(f"shard {self.path.name} was already finished; bytes at {offset} cannot be written")
        if offset < 0 or offset + data.nbytes > self.box.volume * self.itemsize:
            raise StoreError(f"bytes {offset}-{offset + data.nbytes} lie outside shard {self.path.name}")
        self._pwrite(data, self.data_offset + offset)
        self._tally.wrote(offset, data, digest)

    def reserve(self) -> None:
        """Allocate the file's space now (fails early on a full disk); safe while others write, and nothing to
        do once the shard is finished (all of it was written)."""
        try:
            with self._file.use() as fd:
                st.reserve_space(fd, self.data_offset + self.box.volume * self.itemsize)
        except _Finished:
            pass

    def _pwrite(self, view: memoryview, offset: int) -> None:
        with self._file.use() as fd:
            while view.nbytes:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written

    def finish(self) -> list[str]:
        """fsync and close; return the data's block checksums (``blocks``). Later calls return the same list
        (the transformer finishes a shard as soon as its last region lands; ``prepare`` then reuses it)."""
        if self._blocks is not None:
            return self._blocks
        self._array = None
        with self._file.use() as fd:
            os.fsync(fd)  # on Linux this also writes pages dirtied through the shared map
        try:
            self._blocks = self._tally.digests()
            return self._blocks
        finally:
            self.close()

    def _finished_error(self) -> StoreError:
        return _Finished(f"shard {self.path.name} was finished (or discarded); its file is closed")

    def release(self) -> None:
        """Close the file and its map until the next write (a filled shard waiting for ``prepare`` holds no
        descriptor); what was written stays, and so do the block checksums computed so far."""
        self._array = None
        self._file.release()

    def close(self) -> None:
        """Close the file for good (after the writes under way); any thread, any number of times."""
        self._file.close()


class _Finished(StoreError):
    """The shard's file was closed for good (finished or discarded)."""
