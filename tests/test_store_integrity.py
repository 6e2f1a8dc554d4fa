"""Issue 12, defects 1-4: stored bytes are verified on every read path (per-block checksums), a truncated shard
never kills the server, and cached readers never serve a deleted or replaced version."""

from __future__ import annotations

import os
import subprocess

import grpc
import numpy as np
import pytest

from tenplex.box import Box
from tenplex.errors import StoreError, TransformError
from tenplex.planner import plan
from tenplex.store import Store, checksum
from tenplex.store.blocks import BLOCK_BYTES, block_digests, root_digest
from tenplex.store.client import RemoteStoreError, StoreClient
from tenplex.store.manifest import CorruptShard
from tenplex.transform import transform

from store_helpers import (Cluster, StoreProcess, assert_version_matches, flip_data_byte, random_globals, tiny_layout,
                           write_version)

ROWS, COLS = 768, 1024  # float32: 3 MiB, three 1 MiB blocks; one row is 4 KiB
BLOCK_ROWS = BLOCK_BYTES // (COLS * 4)


def _matrix(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((ROWS, COLS), dtype=np.float32)


def _write(store: Store, version: int, data: np.ndarray) -> None:
    with store.begin(version) as w:
        w.put("h0/0", "w", Box((0, 0), data.shape), data, "float32", shape=data.shape)
        w.put_json("step", {"step": version})
        w.commit()


def _flip(store: Store, version: int, data_byte: int) -> str:
    """Flip one byte of the stored data of h0/0's shard of ``w`` (``data_byte`` counts from the data start)."""
    reader = store.open(version)
    entry = reader.find("h0/0", "w", Box((0, 0), (1, 1)))
    flip_data_byte(reader.path / entry.file, data_byte)
    return entry.file


def test_block_checksum_format_is_pinned():
    """Blocks of BLOCK_BYTES (1 MiB), xxh3_64 each as 16 hex digits; the shard's xxh3 is the xxh3_64 of the
    concatenated 8-byte big-endian block digests."""
    assert BLOCK_BYTES == 1 << 20
    data = bytes(range(256)) * (4096 + 16)  # 1 MiB + 4 KiB: two blocks, the last one short
    blocks = block_digests(memoryview(data))
    assert blocks == [checksum(data[:BLOCK_BYTES]), checksum(data[BLOCK_BYTES:])]
    assert root_digest(blocks) == checksum(b"".join(bytes.fromhex(b) for b in blocks))
    assert block_digests(memoryview(b"")) == []
    assert root_digest([]) == checksum(b"")


def test_manifest_rows_carry_block_checksums(tmp_path):
    store = Store(tmp_path / "s", "h0")
    data = _matrix()
    _write(store, 1, data)
    row = store.open(1).manifest["shards"][0]
    raw = data.tobytes()
    assert row["block_bytes"] == BLOCK_BYTES
    assert row["blocks"] == [checksum(raw[i:i + BLOCK_BYTES]) for i in range(0, len(raw), BLOCK_BYTES)]
    assert row["xxh3"] == root_digest(row["blocks"])


def test_local_read_detects_a_flipped_bit_and_names_the_shard(tmp_path):
    store = Store(tmp_path / "s", "h0")
    data = _matrix()
    _write(store, 1, data)
    file = _flip(store, 1, BLOCK_BYTES + 100)  # in block 1
    reader = store.open(1)
    # only the blocks a read touches are checked: block 0 reads fine
    np.testing.assert_array_equal(reader.read("h0/0", "w", Box((0, 0), (BLOCK_ROWS, COLS))), data[:BLOCK_ROWS])
    with pytest.raises(CorruptShard) as info:
        reader.read("h0/0", "w", Box((BLOCK_ROWS, 0), (1, 8)))
    message = str(info.value)
    for part in ("version 1", "h0/0", "'w'", file, "block 1"):
        assert part in message
    assert isinstance(info.value, StoreError)
    with pytest.raises(CorruptShard):
        reader.read("h0/0", "w", Box((0, 0), (ROWS, COLS)))
    out = np.empty((ROWS, COLS), np.float32)
    with pytest.raises(CorruptShard):  # the restore path (reads straight into the destination)
        reader.readinto("h0/0", "w", Box((0, 0), (ROWS, COLS)), memoryview(out).cast("B"))
    assert len(reader.verify()) == 1 and "block 1" in reader.verify()[0]


def test_restore_path_detects_corruption(tmp_path):
    """``shardio.read_piece`` (what Checkpointer.restore uses) verifies the bytes it reads."""
    import torch

    from tenplex.integration.pieces import Piece
    from tenplex.integration.shardio import read_piece
    from tenplex.layout import TensorSpec

    store = Store(tmp_path / "s", "h0")
    data = _matrix()
    _write(store, 1, data)
    _flip(store, 1, 2 * BLOCK_BYTES + 4)
    local = torch.zeros((ROWS, COLS))
    piece = Piece("w", TensorSpec((ROWS, COLS), "float32"), Box((0, 0), (ROWS, COLS)), Box((0, 0), (ROWS, COLS)),
                  local)
    with pytest.raises(CorruptShard, match="block 2"):
        read_piece(store.open(1), [("h0/0", Box((0, 0), (ROWS, COLS)))], piece)
    # a region that is one contiguous run of the file is read straight into the tensor, and verified as well
    rows = Box((2 * BLOCK_ROWS, 0), (ROWS - 2 * BLOCK_ROWS, COLS))
    part = Piece("w", TensorSpec((ROWS, COLS), "float32"), rows, Box((0, 0), rows.lengths), local[:rows.lengths[0]])
    with pytest.raises(CorruptShard, match="block 2"):
        read_piece(store.open(1), [("h0/0", rows)], part)
    good = Piece("w", TensorSpec((ROWS, COLS), "float32"), Box((0, 0), (BLOCK_ROWS, COLS)),
                 Box((0, 0), (BLOCK_ROWS, COLS)), local[:BLOCK_ROWS])
    read_piece(store.open(1), [("h0/0", Box((0, 0), (BLOCK_ROWS, COLS)))], good)
    np.testing.assert_array_equal(local[:BLOCK_ROWS].numpy(), data[:BLOCK_ROWS])


@pytest.mark.parametrize("data_plane", [False, True], ids=["grpc", "dataplane"])
def test_remote_reads_refuse_corrupted_shards(tmp_path, data_plane):
    store = Store(tmp_path / "h0", "h0")
    data = _matrix()
    _write(store, 1, data)
    file = _flip(store, 1, 5)
    proc = StoreProcess(tmp_path / "h0", "h0")
    try:
        with StoreClient(proc.address, timeout=30, data_plane=data_plane, data_plane_min_bytes=1) as client:
            with pytest.raises(RemoteStoreError) as info:
                client.read_box(1, "h0/0", "w", Box((0, 0), (ROWS, COLS)), "float32")
            assert info.value.code == grpc.StatusCode.DATA_LOSS
            for part in ("version 1", "h0/0", "'w'", file, "block 0"):
                assert part in str(info.value)
            # untouched blocks still read, and the server keeps serving
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((BLOCK_ROWS, 0), (ROWS - BLOCK_ROWS,
                                                                                               COLS)), "float32"),
                                          data[BLOCK_ROWS:])
            with pytest.raises(RemoteStoreError) as info:
                client.read_boxes_to(1, [("h0/0", "w", Box((0, 0), (1, 4)), 4, lambda sub, b: None)])
            assert info.value.code == grpc.StatusCode.DATA_LOSS
            assert client.health()["versions"] == [1]
    finally:
        proc.stop()


