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
A snapshotter's second set of buffers copies in its writer thread (:mod:`.snapshot_defer`): made with
``release_gil``, it copies a piece of 64 KiB or more through numpy, which releases the GIL during the copy (a byte
copy between memoryviews holds it: the training thread's Python would wait up to the interpreter's switch
interval, 5 ms, per copy).
CUDA tensors: the buffers are pinned and the copies are non-blocking on a side stream that first waits for the
current stream (the values the step produced); the current stream then waits for the copies' event, so the next
optimizer step cannot overwrite a tensor before its copy is done, while the host returns at once. The background
writer calls :meth:`SnapshotBuffers.wait_copied` before it reads a buffer.
"""

from __future__ import annotations

import operator
from typing import Any, Iterator

import numpy as np
import torch

from ..box import Box
from .pieces import Piece
from .staging import copies_on_side_stream


class SnapshotBuffers:
    """Reused host buffers for this rank's pieces (see the module docstring)."""

    def __init__(self, release_gil: bool = False) -> None:
        self._release_gil = release_gil  # copies of GIL_FREE_BYTES or more through numpy (see the module docstring)
        self._buffers: dict[tuple[str, Box], torch.Tensor] = {}
        self._staged: list[tuple[str, Box]] = []  # the keys the last stage copied (buffers of others are freed)
        self._events: list[torch.cuda.Event] = []  # the last staging's copies, when some piece is on a GPU
        # (tensor, box) -> (the source memory it was made for, destination view, source view, the source tensor,
        # the structure it was last checked under)
        self._plans: dict[tuple[str, Box], tuple[tuple, Any, Any, torch.Tensor, Any]] = {}
        # The last staging's pieces (the same objects while a cached structure stays), the structure they were
        # checked under and their copies (destination, source): byte views of contiguous memory, numpy views of
        # the others, when all of them are numpy views of CPU memory (see _replayable)
        self._replay: tuple[list[Piece], Any, list[tuple[memoryview, memoryview]],
                            list[tuple[np.ndarray, np.ndarray]]] | None = None
        self._nbytes: int | None = None  # of the buffers; None: count again

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold (reported as the snapshot's staging memory)."""
        if self._nbytes is None:
            self._nbytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        return self._nbytes

    def stage(self, pieces: list[Piece], structure: Any = None) -> None:
        """Copy every piece's values into its buffer; returns once the tensors may change (see the docstring).
        ``structure``: :attr:`.snapshot_pieces.PiecesCache.generation`, the same object while every source
        tensor's memory is the same, checked by the cache (None: unknown): a plan made for the same tensor object
        under it needs no check of its own, and the same piece objects as the last staging's under it (the cached
        pieces) copy through that staging's views, with no per-piece lookup."""
        replay = self._replay
        if replay is not None and structure is not None and replay[1] is structure \
                and len(pieces) == len(replay[0]) and all(map(operator.is_, pieces, replay[0])):
            for into, of in replay[2]:
                into[:] = of  # a memcpy
            for destination, source in replay[3]:
                destination[...] = source  # the same dtype (checked when recorded): a copy of the bytes
            return
        self._replay = None
        keys = [(p.name, p.box) for p in pieces]
        if keys != self._staged:  # compared by identity first: the same boxes while the pieces stay
            wanted = set(keys)
            for key in list(self._buffers):  # a piece no longer written (a new layout): free its buffer
                if key not in wanted:
                    del self._buffers[key]
                    self._plans.pop(key, None)
                    self._nbytes = None
            self._staged = keys
        on_gpu = [p for p in pieces if p.local.device.type == "cuda"]
        with torch.no_grad():
            copies = [self._copy(p, structure) for p in pieces if p.local.device.type != "cuda"]
            if on_gpu:
                self._stage_cuda(on_gpu)
        if structure is not None and not on_gpu:
            self._replay = _replayable(list(pieces), structure, copies,
                                       GIL_FREE_BYTES if self._release_gil else None)

    def _copy(self, piece: Piece, structure: Any) -> tuple[Any, Any]:
        """Copy one CPU piece into its buffer through views made once (the region of the same memory, into the
        same buffer): slicing and viewing cost more than copying a small piece. Returns the views."""
        local, key = piece.local, (piece.name, piece.box)
        plan = self._plans.get(key)
        if plan is None or structure is None or plan[4] is not structure or plan[3] is not local:
            where = (local.data_ptr(), local.shape, local.stride(), local.dtype, piece.local_box)
            if plan is None or plan[0] != where:
                buffer = self._buffer(piece)
                plan = (where, *_copy_views(buffer, local[piece.local_box.slices()]), local, structure)
            self._plans[key] = plan = (*plan[:3], local, structure)
        destination, source = plan[1], plan[2]
        if isinstance(destination, np.ndarray):
            np.copyto(destination, source, casting="no")
        else:
            destination.copy_(source)
        return destination, source

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
            self._nbytes = None
        return buffer


GIL_FREE_BYTES = 64 * 1024  # a buffer set with release_gil copies pieces of this size or more through numpy
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (no copy); dtypes numpy lacks (bfloat16, float8) are viewed as the
    integers of their size: the bytes are what is copied."""
    tensor = tensor.detach()
    try:
        return tensor.numpy()
    except TypeError:  # "unsupported ScalarType"
        return tensor.view(_SAME_SIZE_INT[tensor.element_size()]).numpy()


def _copy_views(buffer: torch.Tensor, source: torch.Tensor) -> tuple[Any, Any]:
    """Numpy views of both (a copy between them runs on the calling thread alone), or the tensors themselves
    when numpy cannot view them (conjugate or negative bits, dtypes of no fixed size)."""
    try:
        return _as_numpy(buffer), _as_numpy(source)
    except (TypeError, RuntimeError, KeyError):
        return buffer, source


def _replayable(pieces: list[Piece], structure: Any, copies: list[tuple[Any, Any]],
                gil_free: int | None = None) -> tuple | None:
    """What :meth:`SnapshotBuffers.stage` replays for the same pieces under the same structure, when every copy is
    between numpy views of one dtype: a byte copy between flat byte views where the source is contiguous too (the
    least work per piece; the buffer always is), a numpy assignment between the views otherwise, and for pieces of
    ``gil_free`` bytes or more (numpy's copy releases the GIL)."""
    flat, strided = [], []
    for destination, source in copies:
        if not (isinstance(destination, np.ndarray) and isinstance(source, np.ndarray)) \
                or destination.dtype != source.dtype or destination.shape != source.shape:
            return None
        if source.flags.c_contiguous and destination.flags.c_contiguous and source.ndim \
                and (gil_free is None or source.nbytes < gil_free):
            flat.append((memoryview(destination).cast("B"), memoryview(source).cast("B")))
        else:
            strided.append((destination, source))
    return pieces, structure, flat, strided
