"""N-dimensional boxes (hyper-rectangles): the arithmetic of all resharding.

May import: only the standard library and ``tenplex.errors``. Pure.

A box is a pair of integer tuples, ``offsets`` and ``lengths``, in global tensor
coordinates. A box with any zero length is empty. Boxes are half-open: a box
covers ``offsets[d] <= x < offsets[d] + lengths[d]`` in every dimension ``d``.
A 0-dimensional box (a scalar tensor) has volume 1.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence, TypeVar

from .errors import BoxError

K = TypeVar("K")  # what a caller keys the candidate boxes of ``tile`` by (a device, a file)


@dataclass(frozen=True, order=True)
class Box:
    """``offsets`` and ``lengths`` per dimension (see the module docstring).

    Frozen, with two hidden caches: :attr:`ends` and the hash are computed once and kept in
    the instance dict (outside equality, order and hash).
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets = tuple(operator.index(o) for o in self.offsets)
        lengths = tuple(operator.index(n) for n in self.lengths)
        if len(offsets) != len(lengths):
            raise BoxError(f"box offsets {offsets} and lengths {lengths} differ in rank")
        if any(n < 0 for n in lengths):
            raise BoxError(f"box lengths must be non-negative, got {lengths}")
        if any(o < 0 for o in offsets):
            raise BoxError(f"box offsets must be non-negative, got {offsets}")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "lengths", lengths)

    @classmethod
    def trusted(cls, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> "Box":
        """A box from tuples of ints already known to be valid, without re-checking them.

        For hot loops (planning thousands of tensors on thousands of devices)
        whose inputs come from validated boxes.
        """
        box = object.__new__(cls)
        object.__setattr__(box, "offsets", offsets)
        object.__setattr__(box, "lengths", lengths)
        return box

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Box":
        """The box covering a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @cached_property  # planners ask for it in hot loops; cached in the instance dict, outside eq/hash
    def ends(self) -> tuple[int, ...]:
        return tuple(map(operator.add, self.offsets, self.lengths))

    def __hash__(self) -> int:
        # The dataclass's own hash, cached like ends: a snapshot keys its dicts by (tensor, box) ~10 times per
        # piece per step, and a frozen box's fields never change.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = self.__dict__["_hash"] = hash((self.offsets, self.lengths))
        return cached

    @property
    def volume(self) -> int:
        v = 1
        for n in self.lengths:
            v *= n
        return v

    def is_empty(self) -> bool:
        return self.volume == 0

    def _check_rank(self, other: "Box") -> None:
        if self.ndim != other.ndim:
            raise BoxError(f"cannot combine boxes of rank {self.ndim} and {other.ndim}: {self} and {other}")

    def intersect(self, other: "Box") -> "Box | None":
        """The common part of two boxes, or None if they do not overlap."""
        self._check_rank(other)
        offsets, lengths = [], []
        for a0, a1, b0, b1 in zip(self.offsets, self.ends, other.offsets, other.ends):
            lo, hi = max(a0, b0), min(a1, b1)
            if hi <= lo:
                return None
            offsets.append(lo)
            lengths.append(hi - lo)
        return Box(tuple(offsets), tuple(lengths))

    def overlaps(self, other: "Box") -> bool:
        return self.intersect(other) is not None

    def contains(self, other: "Box") -> bool:
        """True if ``other`` lies entirely inside this box (an empty box lies anywhere)."""
        self._check_rank(other)
        if other.is_empty():
            return True
        return all(a0 <= b0 and b1 <= a1 for a0, a1, b0, b1 in zip(self.offsets, self.ends, other.offsets, other.ends))

    def is_run_of(self, outer: "Box") -> bool:
        """True if this non-empty box lies inside ``outer`` as one contiguous run of ``outer``'s elements in C
        order (row-major): one long in every dimension before some dimension k, whole in every one after it
        (a slab along dim 0, part of one row, ...). Such a region of a stored shard is a contiguous byte range."""
        if self.is_empty() or not outer.contains(self):
            return False
        k = next((d for d, n in enumerate(self.lengths) if n != 1), self.ndim)
        return self.lengths[k + 1:] == outer.lengths[k + 1:]

    def subtract(self, other: "Box") -> list["Box"]:
        """This box minus ``other``, as a list of disjoint non-empty boxes.

        Splits dimension by dimension: for each dimension, the slabs below and
        above the intersection are emitted and the remainder is narrowed to
        the intersection's extent, so at most ``2 * ndim`` boxes result.
        """
        common = self.intersect(other)
        if common is None:
            return [] if self.is_empty() else [self]
        pieces: list[Box] = []
        offsets, lengths = list(self.offsets), list(self.lengths)
        for d in range(self.ndim):
            lo, hi = offsets[d], offsets[d] + lengths[d]
            c_lo, c_hi = common.offsets[d], common.ends[d]
            if c_lo > lo:
                pieces.append(Box(tuple(offsets[:d] + [lo] + offsets[d + 1:]),
                                  tuple(lengths[:d] + [c_lo - lo] + lengths[d + 1:])))
            if hi > c_hi:
                pieces.append(Box(tuple(offsets[:d] + [c_hi] + offsets[d + 1:]),
                                  tuple(lengths[:d] + [hi - c_hi] + lengths[d + 1:])))
            offsets[d], lengths[d] = c_lo, c_hi - c_lo
        return pieces

    def local(self, origin: "Box") -> "Box":
        """This box in the local coordinates of ``origin``, which must contain it."""
        if not origin.contains(self):
            raise BoxError(f"{self} does not lie inside {origin}")
        return Box(tuple(o - p for o, p in zip(self.offsets, origin.offsets)), self.lengths)

    def shift(self, origin: "Box") -> "Box":
        """The inverse of :meth:`local`: a box in ``origin``'s local coordinates, made global."""
        return Box(tuple(o + p for o, p in zip(self.offsets, origin.offsets)), self.lengths)

    def slices(self) -> tuple[slice, ...]:
        """Index this box out of an array whose origin is the global origin."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "lengths": list(self.lengths)}

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths)) + "]"


def subtract_all(box: Box, others: Iterable[Box]) -> list[Box]:
    """``box`` minus the union of ``others``, as disjoint non-empty boxes."""
    remaining = [] if box.is_empty() else [box]
    for other in others:
        if not remaining:
            break
        remaining = [piece for r in remaining for piece in r.subtract(other)]
    return remaining


def split_by(boxes: Iterable[Box], other: Box) -> tuple[list[Box], list[Box]]:
    """(the parts of ``boxes`` inside ``other``, the parts outside it): one step of tiling a box from candidates."""
    inside, outside = [], []
    for box in boxes:
        common = box.intersect(other)
        if common is None:
            outside.append(box)
        else:
            inside.append(common)
            outside += box.subtract(common)
    return inside, outside


def tile(box: Box, candidates: Iterable[tuple[K, Box]]) -> tuple[list[tuple[K, Box]], list[Box]]:
    """Cover ``box`` from candidate ``(key, held box)`` pairs, earlier candidates first.

    Returns the tiles ``(key, part)`` (disjoint, each inside its candidate's
    box) and the parts of ``box`` no candidate covers. The planner's ``_cover``
    is the same step on plain tuples, for speed.
    """
    remaining, tiles = ([] if box.is_empty() else [box]), []
    for key, held in candidates:
        if not remaining:
            break
        inside, remaining = split_by(remaining, held)
        tiles += [(key, part) for part in inside]
    return tiles, remaining


def union_volume(boxes: Sequence[Box]) -> int:
    """Volume of the union of possibly overlapping boxes."""
    total = 0
    for i, box in enumerate(boxes):
        total += sum(piece.volume for piece in subtract_all(box, boxes[:i]))
    return total
