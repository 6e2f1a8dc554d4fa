"""Copy pieces between torch tensors and a host's store (no network).

May import: ``tenplex.store``, ``tenplex.dtypes``, ``tenplex.box``,
``tenplex.integration.pieces``, torch, numpy and the standard library.

Saving hands each piece's CPU values to ``VersionWriter.put``, which writes
them with plain file writes (no intermediate copy for a contiguous CPU tensor).
Restoring reads each region that is one contiguous byte range of its stored
file with ``readinto``: straight into the local tensor when that is a
contiguous CPU tensor, otherwise into a buffer and then one copy. On tmpfs this
is several times faster than touching a memory map page by page. Other regions
go through the store's memory-mapped ``read``. bfloat16 and float8 travel as their raw bits
(uint16/uint8) because numpy has no such types.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from ..box import Box
from ..dtypes import numpy_storage
from ..store import VersionReader, VersionWriter
from ..store._safetensors import read_header
from .pieces import Piece

_BITS = {"uint16": torch.uint16, "uint8": torch.uint8}


def _as_storage(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """``values`` reinterpreted as the integer type numpy stores ``dtype`` in (when numpy lacks ``dtype``)."""
    storage = numpy_storage(dtype)
    return values.view(_BITS[storage]) if storage != dtype else values


def write_piece(writer: VersionWriter, device: str, piece: Piece) -> None:
    values = _as_storage(piece.read(), piece.spec.dtype)
    writer.put(device, piece.name, piece.box, values.numpy(), piece.spec.dtype, piece.spec.shape)


@torch.no_grad()
def read_piece(reader: VersionReader, sources: list[tuple[str, Box]], piece: Piece) -> None:
    """Fill ``piece`` from stored shards: ``sources`` are (device, region) pairs that tile the piece's box."""
    own = piece.local[piece.local_box.slices()]
    for device, region in sources:
        dest = own[region.local(piece.box).slices()]
        entry = reader.find(device, piece.name, region)
        byte_range = _byte_range(entry.box, region, dest.element_size())
        if byte_range is None or dest.dim() == 0:
            _copy_from_map(reader.read(device, piece.name, region), dest, piece.spec.dtype)
        elif dest.device.type == "cpu" and dest.is_contiguous():
            _read_into(reader.path / entry.file, byte_range, dest)
        else:  # e.g. a column block of the local tensor, or a GPU tensor: read whole, then one copy
            buffer = torch.empty(dest.shape, dtype=dest.dtype)
            _read_into(reader.path / entry.file, byte_range, buffer)
            dest.copy_(buffer)


def _copy_from_map(region: np.ndarray, dest: torch.Tensor, dtype: str) -> None:
    with warnings.catch_warnings():
        # The memory map is read-only; torch warns that writing through the view would be undefined. We only read.
        warnings.simplefilter("ignore", UserWarning)
        values = torch.from_numpy(region) if region.ndim else torch.from_numpy(np.array(region))
    if numpy_storage(dtype) != dtype:
        values = values.view(getattr(torch, dtype))
    dest.copy_(values)


def _byte_range(stored: Box, region: Box, itemsize: int) -> tuple[int, int] | None:
    """(start, length) in bytes of ``region`` inside the C-ordered data of ``stored``; None if not contiguous."""
    local = region.local(stored)
    dims = stored.ndim
    # Contiguous iff, after the first dimension that is not fully covered, every dimension is full,
    # and before it every dimension has length 1.
    k = next((d for d in range(dims) if local.lengths[d] != stored.lengths[d]), dims)
    if any(local.lengths[d] != 1 for d in range(k)) or any(local.lengths[d] != stored.lengths[d]
                                                          for d in range(k + 1, dims)):
        return None
    start, stride = 0, itemsize
    for d in reversed(range(dims)):
        start += local.offsets[d] * stride
        stride *= stored.lengths[d]
    return start, region.volume * itemsize


def _data_offset(path: Path) -> int:
    """Where a one-tensor safetensors file's data starts."""
    offset, header = read_header(path)
    begin = [v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"]
    return offset + (begin[0] if begin else 0)


def _read_into(path: Path, byte_range: tuple[int, int], dest: torch.Tensor) -> None:
    start, length = byte_range
    view = memoryview(dest.view(_int_of_size(dest.element_size())).numpy()).cast("B")
    if len(view) != length:
        raise ValueError(f"{path}: region of {length} bytes does not fit a destination of {len(view)} bytes")
    with open(path, "rb", buffering=0) as f:
        f.seek(_data_offset(path) + start)
        done = 0
        while done < length:
            n = f.readinto(view[done:])
            if not n:
                raise EOFError(f"{path}: file ends {length - done} bytes before the region does")
            done += n


def _int_of_size(size: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
