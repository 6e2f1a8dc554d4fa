"""Slice rows: a new shard that is one contiguous run of an old shard's bytes is that file, hard-linked, plus where
its bytes start (``VersionWriter.link(..., box)``); the transformer links them for ZeRO/FSDP-style changes instead of
copying, and never links damaged bytes."""

from __future__ import annotations

import contextlib
import os
import subprocess

import numpy as np
import pytest

from tenplex.box import Box
from tenplex.errors import StoreError
from tenplex.planner import plan
from tenplex.store import Store, checksum
from tenplex.store.blocks import BLOCK_BYTES, block_digests, root_digest
from tenplex.store.manifest import CorruptShard, ShardEntry
from tenplex.transform import transform

from store_helpers import (Cluster, assert_version_matches, flip_data_byte, gpt_layout, random_globals, tiny_layout,
                           write_version)

ROWS, COLS = 768, 1024  # float32: 3 MiB, three 1 MiB blocks; one row is 4 KiB
ROW_BYTES = COLS * 4
BLOCK_ROWS = BLOCK_BYTES // ROW_BYTES  # 256


def _rows(lo: int, hi: int) -> Box:
    return Box((lo, 0), (hi - lo, COLS))


def _old_version(tmp_path) -> tuple[Store, np.ndarray]:
    store = Store(tmp_path / "s", "h0")
    data = np.random.default_rng(3).random((ROWS, COLS), dtype=np.float32)
    with store.begin(1) as w:
        w.put("h0/0", "w", _rows(0, ROWS), data, "float32", shape=data.shape)
        w.commit()
    return store, data


def _link(store: Store, version: int, source_version: int, links: list[tuple[str, Box]]):
    """Commit ``version`` whose shards are the given regions of ``source_version``'s shard of ``w`` on h0/0, linked."""
    reader = store.open(source_version)
    with store.begin(version) as w:
        for device, box in links:
            w.link(device, reader, reader.find("h0/0", "w", box), box)
        w.commit()
    return store.open(version)


def _stored_bytes(data: np.ndarray, lo: int, hi: int) -> bytes:
    return data.tobytes()[lo:hi]


def test_slice_row_format_is_pinned(tmp_path):
    """A block-aligned slice takes the stored digest of each whole stored block it holds and hashes its short last
    block; an unaligned one hashes every block; both rows name where their bytes start in the shared file."""
    store, data = _old_version(tmp_path)
    source = store.open(1).entries[0]
    reader = _link(store, 2, 1, [("h0/0", _rows(BLOCK_ROWS, 640)), ("h0/1", _rows(100, 300))])
    aligned, unaligned = sorted(reader.entries, key=lambda e: e.device)
    start = BLOCK_ROWS * ROW_BYTES
    assert aligned.to_dict() == {
        "device": "h0/0", "tensor": "w", "offsets": [BLOCK_ROWS, 0], "lengths": [640 - BLOCK_ROWS, COLS],
        "dtype": "float32", "shape": [ROWS, COLS], "file": aligned.file, "nbytes": (640 - BLOCK_ROWS) * ROW_BYTES,
        "xxh3": root_digest([source.blocks[1], checksum(_stored_bytes(data, 2 * BLOCK_BYTES, 640 * ROW_BYTES))]),
        "block_bytes": BLOCK_BYTES,
        "blocks": [source.blocks[1], checksum(_stored_bytes(data, 2 * BLOCK_BYTES, 640 * ROW_BYTES))],
        "slice": {"start": start, "file_nbytes": ROWS * ROW_BYTES}}
    assert unaligned.to_dict()["slice"] == {"start": 100 * ROW_BYTES, "file_nbytes": ROWS * ROW_BYTES}
    assert list(unaligned.blocks) == block_digests(_stored_bytes(data, 100 * ROW_BYTES, 300 * ROW_BYTES))
    assert unaligned.nbytes == 200 * ROW_BYTES and unaligned.xxh3 == root_digest(list(unaligned.blocks))
    # one file, three names: nothing was copied
    inode = os.stat(store.open(1).path / source.file).st_ino
    assert {os.stat(reader.path / e.file).st_ino for e in reader.entries} == {inode}
    # a row that is no slice has no "slice" key, and reads back as one
    assert "slice" not in source.to_dict() and ShardEntry.from_dict(source.to_dict()) == source
    assert ShardEntry.from_dict(aligned.to_dict()) == aligned


