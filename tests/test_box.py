"""Property tests of the box algebra (tenplex.box)."""

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from tenplex.box import Box, subtract_all, tile, union_volume
from tenplex.errors import BoxError
from tenplex.store._safetensors import c_strides

SETTINGS = settings(max_examples=100, deadline=None)


@st.composite
def boxes(draw, ndim=None, extent=8):
    n = draw(st.integers(0, 3)) if ndim is None else ndim
    offsets = draw(st.lists(st.integers(0, extent), min_size=n, max_size=n))
    lengths = draw(st.lists(st.integers(0, extent), min_size=n, max_size=n))
    return Box(tuple(offsets), tuple(lengths))


@st.composite
def box_pairs(draw):
    n = draw(st.integers(0, 3))
    return draw(boxes(n)), draw(boxes(n))


def cells(box):
    """The set of integer points inside a box (small boxes only)."""
    return set(itertools.product(*(range(o, o + n) for o, n in zip(box.offsets, box.lengths))))


@SETTINGS
@given(box_pairs())
def test_intersect_is_the_common_points(pair):
    a, b = pair
    common = a.intersect(b)
    expected = cells(a) & cells(b)
    assert (cells(common) if common else set()) == expected
    assert a.overlaps(b) == bool(expected)
    if common:
        assert a.contains(common) and b.contains(common)


@SETTINGS
@given(box_pairs())
def test_subtract_pieces_are_disjoint_and_conserve_volume(pair):
    a, b = pair
    pieces = a.subtract(b)
    assert len(pieces) <= 2 * a.ndim or a.ndim == 0
    assert all(not p.is_empty() and a.contains(p) for p in pieces)
    for p, q in itertools.combinations(pieces, 2):
        assert not p.overlaps(q)
    common = a.intersect(b)
    assert sum(p.volume for p in pieces) + (common.volume if common else 0) == a.volume
    assert set().union(*map(cells, pieces)) == cells(a) - cells(b)


@SETTINGS
@given(st.integers(1, 3).flatmap(lambda n: st.tuples(boxes(n), st.lists(boxes(n), max_size=4))))
def test_subtract_all_and_union_volume(args):
    box, others = args
    rest = subtract_all(box, others)
    covered = set().union(*map(cells, others)) if others else set()
    assert set().union(*map(cells, rest)) == cells(box) - covered
    assert sum(p.volume for p in rest) == len(cells(box) - covered)
    everything = [box, *others]
    assert union_volume(everything) == len(set().union(*map(cells, everything)))


@SETTINGS
@given(st.integers(1, 3).flatmap(lambda n: st.tuples(boxes(n), st.lists(boxes(n), max_size=4))))
def test_tile_covers_each_point_once_from_the_first_candidate_holding_it(args):
    box, held = args
    tiles, rest = tile(box, enumerate(held))
    for key, part in tiles:
        assert not part.is_empty() and held[key].contains(part) and box.contains(part)
    points = [p for _, part in tiles for p in cells(part)] + [p for part in rest for p in cells(part)]
    assert sorted(points) == sorted(cells(box))  # tiles and rest partition the box: every point exactly once
    for key, part in tiles:  # earlier candidates win: no earlier candidate holds any point of a later tile
        assert all(not cells(part) & cells(held[k]) for k in range(key))
    assert set().union(*map(cells, rest)) == cells(box) - set().union(set(), *map(cells, held))


@SETTINGS
@given(box_pairs())
def test_containment_matches_points(pair):
    a, b = pair
    assert a.contains(b) == (cells(b) <= cells(a) or b.is_empty())


@SETTINGS
@given(box_pairs())
def test_run_of_matches_the_c_order_positions_of_its_points(pair):
    """A box is a run of ``outer`` exactly when its points take consecutive C-order positions in ``outer``."""
    outer, other = pair
    inner = outer.intersect(other)
    if inner is None:
        assert not other.is_run_of(outer)
        return
    steps = c_strides(outer.lengths, 1)  # elements per step of each dimension, C order
    positions = sorted(sum((p - o) * step for p, o, step in zip(point, outer.offsets, steps)) for point in cells(inner))
    consecutive = positions == list(range(positions[0], positions[0] + len(positions)))
    assert inner.is_run_of(outer) == consecutive, (outer, inner)


def test_run_of_golden_cases():
    outer = Box((0, 0, 0), (4, 3, 5))
    assert Box((1, 0, 0), (2, 3, 5)).is_run_of(outer)        # a dim-0 slab
    assert Box((1, 1, 0), (1, 2, 5)).is_run_of(outer)        # rows of one dim-0 index
    assert Box((1, 2, 1), (1, 1, 3)).is_run_of(outer)        # part of one row
    assert not Box((1, 0, 0), (2, 2, 5)).is_run_of(outer)    # two indices of dim 0, partial dim 1
    assert not Box((0, 0, 0), (4, 3, 4)).is_run_of(outer)    # a column block
    assert not Box((0, 0, 0), (0, 3, 5)).is_run_of(outer)    # empty
    assert not Box((3, 0, 0), (2, 3, 5)).is_run_of(outer)    # not inside
    assert Box((), ()).is_run_of(Box((), ()))                # a scalar


@SETTINGS
@given(box_pairs())
def test_local_and_shift_round_trip(pair):
    outer, inner = pair
    common = outer.intersect(inner)
    if common is None:
        return
    local = common.local(outer)
    assert all(o >= 0 for o in local.offsets)
    assert Box.whole(outer.lengths).contains(local)
    assert local.shift(outer) == common


def test_local_outside_origin_is_an_error():
    with pytest.raises(BoxError, match="does not lie inside"):
        Box((4,), (2,)).local(Box((0,), (5,)))


def test_invalid_boxes_are_rejected():
    with pytest.raises(BoxError):
        Box((0, 0), (1,))
    with pytest.raises(BoxError):
        Box((0,), (-1,))
    with pytest.raises(BoxError):
        Box((1,), (1,)).intersect(Box((1, 1), (1, 1)))


def test_scalar_box_has_volume_one_and_slices_index_numpy():
    import numpy as np
    assert Box((), ()).volume == 1
    array = np.arange(24).reshape(4, 6)
    assert (array[Box((1, 2), (2, 3)).slices()] == array[1:3, 2:5]).all()
    assert Box.trusted((1,), (2,)) == Box((1,), (2,))