def _replicated():
    tensors = {"a": ((ROWS, COLS), "float32")}
    old = tiny_layout(tensors, {f"{h}/0": [("a", (0, 0), (ROWS, COLS))] for h in ("h0", "h1")})
    new = tiny_layout(tensors, {"h2/0": [("a", (0, 0), (ROWS // 2, COLS))],
                                "h2/1": [("a", (ROWS // 2, 0), (ROWS // 2, COLS))]})
    return old, new


def _corrupt_shard(root, host: str, version: int, data_byte: int) -> None:
    reader = Store(root, host).open(version)
    flip_data_byte(reader.path / reader.entries[0].file, data_byte, mask=1)


def test_transform_never_launders_corruption_and_falls_back_to_a_replica(tmp_path):
    old, new = _replicated()
    with Cluster(tmp_path, ["h0", "h1", "h2"]) as cluster:
        arrays = random_globals(old)
        write_version(cluster.roots, old, 1, arrays)
        _corrupt_shard(cluster.roots["h0"], "h0", 1, 3)
        _corrupt_shard(cluster.roots["h1"], "h1", 1, 2 * BLOCK_BYTES + 3)  # each replica has one bad block
        report = transform(plan(old, new), old, new, cluster.addresses, 1, 2)
        assert report["hosts"]["h2"]["refetched_bytes"] > 0
        assert_version_matches(cluster.roots, new, 2, arrays)  # bit for bit the original, not the corruption


def test_transform_without_a_good_replica_fails_and_commits_nothing(tmp_path):
    old, new = _replicated()
    with Cluster(tmp_path, ["h0", "h1", "h2"]) as cluster:
        arrays = random_globals(old)
        write_version(cluster.roots, old, 1, arrays)
        _corrupt_shard(cluster.roots["h0"], "h0", 1, 7)
        _corrupt_shard(cluster.roots["h1"], "h1", 1, 9)
        with pytest.raises(TransformError) as info:
            transform(plan(old, new), old, new, cluster.addresses, 1, 2)
        assert "DATA_LOSS" in str(info.value) and "damaged" in str(info.value), str(info.value)
        assert Store(cluster.roots["h2"], "h2").versions() == []


def test_local_transform_source_is_verified(tmp_path):
    """A host copying its own old shard (no network) verifies it too, and takes a remote replica instead."""
    tensors = {"a": ((ROWS, COLS), "float32")}
    old = tiny_layout(tensors, {f"{h}/0": [("a", (0, 0), (ROWS, COLS))] for h in ("h0", "h1")})
    new = tiny_layout(tensors, {"h0/0": [("a", (0, 0), (ROWS // 2, COLS))],
                                "h0/1": [("a", (ROWS // 2, 0), (ROWS // 2, COLS))],
                                "h1/0": [("a", (0, 0), (ROWS, COLS))]})
    with Cluster(tmp_path, ["h0", "h1"]) as cluster:
        arrays = random_globals(old)
        write_version(cluster.roots, old, 1, arrays)
        _corrupt_shard(cluster.roots["h0"], "h0", 1, 11)
        report = transform(plan(old, new), old, new, cluster.addresses, 1, 2)
        assert report["hosts"]["h0"]["refetched_bytes"] > 0
        assert_version_matches(cluster.roots, new, 2, arrays)


def test_versions_written_before_block_checksums_are_verified_whole(tmp_path):
    """A manifest row without ``blocks`` (tenplex before issue 12) is checked against its whole-shard xxh3."""
    import json

    store = Store(tmp_path / "s", "h0")
    data = _matrix()
    _write(store, 1, data)
    path = store.root / "versions" / "1" / "manifest.json"
    doc = json.loads(path.read_text())
    for row in doc["shards"]:
        del row["blocks"], row["block_bytes"]
        row["xxh3"] = checksum(data.tobytes())
    path.write_text(json.dumps(doc))
    np.testing.assert_array_equal(store.open(1).read("h0/0", "w", Box((5, 0), (2, COLS))), data[5:7])
    assert store.open(1).verify() == []
    _flip(store, 1, 2 * BLOCK_BYTES + 1)
    with pytest.raises(CorruptShard, match="whole shard"):
        store.open(1).read("h0/0", "w", Box((0, 0), (1, 4)))


# ---- defect 2: SIGBUS ------------------------------------------------------------------------------------
@pytest.mark.parametrize("data_plane", [False, True], ids=["grpc", "dataplane"])
def test_truncated_shard_fails_its_reads_and_the_server_survives(tmp_path, data_plane):
    store = Store(tmp_path / "h0", "h0")
    data = _matrix()
    _write(store, 1, data)
    _write(store, 2, data + 1)
    proc = StoreProcess(tmp_path / "h0", "h0")
    try:
        with StoreClient(proc.address, timeout=30, data_plane=data_plane, data_plane_min_bytes=1) as client:
            whole = Box((0, 0), (ROWS, COLS))
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", whole, "float32"), data)  # cached, mapped
            reader = store.open(1)
            path = reader.path / reader.entries[0].file
            os.truncate(path, os.path.getsize(path) // 2)
            with pytest.raises(RemoteStoreError) as info:
                client.read_box(1, "h0/0", "w", whole, "float32")
            assert proc.alive(), "the server died reading a truncated file"
            assert info.value.code == grpc.StatusCode.DATA_LOSS
            assert "truncated" in str(info.value) and reader.entries[0].file in str(info.value)
            np.testing.assert_array_equal(client.read_box(2, "h0/0", "w", whole, "float32"), data + 1)
    finally:
        proc.stop()


def test_truncated_shard_fails_local_reads_with_a_clear_error(tmp_path):
    store = Store(tmp_path / "s", "h0")
    _write(store, 1, _matrix())
    reader = store.open(1)
    path = reader.path / reader.entries[0].file
    os.truncate(path, 100)
    with pytest.raises(CorruptShard, match="truncated"):
        reader.read("h0/0", "w", Box((0, 0), (1, 1)))
    with open(path, "r+b") as f:  # a header length of 2^62
        f.write((1 << 62).to_bytes(8, "little"))
    with pytest.raises(CorruptShard, match="header"):
        store.open(1).read("h0/0", "w", Box((0, 0), (1, 1)))


# ---- defects 3 and 4: stale cached readers ------------------------------------------------------------------
@pytest.mark.parametrize("how", ["delete", "gc"])
@pytest.mark.parametrize("data_plane", [False, True], ids=["grpc", "dataplane"])
def test_no_stale_reads_after_a_local_delete_and_recommit(tmp_path, how, data_plane):
    store = Store(tmp_path / "h0", "h0")
    old, new = _matrix(1), _matrix(2)
    _write(store, 3, old)
    proc = StoreProcess(tmp_path / "h0", "h0")
    try:
        with StoreClient(proc.address, timeout=30, data_plane=data_plane, data_plane_min_bytes=1) as client:
            whole = Box((0, 0), (ROWS, COLS))
            np.testing.assert_array_equal(client.read_box(3, "h0/0", "w", whole, "float32"), old)
            assert client.get_json(3, "step") == {"step": 3}
            if how == "delete":
                store.delete(3)  # a local writer, as Checkpointer.save's failure path does
            else:
                _write(store, 4, old)
                store.gc(keep=1)
                store.delete(4)
            _write(store, 3, new)
            np.testing.assert_array_equal(client.read_box(3, "h0/0", "w", whole, "float32"), new)
            assert client.manifest(3)["shards"][0]["xxh3"] == store.open(3).entries[0].xxh3
    finally:
        proc.stop()


def _held_deleted_files(pid: int) -> list[str]:
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.endswith("(deleted)"):
            held.append(target)
    with open(f"/proc/{pid}/maps") as f:
        held += [line.split(None, 5)[-1].strip() for line in f if "(deleted)" in line]
    return held


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a 64 MiB tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_local_gc_frees_the_space_the_server_read(small_tmpfs):
    store = Store(small_tmpfs / "h0", "h0")
    for v in (1, 2, 3):
        _write(store, v, _matrix(v))
    proc = StoreProcess(small_tmpfs / "h0", "h0")
    try:
        with StoreClient(proc.address, timeout=30, data_plane_min_bytes=1) as client:
            for v in (1, 2, 3):
                client.read_box(v, "h0/0", "w", Box((0, 0), (ROWS, COLS)), "float32")
            with StoreClient(proc.address, timeout=30, data_plane=False) as grpc_client:
                for v in (1, 2, 3):
                    grpc_client.read_box(v, "h0/0", "w", Box((0, 0), (ROWS, COLS)), "float32")
            used = os.statvfs(small_tmpfs)
            assert store.gc(keep=1) == [1, 2]
            client.versions()
            assert _held_deleted_files(proc.proc.pid) == []
            after = os.statvfs(small_tmpfs)
            freed = (after.f_bfree - used.f_bfree) * after.f_frsize
            assert freed >= 2 * ROWS * COLS * 4, f"only {freed} bytes were freed"
    finally:
        proc.stop()


# ---- block checksums computed while a shard is written ------------------------------------------------------
@pytest.mark.parametrize("order", ["whole", "rows", "runs", "reversed", "columns", "shuffled", "allocate"])
def test_shard_target_block_checksums_match_the_data_in_any_write_order(tmp_path, order):
    import random
    from concurrent.futures import ThreadPoolExecutor

    store = Store(tmp_path / "s", "h0")
    data = _matrix(5)
    whole = Box((0, 0), (ROWS, COLS))
    writer = store.begin(1)
    target = writer.create("h0/0", "w", whole, "float32", shape=(ROWS, COLS))
    reads = []
    original = target._read_block
    target._tally._read = lambda index, view: (reads.append(index), original(index, view))  # what the tally reads back
    if order == "whole":
        target.write(whole, data)
    elif order == "rows":  # 100-row slabs: long runs (pwrite), block edges inside writes
        for r in range(0, ROWS, 100):
            box = Box((r, 0), (min(100, ROWS - r), COLS))
            target.write(box, data[box.slices()])
    elif order in ("runs", "reversed"):  # raw bytes piece by piece, off the block grid (a local copy's pieces)
        raw = memoryview(data.tobytes())
        pieces = [(0, 1000)] + [(a, min(a + BLOCK_BYTES, len(raw))) for a in range(1000, len(raw), BLOCK_BYTES)]
        for a, b in (pieces if order == "runs" else reversed(pieces)):
            target.write_at(a, raw[a:b])
    elif order == "columns":  # 16-column strips: short runs through the map
        for c in range(0, COLS, 16):
            box = Box((0, c), (ROWS, 16))
            target.write(box, data[box.slices()])
    elif order == "shuffled":  # 32x256 tiles from 4 threads in random order
        tiles = [Box((r, c), (32, 256)) for r in range(0, ROWS, 32) for c in range(0, COLS, 256)]
        random.Random(0).shuffle(tiles)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda b: target.write(b, data[b.slices()]), tiles))
    else:
        target.array[...] = data
    writer.prepare()
    store.commit(1)
    row = store.open(1).manifest["shards"][0]
    raw = data.tobytes()
    assert row["blocks"] == [checksum(raw[i:i + BLOCK_BYTES]) for i in range(0, len(raw), BLOCK_BYTES)]
    assert store.open(1).verify() == []
    if order == "whole":
        assert reads == [], "blocks inside one write must be hashed from the written bytes"
    if order in ("rows", "runs"):
        assert reads == [], "blocks written in order from their first byte are hashed as the bytes arrive"
    if order == "reversed":
        assert reads and sorted(reads) == sorted(set(reads)), "out of order: read back once, when complete"


def test_a_known_digest_stands_for_exactly_one_whole_block(tmp_path):
    """A chunk's digest (checked on arrival, or a stored block's after verifying it) is taken as the new block's
    digest when the write is exactly one whole block, so those bytes are not hashed again; any other write ignores
    it. Made-up digests show which were taken."""
    data = _matrix(6)
    raw = memoryview(data.tobytes())
    whole = Box((0, 0), (ROWS, COLS))
    first, third = 0x0123456789ABCDEF, 0xFEDCBA9876543210
    writer = Store(tmp_path / "s", "h0").begin(1)
    target = writer.create("h0/0", "w", whole, "float32", shape=(ROWS, COLS))
    reads = []
    original = target._read_block
    target._tally._read = lambda index, view: (reads.append(index), original(index, view))
    target.write(Box((0, 0), (BLOCK_ROWS, COLS)), data[:BLOCK_ROWS], first)  # block 0, whole
    half = BLOCK_BYTES // 2
    target.write_at(BLOCK_BYTES, raw[BLOCK_BYTES:BLOCK_BYTES + half], third)  # block 1 in two halves: hashed
    target.write_at(BLOCK_BYTES + half, raw[BLOCK_BYTES + half:2 * BLOCK_BYTES], third)
    target.write_at(2 * BLOCK_BYTES, raw[2 * BLOCK_BYTES:], third)  # block 2, whole
    assert target.finish() == [f"{first:016x}", checksum(raw[BLOCK_BYTES:2 * BLOCK_BYTES]), f"{third:016x}"]
    assert reads == []
    spanning = writer.create("h0/1", "w", whole, "float32", shape=(ROWS, COLS))
    spanning.write(whole, data, first)  # three blocks in one write: the digest is not theirs
    assert spanning.finish() == [checksum(raw[i:i + BLOCK_BYTES]) for i in range(0, len(raw), BLOCK_BYTES)]
    again = writer.create("h0/2", "w", whole, "float32", shape=(ROWS, COLS))
    again.write_at(0, raw[:1000])
    again.write_at(0, raw[:BLOCK_BYTES], first)  # a whole block written over part of it: hashed from the file
    again.write_at(BLOCK_BYTES, raw[BLOCK_BYTES:])
    assert again.finish()[0] == checksum(raw[:BLOCK_BYTES])


def test_shard_file_block_digest_is_the_stored_one_for_exactly_one_block(tmp_path):
    store = Store(tmp_path / "s", "h0")
    data = _matrix()[:640]  # 2.5 MiB: blocks of 1, 1 and 0.5 MiB
    _write(store, 1, data)
    reader = store.open(1)
    shard = reader.shard_file(reader.find("h0/0", "w", Box((0, 0), (1, 1))))
    blocks = reader.manifest["shards"][0]["blocks"]
    assert [shard.block_digest(start, length) for start, length in
            ((0, BLOCK_BYTES), (BLOCK_BYTES, BLOCK_BYTES), (2 * BLOCK_BYTES, BLOCK_BYTES // 2))] == \
        [int(b, 16) for b in blocks]
    for start, length in ((0, BLOCK_BYTES // 2), (4096, BLOCK_BYTES), (0, 2 * BLOCK_BYTES),
                          (2 * BLOCK_BYTES, BLOCK_BYTES // 4), (len(data.tobytes()), 0)):
        assert shard.block_digest(start, length) is None, (start, length)


def test_shard_target_run_offset_is_the_data_offset_of_a_contiguous_region(tmp_path):
    writer = Store(tmp_path / "s", "h0").begin(1)
    matrix = writer.create("h0/0", "w", Box((10, 0), (4, 6)), "float32", shape=(20, 6))
    cube = writer.create("h0/1", "c", Box((0, 0, 0), (3, 4, 5)), "float32", shape=(3, 4, 5))
    assert matrix.run_offset(Box((11, 0), (2, 6))) == 1 * 6 * 4   # whole rows
    assert matrix.run_offset(Box((12, 2), (1, 3))) == (2 * 6 + 2) * 4   # part of one row
    assert matrix.run_offset(Box((11, 2), (2, 3))) is None   # parts of two rows
    assert cube.run_offset(Box((1, 0, 0), (2, 4, 5))) == 1 * 20 * 4
    assert cube.run_offset(Box((2, 1, 0), (1, 2, 5))) == (2 * 20 + 1 * 5) * 4
    assert cube.run_offset(Box((1, 1, 0), (2, 2, 5))) is None
    assert cube.run_offset(Box((1, 2, 3), (1, 1, 2))) == (20 + 2 * 5 + 3) * 4
    with pytest.raises(StoreError, match="outside shard"):
        matrix.write_at(4 * 6 * 4 - 4, memoryview(bytes(8)))
