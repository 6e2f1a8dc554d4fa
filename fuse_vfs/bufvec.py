"""libfuse read replies (``struct fuse_bufvec``): record-file pieces of a view, or bytes in memory.

May import: numpy, the standard library and ``tenplex.dataset`` (format, view).

A read of a rank's ``data`` is answered with one (record file descriptor,
offset, length) piece per sample it overlaps; libfuse copies them from the
record files, so no sample passes through Python. libfuse frees the bufvec and
every memory buffer in it with free(), so all of it comes from malloc.

This runs once per read request, so it is kept cheap: ``PieceTable`` holds, per
sample of a view, the descriptor and record-file offset as flat arrays, built
once per generation; a request is two binary searches plus, for the usual few
pieces, a short Python loop (numpy's per-call overhead would cost more there).
"""

from __future__ import annotations

import ctypes
import errno
import struct

import numpy as np

from tenplex.dataset.format import FILE, OFFSET
from tenplex.dataset.view import RankView

# struct fuse_buf (fuse_common.h): size_t size; int flags; void *mem; int fd; off_t pos.
BUF = np.dtype({"names": ["size", "flags", "mem", "fd", "pos"],
                "formats": ["<u8", "<i4", "<u8", "<i4", "<i8"],
                "offsets": [0, 8, 16, 24, 32], "itemsize": 40})
_PIECE = struct.Struct("<Qi4xQi4xq")
_HEADER = struct.Struct("<QQQ")            # struct fuse_bufvec: size_t count, idx, off; then the bufs inline
FD_FLAGS = (1 << 1) | (1 << 2) | (1 << 3)  # FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK | FUSE_BUF_FD_RETRY
_LOOP_MAX = 32                             # more pieces than this: numpy is faster than a Python loop
assert _PIECE.size == BUF.itemsize

_libc = ctypes.CDLL(None, use_errno=True)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]


def malloc(n: int) -> int:
    ptr = _libc.malloc(max(n, 1))
    if not ptr:
        raise OSError(errno.ENOMEM, "out of memory for a FUSE read reply")
    return ptr


def _bufvec(count: int) -> tuple[int, ctypes.Array]:
    """A malloc'd bufvec for ``count`` bufs, and a writable view of it."""
    n = _HEADER.size + BUF.itemsize * max(count, 1)
    ptr = malloc(n)
    mem = (ctypes.c_char * n).from_address(ptr)
    _HEADER.pack_into(mem, 0, count, 0, 0)
    return ptr, mem


def array_bufvec(bufs: np.ndarray) -> int:
    """A bufvec holding the ``BUF`` records ``bufs``."""
    ptr, _ = _bufvec(len(bufs))
    if len(bufs):
        ctypes.memmove(ptr + _HEADER.size, bufs.ctypes.data, bufs.nbytes)
    return ptr


def memory_bufvec(data: bytes) -> int:
    """A bufvec of one malloc'd copy of ``data`` (no buf when empty)."""
    if not data:
        return _bufvec(0)[0]
    ptr, mem = _bufvec(1)
    copy = malloc(len(data))
    ctypes.memmove(copy, data, len(data))
    _PIECE.pack_into(mem, _HEADER.size, len(data), 0, copy, 0, 0)
    return ptr


class PieceTable:
    """Where the bytes of one rank's ``data`` live: each sample's record-file descriptor and offset."""

    def __init__(self, view: RankView, fds: np.ndarray):
        self.starts = view.data_offsets                          # (n + 1,) each sample's start in data, then its size
        self.fds = fds[view.rows[:, FILE]].astype(np.int64)      # (n,) descriptor of each sample's record file
        self.pos = np.ascontiguousarray(view.rows[:, OFFSET])    # (n,) each sample's offset in that file
        self.size = view.data_size

    def bufvec(self, offset: int, size: int) -> int:
        """A malloc'd bufvec of the fd pieces of ``data[offset : offset+size]`` (clipped to the file)."""
        end = min(offset + size, self.size)
        if offset >= end:
            return _bufvec(0)[0]
        i0 = int(self.starts.searchsorted(offset, "right")) - 1  # the sample holding ``offset``
        i1 = int(self.starts.searchsorted(end, "left"))           # the first sample at or after ``end``
        if i1 - i0 > _LOOP_MAX:
            return self._array_bufvec(i0, i1, offset, end)
        starts = self.starts[i0:i1 + 1].tolist()
        fds, pos = self.fds[i0:i1].tolist(), self.pos[i0:i1].tolist()
        ptr, mem = _bufvec(i1 - i0)
        at, count = _HEADER.size, 0
        for j in range(i1 - i0):
            lo, hi = max(starts[j], offset), min(starts[j + 1], end)
            if hi > lo:  # empty samples have no piece
                _PIECE.pack_into(mem, at, hi - lo, FD_FLAGS, 0, fds[j], pos[j] + lo - starts[j])
                at, count = at + BUF.itemsize, count + 1
        if count != i1 - i0:
            _HEADER.pack_into(mem, 0, count, 0, 0)
        return ptr

    def _array_bufvec(self, i0: int, i1: int, offset: int, end: int) -> int:
        starts = self.starts[i0:i1 + 1]                           # (k + 1,) for the k samples i0..i1-1
        lo = np.maximum(starts[:-1], offset)
        hi = np.minimum(starts[1:], end)
        keep = hi > lo                                            # (k,) drops empty samples
        bufs = np.zeros(int(keep.sum()), dtype=BUF)
        bufs["size"], bufs["flags"] = (hi - lo)[keep], FD_FLAGS
        bufs["fd"] = self.fds[i0:i1][keep]
        bufs["pos"] = (self.pos[i0:i1] + lo - starts[:-1])[keep]
        return array_bufvec(bufs)
