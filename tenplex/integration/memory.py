"""Restore from memory: what a survivor of a world change in place still holds comes from its own tensors.

May import: ``tenplex.box``, ``tenplex.layout``, ``tenplex.transfer_plan``, this package's
:mod:`.pieces` and :mod:`.layouts`, torch and the standard library. No store, no process group.

In place (:mod:`tenplex.elastic.worlds`) a worker that survives a change keeps its process, and with it the
model and optimizer it trained in the old world. At the change's stopping save, committed on every host, it
keeps their local tensors (:meth:`Kept.capture`; never the module, optimizer or a DTensor, whose mesh would keep
the old world's groups and their sockets alive): they hold exactly that version. When the new
world's :meth:`~tenplex.Checkpointer.restore` restores that version, every region of a new piece that a kept
piece holds is copied from memory, device to device (:meth:`Memory.fill`); only what memory lacks is read,
from this host's store or from other hosts' (:meth:`Memory.cut_tiles`, :meth:`Memory.cut_share`: the
plan's transfers cut to the lacking regions). Memory wins over any store, as the planner's rule "data
already on a device stays there" says. The stores still hold the whole version, so the other ranks (a
joiner, a survivor that now holds other slices) read this survivor's slices from them.

Memory is used only where it is exactly the restored version: the version is the captured one, and no kept
tensor's in-place version counter changed since the capture (when one did, say a model reused and reset by
the user's ``build``, everything is read from the stores instead). The job keeps its tensors
after a change (the stopping save's version) and after a lost peer only when :func:`state_counters` says
nothing changed them since its last save (the peer died before this rank's next optimizer step); a restore
of any other version (that save was not committed everywhere) reads the stores.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from ..box import Box, tile
from ..layout import TensorSpec
from ..transfer_plan import Plan
from .layouts import state_pieces
from .pieces import Piece

log = logging.getLogger(__name__)


@dataclass
class Kept:
    """A survivor's state at the end of a world: its pieces (plain local tensors), the committed ``version`` they
    hold, and the in-place version counters (:func:`state_counters`) of the model's and optimizer's tensors then.

    It holds no module, optimizer or DTensor: a DTensor's mesh holds the old world's process groups, and a group
    alive in this process keeps its sockets open, so a survivor still blocked in a collective with this rank
    would wait for its full timeout instead of seeing the connection close (issue 36: a departed rank that kept
    its model hung the last rank of a tp job). A DTensor is watched through a weak reference: while the user
    still holds it (a model reused by ``build``), an in-place change shows in its counter; once it is gone
    nothing can change it, and its local tensor, held here, has its own counter."""

    version: int
    pieces: list[Piece] | None       # None: the state could not be cut into pieces (memory unusable)
    watched: list[Any]               # per counted tensor: the tensor, or (a weak reference to a DTensor, its local)
    counters: tuple[int, ...]

    @classmethod
    def capture(cls, model, optimizer, annotations, version: int, counters: tuple[int, ...] | None = None) -> "Kept":
        """Keep the pieces of ``model`` and ``optimizer`` as they are right after ``version`` was saved from them
        (``counters``: their :func:`state_counters` now, when the caller has them)."""
        try:
            pieces: list[Piece] | None = [_plain(p) for p in _pieces(model, optimizer, annotations)]
        except Exception as e:  # noqa: BLE001 -- memory is only a faster source: any doubt reads the stores
            log.warning("restore: the state kept in memory is not usable (%s: %s); reading the stores",
                        type(e).__name__, e)
            pieces = None
        watched = [(weakref.ref(t), local) if (local := getattr(t, "_local_tensor", None)) is not None else t
                   for t in _counted(model, optimizer)]
        return cls(version, pieces, watched, state_counters(model, optimizer) if counters is None else counters)

    def usable(self, version: int | None, specs: Mapping[str, TensorSpec]) -> "Memory | None":
        """The kept pieces when they still hold ``version``'s values (the same version, no kept tensor changed
        since the capture), those with the global spec of ``specs`` (the restored version's); else None."""
        if version != self.version or self.pieces is None or self._counters_now() != self.counters:
            return None
        valid = [p for p in self.pieces if specs.get(p.name) == p.spec]
        return Memory(valid) if valid else None

    def _counters_now(self) -> tuple[int, ...] | None:
        """The watched tensors' counters now, in :func:`state_counters`' order; a DTensor no longer alive counts
        its counter at the capture (nothing can change it any more), its local tensor its counter now."""
        counts: list[int] = []
        captured = iter(self.counters)
        try:
            for w in self.watched:
                if isinstance(w, tuple):
                    ref, local = w
                    wrapper_then, _ = next(captured), next(captured)
                    t = ref()
                    counts += [wrapper_then if t is None else t._version, local._version]
                else:
                    counts.append(w._version)
                    next(captured)
        except StopIteration:  # counters of another state than the watched one: no memory
            return None
        return tuple(counts)


def _pieces(model, optimizer, annotations) -> list[Piece]:
    return [p for p in state_pieces(model, optimizer, annotations) if not p.box.is_empty()]


class Memory:
    """The kept pieces a restore takes its regions from; ``bytes``: how many it copied."""

    def __init__(self, pieces: list[Piece]):
        self.by_name: dict[str, list[Piece]] = {}
        for p in pieces:
            self.by_name.setdefault(p.name, []).append(p)
        self.bytes = 0
        self.lacking: dict[tuple[str, Box], list[Box]] = {}  # (tensor, new piece's box) -> regions memory lacks

    @torch.no_grad()
    def fill(self, pieces: list[Piece]) -> None:
        """Copy into each piece every region memory holds; remember, per piece, the regions it lacks."""
        for piece in pieces:
            tiles, lacking = tile(piece.box, ((kept, kept.box) for kept in self.by_name.get(piece.name, ())))
            for kept, region in tiles:
                into, values = _region(piece, region), _region(kept, region)
                if into.data_ptr() != values.data_ptr() or into.stride() != values.stride():  # else: the same tensor
                    into.copy_(values)
                self.bytes += region.volume * piece.local.element_size()
            self.lacking[(piece.name, piece.box)] = lacking

    def cut_tiles(self, piece: Piece, tiles: list[tuple[str, Box]]) -> list[tuple[str, Box]]:
        """``piece``'s (stored device, region) tiles cut to the regions memory lacks."""
        lacking = self.lacking.get((piece.name, piece.box), [piece.box])
        return [(device, part) for device, region in tiles for box in lacking
                if (part := region.intersect(box)) is not None]

    def cut_share(self, share: Plan, device: str) -> Plan:
        """``device``'s transfers of ``share`` cut to the regions memory lacks (other devices' as they are)."""
        lacking: dict[str, list[Box]] = {}
        for (name, _box), boxes in self.lacking.items():
            lacking.setdefault(name, []).extend(boxes)
        transfers = []
        for t in share.transfers:
            if t.dst != device:
                transfers.append(t)
                continue
            transfers += [replace(t, box=part) for box in lacking.get(t.tensor, ())
                          if (part := t.box.intersect(box)) is not None]
        return replace(share, transfers=tuple(transfers))


def _region(piece: Piece, region: Box) -> torch.Tensor:
    """The part of ``piece``'s local tensor that holds ``region`` (global coordinates, inside the piece's box)."""
    return piece.local[piece.local_box.slices()][region.local(piece.box).slices()]


def _counted(model, optimizer) -> list[torch.Tensor]:
    """The tensors :func:`state_counters` counts: the model's and the optimizer's state tensors."""
    tensors = list(model.state_dict(keep_vars=True).values())
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values()]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def _plain(piece: Piece) -> Piece:
    """``piece`` holding a plain tensor: a DTensor's local tensor (an optimizer state's piece holds the state)."""
    if getattr(piece.local, "_local_tensor", None) is None:
        return piece
    with torch.no_grad():
        return replace(piece, local=piece.local.to_local())  # type: ignore[attr-defined]


def state_counters(model, optimizer) -> tuple[int, ...]:
    """The in-place version counters of the model's tensors and the optimizer's state tensors (a DTensor's and
    its local tensor's: an in-place op bumps the first, a copy into the local tensor the second)."""
    counts = []
    for t in _counted(model, optimizer):
        counts.append(t._version)
        local = getattr(t, "_local_tensor", None)
        if local is not None:
            counts.append(local._version)
    return tuple(counts)
