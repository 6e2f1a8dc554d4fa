"""Copy pieces between torch tensors and a host's store (no network).

May import: ``tenplex.store``, ``tenplex.dtypes``, ``tenplex.box``,
``tenplex.integration.pieces``, torch, numpy and the standard library.

Both functions need only the store's contract (``StoreWriter.put`` and
``StoreReader.read``/``readinto``, ``tenplex.store.contract``), so any backend
fits. Saving hands each piece's CPU values to ``StoreWriter.put`` (the POSIX
store writes them with plain file writes, no intermediate copy for a
contiguous CPU tensor). Restoring reads each region with
``StoreReader.readinto``, which verifies the bytes it reads, straight into the
local CPU tensor (the POSIX store: a contiguous run with ``pread``, rows such
as a column block copied into place piece by piece); a GPU tensor gets a host
buffer and then one copy. bfloat16 and float8 travel as
their raw bits (uint16/uint8) because numpy has no such types.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import numpy as np
import torch

from ..box import Box
from ..dtypes import numpy_storage
from ..store import StoreWriter
from .pieces import Piece

_BITS = {"uint16": torch.uint16, "uint8": torch.uint8}


def _as_storage(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """``values`` reinterpreted as the integer type numpy stores ``dtype`` in (when numpy lacks ``dtype``)."""
    storage = numpy_storage(dtype)
    return values.view(_BITS[storage]) if storage != dtype else values


class RegionReader(Protocol):
    """What ``read_piece`` needs of a reader: ``StoreReader``'s two region reads (a local version, or a
    version on another host's store: ``readthrough.RemoteVersion``)."""

    def read(self, device: str, tensor: str, box: Box) -> np.ndarray: ...

    def readinto(self, device: str, tensor: str, box: Box, dest: Any) -> None: ...


def write_piece(writer: StoreWriter, device: str, piece: Piece) -> None:
    values = _as_storage(piece.read(), piece.spec.dtype)
    writer.put(device, piece.name, piece.box, values.numpy(), piece.spec.dtype, piece.spec.shape)


@torch.no_grad()
def read_piece(reader: RegionReader, sources: list[tuple[str, Box]], piece: Piece) -> None:
    """Fill ``piece`` from stored shards: ``sources`` are (device, region) pairs that tile the piece's box.
    Every byte read is verified against the shard's checksums (``StoreReader.readinto``)."""
    own = piece.local[piece.local_box.slices()]
    for device, region in sources:
        dest = own[region.local(piece.box).slices()]
        if dest.dim() == 0:
            _copy_from_map(reader.read(device, piece.name, region), dest, piece.spec.dtype)
        elif dest.device.type == "cpu":  # contiguous or not (a column block of the local tensor): in place
            reader.readinto(device, piece.name, region, dest.view(_int_of_size(dest.element_size())).numpy())
        else:  # a GPU tensor: read into host memory, then one copy
            buffer = torch.empty(dest.shape, dtype=dest.dtype)
            reader.readinto(device, piece.name, region, _bytes_of(buffer))
            dest.copy_(buffer)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable."""
    return memoryview(tensor.view(_int_of_size(tensor.element_size())).numpy()).cast("B")


def _copy_from_map(region: np.ndarray, dest: torch.Tensor, dtype: str) -> None:
    with warnings.catch_warnings():
        # The array may be read-only; torch warns that writing through the view would be undefined. We only read.
        warnings.simplefilter("ignore", UserWarning)
        values = torch.from_numpy(region) if region.ndim else torch.from_numpy(np.array(region))
    if numpy_storage(dtype) != dtype:
        values = values.view(getattr(torch, dtype))
    dest.copy_(values)


def _int_of_size(size: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
