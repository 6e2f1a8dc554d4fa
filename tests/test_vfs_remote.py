"""Datasets on another host's store: reads through the real gRPC service, a local cache, and a FUSE mount."""

import os
import shutil
from pathlib import PurePosixPath

import numpy as np
import pytest

import fuse_vfs
from tenplex.dataset import DatasetError, DatasetState, pack
from tenplex.dataset.reader import open_fallback, open_mounted
from tenplex.dataset.remote import RemoteRecords, open_remote

from store_helpers import StoreProcess

SEQ = 6


@pytest.fixture
def store(tmp_path):
    toks = np.random.default_rng(1).integers(0, 60000, (80, SEQ)).astype(np.uint16)
    toks.tofile(tmp_path / "t.bin")
    proc = StoreProcess(tmp_path / "store", "h1")
    try:
        info = pack(tmp_path / "t.bin", tmp_path / "store" / "datasets" / "tok", seq_len=SEQ, dtype="uint16",
                    file_bytes=256)
        yield proc, info, toks
    finally:
        proc.stop()


def test_remote_reads_are_cached_and_survive_the_store_going_away(store, tmp_path):
    proc, local, toks = store
    info, source = open_remote(proc.address, "tok", cache_dir=tmp_path / "cache")
    assert info.identity == local.identity
    state = DatasetState(info.identity, 80, 3, 16, 8)
    reader = open_fallback(info, state, 3, 1, source=source)
    values = [reader.get(i) for i in range(len(reader))]
    for i, v in enumerate(values):
        np.testing.assert_array_equal(v, toks[reader.sample_ids[i]])
    fetched = source.remote_reads
    assert 0 < fetched <= len(info.files)
    proc.kill()                                           # every block read so far is in the local cache
    for i in range(len(reader)):
        np.testing.assert_array_equal(reader.get(i), values[i])
    assert source.remote_reads == fetched
    source.close()


def test_remote_reads_span_blocks_and_read_only_the_range_from_the_cache(store, tmp_path):
    proc, local, _ = store
    info, opened = open_remote(proc.address, "tok", cache_dir=tmp_path / "cache")
    source = RemoteRecords(opened.client, info, PurePosixPath("tok"), tmp_path / "small", block_bytes=50)
    want = (local.root / info.files[0].name).read_bytes()
    ranges = [(0, 1), (45, 10), (49, 102), (0, len(want)), (100, 50), (len(want) - 7, 7)]
    for _ in range(2):                                    # first pass fetches blocks, second hits the cache
        for offset, length in ranges:
            assert source.read(0, offset, length) == want[offset:offset + length]
    assert source.remote_reads == -(-len(want) // 50)     # every block fetched exactly once
    assert not [p for p in source.cache.iterdir() if p.name.startswith(".")]  # no temp files left
    opened.close()


def test_remote_errors(store, tmp_path):
    proc, _, _ = store
    with pytest.raises(DatasetError, match="not a plain file name"):
        open_remote(proc.address, "../tok", cache_dir=tmp_path / "c")
    with pytest.raises(DatasetError, match="not a tenplex dataset"):
        open_remote(proc.address, "missing", cache_dir=tmp_path / "c")
    shards = tmp_path / "store" / "datasets" / "shards"   # a WebDataset source, not packed: says what to do
    shards.mkdir()
    (shards / "000.tar").write_bytes(bytes(1024))
    with pytest.raises(DatasetError, match=r"shards: not a tenplex dataset .* must be packed; .*tenplex data pack "
                                           r"--from hf\|parquet\|webdataset\|megatron SRC OUT"):
        open_remote(proc.address, "shards", cache_dir=tmp_path / "c")


_WHY = fuse_vfs.fuse_unavailable_reason()


@pytest.mark.skipif(_WHY is not None, reason=f"FUSE unavailable: {_WHY}")
def test_mount_a_remote_dataset(store, tmp_path):
    proc, local, toks = store
    state = DatasetState(local.identity, 80, 3, 0, 8)
    fuse_vfs.write_state_file(tmp_path / "state.json", state, dp=2)
    (tmp_path / "mnt").mkdir()
    handle = fuse_vfs.mount("tok", tmp_path / "mnt", tmp_path / "state.json", store=proc.address,
                            cache_dir=str(tmp_path / "cache"), log_path=tmp_path / "vfs.log")
    try:
        for r in range(2):
            reader = open_mounted(handle.mountpoint, r)
            local_view = open_fallback(local.root, state, 2, r)
            assert reader.sample_ids.tolist() == local_view.sample_ids.tolist()
            with open(handle.mountpoint / f"rank{r}" / "data", "rb") as f:
                assert f.read() == b"".join(local_view.read(i) for i in range(len(local_view)))
            np.testing.assert_array_equal(reader.get(3), toks[reader.sample_ids[3]])
            reader.close()
        assert os.listdir(tmp_path / "cache")
    finally:
        handle.unmount(lazy=True)
    shutil.rmtree(tmp_path / "cache")
