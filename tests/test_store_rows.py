"""Reading a region into place: the row geometry (golden values), strided destinations filled bit for bit from
real stored shards across block and piece boundaries, and verification on that path too."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tenplex.box import Box
from tenplex.errors import StoreError
from tenplex.store import Store
from tenplex.store.manifest import CorruptShard
from tenplex.store.reader import row_geometry

from store_helpers import flip_data_byte


def test_row_geometry_golden_values():
    # half the columns of a 4 x 6 float32 shard, into a contiguous destination: 4 rows of 12 bytes
    assert row_geometry((4, 3), (24, 4), (12, 4), 4) == (4, 12, 24, 12)
    # the whole shard (contiguous in the file) into a column block of a 4 x 10 tensor
    assert row_geometry((4, 6), (24, 4), (40, 4), 4) == (4, 24, 24, 40)
    # contiguous in both: one row
    assert row_geometry((4, 6), (24, 4), (24, 4), 4) == (1, 96, 96, 96)
    # 3-D: whole inner dims merge into the row, even outer dims into one
    assert row_geometry((2, 3, 5), (60, 20, 4), (60, 20, 4), 4) == (1, 120, 120, 120)
    assert row_geometry((2, 3, 2), (60, 20, 4), (24, 8, 4), 4) == (6, 8, 20, 8)
    # whole rows of a middle dimension join the row; part of a row and part of the middle: uneven steps
    assert row_geometry((2, 2, 5), (60, 20, 4), (40, 20, 4), 4) == (2, 40, 60, 40)
    assert row_geometry((2, 2, 3), (60, 20, 4), (24, 12, 4), 4) is None
    # dimensions of length 1 do not count; a column is rows of one item
    assert row_geometry((1, 4, 1), (96, 24, 4), (16, 4, 4), 4) == (4, 4, 24, 4)
    assert row_geometry((4, 1), (24, 4), (4, 4), 4) == (4, 4, 24, 4)
    assert row_geometry((1, 1), (24, 4), (4, 4), 4) == (1, 4, 4, 4)
    # a strided innermost dimension in the destination, inside rows that step unevenly: no row geometry
    assert row_geometry((4, 3), (24, 4), (24, 8), 4) is None
    assert row_geometry((4, 3), (12, 4), (24, 8), 4) == (12, 4, 4, 8)


SHAPE = (96, 40, 33)  # float32: 495 KiB per 32 rows of dim 0 -> ~1.45 MiB, two blocks; odd sizes cut rows at ends


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    data = np.random.default_rng(7).random(SHAPE, dtype=np.float32)
    big = np.random.default_rng(8).random((256, 1100), dtype=np.float32)  # 1.07 MiB: rows cross pieces
    store = Store(root, "h0")
    with store.begin(1) as w:
        w.put("h0/0", "t", Box((0, 0, 0), SHAPE), data, "float32", shape=SHAPE)
        w.put("h0/0", "m", Box((0, 0), big.shape), big, "float32", shape=big.shape)
        w.commit()
    return store, data, big


BOXES = [Box((0, 0, 0), SHAPE), Box((10, 0, 0), (50, 40, 33)), Box((0, 0, 5), (96, 40, 20)),
         Box((3, 7, 0), (80, 20, 33)), Box((1, 2, 3), (90, 30, 25)), Box((95, 39, 32), (1, 1, 1)),
         Box((0, 5, 0), (96, 1, 33))]


@pytest.mark.parametrize("box", BOXES, ids=str)
def test_regions_fill_strided_destinations_bit_for_bit(stored, box):
    store, data, _ = stored
    reader = store.open(1)
    expected = data[box.slices()]
    # contiguous destinations (bytes and arrays) and a block of a larger array (a column block of a tensor)
    flat = bytearray(expected.nbytes)
    reader.readinto("h0/0", "t", box, flat)
    assert bytes(flat) == expected.tobytes()
    outer = np.full(tuple(n + 3 for n in box.lengths), -1.0, np.float32)
    inner = outer[tuple(slice(1, 1 + n) for n in box.lengths)]
    reader.readinto("h0/0", "t", box, inner)
    assert np.array_equal(inner, expected)
    inner[...] = -1.0
    assert (outer == -1.0).all()  # nothing outside the block was written


@pytest.mark.parametrize("box", BOXES, ids=str)
def test_read_returns_the_region_contiguous(stored, box):
    store, data, _ = stored
    values = store.open(1).read("h0/0", "t", box)
    strides = [SHAPE[1] * SHAPE[2] * 4, SHAPE[2] * 4, 4]
    lined_up = row_geometry(box.lengths, strides, np.empty(box.lengths, np.float32).strides, 4) is not None
    assert values.flags.c_contiguous == lined_up and values.dtype == np.float32
    assert np.array_equal(values, data[box.slices()])


def test_long_rows_crossing_pieces_and_blocks(stored):
    store, _, big = stored
    reader = store.open(1)
    for cols in (slice(0, 1100), slice(1, 1099), slice(500, 501), slice(0, 550)):
        box = Box((0, cols.start), (256, cols.stop - cols.start))
        target = np.zeros((256, 1200), np.float32)[:, 50:50 + box.lengths[1]]
        reader.readinto("h0/0", "m", box, target)
        assert np.array_equal(target, big[:, cols])


def test_rows_path_verifies_every_block_it_reads(tmp_path):
    store = Store(tmp_path, "h0")
    data = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB: two blocks
    with store.begin(1) as w:
        w.put("h0/0", "w", Box((0, 0), data.shape), data, "float32", shape=data.shape)
        w.commit()
    reader = store.open(1)
    entry = reader.find("h0/0", "w", Box((0, 0), (1, 1)))
    flip_data_byte(reader.path / entry.file, 300 * 4096 + 1000 * 4 + 1)  # block 1, row 300, column 1000: not read
    box = Box((0, 0), (512, 10))  # the first 10 columns of every row: touches both blocks
    with pytest.raises(CorruptShard, match=r"tensor .w.*block 1 \(data bytes 1048576-2097152\)"):
        reader.readinto("h0/0", "w", box, np.zeros((512, 20), np.float32)[:, :10])


def test_destination_of_the_wrong_shape_or_read_only_is_refused(stored):
    store, _, _ = stored
    reader = store.open(1)
    box = Box((0, 0, 0), (2, 2, 2))
    for bad in (np.zeros((2, 2), np.float32), np.zeros((2, 2, 2), np.float64),
                np.zeros((2, 2, 2), np.float32)[::1].view()):
        if bad.ndim == 3 and bad.dtype == np.float32:
            bad.flags.writeable = False
        with pytest.raises(StoreError, match="destination array"):
            reader.readinto("h0/0", "t", box, bad)


def test_every_sub_box_of_a_small_shard(tmp_path):
    # exhaustive over a small 3-D shard: every box, contiguous and strided destinations
    store = Store(tmp_path, "h0")
    data = np.arange(4 * 3 * 5, dtype=np.int16).reshape(4, 3, 5)
    with store.begin(1) as w:
        w.put("h0/0", "x", Box((0, 0, 0), data.shape), data, "int16", shape=data.shape)
        w.commit()
    reader = store.open(1)
    ranges = [[(a, b) for a in range(n) for b in range(a + 1, n + 1)] for n in data.shape]
    for (a0, b0), (a1, b1), (a2, b2) in itertools.product(*ranges):
        box = Box((a0, a1, a2), (b0 - a0, b1 - a1, b2 - a2))
        target = np.zeros((9, 9, 9), np.int16)[1:1 + box.lengths[0], 2:2 + box.lengths[1], ::2][:, :, :box.lengths[2]]
        reader.readinto("h0/0", "x", box, target)
        assert np.array_equal(target, data[a0:b0, a1:b1, a2:b2]), box


def test_bench_reads_reports_every_case_against_its_baselines():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tenplex.cli", "bench", "reads", "--json", "--mib", "4",
                          "--repeat", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["bytes"] == 4 << 20 and doc["rows"] * doc["cols"] * 4 == doc["bytes"]
    sizes = {"whole": 4 << 20, "whole_into_columns": 4 << 20, "half_columns": 2 << 20, "half_rows": 2 << 20}
    for case, nbytes in sizes.items():
        row = doc[case]
        assert row["bytes"] == nbytes
        assert row["verified_s"] > 0 and row["mmap_s"] > 0 and row["memcpy_s"] > 0
        assert row["verified_over_mmap"] == pytest.approx(row["verified_s"] / row["mmap_s"], rel=0.02, abs=0.01)
