"""The bulk data plane (``tenplex.store.dataplane``) against real store processes: exact bytes, clear errors,
tokens, corrupted frames, dying and hanging sources, TLS falling back to gRPC, transforms and the benchmark."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from tenplex.box import Box
from tenplex.planner import plan
from tenplex.store import Store
from tenplex.store.client import ChecksumError, RemoteStoreError, StoreClient
from tenplex.store.dataplane import DataConnection, DataPlaneError
from tenplex.transform import transform

from store_helpers import (StoreProcess, assert_version_matches, flip_data_byte, random_globals, tiny_layout,
                           write_version)

SHAPE = (64, 48)


def _write(root: Path) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    w = rng.random(SHAPE, dtype=np.float32)
    b = rng.integers(0, 2**16, size=(1000,), dtype=np.uint16)
    with Store(root, "h0").begin(1) as writer:
        writer.put("h0/0", "w", Box((0, 0), SHAPE), w, "float32", shape=SHAPE)
        writer.put("h0/1", "b", Box((0,), (1000,)), b, "bfloat16", shape=(1000,))
        writer.commit()
    return w, b


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base = tmp_path_factory.mktemp("dataplane")
    w, b = _write(base / "h0")
    proc = StoreProcess(base / "h0", "h0")
    yield proc, w, b
    proc.stop()


def _client(address: str, **kwargs) -> StoreClient:
    """A client that sends every box read, however small, over the data plane."""
    return StoreClient(address, chunk_bytes=4096, data_plane_min_bytes=0, **kwargs)


def test_reads_are_exact_and_errors_clear(served):
    proc, w, b = served
    with _client(proc.address) as client:
        assert client.data_pool() is not None and client.health()["data_port"] > 0
        for box in (Box((0, 0), SHAPE),          # whole rows: one run of the file
                    Box((3, 5), (40, 30)),       # strided: gathered, then sent
                    Box((7, 0), (1, 48))):
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", box, "float32"), w[box.slices()])
        assert client.read_box(1, "h0/1", "b", Box((0,), (1000,)), "bfloat16").tobytes() == b.tobytes()
        # into a strided destination (frames go through the scratch buffer) and into a sink
        out = np.zeros((40, 60), dtype=np.float32)
        client.read_box_into(1, "h0/0", "w", Box((10, 0), (40, 48)), out[:, 6:54])
        np.testing.assert_array_equal(out[:, 6:54], w[10:50])
        pieces = {}
        n = client.read_box_to(1, "h0/0", "w", Box((0, 0), SHAPE), 4,
                               lambda sub, data: pieces.update({sub: bytes(data)}))
        assert n == w.nbytes and len(pieces) > 1  # 4 KiB frames
        joined = np.zeros(SHAPE, dtype=np.float32)
        for sub, data in pieces.items():
            joined[sub.slices()] = np.frombuffer(data, np.float32).reshape(sub.lengths)
        np.testing.assert_array_equal(joined, w)
        for args, code, text in [((9, "h0/0", "w", Box((0, 0), (1, 1))), grpc.StatusCode.NOT_FOUND, "version 9"),
                                 ((1, "h0/0", "w", Box((60, 0), (8, 1))), grpc.StatusCode.OUT_OF_RANGE,
                                  "inside no box"),
                                 ((1, "h9/0", "w", Box((0, 0), (1, 1))), grpc.StatusCode.NOT_FOUND, "devices here")]:
            with pytest.raises(RemoteStoreError) as info:
                client.read_box(*args, "float32")
            assert info.value.code == code and "data-plane" in str(info.value) and text in str(info.value)
        np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((1, 1), (2, 2)), "float32"), w[1:3, 1:3])


def _store_of_three_blocks(root: Path) -> tuple[Store, np.ndarray]:
    """Version 1 with x (640 x 1024 float32: 2.5 MiB, checksum blocks of 1, 1 and 0.5 MiB) on h0/0."""
    data = np.random.default_rng(3).random((640, 1024), dtype=np.float32)
    store = Store(root, "h0")
    with store.begin(1) as writer:
        writer.put("h0/0", "x", Box((0, 0), data.shape), data, "float32", shape=data.shape)
        writer.commit()
    return store, data


def _frames(conn: DataConnection, data: np.ndarray, frame_bytes: int) -> tuple[list, list]:
    """(frames as (sub box, bytes, digest), corrupted sub-boxes) of one read of all of x."""
    frames: list = []
    got, bad = conn.read(1, "h0/0", "x", Box((0, 0), data.shape), 4, frame_bytes,
                         sink=lambda sub, view, digest, into=frames: into.append((sub, bytes(view), digest)))
    assert got + sum(b.volume * 4 for b in bad) == data.nbytes
    return frames, bad


def test_frames_of_one_stored_block_carry_the_committed_digest(tmp_path, monkeypatch):
    """Frame checksums are xxh3_64 of the frame's bytes; a frame that is one whole stored block carries the block's
    digest from the manifest, so the client checks the bytes against what was committed."""
    import xxhash

    from tenplex.store.blocks import BLOCK_BYTES
    from tenplex.store.dataplane import DataServer
    from tenplex.store.shardfile import ShardFile

    store, data = _store_of_three_blocks(tmp_path / "h0")
    blocks = [int(b, 16) for b in store.open(1).manifest["shards"][0]["blocks"]]
    proc = StoreProcess(tmp_path / "h0", "h0")
    try:  # a real store server: the digests on the wire
        conn = DataConnection("127.0.0.1", StoreClient(proc.address).health()["data_port"], None, timeout=30)
        try:
            whole, bad = _frames(conn, data, BLOCK_BYTES)
            assert bad == [] and [digest for *_, digest in whole] == blocks
            assert b"".join(view for _, view, _ in whole) == data.tobytes()
            halves, bad = _frames(conn, data, BLOCK_BYTES // 2)
            assert bad == [] and len(halves) == 5
            assert [digest for *_, digest in halves] == [xxhash.xxh3_64_intdigest(v) for _, v, _ in halves]
        finally:
            conn.close()
    finally:
        proc.stop()
    # In process, with the stored digests the server sends made wrong: whole-block frames arrive "corrupted" (so
    # their digest is the stored one, not computed from the bytes), frames of part of a block do not.
    stored = ShardFile.block_digest
    monkeypatch.setattr(ShardFile, "block_digest", lambda self, start, length: None if stored(self, start, length)
                        is None else stored(self, start, length) ^ 1)
    read = []  # bytes the server reads from the shard file
    pread = ShardFile._pread
    monkeypatch.setattr(ShardFile, "_pread", lambda self, fd, view, offset: (read.append(view.nbytes),
                                                                              pread(self, fd, view, offset))[1])
    server = DataServer("127.0.0.1", lambda version: store.open(version), lambda e: ("INTERNAL", str(e)))
    conn = DataConnection("127.0.0.1", server.port, None, timeout=30)
    try:
        whole, bad = _frames(conn, data, BLOCK_BYTES)
        assert whole == [] and [b.lengths[0] for b in bad] == [256, 256, 128]
        assert sum(read) == 0  # whole stored blocks leave unread (sendfile): the client checks them
        halves, bad = _frames(conn, data, BLOCK_BYTES // 2)  # the fifth half is the whole (short) last block
        assert len(halves) == 4 and bad == [Box((512, 0), (128, 1024))]
        # the halves are read: a block whole with its first half (to verify it), its second half again; the last
        # block not at all
        assert read == [BLOCK_BYTES, BLOCK_BYTES // 2] * 2
        # asked to verify (a re-fetch), the server reads every byte once (the first frame is checked before "ok",
        # then sent from memory) and its bad digests now go out as they are: the frames arrive "corrupted" still
        read.clear()
        got, bad = conn.read(1, "h0/0", "x", Box((0, 0), data.shape), 4, BLOCK_BYTES, sink=lambda *a: None,
                             verify=True)
        assert got == 0 and [b.lengths[0] for b in bad] == [256, 256, 128] and sum(read) == data.nbytes
    finally:
        conn.close()
        server.close()


def test_frames_are_cut_on_the_stored_blocks_and_whole_blocks_leave_unread(tmp_path, monkeypatch):
    """A box that starts inside a stored block (rows 100-639: 100 rows = 400 KiB into block 0) is cut on the
    shard's blocks for a client that asks (``align``): a first frame up to the block's end (read, verified,
    hashed), then whole blocks with their committed digests, sent from the file unread. A client that does not
    ask gets frames cut from the box's start, as before."""
    from tenplex.store import dataplane
    from tenplex.store.blocks import BLOCK_BYTES
    from tenplex.store.dataplane import DataServer, _recv_json, _send_json
    from tenplex.store.shardfile import ShardFile

    store, data = _store_of_three_blocks(tmp_path / "h0")
    blocks = [int(b, 16) for b in store.open(1).manifest["shards"][0]["blocks"]]
    read, sent = [], []
    pread = ShardFile._pread
    monkeypatch.setattr(ShardFile, "_pread", lambda self, fd, view, offset: (read.append(view.nbytes),
                                                                              pread(self, fd, view, offset))[1])
    send_file = dataplane._send_file
    monkeypatch.setattr(dataplane, "_send_file", lambda conn, fd, offset, count, where: (
        sent.append(count), send_file(conn, fd, offset, count, where))[1])
    server = DataServer("127.0.0.1", lambda version: store.open(version), lambda e: ("INTERNAL", str(e)))
    conn = DataConnection("127.0.0.1", server.port, None, timeout=30)
    box = Box((100, 0), (540, 1024))
    try:
        frames: list = []
        got, bad = conn.read(1, "h0/0", "x", box, 4, BLOCK_BYTES,
                             sink=lambda sub, view, digest: frames.append((sub, bytes(view), digest)))
        assert got == box.volume * 4 and bad == []
        assert [(sub.offsets[0], sub.lengths[0]) for sub, _, _ in frames] == [(100, 156), (256, 256), (512, 128)]
        assert [digest for *_, digest in frames[1:]] == blocks[1:]  # the committed digests
        assert b"".join(view for _, view, _ in frames) == data[100:].tobytes()
        assert read == [BLOCK_BYTES] and sent == [BLOCK_BYTES, BLOCK_BYTES // 2]
        # a client from before (no "align"): frames from the box's start, each read, verified and hashed here (it
        # would only re-fetch damaged bytes, where this server names the damage)
        read.clear()
        raw = socket.create_connection(("127.0.0.1", server.port))
        try:
            assert _recv_json(raw)["tenplex_data"] == 1
            _send_json(raw, {"v": 1, "auth": "", "version": 1, "device": "h0/0", "tensor": "x", "frame_bytes":
                             BLOCK_BYTES, "box": {"offsets": list(box.offsets), "lengths": list(box.lengths)}})
            reply = _recv_json(raw)
            assert reply["ok"] and reply["lead"] == 0
            sizes = []
            for _ in range(3):
                head = bytearray(16)
                _recv_exact_into(raw, head)
                nbytes, _ = struct.unpack("<QQ", head)
                _recv_exact_into(raw, bytearray(nbytes))
                sizes.append(nbytes)
            assert sizes == [BLOCK_BYTES, BLOCK_BYTES, 540 * 4096 - 2 * BLOCK_BYTES]
            assert sent == [BLOCK_BYTES, BLOCK_BYTES // 2] and sum(read) >= box.volume * 4  # nothing unread
        finally:
            raw.close()
    finally:
        conn.close()
        server.close()


def _recv_exact_into(sock: socket.socket, buffer: bytearray) -> None:
    view = memoryview(buffer)
    while view.nbytes:
        n = sock.recv_into(view)
        assert n, "the server closed the connection"
        view = view[n:]


def test_a_damaged_block_sent_unread_is_caught_by_the_client_and_named_by_the_refetch(tmp_path):
    """Damage on the source's disk in a whole-block frame: the server sends the block unread, the client's check
    against the committed digest fails, and its re-fetch asks the server to verify, which names the block
    (DATA_LOSS) instead of the client giving up on "arrived corrupted" after every retry."""
    from tenplex.store.blocks import BLOCK_BYTES

    store, data = _store_of_three_blocks(tmp_path / "h0")
    reader = store.open(1)
    flip_data_byte(reader.path / reader.entries[0].file, BLOCK_BYTES + 77)  # in block 1
    proc = StoreProcess(tmp_path / "h0", "h0")
    try:
        with StoreClient(proc.address, data_plane_min_bytes=0) as client:
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "x", Box((0, 0), (256, 1024)), "float32"),
                                          data[:256])  # block 0 is sound
            with pytest.raises(RemoteStoreError) as info:
                client.read_box(1, "h0/0", "x", Box((0, 0), data.shape), "float32")
            assert info.value.code == grpc.StatusCode.DATA_LOSS and "block 1" in str(info.value)
            assert "data-plane" in str(info.value)
        with StoreClient(proc.address, data_plane_min_bytes=0, retries=0) as client:  # will not re-fetch: verified
            with pytest.raises(RemoteStoreError) as info:  # up front, so still named rather than "corrupted"
                client.read_box(1, "h0/0", "x", Box((0, 0), data.shape), "float32")
            assert info.value.code == grpc.StatusCode.DATA_LOSS and "block 1" in str(info.value)
    finally:
        proc.stop()


