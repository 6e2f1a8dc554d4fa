"""The gRPC store service in a real server process: reads, writes, bad input, tokens, corruption, dataset files."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

from tenplex.box import Box
from tenplex.store import Store
from tenplex.store.client import ChecksumError, RemoteStoreError, StoreClient

from store_helpers import StoreProcess

SHAPE = (64, 48)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One store process holding version 1: h0/0 has rows 0:32 of w (float32), h0/1 a bf16 vector."""
    base = tmp_path_factory.mktemp("grpc")
    rng = np.random.default_rng(7)
    w = rng.random(SHAPE, dtype=np.float32)
    b = rng.integers(0, 2**16, size=(1000,), dtype=np.uint16)
    store = Store(base / "h0", "h0")
    with store.begin(1) as writer:
        writer.put("h0/0", "w", Box((0, 0), (32, 48)), w[:32], "float32", shape=SHAPE)
        writer.put("h0/1", "b", Box((0,), (1000,)), b, "bfloat16", shape=(1000,))
        writer.put_json("step", {"step": 3})
        writer.commit()
    data = base / "h0" / "datasets"
    (data / "train").mkdir(parents=True)
    (data / "train" / "part-0.bin").write_bytes(bytes(range(256)) * 100)
    (base / "secret.txt").write_text("outside")
    os.symlink(base / "secret.txt", data / "escape")
    proc = StoreProcess(base / "h0", "h0")
    yield proc, w, b, base
    proc.stop()


def _code(info) -> grpc.StatusCode:
    return info.value.code


def test_read_boxes_in_many_chunks(served):
    proc, w, b, _ = served
    with StoreClient(proc.address, chunk_bytes=4096) as client:  # forces many chunks per read
        client.wait_ready()
        assert client.versions() == [1]
        box = Box((3, 5), (20, 40))
        np.testing.assert_array_equal(client.read_box(1, "h0/0", "w", box, "float32"), w[3:23, 5:45])
        whole = client.read_box(1, "h0/1", "b", Box((0,), (1000,)), "bfloat16")
        assert whole.tobytes() == b.tobytes()
        manifest = client.manifest(1)
        assert {row["device"] for row in manifest["shards"]} == {"h0/0", "h0/1"}
        assert client.get_json(1, "step") == {"step": 3}
        assert client.health()["host"] == "h0"


@pytest.mark.parametrize("call, code, message", [
    (lambda c: c.read_box(9, "h0/0", "w", Box((0, 0), (1, 1)), "float32"), grpc.StatusCode.NOT_FOUND,
     "no committed version 9"),
    (lambda c: c.read_box(1, "h0/0", "w", Box((30, 0), (8, 48)), "float32"), grpc.StatusCode.OUT_OF_RANGE,
     "lies inside no box device h0/0 stores"),
    (lambda c: c.read_box(1, "h0/7", "w", Box((0, 0), (1, 1)), "float32"), grpc.StatusCode.NOT_FOUND,
     "holds nothing for device h0/7"),
    (lambda c: c.read_box(1, "h0/0", "nope", Box((0, 0), (1, 1)), "float32"), grpc.StatusCode.NOT_FOUND,
     "no box of tensor 'nope'"),
    (lambda c: c.get_json(1, "missing"), grpc.StatusCode.NOT_FOUND, "no JSON document 'missing'"),
    (lambda c: c.manifest(42), grpc.StatusCode.NOT_FOUND, "no committed version 42"),
    (lambda c: c.gc(0), grpc.StatusCode.FAILED_PRECONDITION, "at least one version"),
    (lambda c: c.commit(77), grpc.StatusCode.FAILED_PRECONDITION, "nothing was prepared"),
    (lambda c: c.prepare(5, "ghost"), grpc.StatusCode.NOT_FOUND, "no open part 'ghost'"),
])
def test_bad_requests_get_clear_statuses_and_the_server_keeps_serving(served, call, code, message):
    proc, *_ = served
    with StoreClient(proc.address) as client:
        with pytest.raises(RemoteStoreError) as info:
            call(client)
        assert _code(info) == code, str(info.value)
        assert message in str(info.value)
        assert client.versions() == [1]


