"""Copy pieces between torch tensors and a host's store (no network).

May import: ``tenplex.store``, ``tenplex.dtypes``, ``tenplex.integration.pieces``,
torch, numpy and the standard library.

Saving fills a memory-mapped shard file in place (one copy, device -> file
pages); restoring copies from the memory-mapped file into the local tensor
region on its own device (one copy). bfloat16 and float8 travel as their raw
bits (uint16/uint8) because numpy has no such types.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..box import Box
from ..dtypes import numpy_storage
from ..store import VersionReader, VersionWriter
from .pieces import Piece

_BITS = {"uint16": torch.uint16, "uint8": torch.uint8}


def _as_storage(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """``values`` reinterpreted as the integer type numpy stores ``dtype`` in (when numpy lacks ``dtype``)."""
    storage = numpy_storage(dtype)
    return values.view(_BITS[storage]) if storage != dtype else values


def write_piece(writer: VersionWriter, device: str, piece: Piece) -> None:
    values = _as_storage(piece.read(), piece.spec.dtype)
    target = writer.allocate(device, piece.name, piece.box, piece.spec.dtype, piece.spec.shape)
    if values.numel():
        np.copyto(target, values.numpy())


def read_piece(reader: VersionReader, device: str, piece: Piece, box: Box | None = None) -> None:
    """Fill ``piece`` from the region ``box`` (default: the piece's own box) of ``device``'s stored shard."""
    region = reader.read(device, piece.name, box or piece.box)
    with warnings.catch_warnings():
        # The memory map is read-only; torch warns that writing through the view would be undefined. We only read.
        warnings.simplefilter("ignore", UserWarning)
        values = torch.from_numpy(region) if region.ndim else torch.from_numpy(np.array(region))
    storage = numpy_storage(piece.spec.dtype)
    if storage != piece.spec.dtype:
        values = values.view(getattr(torch, piece.spec.dtype))
    piece.write(values)