def test_slice_rows_send_their_whole_blocks_unread_from_the_shared_file(tmp_path, monkeypatch):
    """Slice rows (a new shard that is part of an old file, ``file_start`` bytes in) over the data plane: an aligned
    slice's blocks are the file's, an unaligned one's are its own; either way the whole ones leave by sendfile from
    the right place of the shared file, and every frame checks out on the first pass (a wrong offset would only be
    repaired by the verified re-fetch, so the first pass is what this pins)."""
    from tenplex.store import dataplane
    from tenplex.store.blocks import BLOCK_BYTES
    from tenplex.store.dataplane import DataServer

    store, data = _store_of_three_blocks(tmp_path / "h0")
    reader = store.open(1)
    with store.begin(2) as writer:
        writer.link("h0/1", reader, reader.entries[0], Box((256, 0), (384, 1024)))  # aligned: rows 256-639
        writer.link("h0/2", reader, reader.entries[0], Box((100, 0), (540, 1024)))  # unaligned: rows 100-639
        writer.commit()
    assert sorted(e.file_start for e in store.open(2).entries) == [100 * 4096, 256 * 4096]
    sent = []
    send_file = dataplane._send_file
    monkeypatch.setattr(dataplane, "_send_file", lambda conn, fd, offset, count, where: (
        sent.append(count), send_file(conn, fd, offset, count, where))[1])
    server = DataServer("127.0.0.1", lambda version: store.open(version), lambda e: ("INTERNAL", str(e)))
    conn = DataConnection("127.0.0.1", server.port, None, timeout=30)
    try:
        short = 28 * 4096  # the unaligned slice's last block of its own: 540 rows are 2 MiB and 28 rows
        for device, box, unread in (("h0/1", Box((256, 0), (384, 1024)), [BLOCK_BYTES, BLOCK_BYTES // 2]),
                                    ("h0/2", Box((100, 0), (540, 1024)), [BLOCK_BYTES, BLOCK_BYTES, short]),
                                    ("h0/2", Box((356, 0), (284, 1024)), [BLOCK_BYTES, short]),  # from its block 1
                                    ("h0/2", Box((150, 0), (462, 1024)), [BLOCK_BYTES])):  # its block 1 inside
            sent.clear()
            out = np.zeros(box.lengths, np.float32)
            got, bad = conn.read(2, device, "x", box, 4, BLOCK_BYTES, out=out, out_box=box)
            assert bad == [] and got == out.nbytes and out.tobytes() == data[box.slices()].tobytes(), device
            assert sent == unread, (device, box, sent)
    finally:
        conn.close()
        server.close()


def test_a_file_cut_short_while_being_sent_ends_the_read_not_silently(tmp_path, monkeypatch):
    """The file passed its size check, then lost its end before the kernel sent it: the server ends the connection
    (the frame's header is out), the client's read fails (UNAVAILABLE), and the next read of it gets a plain
    DATA_LOSS reply naming the truncation."""
    from tenplex.store.blocks import BLOCK_BYTES
    from tenplex.store.dataplane import DataPool, DataServer
    from tenplex.store.shardfile import ShardFile

    store, data = _store_of_three_blocks(tmp_path / "h0")
    path = store.open(1).path / store.open(1).entries[0].file
    opened = ShardFile.open_checked

    def open_then_cut(self):
        result = opened(self)
        monkeypatch.setattr(ShardFile, "open_checked", opened)  # once
        os.truncate(path, path.stat().st_size - BLOCK_BYTES)
        return result

    monkeypatch.setattr(ShardFile, "open_checked", open_then_cut)
    server = DataServer("127.0.0.1", lambda version: store.open(version), lambda e: (
        "DATA_LOSS" if type(e).__name__ == "CorruptShard" else "INTERNAL", str(e)))
    pool = DataPool("127.0.0.1", server.port, None, timeout=30)
    frames: list = []
    try:
        with pytest.raises(DataPlaneError) as info:
            pool.read(1, "h0/0", "x", Box((0, 0), data.shape), 4, BLOCK_BYTES,
                      sink=lambda sub, view, digest: frames.append(sub))
        assert info.value.code == "UNAVAILABLE" and "mid-transfer" in str(info.value)
        assert [sub.lengths[0] for sub in frames] == [256]  # the first block arrived whole and checked
        with pytest.raises(DataPlaneError) as info:
            pool.read(1, "h0/0", "x", Box((0, 0), data.shape), 4, BLOCK_BYTES, sink=lambda *a: None)
        assert info.value.code == "DATA_LOSS" and "truncated" in str(info.value)
    finally:
        pool.close()
        server.close()


def test_a_transform_hashes_whole_blocks_once_per_end(tmp_path, monkeypatch):
    """Blocks of a new shard that arrive whole from another host, or are copied whole from a verified local block,
    take the digest checked on the way: the destination hashes none of them again, and the version verifies."""
    from tenplex.layout import Layout, Shard, TensorSpec
    from tenplex.store.blocks import BlockTally
    from tenplex.store.manifest import TRANSFORM_PART
    from tenplex.transform import TransformRequest
    from tenplex.transform.host import run_host_part

    h0, data = _store_of_three_blocks(tmp_path / "h0")
    spec = {"x": TensorSpec(data.shape, "float32")}
    whole = Box((0, 0), data.shape)
    old = Layout.build(spec, {"h0/0": [Shard("x", whole)]})
    # h1/0 pulls all of x (three whole blocks); h0/1 copies rows 256-511, the second stored block, on its host
    new = Layout.build(spec, {"h1/0": [Shard("x", whole)], "h0/1": [Shard("x", Box((256, 0), (256, 1024)))]})
    hashed = []
    original = BlockTally._hash
    monkeypatch.setattr(BlockTally, "_hash", lambda self, index, block: (hashed.append(index),
                                                                          original(self, index, block))[1])
    proc = StoreProcess(tmp_path / "h0", "h0")
    try:
        peers = {"h0": proc.address, "h1": "127.0.0.1:1"}
        for host, store in (("h1", Store(tmp_path / "h1", "h1")), ("h0", h0)):
            request = TransformRequest(host=host, old_version=1, new_version=2, plan=plan(old, new), old_layout=old,
                                       new_layout=new, peers=peers)
            report = run_host_part(store, request, lambda progress: None)
            assert report.bytes_total > 0
            store.commit(2, [TRANSFORM_PART])
    finally:
        proc.stop()
    assert hashed == []
    assert_version_matches({"h0": tmp_path / "h0", "h1": tmp_path / "h1"}, new, 2, {"x": data})


def _raw_exchange(port: int, body: bytes, closes: bool) -> dict:
    """Send one raw request body; return the server's reply, checking whether the server then closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        reader = sock.makefile("rb")
        (n,) = struct.unpack("<I", reader.read(4))
        hello = json.loads(reader.read(n))
        assert hello["tenplex_data"] == 1 and hello["auth"] is False
        sock.sendall(struct.pack("<I", len(body)) + body)
        (n,) = struct.unpack("<I", reader.read(4))
        reply = json.loads(reader.read(n))
        if closes:
            assert reader.read() == b"", "the server must close the connection after a protocol error"
        else:  # the connection stays usable
            sock.sendall(struct.pack("<I", len(body)) + body)
            (n,) = struct.unpack("<I", reader.read(4))
            assert json.loads(reader.read(n)) == reply
        return reply


def test_malformed_requests_and_unknown_protocol_versions(served):
    proc, w, _ = served
    port = StoreClient(proc.address).health()["data_port"]
    reply = _raw_exchange(port, b"{not json", closes=True)
    assert reply["code"] == "INVALID_ARGUMENT" and "malformed" in reply["message"]
    reply = _raw_exchange(port, json.dumps({"v": 99}).encode(), closes=True)
    assert reply["code"] == "INVALID_ARGUMENT" and "protocol version 99" in reply["message"]
    reply = _raw_exchange(port, json.dumps({"v": 1, "version": 1, "device": "h0/0"}).encode(), closes=False)
    assert reply["code"] == "INVALID_ARGUMENT" and "expected version, device, tensor and box" in reply["message"]
    reply = _raw_exchange(port, json.dumps({"v": 1, "version": 1, "device": "h0/0", "tensor": "w",
                                            "box": {"offsets": [0, 0], "lengths": [-1, 2]}}).encode(), closes=False)
    assert not reply["ok"] and reply["code"] == "INVALID_ARGUMENT", reply
    with _client(proc.address) as client:  # still serving
        np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((0, 0), (2, 3)), "float32"), w[:2, :3])


def test_data_connections_need_the_token(tmp_path):
    w, _ = _write(tmp_path / "h0")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    proc = StoreProcess(tmp_path / "h0", "h0", token_file=token_file, bind="0.0.0.0")
    try:
        with StoreClient(proc.address, token="s3cret") as client:
            port = client.health()["data_port"]
        box = Box((0, 0), (4, 48))
        for token in (None, "wrong"):
            conn = DataConnection("127.0.0.1", port, token, timeout=30)
            with pytest.raises(DataPlaneError) as info:
                conn.read(1, "h0/0", "w", box, 4, 4096, out=np.zeros((4, 48), np.float32), out_box=box)
            assert info.value.code == "UNAUTHENTICATED" and "token" in str(info.value)
            assert conn._sock.recv(1) == b"", "the server must close a connection that failed authentication"
            conn.close()
        with _client(proc.address, token="s3cret") as client:
            assert client.data_pool() is not None
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((0, 0), SHAPE), "float32"), w)
    finally:
        proc.stop()


def test_corrupted_frames_are_refetched_and_never_returned(tmp_path):
    w, _ = _write(tmp_path / "h0")
    proc = StoreProcess(tmp_path / "h0", "h0", env={"TENPLEX_STORE_TEST_HOOKS": "corrupt_chunks=3"})
    try:
        with _client(proc.address) as client:
            assert client.data_pool() is not None
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((0, 0), SHAPE), "float32"), w)
    finally:
        proc.stop()
    proc = StoreProcess(tmp_path / "h0", "h0", env={"TENPLEX_STORE_TEST_HOOKS": "corrupt_chunks=100000"})
    try:
        with _client(proc.address, retries=2) as client:
            with pytest.raises(ChecksumError, match="arrived corrupted 3 times"):
                client.read_box(1, "h0/0", "w", Box((0, 0), SHAPE), "float32")
    finally:
        proc.stop()


def test_source_killed_mid_stream_and_hung_source(tmp_path):
    _write(tmp_path / "h0")
    proc = StoreProcess(tmp_path / "h0", "h0", env={"TENPLEX_STORE_TEST_HOOKS": "exit_after_chunks=3"})
    try:
        with _client(proc.address) as client:
            with pytest.raises(RemoteStoreError) as info:
                client.read_box(1, "h0/0", "w", Box((0, 0), SHAPE), "float32")
            assert info.value.code == grpc.StatusCode.UNAVAILABLE and "data-plane" in str(info.value)
        proc.proc.wait(timeout=120)
        assert proc.proc.returncode == 137
    finally:
        proc.stop()
    proc = StoreProcess(tmp_path / "h0", "h0")
    try:
        with _client(proc.address, timeout=3.0) as client:  # short: the hung read below waits it out
            client.wait_ready(120)  # connected first, so the 3 s bound only meets answers of a working server
            assert client.data_pool() is not None
            proc.proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
            try:
                with pytest.raises(RemoteStoreError) as info:
                    client.read_box(1, "h0/0", "w", Box((0, 0), SHAPE), "float32")
            finally:
                proc.proc.send_signal(signal.SIGCONT)
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        proc.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a test certificate")
def test_tls_stores_keep_every_box_on_grpc(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    w, _ = _write(tmp_path / "h0")
    proc = StoreProcess(tmp_path / "h0", "h0", extra_args=("--tls-cert", str(cert), "--tls-key", str(key)))
    try:
        with _client(proc.address, root_certificates=cert.read_bytes()) as client:
            assert client.health()["data_port"] == 0  # the server starts no plaintext data plane
            assert client.data_pool() is None
            np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", Box((0, 0), SHAPE), "float32"), w)
    finally:
        proc.stop()
    plain = StoreProcess(tmp_path / "h0", "h0")
    try:  # a TLS client never uses a data plane, even one a server offers
        assert not StoreClient(plain.address, root_certificates=cert.read_bytes())._data_wanted
    finally:
        plain.stop()


@pytest.mark.parametrize("source", ["data plane", "gRPC only"])
def test_transform_source_dies_mid_stream_and_the_replica_takes_over(tmp_path, source):
    """3 MiB tensors pulled in 1.5 MiB pieces (the data plane's size) from h0, which dies after 3 frames."""
    tensors = {"a": ((1024, 768), "float32"), "b": ((768, 1024), "float32")}
    old = tiny_layout(tensors, {f"{h}/0": [("a", (0, 0), (1024, 768)), ("b", (0, 0), (768, 1024))]
                                for h in ("h0", "h1")})
    new = tiny_layout(tensors, {"h2/0": [("a", (0, 0), (512, 768)), ("b", (0, 0), (768, 512))],
                                "h2/1": [("a", (512, 0), (512, 768)), ("b", (0, 512), (768, 512))]})
    roots = {h: tmp_path / h for h in ("h0", "h1", "h2")}
    arrays = random_globals(old, seed=5)
    write_version(roots, old, 1, arrays)
    extra = () if source == "data plane" else ("--no-data-plane",)
    procs = {"h0": StoreProcess(roots["h0"], "h0", env={"TENPLEX_STORE_TEST_HOOKS": "exit_after_chunks=3"},
                                extra_args=extra),
             "h1": StoreProcess(roots["h1"], "h1", extra_args=extra), "h2": StoreProcess(roots["h2"], "h2")}
    try:
        report = transform(plan(old, new), old, new, {h: p.address for h, p in procs.items()}, 1, 2,
                           chunk_bytes=64 << 10)
        assert not procs["h0"].alive(), "the fault was not injected"
        assert report["hosts"]["h2"]["refetched_bytes"] > 0
        assert_version_matches(roots, new, 2, arrays)
        served_by_data_plane = "data connection from" in (tmp_path / ".h1.log").read_text()
        assert served_by_data_plane == (source == "data plane")
    finally:
        for p in procs.values():
            p.stop()


def test_bench_transfer_reports_both_paths_and_baselines():
    done = subprocess.run([str(Path(sys.executable).with_name("tenplex")), "bench", "transfer", "--json",
                           "--bytes", str(8 << 20), "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["path"] == "dataplane" and row["bytes"] == 8 << 20
    for key in ("tenplex_gbps", "grpc_gbps", "raw_socket_gbps", "memcpy_gbps", "tenplex_pull_gbps", "grpc_pull_gbps",
                "raw_socket_file_gbps"):
        assert row[key] > 0, key
    assert row["tenplex_vs_file_ratio"] == round(row["tenplex_gbps"] / row["raw_socket_file_gbps"], 3) or \
        abs(row["tenplex_vs_file_ratio"] - row["tenplex_gbps"] / row["raw_socket_file_gbps"]) < 0.01