def test_slices_read_back_bit_for_bit_and_outlive_their_source_version(tmp_path):
    store, data = _old_version(tmp_path)
    _link(store, 2, 1, [("h0/0", _rows(BLOCK_ROWS, 640)), ("h0/1", _rows(100, 300))])
    # a slice of a slice: its start adds up, the file stays the first one
    reader3 = _link(store, 3, 2, [("h0/0", _rows(384, 640))])
    assert reader3.entries[0].file_start == 384 * ROW_BYTES and reader3.entries[0].file_nbytes == ROWS * ROW_BYTES
    store.delete(1)
    store.gc(keep=1)  # deletes version 2 as well: version 3 alone keeps the file
    assert store.versions() == [3]
    reader3 = store.open(3)
    assert reader3.verify() == []
    assert reader3.read("h0/0", "w", _rows(384, 640)).tobytes() == data[384:640].tobytes()
    assert reader3.read("h0/0", "w", Box((500, 8), (3, 5))).tobytes() == data[500:503, 8:13].tobytes()
    out = np.empty((256, 16), np.float32)
    reader3.readinto("h0/0", "w", Box((384, 32), (256, 16)), out)  # a column block: rows copied into place
    assert out.tobytes() == data[384:640, 32:48].tobytes()


def test_slice_links_only_one_contiguous_run_of_bytes(tmp_path):
    store, _ = _old_version(tmp_path)
    reader = store.open(1)
    entry = reader.entries[0]
    with store.begin(2) as w:
        with pytest.raises(StoreError, match="not one contiguous run"):
            w.link("h0/0", reader, entry, Box((0, 0), (ROWS, COLS // 2)))  # a column block
        w.link("h0/0", reader, entry, Box((0, 0), (BLOCK_ROWS, COLS)))  # the claim was released: the box is free
        w.commit()
    assert store.open(2).entries[0].file_start == 0


def test_a_damaged_region_is_never_linked_and_later_damage_is_caught(tmp_path):
    store, data = _old_version(tmp_path)
    reader = store.open(1)
    entry = reader.entries[0]
    flip_data_byte(reader.path / entry.file, 2 * BLOCK_BYTES + 5)  # inside the last stored block
    with store.begin(2) as w:
        with pytest.raises(CorruptShard, match="block 2"):
            w.link("h0/1", reader, entry, _rows(BLOCK_ROWS, ROWS))  # aligned: even a stored digest is checked
        assert not any(p.name.endswith(".safetensors") for p in w.dir.iterdir())  # the link was undone
        w.link("h0/0", reader, entry, _rows(0, 2 * BLOCK_ROWS))  # the sound part links
        w.commit()
    reader2 = store.open(2)
    assert reader2.verify() == []
    # damage to the shared file: inside the slice it fails the slice's reads, past its end it does not concern it
    flip_data_byte(reader2.path / reader2.entries[0].file, 7)
    with pytest.raises(CorruptShard, match="block 0"):
        reader2.read("h0/0", "w", _rows(0, 1))
    assert reader2.read("h0/0", "w", _rows(BLOCK_ROWS, BLOCK_ROWS + 1)).tobytes() == \
        data[BLOCK_ROWS:BLOCK_ROWS + 1].tobytes()


def test_an_unaligned_slice_is_verified_in_one_pass_and_refused_when_damaged(tmp_path, monkeypatch):
    """Every slice block of an unaligned slice is hashed: the stored blocks it straddles are read once each, in one
    verified read; a damaged byte in them refuses the link and leaves nothing behind."""
    from tenplex.store import shardfile

    store, data = _old_version(tmp_path)
    reader = store.open(1)
    entry = reader.entries[0]
    read = []
    original = shardfile.ShardFile._pread
    monkeypatch.setattr(shardfile.ShardFile, "_pread",
                        lambda self, fd, view, offset: (read.append(view.nbytes), original(self, fd, view, offset)))
    with store.begin(2) as w:
        w.link("h0/0", reader, entry, _rows(100, 600))  # data bytes 400-2,400 KiB: stored blocks 0, 1 and 2
        w.commit()
    assert sum(read) == 3 * BLOCK_BYTES  # one pass: two slice blocks straddle stored block 1, read once
    monkeypatch.undo()
    flip_data_byte(reader.path / entry.file, 1100 * 1024)  # in stored block 1, inside the slice
    with store.begin(3) as w:
        with pytest.raises(CorruptShard, match="block 1"):
            w.link("h0/0", reader, entry, _rows(100, 600))
        assert not any(p.name.endswith(".safetensors") for p in w.dir.iterdir())
        w.abort()
    # version 2 shares the file: its checksums, from before the damage, catch it (slice byte 700 KiB: its block 0)
    problems = store.open(2).verify()
    assert len(problems) == 1 and "block 0 (data bytes 0-1048576)" in problems[0], problems
    with pytest.raises(CorruptShard):
        store.open(2).read("h0/0", "w", _rows(101, 102))


def test_rows_without_block_checksums_are_not_sliced(tmp_path):
    store, _ = _old_version(tmp_path)
    reader = store.open(1)
    legacy = ShardEntry.from_dict({k: v for k, v in reader.entries[0].to_dict().items()
                                   if k not in ("blocks", "block_bytes")})
    with store.begin(2) as w:
        with pytest.raises(StoreError, match="no block checksums"):
            w.link("h0/0", reader, legacy, _rows(0, BLOCK_ROWS))
        w.abort()


def test_a_truncated_or_mismatched_file_fails_the_slice_by_name(tmp_path):
    store, _ = _old_version(tmp_path)
    reader = _link(store, 2, 1, [("h0/0", _rows(BLOCK_ROWS, 2 * BLOCK_ROWS))])
    path = reader.path / reader.entries[0].file
    size = os.path.getsize(path)
    os.truncate(path, size - BLOCK_BYTES - 10)  # cuts into the slice's last block
    with pytest.raises(CorruptShard, match="truncated"):
        store.open(2).read("h0/0", "w", _rows(BLOCK_ROWS, BLOCK_ROWS + 1))
    row = reader.entries[0].to_dict()
    row["slice"]["file_nbytes"] = row["slice"]["start"] + row["nbytes"] - 1
    with pytest.raises(StoreError, match="outside the file's"):
        ShardEntry.from_dict(row)


def _stored(layout) -> int:
    """Bytes of every device's shards (replicas counted each time)."""
    return sum(layout.device_bytes(d) for d in layout.devices)


def _zero_on(tmp_path, old, new):
    with Cluster(tmp_path, old.hosts()) as cluster:
        arrays = random_globals(old)
        write_version(cluster.roots, old, 1, arrays)
        report = transform(plan(old, new), old, new, cluster.addresses, 1, 2)
        assert_version_matches(cluster.roots, new, 2, arrays)
        return cluster.roots, report


def test_zero_change_links_every_shard_and_shares_one_file_per_region(tmp_path):
    """Sharding a replicated tensor over dp on one host copies no byte: each device's part is a slice, and both
    parts come from one replica's file, so the other replica's file goes with the old version."""
    tensors = {"m": ((ROWS, COLS), "float32"), "b": ((1000,), "float32")}  # b: halves of 2,000 bytes (unaligned)
    old = tiny_layout(tensors, {d: [("m", (0, 0), (ROWS, COLS)), ("b", (0,), (1000,))] for d in ("h0/0", "h0/1")})
    new = tiny_layout(tensors, {"h0/0": [("m", (0, 0), (384, COLS)), ("b", (0,), (500,))],
                                "h0/1": [("m", (384, 0), (384, COLS)), ("b", (500,), (500,))]})
    roots, report = _zero_on(tmp_path, old, new)
    h0 = report["hosts"]["h0"]
    assert h0["linked_bytes"] == h0["sliced_bytes"] == h0["bytes_total"] == _stored(new)
    assert h0["local_bytes"] == h0["kept_bytes"] == 0
    store = Store(roots["h0"], "h0")
    old_files = {e.tensor: os.stat(store.open(1).path / e.file).st_ino for e in store.open(1).entries_of("h0/0")}
    reader = store.open(2)
    rows = sorted(reader.entries, key=lambda e: (e.tensor, e.device))
    assert [(e.tensor, e.device, e.file_start, e.file_nbytes) for e in rows] == [
        ("b", "h0/0", 0, 4000), ("b", "h0/1", 2000, 4000),
        ("m", "h0/0", 0, ROWS * ROW_BYTES), ("m", "h0/1", 384 * ROW_BYTES, ROWS * ROW_BYTES)]
    # both parts of each tensor are h0/0's old file (planned for h0/1: its own replica, the same bytes)
    assert {e.tensor: {os.stat(reader.path / e.file).st_ino} for e in rows} == \
        {t: {inode} for t, inode in old_files.items()}
    store.delete(1)
    inodes = {os.stat(p).st_ino for p in (roots["h0"] / "versions").rglob("*.safetensors")}
    assert inodes == set(old_files.values())  # h0/1's old files are gone with version 1


def test_gpt_zero_and_fsdp_on_copy_nothing(tmp_path):
    """dp=2 x tp=2 on one host of four devices: turning on ZeRO-1 or FSDP links every byte of the new version."""
    old = gpt_layout(2, 2, 1, 1, 4, hidden=64)
    for sharding in ("optimizer", "full"):
        new = gpt_layout(2, 2, 1, 1, 4, sharding=sharding, hidden=64)
        _, report = _zero_on(tmp_path / sharding, old, new)
        h0 = report["hosts"]["h0"]
        assert h0["linked_bytes"] == h0["bytes_total"] == _stored(new), (sharding, h0)
        # the replicated tensors (norms, biases: all of them under FSDP) are sliced, the others linked whole
        sliced = sum(b.volume * new.tensors[t].itemsize for d, shards in new.devices.items() for t, b in
                     ((s.tensor, s.box) for s in shards) if not any(o.box == b for o in old.devices[d]
                                                                    if o.tensor == t))
        assert h0["sliced_bytes"] == sliced > 0, (sharding, h0)
        assert h0["local_bytes"] == h0["remote_bytes"] == 0, (sharding, h0)


def _two_replicas_split():
    tensors = {"m": ((ROWS, COLS), "float32")}
    old = tiny_layout(tensors, {d: [("m", (0, 0), (ROWS, COLS))] for d in ("h0/0", "h0/1")})
    new = tiny_layout(tensors, {"h0/0": [("m", (0, 0), (384, COLS))], "h0/1": [("m", (384, 0), (384, COLS))]})
    return old, new


def test_a_damaged_slice_is_copied_from_a_replica_and_counted_so(tmp_path):
    """h0/0's old file is damaged in its first block: h0/0's part (planned as a slice of it) is copied from h0/1's
    replica instead; h0/1's part, from rows the damage does not touch, is still a slice of that same file."""
    old, new = _two_replicas_split()
    with Cluster(tmp_path, ["h0"]) as cluster:
        arrays = random_globals(old)
        write_version(cluster.roots, old, 1, arrays)
        reader = Store(cluster.roots["h0"], "h0").open(1)
        damaged = reader.entries_of("h0/0")[0].file
        flip_data_byte(reader.path / damaged, 9)
        report = transform(plan(old, new), old, new, cluster.addresses, 1, 2)
        assert_version_matches(cluster.roots, new, 2, arrays)
    h0, half = report["hosts"]["h0"], 384 * ROW_BYTES
    assert (h0["refetched_bytes"], h0["linked_bytes"], h0["sliced_bytes"]) == (half, half, half), h0
    rows = {e.device: e for e in Store(tmp_path / "h0", "h0").open(2).entries}
    assert not rows["h0/0"].is_slice and rows["h0/1"].file_start == half
    assert os.stat(tmp_path / "h0" / "versions" / "2" / rows["h0/1"].file).st_ino == \
        os.stat(tmp_path / "h0" / "versions" / "1" / damaged).st_ino


def test_a_missing_old_file_is_copied_from_a_replica(tmp_path):
    old, new = _two_replicas_split()
    with Cluster(tmp_path, ["h0"]) as cluster:
        arrays = random_globals(old)
        write_version(cluster.roots, old, 1, arrays)
        reader = Store(cluster.roots["h0"], "h0").open(1)
        os.unlink(reader.path / reader.entries_of("h0/0")[0].file)
        report = transform(plan(old, new), old, new, cluster.addresses, 1, 2)
        assert_version_matches(cluster.roots, new, 2, arrays)
    h0 = report["hosts"]["h0"]
    assert h0["linked_bytes"] == h0["sliced_bytes"] == 0 and h0["refetched_bytes"] == 384 * ROW_BYTES, h0


@contextlib.contextmanager
def _own_mount(path):
    """``path`` bind-mounted onto itself: the same files, but another mount, so that a hard link from inside it to
    outside fails with EXDEV (as when an old version lives on another file system). Needs root (CI has it)."""
    try:
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot bind-mount here: {getattr(e, 'stderr', b'').decode().strip() or e}")
    try:
        yield
    finally:
        # lazily: a store server may still hold the directory open (its reader cache)
        subprocess.run(["umount", "--lazy", str(path)], check=True, capture_output=True, timeout=30)


def test_shards_whose_old_file_is_on_another_mount_are_copied_not_linked(tmp_path):
    """The old version on another mount (EXDEV): the shard kept whole and the slice are both copied, and the
    transformation succeeds with every byte exact."""
    tensors = {"m": ((ROWS, COLS), "float32"), "k": ((ROWS, COLS), "float32")}
    old = tiny_layout(tensors, {"h0/0": [("k", (0, 0), (ROWS, COLS))], "h0/1": [("m", (0, 0), (ROWS, COLS))]})
    new = tiny_layout(tensors, {"h0/0": [("k", (0, 0), (ROWS, COLS))], "h0/1": [("m", (0, 0), (384, COLS))]})
    with Cluster(tmp_path, ["h0"]) as cluster:
        arrays = random_globals(old)
        write_version(cluster.roots, old, 1, arrays)
        old_dir = cluster.roots["h0"] / "versions" / "1"
        with _own_mount(old_dir):
            report = transform(plan(old, new), old, new, cluster.addresses, 1, 2)
        assert_version_matches(cluster.roots, new, 2, arrays)
    h0 = report["hosts"]["h0"]
    assert h0["linked_bytes"] == h0["sliced_bytes"] == h0["refetched_bytes"] == 0, h0
    assert h0["kept_bytes"] == h0["bytes_total"] == _stored(new), h0  # both planned as kept on their device
    new_dir = tmp_path / "h0" / "versions" / "2"
    assert all(os.stat(new_dir / e.file).st_nlink == 1 for e in Store(tmp_path / "h0", "h0").open(2).entries)
