"""Issue 12: a store server stays available and coherent under hostile or broken clients (defects 5-9, 11, 12)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import xxhash

from tenplex.box import Box
from tenplex.store import Store, wire
from tenplex.store._proto import store_pb2 as pb
from tenplex.store.client import StoreClient

from store_helpers import StoreProcess

SHAPE = (64, 48)


def _write_stream(address: str):
    channel = grpc.insecure_channel(address)
    call = channel.stream_unary("/tenplex.v1.Store/WriteShard",
                                request_serializer=pb.WriteShardRequest.SerializeToString,
                                response_deserializer=pb.WriteShardReply.FromString)
    return channel, call


def _header(version: int, part: str, lengths: tuple[int, ...], tensor: str = "w") -> pb.WriteShardRequest:
    box = Box((0,) * len(lengths), lengths)
    return pb.WriteShardRequest(header=pb.ShardHeader(version=version, part=part, device="h0/0", tensor=tensor,
                                                      box=wire.to_pb_box(box), dtype="float32",
                                                      shape=list(lengths)))


def _stalled(header: pb.WriteShardRequest, release: threading.Event):
    """A WriteShard request stream that sends its header, then nothing until ``release``."""
    yield header
    release.wait()


def _part_files(root) -> list[str]:
    staging = root / "staging"
    return sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())


# ---- defect 5: stalled streams -------------------------------------------------------------------------------
def test_stalled_write_streams_cannot_take_the_server_down(tmp_path):
    proc = StoreProcess(tmp_path / "h0", "h0", extra_args=("--max-streams", "4", "--stream-idle-s", "2"))
    release = threading.Event()
    channel, write = _write_stream(proc.address)
    try:
        calls = [write.future(_stalled(_header(1, f"p{i}", (16,), tensor=f"t{i}"), release), timeout=60)
                 for i in range(40)]
        with StoreClient(proc.address, timeout=10) as client:
            assert client.health()["host"] == "h0"  # control calls keep their own threads
            codes = [c.exception().code() if c.exception() else grpc.StatusCode.OK for c in calls]
            busy = [c for c in calls if c.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
            assert len(busy) == 36, codes
            assert "4 bulk streams" in busy[0].exception().details()
            # the four admitted streams sent nothing for 2 s: cancelled, their partial shards dropped
            for c in calls:
                assert c.exception().code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)
            deadline = time.monotonic() + 30  # the handlers clean up just after the client sees CANCELLED
            while _part_files(tmp_path / "h0") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _part_files(tmp_path / "h0") == [], "idle streams left their shard files"
            # a well-behaved writer gets through afterwards
            data = np.arange(16, dtype=np.float32)
            assert client.write_shard(1, "ok", "h0/0", "w", Box((0,), (16,)), data, "float32") == data.nbytes
            client.prepare(1, "ok")
            client.commit(1)
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((0,), (16,)), "float32"), data)
    finally:
        release.set()
        channel.close()
        proc.stop()


# ---- defect 7: reservations ----------------------------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount an 8 MiB tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _free(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_write_shard_reserves_no_space_before_data_and_leaks_none(small_tmpfs):
    root = small_tmpfs / "h0"
    proc = StoreProcess(root, "h0")
    channel, write = _write_stream(proc.address)
    try:
        # a header declaring 1 GiB on an 8 MiB disk: refused at once, nothing left behind
        with pytest.raises(grpc.RpcError) as info:
            write(iter([_header(1, "big", (1 << 28,))]), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1073741824" in info.value.details() and "free" in info.value.details()
        assert _part_files(root) == []
        # a 6 MiB header and a stalled client: no space is held while no data comes
        before = _free(small_tmpfs)
        release = threading.Event()
        call = write.future(_stalled(_header(1, "stall", (6 << 18,)), release), timeout=60)
        deadline = time.monotonic() + 30
        while not any(p.endswith(".safetensors") for p in _part_files(root)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert before - _free(small_tmpfs) < (1 << 20), "space was reserved before any data arrived"
        release.set()
        with pytest.raises(grpc.RpcError):
            call.result()
        assert not any(p.endswith(".safetensors") for p in _part_files(root))
        # a stream that fills the disk halfway through fails with ENOSPC and frees what it wrote
        with StoreClient(proc.address, timeout=30, chunk_bytes=1 << 20) as client:
            from tenplex.store.client import RemoteStoreError
            with pytest.raises(RemoteStoreError) as failed:
                client.write_shard(1, "full", "h0/0", "w", Box((0,), (3 << 20,)), np.ones(3 << 20, np.float32),
                                   "float32")
            assert failed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert not any(p.endswith(".safetensors") for p in _part_files(root))
            assert _free(small_tmpfs) >= before - (1 << 20)
            # and later writes succeed without an Abort
            data = np.arange(1 << 18, dtype=np.float32)
            client.write_shard(1, "ok", "h0/0", "w", Box((0,), data.shape), data, "float32")
            client.prepare(1, "ok")
            client.commit(1, )
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((0,), data.shape), "float32"), data)
        assert proc.alive()
    finally:
        channel.close()
        proc.stop()
