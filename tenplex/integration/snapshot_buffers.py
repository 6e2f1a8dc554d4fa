"""Host buffers for snapshots: a consistent copy of a rank's pieces, made at a step boundary and reused.

May import: ``tenplex.box``, ``tenplex.integration.pieces`` and ``.staging`` (the per-device side stream), numpy,
torch and the standard library. No I/O.

One buffer per (tensor, box) that this rank copies, allocated at the first
snapshot and reused by every later one, so staging memory is at most one copy
of the rank's state. A piece not staged at a snapshot (unchanged: its file is
hard-linked) loses its buffer. A buffer is the piece's region as one contiguous CPU
tensor, ready for ``StoreWriter.put`` (plain file writes, no further copy).

CPU tensors: a memcpy on the calling thread alone (numpy's ``copyto`` on views of the same memory); once
:meth:`SnapshotBuffers.stage` returns, the training loop may change its tensors. Not ``Tensor.copy_``: it splits
a large copy over torch's intra-op threads, whose wake-ups cost milliseconds per copy on a busy machine (measured
here: ~5 ms per staging copy under load, 0.05 ms with one thread), and the user's thread settings are theirs.
CUDA tensors: the buffers are pinned and the copies are non-blocking on a side stream that first waits for the
current stream (the values the step produced); the current stream then waits for the copies' event, so the next
optimizer step cannot overwrite a tensor before its copy is done, while the host returns at once. The background
writer calls :meth:`SnapshotBuffers.wait_copied` before it reads a buffer.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
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
                    copy_on_this_thread(self._buffer(p), p.local[p.local_box.slices()])
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


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (no copy); dtypes numpy lacks (bfloat16, float8) are viewed as the
    integers of their size: the bytes are what is copied."""
    tensor = tensor.detach()
    try:
        return tensor.numpy()
    except TypeError:  # "unsupported ScalarType"
        return tensor.view(_SAME_SIZE_INT[tensor.element_size()]).numpy()


def copy_on_this_thread(buffer: torch.Tensor, source: torch.Tensor) -> None:
    """``buffer.copy_(source)`` for CPU tensors of the same dtype and shape, on the calling thread only."""
    try:
        np.copyto(_as_numpy(buffer), _as_numpy(source), casting="no")
    except (TypeError, RuntimeError, KeyError):  # what numpy cannot view (conjugate/negative bits, odd dtypes)
        buffer.copy_(source)
