"""Single-tensor safetensors files that can be filled and read through a memory map.

May import: numpy, ``tenplex.dtypes``, ``tenplex.errors`` and the standard library.

The file format is safetensors' own (8-byte little-endian header length, a
JSON header, then the raw little-endian data), so ``safetensors.safe_open``
reads every shard file (a slice row's file holds the old shard it is part of:
its manifest row says which bytes are the row's). We write it ourselves because the transformer must
allocate a shard first and fill it region by region straight from the
network, which the safetensors library cannot do. The header is padded with
spaces so the data starts at a 64-byte boundary (aligned memory maps).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from ..dtypes import itemsize, numpy_storage
from ..errors import StoreError

# tenplex dtype name -> safetensors dtype code.
SAFETENSORS_DTYPE = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}
TENPLEX_DTYPE = {code: name for name, code in SAFETENSORS_DTYPE.items()}
_ALIGN = 64


def header_bytes(key: str, dtype: str, shape: tuple[int, ...], metadata: dict[str, str]) -> bytes:
    """The header (length prefix included) of a file holding one tensor ``key``."""
    nbytes = itemsize(dtype) * int(np.prod(shape, dtype=np.int64))
    header = {"__metadata__": metadata,
              key: {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [0, nbytes]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    pad = (-(8 + len(text))) % _ALIGN
    text += b" " * pad
    return struct.pack("<Q", len(text)) + text


def create(path: Path, key: str, dtype: str, shape: tuple[int, ...], metadata: dict[str, str],
           reserve: bool = True) -> tuple[int, int]:
    """Create a zero-filled file for one tensor; return (data offset, data bytes).

    ``reserve`` allocates the file's space now (see :func:`reserve`); without
    it the file is sparse until written."""
    head = header_bytes(key, dtype, shape, metadata)
    nbytes = itemsize(dtype) * int(np.prod(shape, dtype=np.int64))
    with open(path, "xb") as f:
        f.write(head)
        f.truncate(len(head) + nbytes)
        if reserve:
            reserve_space(f.fileno(), len(head) + nbytes)
    return len(head), nbytes


def c_strides(shape: tuple[int, ...], item: int) -> tuple[int, ...]:
    """Byte stride of each dimension of a C-order array of ``shape`` with ``item``-byte elements."""
    strides, step = [], item
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def c_span(strides: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...],
              item: int) -> tuple[int, int]:
    """(first byte, bytes up to and including the last element) of the non-empty block at ``offsets`` with
    ``lengths`` in an array of byte ``strides``; the block is one contiguous run iff the span equals its bytes."""
    start = sum(o * s for o, s in zip(offsets, strides))
    return start, sum((n - 1) * s for n, s in zip(lengths, strides)) + item


def reserve_space(fd: int, size: int, offset: int = 0) -> None:
    """Allocate bytes [offset, offset + size) of the file now: a full disk fails here, before any data moved,
    and the pages are allocated in one call rather than one page fault at a time. Existing data is untouched."""
    if not size:
        return
    try:
        os.posix_fallocate(fd, offset, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate: stay sparse
            raise


def write(path: Path, key: str, dtype: str, array: np.ndarray, metadata: dict[str, str]) -> memoryview:
    """Write a complete file from ``array``; fsync it; return the data's bytes (for checksumming)."""
    data = np.ascontiguousarray(array)
    head = header_bytes(key, dtype, data.shape, metadata)
    raw = memoryview(data).cast("B") if data.size else memoryview(b"")
    with open(path, "xb") as f:
        f.write(head)
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return raw


def read_header(path: Path) -> tuple[int, dict]:
    """(data offset, header dict) of a safetensors file."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise StoreError(f"{path}: truncated safetensors file (no header length)")
        (n,) = struct.unpack("<Q", prefix)
        text = f.read(n)
    if len(text) != n:
        raise StoreError(f"{path}: truncated safetensors header")
    return 8 + n, json.loads(text)


def map_array(path: Path, offset: int, dtype: str, shape: tuple[int, ...], writable: bool = False) -> np.ndarray:
    """A numpy view of the tensor data in ``path`` through a memory map (pages load on access)."""
    np_dtype = np.dtype(numpy_storage(dtype))
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype=np_dtype)
    with open(path, "r+b" if writable else "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    array = np.frombuffer(mapped, dtype=np_dtype, count=count, offset=offset).reshape(shape)
    return array
