"""Issue 31 item 9: a shard of a version written before block checksums (one checksum of the whole data) is never
served or laundered after a byte of it is damaged on disk, even by a server whose cached reader read it before."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from tenplex.box import Box
from tenplex.errors import TransformError
from tenplex.planner import plan
from tenplex.store import Store, checksum
from tenplex.store.client import RemoteStoreError, StoreClient
from tenplex.store.manifest import CorruptShard
from tenplex.transform import transform

from store_helpers import Cluster, flip_data_byte, tiny_layout, write_version

ROWS, COLS = 768, 1024  # float32: 3 MiB; one row is 4 KiB
WHOLE = Box((0, 0), (ROWS, COLS))
LATE = 2 * (1 << 20) + 8  # a data byte in the third MiB, away from the first rows read


def _as_written_before_blocks(root, host: str, version: int, arrays: dict[str, np.ndarray]) -> None:
    """Rewrite ``version``'s manifest as tenplex wrote it before block checksums: rows without ``blocks``, each
    with the xxh3 of its whole data."""
    path = root / "versions" / str(version) / "manifest.json"
    doc = json.loads(path.read_text())
    for row in doc["shards"]:
        del row["blocks"], row["block_bytes"]
        box = Box(tuple(row["offsets"]), tuple(row["lengths"]))
        row["xxh3"] = checksum(np.ascontiguousarray(arrays[row["tensor"]][box.slices()]).tobytes())
    path.write_text(json.dumps(doc))


def _flip(store: Store, version: int) -> None:
    reader = store.open(version)
    flip_data_byte(reader.path / reader.entries[0].file, LATE)


def _one_host(tmp_path) -> tuple[Cluster, dict[str, np.ndarray], object]:
    layout = tiny_layout({"w": ((ROWS, COLS), "float32")}, {"h0/0": [("w", (0, 0), (ROWS, COLS))]})
    arrays = {"w": np.random.default_rng(5).random((ROWS, COLS), dtype=np.float32)}
    cluster = Cluster(tmp_path, ["h0"])
    write_version(cluster.roots, layout, 1, arrays)
    _as_written_before_blocks(cluster.roots["h0"], "h0", 1, arrays)
    return cluster, arrays, layout


def test_a_reader_checks_later_reads_against_digests_derived_from_the_whole_check(tmp_path):
    store = Store(tmp_path / "h0", "h0")
    layout = tiny_layout({"w": ((ROWS, COLS), "float32")}, {"h0/0": [("w", (0, 0), (ROWS, COLS))]})
    arrays = {"w": np.random.default_rng(5).random((ROWS, COLS), dtype=np.float32)}
    write_version({"h0": store.root}, layout, 1, arrays)
    _as_written_before_blocks(store.root, "h0", 1, arrays)
    reader = store.open(1)
    np.testing.assert_array_equal(reader.read("h0/0", "w", Box((0, 0), (2, COLS))), arrays["w"][:2])
    _flip(store, 1)
    np.testing.assert_array_equal(reader.read("h0/0", "w", Box((0, 0), (2, COLS))), arrays["w"][:2])  # untouched
    with pytest.raises(CorruptShard, match="block 2 .* the digest derived when the whole shard last matched"):
        reader.read("h0/0", "w", WHOLE)
    assert reader.verify() and "whole shard has xxh3" in reader.verify()[0]


@pytest.mark.parametrize("data_plane", [False, True], ids=["grpc", "dataplane"])
def test_a_server_that_read_a_shard_never_serves_it_damaged(tmp_path, data_plane):
    cluster, arrays, _ = _one_host(tmp_path)
    with cluster, StoreClient(cluster.addresses["h0"], timeout=30, data_plane=data_plane, data_plane_min_bytes=1,
                              retries=0) as client:
        np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", WHOLE, "float32"), arrays["w"])  # cached
        _flip(Store(cluster.roots["h0"], "h0"), 1)
        with pytest.raises(RemoteStoreError) as info:
            client.read_box(1, "h0/0", "w", WHOLE, "float32")
        assert info.value.code == grpc.StatusCode.DATA_LOSS, str(info.value)


def test_a_transformation_never_launders_a_byte_damaged_after_a_first_read(tmp_path):
    """h1 pulls the whole tensor from h0's server, whose cached reader read it before the byte flipped: the
    transformation fails (no other replica) instead of committing the damage with fresh checksums."""
    tensors = {"w": ((ROWS, COLS), "float32")}
    old = tiny_layout(tensors, {"h0/0": [("w", (0, 0), (ROWS, COLS))]})
    new = tiny_layout(tensors, {"h1/0": [("w", (0, 0), (ROWS, COLS))]})
    arrays = {"w": np.random.default_rng(6).random((ROWS, COLS), dtype=np.float32)}
    with Cluster(tmp_path, ["h0", "h1"]) as cluster:
        write_version(cluster.roots, old, 1, arrays)
        _as_written_before_blocks(cluster.roots["h0"], "h0", 1, arrays)
        with StoreClient(cluster.addresses["h0"], timeout=30) as client:
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", WHOLE, "float32"), arrays["w"])
        _flip(Store(cluster.roots["h0"], "h0"), 1)
        with pytest.raises(TransformError, match="damaged"):
            transform(plan(old, new), old, new, cluster.addresses, 1, 2)
        assert Store(cluster.roots["h1"], "h1").versions() == []