def test_malformed_requests(served):
    proc, *_ = served
    from tenplex.store._proto import store_pb2 as pb
    channel = grpc.insecure_channel(proc.address)
    # offsets and lengths of different rank: the box itself is malformed
    read = channel.unary_stream("/tenplex.v1.Store/ReadBox", request_serializer=pb.ReadBoxRequest.SerializeToString,
                                response_deserializer=pb.Chunk.FromString)
    bad_box = pb.ReadBoxRequest(version=1, device="h0/0", tensor="w", box=pb.Box(offsets=[0], lengths=[1, 2]))
    with pytest.raises(grpc.RpcError) as info:
        list(read(bad_box, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "differ in rank" in info.value.details()
    negative = pb.ReadBoxRequest(version=1, device="h0/0", tensor="w", box=pb.Box(offsets=[-1, 0], lengths=[1, 2]))
    with pytest.raises(grpc.RpcError) as info:
        list(read(negative, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "non-negative" in info.value.details()
    # bytes that are no protobuf message at all
    raw = channel.unary_unary("/tenplex.v1.Store/GetManifest", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff\xff\x0f", timeout=10)
    assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    # a WriteShard stream that starts with a chunk instead of its header
    write = channel.stream_unary("/tenplex.v1.Store/WriteShard",
                                 request_serializer=pb.WriteShardRequest.SerializeToString,
                                 response_deserializer=pb.WriteShardReply.FromString)
    with pytest.raises(grpc.RpcError) as info:
        write(iter([pb.WriteShardRequest(chunk=pb.Chunk(data=b"x"))]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in info.value.details()
    channel.close()
    with StoreClient(proc.address) as client:
        assert client.versions() == [1]


def test_remote_write_commit_and_delete(served):
    proc, w, _, base = served
    with StoreClient(proc.address, chunk_bytes=4096) as client:
        new = np.arange(32 * 48, dtype=np.float32).reshape(32, 48)
        assert client.write_shard(2, "remote", "h0/0", "w", Box((32, 0), (32, 48)), new, "float32", SHAPE) == new.nbytes
        client.put_json(2, "remote", "step", {"step": 4})
        assert client.versions() == [1]  # staged only
        client.prepare(2, "remote")
        client.commit(2)
        assert client.versions() == [1, 2]
        np.testing.assert_array_equal(client.read_box(2, "h0/0", "w", Box((40, 0), (2, 48)), "float32"), new[8:10])
        assert Store(base / "h0", "h0").open(2).verify() == []
        assert client.delete(2) is True
        assert client.versions() == [1]
        with pytest.raises(RemoteStoreError, match="no committed version 2"):
            client.manifest(2)


def test_failed_shard_write_leaves_nothing_in_the_part(served):
    """A short WriteShard stream is discarded: the part never publishes it, and the box can be written again."""
    import xxhash

    from tenplex.store import wire
    from tenplex.store._proto import store_pb2 as pb
    proc, *_ = served
    box = Box((0, 0), (8, 48))
    full = np.arange(8 * 48, dtype=np.float32).reshape(8, 48) + 7
    half = np.ascontiguousarray(full[:4]).tobytes()
    header = pb.ShardHeader(version=5, part="broken", device="h0/0", tensor="w", box=wire.to_pb_box(box),
                            dtype="float32", shape=list(SHAPE))
    messages = [pb.WriteShardRequest(header=header),
                pb.WriteShardRequest(chunk=pb.Chunk(box=wire.to_pb_box(Box((0, 0), (4, 48))), data=half,
                                                    xxh3=xxhash.xxh3_64_intdigest(half)))]
    channel = grpc.insecure_channel(proc.address)
    write = channel.stream_unary("/tenplex.v1.Store/WriteShard",
                                 request_serializer=pb.WriteShardRequest.SerializeToString,
                                 response_deserializer=pb.WriteShardReply.FromString)
    with pytest.raises(grpc.RpcError) as info:
        write(iter(messages), timeout=10)
    assert "received 768 of 1536 bytes" in info.value.details()
    channel.close()
    with StoreClient(proc.address) as client:
        # the box is free again (its claim was dropped with the partial shard) and only the retry is published
        assert client.write_shard(5, "broken", "h0/0", "w", box, full, "float32", SHAPE) == full.nbytes
        client.prepare(5, "broken")
        client.commit(5)
        assert len(client.manifest(5)["shards"]) == 1
        np.testing.assert_array_equal(client.read_box(5, "h0/0", "w", box, "float32"), full)
        assert client.delete(5) is True


def test_dataset_files(served):
    proc, *_ = served
    expected = bytes(range(256)) * 100
    with StoreClient(proc.address, chunk_bytes=4096) as client:
        assert client.stat_file("train/part-0.bin")["size"] == len(expected)
        assert client.read_file("train/part-0.bin") == expected
        assert client.read_file("train/part-0.bin", 1000, 9000) == expected[1000:10000]
        assert client.read_file("train/part-0.bin", len(expected) - 5, 100) == expected[-5:]
        for path, code in [("../secret.txt", grpc.StatusCode.INVALID_ARGUMENT),
                           ("/etc/passwd", grpc.StatusCode.INVALID_ARGUMENT),
                           ("train/../../secret.txt", grpc.StatusCode.INVALID_ARGUMENT),
                           ("escape", grpc.StatusCode.PERMISSION_DENIED),
                           ("train/missing.bin", grpc.StatusCode.NOT_FOUND),
                           ("train", grpc.StatusCode.NOT_FOUND)]:
            with pytest.raises(RemoteStoreError) as info:
                client.read_file(path)
            assert _code(info) == code, (path, str(info.value))
            with pytest.raises(RemoteStoreError):
                client.stat_file(path)
        with pytest.raises(RemoteStoreError) as info:
            client.read_file("train/part-0.bin", -1, 10)
        assert _code(info) == grpc.StatusCode.INVALID_ARGUMENT


def test_corrupted_chunks_are_refetched_and_never_returned(tmp_path):
    data = np.random.default_rng(3).random((50, 40), dtype=np.float32)
    store = Store(tmp_path / "h0", "h0")
    with store.begin(1) as writer:
        writer.put("h0/0", "x", Box((0, 0), (50, 40)), data, "float32")
        writer.commit()
    # The first 3 chunks the server sends have a flipped byte after their checksum was computed.
    (tmp_path / "h0" / "datasets" / "f.bin").write_bytes(bytes(range(256)) * 64)
    proc = StoreProcess(tmp_path / "h0", "h0", env={"TENPLEX_STORE_TEST_HOOKS": "corrupt_chunks=3"})
    try:
        with StoreClient(proc.address, chunk_bytes=4096) as client:
            got = client.read_box(1, "h0/0", "x", Box((0, 0), (50, 40)), "float32")
            assert got.tobytes() == data.tobytes()
    finally:
        proc.stop()
    proc = StoreProcess(tmp_path / "h0", "h0", env={"TENPLEX_STORE_TEST_HOOKS": "corrupt_chunks=1"})
    try:
        with StoreClient(proc.address, chunk_bytes=4096) as client:
            assert client.read_file("f.bin") == bytes(range(256)) * 64  # its first chunk arrived corrupted
    finally:
        proc.stop()
    proc = StoreProcess(tmp_path / "h0", "h0", env={"TENPLEX_STORE_TEST_HOOKS": "corrupt_chunks=100000"})
    try:
        with StoreClient(proc.address, chunk_bytes=4096, retries=2) as client:
            with pytest.raises(ChecksumError, match="arrived corrupted 3 times"):
                client.read_box(1, "h0/0", "x", Box((0, 0), (50, 40)), "float32")
            with pytest.raises(ChecksumError, match="corrupted 3 times"):
                client.read_file("f.bin")
    finally:
        proc.stop()


def test_token_required_off_loopback_and_checked_on_every_call(tmp_path):
    Store(tmp_path / "h0", "h0")
    refused = subprocess.run([sys.executable, "-m", "tenplex.cli.store", "serve", "--root", str(tmp_path / "h0"),
                              "--host", "h0", "--bind", "0.0.0.0", "--port", "0"], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "without a token" in refused.stderr
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    proc = StoreProcess(tmp_path / "h0", "h0", token_file=token_file, bind="0.0.0.0")
    try:
        for token in (None, "wrong"):
            with StoreClient(proc.address, token=token) as client:
                with pytest.raises(RemoteStoreError) as info:
                    client.versions()
                assert _code(info) == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(RemoteStoreError) as info:  # streaming calls are checked too
                    client.read_file("anything")
                assert _code(info) == grpc.StatusCode.UNAUTHENTICATED
        with StoreClient(proc.address, token="s3cret-token") as client:
            assert client.versions() == []
    finally:
        proc.stop()


def test_concurrent_remote_writes_into_one_part(served):
    from concurrent.futures import ThreadPoolExecutor

    proc, _, _, base = served
    rows = [np.full((4, 48), i, dtype=np.float32) for i in range(16)]
    with StoreClient(proc.address, chunk_bytes=4096) as client:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: client.write_shard(3, "many", f"h0/{i}", "w", Box((4 * i, 0), (4, 48)), rows[i],
                                                       "float32", SHAPE), range(16)))
        client.prepare(3, "many")
        client.commit(3)
        reader = Store(base / "h0", "h0").open(3)
        assert reader.verify() == [] and len(reader.devices()) == 16
        for i in range(16):
            np.testing.assert_array_equal(reader.read(f"h0/{i}", "w", Box((4 * i, 0), (4, 48))), rows[i])
        assert client.delete(3)


def test_many_regions_in_one_call(served):
    proc, w, b, _ = served
    regions = [("h0/0", "w", Box((i, 2 * i), (3, 5)), 4) for i in range(10)] + [("h0/1", "b", Box((7,), (500,)), 2)]
    got: dict[int, dict] = {i: {} for i in range(len(regions))}

    def sink(i):
        return lambda sub, data: got[i].__setitem__(sub, bytes(data))

    with StoreClient(proc.address, chunk_bytes=4096) as client:
        n = client.read_boxes_to(1, [(d, t, box, size, sink(i)) for i, (d, t, box, size) in enumerate(regions)])
        assert n == sum(box.volume * size for _, _, box, size in regions)
        for i, (_, tensor, box, _) in enumerate(regions):
            source = w if tensor == "w" else b
            joined = np.zeros(box.lengths, dtype=source.dtype)
            for sub, data in got[i].items():
                joined[sub.local(box).slices()] = np.frombuffer(data, source.dtype).reshape(sub.lengths)
            np.testing.assert_array_equal(joined, source[box.slices()])
        with pytest.raises(RemoteStoreError) as info:  # one bad region fails the call before any data
            client.read_boxes_to(1, [(d, t, box, size, sink(0)) for d, t, box, size in regions[:2]] +
                                 [("h0/0", "w", Box((40, 0), (1, 1)), 4, sink(0))])
        assert info.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_a_transform_request_for_gpt3_175b_on_1024_devices_reaches_the_store(tmp_path):
    """The request carries both whole layouts: 75 MB of JSON here, more than gRPC's default limits and the 65 MiB
    the store allowed before. With an empty plan the store decodes it and refuses the plan itself, which shows
    the request arrived whole (not RESOURCE_EXHAUSTED on the way)."""
    from tenplex.gpt import gpt
    from tenplex.parallel import ParallelConfig
    from tenplex.ptc import layout
    from tenplex.store import wire
    from tenplex.transfer_plan import Plan, PlanStats
    from tenplex.transform import TransformRequest

    model = gpt(layers=96, hidden=12288, heads=96, vocab=50257, optimizer="adam")
    old = layout(model, ParallelConfig.on_hosts(8, 8, 16, 128, 8))
    new = layout(model, ParallelConfig.on_hosts(16, 8, 8, 128, 8))
    proc = StoreProcess(tmp_path / "h0", "h0")
    try:
        request = TransformRequest(host="h0", old_version=1, new_version=2, plan=Plan((), PlanStats()),
                                   old_layout=old, new_layout=new, peers={"h0": proc.address})
        assert wire.to_pb_transform_request(request).ByteSize() > 70 << 20
        with StoreClient(proc.address, timeout=300) as client:
            with pytest.raises(RemoteStoreError) as info:
                for _ in client.transform(request, timeout=300):
                    pass
        assert "plan covers 0 of" in str(info.value) and "RESOURCE_EXHAUSTED" not in str(info.value)
        assert proc.alive()
    finally:
        proc.stop()
