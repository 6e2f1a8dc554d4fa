"""Host buffers for snapshots: a consistent copy of a rank's pieces, made at a step boundary and reused.

May import: ``tenplex.box``, ``tenplex.integration.pieces``, torch and the standard library. No I/O.

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


class SnapshotBuffers:
    """Reused host buffers for this rank's pieces (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, Box], torch.Tensor] = {}
        self._event: torch.cuda.Event | None = None  # the last staging's copies, when some piece is on a GPU
        self._stream: torch.cuda.Stream | None = None

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
        side = self._stream = self._stream or torch.cuda.Stream()
        current = torch.cuda.current_stream()
        side.wait_stream(current)  # the step's kernels that wrote the tensors come first
        with torch.cuda.stream(side):
            for p in pieces:
                self._buffer(p).copy_(p.local[p.local_box.slices()], non_blocking=True)
            event = self._event = torch.cuda.Event()
            event.record(side)
        current.wait_event(event)  # the next optimizer step may not overwrite a tensor mid-copy

    def wait_copied(self) -> None:
        """Block until the last :meth:`stage`'s copies are in host memory (immediate on CPU)."""
        if self._event is not None:
            self._event.synchronize()

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
