"""Copy pieces between torch tensors and a host's store (no network).

May import: ``tenplex.store``, ``tenplex.dtypes``, ``tenplex.box``,
``tenplex.integration.pieces`` and ``.staging``, torch, numpy and the standard library.

Both directions need only the store's contract (``StoreWriter.put``/``create``
and ``StoreReader.read``/``readinto``, ``tenplex.store.contract``), so any
backend fits. Saving hands each piece's CPU values to ``StoreWriter.put`` (the
POSIX store writes them with plain file writes, no intermediate copy for a
contiguous CPU tensor). Restoring reads each region with
``StoreReader.readinto``, which verifies the bytes it reads, straight into the
local CPU tensor (the POSIX store: a contiguous run with ``pread``, rows such
as a column block copied into place piece by piece).

A tensor on an accelerator goes through the pooled host buffers of
:mod:`.staging` (pinned where CUDA is there), slab by slab
(``staging.SLAB_BYTES``), a few slabs at once (``staging.THREADS``): a
restore reads a slab into a buffer and queues its copy to the device on a
side stream, and reads on while that copy runs; a save copies each slab off
the device and writes it into a new shard file (``StoreWriter.create``) while
other slabs are copied. So a GPU piece of any size needs a
few slabs of host memory, not a host copy of itself. bfloat16 and float8
travel as their raw bits (uint16/uint8) because numpy has no such types.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch

from ..box import Box
from ..dtypes import numpy_storage
from ..store import StoreWriter
from ..store.wire import split_box
from . import staging
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
    region = piece.local[piece.local_box.slices()]
    if region.device.type != "cpu" and region.dim() > 0:
        write_staged(writer, device, piece)
        return
    values = _as_storage(piece.read(), piece.spec.dtype)
    writer.put(device, piece.name, piece.box, values.numpy(), piece.spec.dtype, piece.spec.shape)


def write_staged(writer: StoreWriter, device: str, piece: Piece) -> None:
    """Save ``piece`` (a tensor on any device) slab by slab through staging buffers, ``staging.THREADS`` slabs
    at once: each thread copies its slab off the device and writes it into the new shard file, so copies run
    while other slabs are written."""
    region = piece.local[piece.local_box.slices()].detach()
    target = writer.create(device, piece.name, piece.box, piece.spec.dtype, piece.spec.shape)

    def write(slab: Box) -> None:
        staged = staging.from_device(region[slab.local(piece.box).slices()])
        try:
            target.write(slab, staged.host().reshape(-1).view(torch.uint8).numpy())  # C-order bytes, any dtype
        finally:
            staged.release()

    staging.begin({region.device})  # the copies come after the caller's work on the tensor so far
    staging.each(write, list(split_box(piece.box, region.element_size(), staging.SLAB_BYTES)))


@torch.no_grad()
def read_piece(reader: RegionReader, sources: list[tuple[str, Box]], piece: Piece) -> None:
    """Fill ``piece`` from stored shards: ``sources`` are (device, region) pairs that tile the piece's box.
    Every byte read is verified against the shard's checksums (``StoreReader.readinto``). A piece on an
    accelerator may still be copying when this returns; the current stream waits for it (:mod:`.staging`)."""
    own = piece.local[piece.local_box.slices()]
    for device, region in sources:
        dest = own[region.local(piece.box).slices()]
        if dest.dim() == 0:
            _copy_from_map(reader.read(device, piece.name, region), dest, piece.spec.dtype)
        elif dest.device.type == "cpu":  # contiguous or not (a column block of the local tensor): in place
            reader.readinto(device, piece.name, region, dest.view(_int_of_size(dest.element_size())).numpy())
        else:
            read_staged(reader, device, piece.name, region, dest)


def read_staged(reader: RegionReader, device: str, tensor: str, region: Box, dest: torch.Tensor) -> None:
    """Read ``region`` of ``device``'s shard of ``tensor`` into ``dest`` (any device, ``region``'s shape) slab by
    slab through staging buffers, ``staging.THREADS`` slabs at once; each slab's copy to the device runs while
    other slabs are read. On CUDA the caller's current stream waits for every copy."""
    dest = dest.detach()

    def read(slab: Box) -> None:
        staging.to_device(partial(reader.readinto, device, tensor, slab), dest[slab.local(region).slices()])

    staging.begin({dest.device})
    staging.each(read, list(split_box(region, dest.element_size(), staging.SLAB_BYTES)))
    staging.publish({dest.device})


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
