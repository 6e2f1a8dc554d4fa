"""libfuse read replies (``struct fuse_bufvec``): record-file pieces of a view, or bytes in memory.

May import: numpy, the standard library and ``tenplex.dataset`` (format, view).

A read of a rank's ``data`` is answered with one (record file descriptor,
offset, length) piece per sample it overlaps; libfuse copies them from the
record files, so no sample passes through Python. libfuse frees the bufvec and
every memory buffer in it with free(), so all of it comes from malloc.

This runs once per read request, so it is kept cheap: ``PieceTable`` holds, per
sample of a view, its whole-sample piece (a ``struct fuse_buf``) in one array,
built once per generation; a request is two binary searches, one copy of the
pieces it overlaps and two edits (a 896 KiB request of 64 KiB samples: 9-15 us at
load ~12, against 30-34 us for the per-piece Python loop this replaced).
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
_POS = 32                                  # offset of ``pos`` in a buf (BUF above)
assert _PIECE.size == BUF.itemsize and BUF.fields is not None and BUF.fields["pos"][1] == _POS

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
    """Where the bytes of one rank's ``data`` live: one ready-made fd piece per (non-empty) sample."""

    def __init__(self, view: RankView, fds: np.ndarray):
        lengths = np.diff(view.data_offsets)
        keep = np.flatnonzero(lengths > 0)                       # empty samples have no piece
        # Each kept sample's start in data, then data's size: a sample ends where the next kept one starts.
        self.starts = np.append(view.data_offsets[keep], view.data_size).astype(np.int64)
        self.pieces = np.zeros(len(keep), dtype=BUF)             # (k,) whole-sample pieces, in view order
        self.pieces["size"], self.pieces["flags"] = lengths[keep], FD_FLAGS
        self.pieces["fd"] = fds[view.rows[keep, FILE]]
        self.pieces["pos"] = view.rows[keep, OFFSET]
        self._at = self.pieces.ctypes.data                       # the table outlives every reply built from it
        self.size = view.data_size

    def bufvec(self, offset: int, size: int) -> int:
        """A malloc'd bufvec of the fd pieces of ``data[offset : offset+size]`` (clipped to the file).

        One copy of the whole-sample pieces the read overlaps, then the first is cut at ``offset``
        and the last at the read's end: a few microseconds per request, whatever its size.
        """
        end = min(offset + size, self.size)
        if offset >= end:
            return _bufvec(0)[0]
        i0 = int(self.starts.searchsorted(offset, "right")) - 1  # the piece holding ``offset``
        i1 = int(self.starts.searchsorted(end, "left"))           # one past the piece holding ``end - 1``
        count = i1 - i0
        ptr = malloc(_HEADER.size + BUF.itemsize * count)
        ctypes.memmove(ptr, _HEADER.pack(count, 0, 0), _HEADER.size)
        first = ptr + _HEADER.size
        ctypes.memmove(first, self._at + BUF.itemsize * i0, BUF.itemsize * count)
        head, tail = offset - int(self.starts[i0]), int(self.starts[i1]) - end
        if head:
            ctypes.c_uint64.from_address(first).value -= head
            ctypes.c_int64.from_address(first + _POS).value += head
        if tail:
            ctypes.c_uint64.from_address(first + BUF.itemsize * (count - 1)).value -= tail
        return ptr
