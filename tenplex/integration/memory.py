"""Restore from memory: what a survivor of a world change in place still holds comes from its own tensors.

May import: ``tenplex.box``, ``tenplex.layout``, ``tenplex.transfer_plan``, this package's
:mod:`.pieces` and :mod:`.layouts`, torch and the standard library. No store, no process group.

In place (:mod:`tenplex.elastic.worlds`) a worker that survives a change keeps its process, and with it the
model and optimizer it trained in the old world. At the change's stopping save, committed on every host, it
keeps a reference to them (:meth:`Kept.capture`): their tensors hold exactly that version. When the new
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
    """A survivor's state at the end of a world: references to its model and optimizer, the committed ``version``
    they hold, and their in-place version counters (:func:`state_counters`) then."""

    version: int
    model: Any
    optimizer: Any
    annotations: Any
    counters: tuple[int, ...]

    @classmethod
    def capture(cls, model, optimizer, annotations, version: int, counters: tuple[int, ...] | None = None) -> "Kept":
        """Keep ``model`` and ``optimizer`` as they are right after ``version`` was saved from them (``counters``:
        their :func:`state_counters` now, when the caller has them). Cheap: the pieces are made when used."""
        return cls(version, model, optimizer, annotations,
                   state_counters(model, optimizer) if counters is None else counters)

    def usable(self, version: int | None, specs: Mapping[str, TensorSpec]) -> "Memory | None":
        """The kept pieces when they still hold ``version``'s values (the same version, no kept tensor changed
        since the capture), those with the global spec of ``specs`` (the restored version's); else None."""
        if version != self.version or state_counters(self.model, self.optimizer) != self.counters:
            return None
        try:
            pieces = _pieces(self.model, self.optimizer, self.annotations)
        except Exception as e:  # noqa: BLE001 -- memory is only a faster source: any doubt reads the stores
            log.warning("restore: the state kept in memory is not usable (%s: %s); reading the stores",
                        type(e).__name__, e)
            return None
        valid = [p for p in pieces if specs.get(p.name) == p.spec]
        return Memory(valid) if valid else None


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


def state_counters(model, optimizer) -> tuple[int, ...]:
    """The in-place version counters of the model's tensors and the optimizer's state tensors (a DTensor's and
    its local tensor's: an in-place op bumps the first, a copy into the local tensor the second)."""
    tensors = list(model.state_dict(keep_vars=True).values())
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values()]
    counts = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            counts.append(t._version)
            local = getattr(t, "_local_tensor", None)
            if local is not None:
                counts.append(local._version)
    return tuple(counts)
