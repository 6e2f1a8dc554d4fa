"""A new shard file being filled region by region.

May import: numpy, xxhash, ``tenplex.box``,
``tenplex.dtypes``, ``tenplex.errors``, ``_safetensors`` and the standard library.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import xxhash

from . import _safetensors as st
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
    """

    _MIN_RUN = 64 << 10  # below this, per-run system calls cost more than page faults

    def __init__(self, path: Path, data_offset: int, box: Box, dtype: str):
        self.path, self.data_offset, self.box, self.dtype = path, data_offset, box, dtype
        self.itemsize = itemsize(dtype)
        self._fd = os.open(path, os.O_RDWR)
        self._array: np.ndarray | None = None
        # byte stride of each dimension within the shard (C order)
        strides, step = [], self.itemsize
        for n in reversed(box.lengths):
            strides.append(step)
            step *= n
        self._strides = tuple(reversed(strides))

    @property
    def array(self) -> np.ndarray:
        """The whole shard as a writable memory map (created on first use)."""
        if self._array is None:
            self._array = st.map_array(self.path, self.data_offset, self.dtype, self.box.lengths, writable=True)
        return self._array

    def write(self, region: Box, data) -> None:
        """Store ``data`` (C-order bytes or an array of region.lengths) as ``region`` (global coordinates)."""
        local = region.local(self.box)
        buffer = memoryview(np.ascontiguousarray(data).reshape(-1)).cast("B") if isinstance(data, np.ndarray) \
            else memoryview(data).cast("B")
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
            storage = np.frombuffer(buffer, dtype=self.array.dtype).reshape(region.lengths)
            self.array[local.slices()] = storage
            return
        base = self.data_offset + sum(o * s for o, s in zip(local.offsets, self._strides))
        outer = [range(n) for n in local.lengths[:inner]]
        for i, index in enumerate(itertools.product(*outer)):
            offset = base + sum(j * s for j, s in zip(index, self._strides))
            self._pwrite(buffer[i * run:(i + 1) * run], offset)

    def reserve(self) -> None:
        """Allocate the file's space now (fails early on a full disk); safe while others write."""
        st.reserve_space(self._fd, self.data_offset + self.box.volume * self.itemsize)

    def _pwrite(self, view: memoryview, offset: int) -> None:
        while view.nbytes:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def finish(self) -> str:
        """fsync and close; return the data's checksum."""
        self._array = None
        os.fsync(self._fd)  # on Linux this also writes pages dirtied through the shared map
        self.close()
        data = st.map_array(self.path, self.data_offset, self.dtype, self.box.lengths)
        return checksum(memoryview(np.ascontiguousarray(data).reshape(-1)).cast("B")) if data.size else checksum(b"")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
