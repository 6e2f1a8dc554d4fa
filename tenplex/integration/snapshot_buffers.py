"""Host buffers for snapshots: a consistent copy of a rank's pieces, made at a step boundary and reused.

May import: ``tenplex.box``, ``tenplex.integration.pieces`` and ``.staging`` (the per-device side stream),
torch and the standard library. No I/O.

One buffer per (tensor, box) that this rank copies, allocated at the first
snapshot and reused by every later one, so staging memory is at most one copy
of the rank's state. A piece not staged at a snapshot (unchanged: its file is
hard-linked) loses its buffer. A buffer is the piece's region as one contiguous CPU
tensor, ready for ``StoreWriter.put`` (plain file writes, no further copy).

CPU tensors: ``copy_`` is a memcpy; once :meth:`SnapshotBuffers.stage` returns, the
training loop may change its tensors. CUDA tensors: the buffers are pinned and
the copies are non-blocking on a side stream that first waits for the current
stream (the values the step produced); the current stream then waits for the
copies' event, so the next optimizer step cannot overwrite a tensor before its
copy is done, while the host returns at once. The background writer calls
:meth:`SnapshotBuffers.wait_copied` before it reads a buffer.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..box import Box
from .pieces import Piece
from .staging import copies_on_side_stream


class SnapshotBuffers:
    """Reused host buffers for this rank's pieces (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, Box], torch.Tensor] = {}
        self._events: list[torch.cuda.Event] = []  # the last staging's copies, when some piece is on a GPU

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold (reported as the snapshot's staging memory)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, pieces: list[Piece]) -> None:
        """Copy every piece's values into its buffer; returns once the tensors may change (see the docstring)."""
        wanted = {(p.name, p.box) for p in pieces}
        for key in list(self._buffers):  # a piece no longer written (a new layout): free its buffer
            if key not in wanted:
                del self._buffers[key]
        on_gpu = [p for p in pieces if p.local.device.type == "cuda"]
        with torch.no_grad():
            for p in pieces:
                if p.local.device.type != "cuda":
                    self._buffer(p).copy_(p.local[p.local_box.slices()])
            if on_gpu:
                self._stage_cuda(on_gpu)

    def _stage_cuda(self, pieces: list[Piece]) -> None:
        devices = {p.local.device for p in pieces}  # one event per device (a rank usually has one)
        self._events = [copies_on_side_stream(device, [(self._buffer(p), p.local[p.local_box.slices()])
                                                       for p in pieces if p.local.device == device])
                        for device in devices]

    def wait_copied(self) -> None:
        """Block until the last :meth:`stage`'s copies are in host memory (immediate on CPU)."""
        for event in self._events:
            event.synchronize()

    def buffers(self) -> Iterator[tuple[str, Box, torch.Tensor]]:
        for (name, box), buffer in self._buffers.items():
            yield name, box, buffer

    def _buffer(self, piece: Piece) -> torch.Tensor:
        key = (piece.name, piece.box)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.dtype != piece.local.dtype:
            pin = piece.local.device.type == "cuda"
            buffer = torch.empty(piece.box.lengths, dtype=piece.local.dtype, pin_memory=pin)
            self._buffers[key] = buffer
        return buffer
