"""Boxes as plain ``(lo, hi)`` tuples, and an index of the ones that overlap a query: the planners' hot loops.

May import: ``tenplex.box`` and the standard library. Pure.

:class:`~tenplex.box.Box` is the checked public form; the planners
(``tenplex.planner``, ``tenplex.share_planner``) turn boxes into half-open
``(lo, hi)`` tuples once and do their arithmetic on those, because building a
checked object per intersection dominated planning at a thousand devices.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, bisect_right
from typing import Callable

from .box import Box

Region = tuple[tuple[int, ...], tuple[int, ...]]  # (lo, hi), half-open


def intersect(a: Region, b: Region) -> Region | None:
    lo = tuple(map(max, a[0], b[0]))
    hi = tuple(map(min, a[1], b[1]))
    for low, high in zip(lo, hi):
        if high <= low:
            return None
    return lo, hi


def minus(a: Region, common: Region) -> list[Region]:
    """``a`` minus its sub-region ``common``, as at most 2 * ndim disjoint regions."""
    lo, hi = list(a[0]), list(a[1])
    pieces = []
    for d in range(len(lo)):
        c_lo, c_hi = common[0][d], common[1][d]
        if c_lo > lo[d]:
            pieces.append((tuple(lo), tuple(hi[:d] + [c_lo] + hi[d + 1:])))
        if hi[d] > c_hi:
            pieces.append((tuple(lo[:d] + [c_hi] + lo[d + 1:]), tuple(hi)))
        lo[d], hi[d] = c_lo, c_hi
    return pieces


def volume(r: Region) -> int:
    v = 1
    for low, high in zip(*r):
        v *= high - low
    return v


def to_box(r: Region) -> Box:
    return Box.trusted(r[0], tuple(map(operator.sub, r[1], r[0])))


def cover(pieces: list[Region], region: Region, emit: Callable[[Region], None]) -> list[Region]:
    """Emit the parts of ``pieces`` inside ``region``; return the parts outside it."""
    rest = []
    for piece in pieces:
        common = intersect(piece, region)
        if common is None:
            rest.append(piece)
        else:
            emit(common)
            rest.extend(minus(piece, common))
    return rest


def ignore(region: Region) -> None:
    """``cover``'s emit when only what is left over counts."""


class RegionIndex:
    """Which of a fixed list of regions overlap a query region, without scanning them all.

    Per dimension the regions are sorted by ``lo``, and the longest extent is
    kept: a region can overlap the query in that dimension only if its ``lo``
    lies in ``(query.lo - longest, query.hi)``, two bisections. A query takes the
    dimension whose band holds the fewest regions and checks just those. For
    the grids that partition rules make (tp columns times dp or pp rows) the
    band is one row or column of the grid, so a query costs O(ndim log n + band)
    and the index O(ndim n) memory. Results come in region order.
    """

    def __init__(self, regions: list[Region]) -> None:
        self.regions = regions
        self.dims = []
        for k in range(len(regions[0][0]) if regions else 0):
            order = sorted(range(len(regions)), key=lambda i: regions[i][0][k])
            longest = max(r[1][k] - r[0][k] for r in regions)
            self.dims.append(([regions[i][0][k] for i in order], order, longest))

    def overlapping(self, query: Region) -> list[int]:
        if not self.dims:
            return list(range(len(self.regions)))  # scalars (0-dimensional) all overlap
        band: tuple[int, int, list[int]] | None = None
        for k, (los, order, longest) in enumerate(self.dims):
            first, end = bisect_right(los, query[0][k] - longest), bisect_left(los, query[1][k])
            if band is None or end - first < band[1] - band[0]:
                band = first, end, order
        first, end, order = band  # type: ignore[misc]
        regions = self.regions
        return sorted(i for i in order[first:end] if intersect(regions[i], query) is not None)

    def disjoint(self) -> bool:
        """Whether the indexed regions are pairwise disjoint (each overlaps only itself).

        Fast for grids: when, in every dimension, the distinct extents are disjoint or equal, two distinct
        regions differ in some dimension, where they cannot overlap. Otherwise region by region."""
        regions = self.regions
        solid = all(low < high for r in regions for low, high in zip(*r))  # an empty region overlaps nothing
        grid = all(_extents_disjoint(regions, k) for k in range(len(self.dims)))
        if solid and len(set(regions)) == len(regions) and grid:
            return True
        return all(self.overlapping(r) == [i] for i, r in enumerate(regions))


def _extents_disjoint(regions: list[Region], k: int) -> bool:
    extents = sorted({(r[0][k], r[1][k]) for r in regions})
    return all(hi <= lo for (_, hi), (lo, _) in zip(extents, extents[1:]))
