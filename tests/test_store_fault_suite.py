"""Issue 12's fault suite: bad inputs and faults against one running store server. Each case checks the answer
it gets (a clear status, never INTERNAL), and after every case the server must still serve and every committed
version must still verify, byte for byte, over gRPC, over the data plane and on disk."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
import xxhash

from tenplex.box import Box
from tenplex.store import Store, wire
from tenplex.store._proto import store_pb2 as pb
from tenplex.store.client import RemoteStoreError, StoreClient

from store_helpers import StoreProcess, flip_data_byte

BIG = (768, 1024)  # float32, 3 MiB: three checksum blocks
SMALL = (10, 7)


def _arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"big": rng.random(BIG, dtype=np.float32), "small": rng.integers(0, 1 << 16, SMALL).astype(np.uint16)}


def _commit(store: Store, version: int, arrays: dict[str, np.ndarray]) -> None:
    with store.begin(version) as w:
        w.put("h0/0", "big", Box((0, 0), BIG), arrays["big"], "float32", shape=BIG)
        w.put("h0/1", "small", Box((0, 0), SMALL), arrays["small"], "bfloat16", shape=SMALL)
        w.put_json("step", {"step": version})
        w.commit()


class Served:
    def __init__(self, base):
        self.root = base / "h0"
        self.store = Store(self.root, "h0")
        self.good = {1: _arrays(1), 2: _arrays(2)}
        for version, arrays in self.good.items():
            _commit(self.store, version, arrays)
        (self.root / "datasets" / "d").mkdir(parents=True)
        (self.root / "datasets" / "d" / "f.bin").write_bytes(b"x" * 1000)
        self.proc = StoreProcess(self.root, "h0", extra_args=("--max-streams", "8", "--stream-idle-s", "3"))
        self.grpc = StoreClient(self.proc.address, timeout=30, data_plane=False)
        self.data = StoreClient(self.proc.address, timeout=30, data_plane_min_bytes=1)
        self.data_port = self.grpc.health()["data_port"]
        self.channel = grpc.insecure_channel(self.proc.address)
        self.victims = 100

    def victim(self) -> tuple[int, dict[str, np.ndarray]]:
        """A fresh committed version that a case may damage (it is deleted after the case)."""
        self.victims += 1
        arrays = _arrays(self.victims)
        _commit(self.store, self.victims, arrays)
        return self.victims, arrays

    def shard_file(self, version: int, device: str = "h0/0"):
        reader = self.store.open(version)
        return reader.path / reader.entries_of(device)[0].file

    def call(self, method: str, request, reply, streaming: str = "uu"):
        make = {"uu": self.channel.unary_unary, "us": self.channel.unary_stream, "su": self.channel.stream_unary}
        return make[streaming](f"/tenplex.v1.Store/{method}", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=reply.FromString if reply is not None else (lambda b: b))

    def check(self) -> None:
        """The server serves, and every committed good version reads back exactly and verifies."""
        assert self.proc.alive(), "the store server died"
        health = self.grpc.health()
        for version, arrays in self.good.items():
            assert version in health["versions"]
            for client in (self.grpc, self.data):
                np.testing.assert_array_equal(client.read_box(version, "h0/0", "big", Box((0, 0), BIG), "float32"),
                                              arrays["big"])
                np.testing.assert_array_equal(client.read_box(version, "h0/1", "small", Box((0, 0), SMALL),
                                                              "bfloat16"), arrays["small"])
            assert self.grpc.get_json(version, "step") == {"step": version}
            assert self.store.open(version).verify() == []

    def close(self) -> None:
        self.grpc.close()
        self.data.close()
        self.channel.close()
        self.proc.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("faults"))
    yield s
    s.close()


def _code(call) -> grpc.StatusCode:
    with pytest.raises((grpc.RpcError, RemoteStoreError)) as info:
        call()
    error = info.value
    code = error.code() if isinstance(error, grpc.RpcError) else error.code
    details = error.details() if isinstance(error, grpc.RpcError) else str(error)
    assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), details
    return code, details


# ---------------------------------------------------------------------------------- on-disk faults --
def flipped_bit(s: Served):
    v, _ = s.victim()
    flip_data_byte(s.shard_file(v), 2 * (1 << 20) + 17, mask=0x40)
    for client in (s.grpc, s.data):
        code, details = _code(lambda client=client: client.read_box(v, "h0/0", "big", Box((0, 0), BIG), "float32"))
        assert code == grpc.StatusCode.DATA_LOSS and "block 2" in details


def flipped_bit_in_small_shard(s: Served):
    v, _ = s.victim()
    flip_data_byte(s.shard_file(v, "h0/1"), 3, mask=0x40)
    code, details = _code(lambda: s.grpc.read_box(v, "h0/1", "small", Box((0, 0), SMALL), "bfloat16"))
    assert code == grpc.StatusCode.DATA_LOSS and "'small'" in details


def truncated_shard(s: Served):
    v, arrays = s.victim()
    s.data.read_box(v, "h0/0", "big", Box((0, 0), BIG), "float32")  # cached by the server first
    path = s.shard_file(v)
    os.truncate(path, path.stat().st_size - 4096)
    for client in (s.grpc, s.data):
        code, details = _code(lambda client=client: client.read_box(v, "h0/0", "big", Box((0, 0), BIG), "float32"))
        assert code == grpc.StatusCode.DATA_LOSS and "truncated" in details
    # the other shard of the version still reads
    np.testing.assert_array_equal(s.grpc.read_box(v, "h0/1", "small", Box((0, 0), SMALL), "bfloat16"),
                                  arrays["small"])


def shard_truncated_to_nothing(s: Served):
    v, _ = s.victim()
    os.truncate(s.shard_file(v), 0)
    code, details = _code(lambda: s.data.read_box(v, "h0/0", "big", Box((0, 0), BIG), "float32"))
    assert code == grpc.StatusCode.DATA_LOSS


def huge_safetensors_header(s: Served):
    v, _ = s.victim()
    with open(s.shard_file(v), "r+b") as f:
        f.write(struct.pack("<Q", 1 << 62))
    code, details = _code(lambda: s.grpc.read_box(v, "h0/0", "big", Box((0, 0), (1, 1)), "float32"))
    assert code == grpc.StatusCode.DATA_LOSS and "header" in details


def garbage_safetensors_header(s: Served):
    v, _ = s.victim()
    with open(s.shard_file(v), "r+b") as f:
        f.seek(8)
        f.write(b"{not json")
    code, details = _code(lambda: s.grpc.read_box(v, "h0/0", "big", Box((0, 0), (1, 1)), "float32"))
    assert code == grpc.StatusCode.DATA_LOSS and "header" in details


def shard_file_deleted(s: Served):
    v, _ = s.victim()
    s.shard_file(v).unlink()
    code, details = _code(lambda: s.grpc.read_box(v, "h0/0", "big", Box((0, 0), (1, 1)), "float32"))
    assert code == grpc.StatusCode.DATA_LOSS and "gone" in details


def truncated_manifest(s: Served):
    v, _ = s.victim()
    path = s.root / "versions" / str(v) / "manifest.json"
    path.write_text(path.read_text()[:50])
    code, details = _code(lambda: s.grpc.manifest(v))
    assert "manifest.json" in details and "damaged" in details


def manifest_with_bad_block_list(s: Served):
    v, _ = s.victim()
    path = s.root / "versions" / str(v) / "manifest.json"
    doc = json.loads(path.read_text())
    doc["shards"][0]["blocks"] = doc["shards"][0]["blocks"][:1]
    path.write_text(json.dumps(doc))
    code, details = _code(lambda: s.grpc.read_box(v, "h0/0", "big", Box((0, 0), (1, 1)), "float32"))
    assert "block checksums" in details


def deleted_manifest(s: Served):
    v, _ = s.victim()
    (s.root / "versions" / str(v) / "manifest.json").unlink()
    code, _ = _code(lambda: s.grpc.manifest(v))
    assert code == grpc.StatusCode.NOT_FOUND
    assert v not in s.grpc.versions()


def damaged_json_document(s: Served):
    v, _ = s.victim()
    (s.root / "versions" / str(v) / s.store.open(v).manifest["json"]["step"]).write_text("{")
    code, details = _code(lambda: s.grpc.get_json(v, "step"))
    assert "'step'" in details and "damaged" in details


def local_delete_and_recommit(s: Served):
    v, old = s.victim()
    s.grpc.read_box(v, "h0/0", "big", Box((0, 0), BIG), "float32")
    s.store.delete(v)
    new = _arrays(v + 1000)
    _commit(s.store, v, new)
    for client in (s.grpc, s.data):
        np.testing.assert_array_equal(client.read_box(v, "h0/0", "big", Box((0, 0), BIG), "float32"), new["big"])


def local_gc_under_the_server(s: Served):
    v, _ = s.victim()
    s.data.read_box(v, "h0/0", "big", Box((0, 0), BIG), "float32")
    s.store.delete(v)
    code, _ = _code(lambda: s.data.read_box(v, "h0/0", "big", Box((0, 0), BIG), "float32"))
    assert code == grpc.StatusCode.NOT_FOUND


def killed_local_writer(s: Served):
    script = ("import sys, numpy as np; from tenplex.box import Box; from tenplex.store import Store\n"
              "w = Store(sys.argv[1], 'h0').begin(999)\n"
              "w.put('h0/0', 'big', Box((0,), (1 << 20,)), np.ones(1 << 20, np.float32), 'float32')\n"
              "import os; os._exit(9)\n")
    subprocess.run([sys.executable, "-c", script, str(s.root)], timeout=60)
    assert 999 not in s.grpc.versions()


# ------------------------------------------------------------------------------------ bad requests --
def unknown_version(s: Served):
    code, _ = _code(lambda: s.grpc.read_box(12345, "h0/0", "big", Box((0, 0), (1, 1)), "float32"))
    assert code == grpc.StatusCode.NOT_FOUND


def box_outside_the_shard(s: Served):
    for client in (s.grpc, s.data):
        code, _ = _code(lambda client=client: client.read_box(1, "h0/0", "big", Box((700, 0), (100, 1024)), "float32"))
        assert code == grpc.StatusCode.OUT_OF_RANGE


def negative_box(s: Served):
    request = pb.ReadBoxRequest(version=1, device="h0/0", tensor="big",
                                box=pb.Box(offsets=[0, 0], lengths=[-1, 5]))
    code, _ = _code(lambda: list(s.call("ReadBox", request, None, "us")(request, timeout=10)))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


def wrong_rank_box(s: Served):
    code, _ = _code(lambda: s.grpc.read_box(1, "h0/0", "big", Box((0,), (1,)), "float32"))
    assert code in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT)


def very_long_names(s: Served):
    long = "x" * 5000
    code, _ = _code(lambda: s.grpc.read_box(1, "h0/0", long, Box((0, 0), (1, 1)), "float32"))
    assert code == grpc.StatusCode.NOT_FOUND
    code, _ = _code(lambda: s.grpc.put_json(500, long, "step", {}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = _code(lambda: s.grpc.put_json(500, "p", long, {}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    for call in (lambda: s.grpc.read_file(long), lambda: s.grpc.stat_file(long), lambda: s.grpc.read_file(f"d/{long}")):
        code, details = _code(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "too long" in details
    s.grpc.abort(500)


def negative_version(s: Served):
    code, _ = _code(lambda: s.grpc.put_json(-3, "p", "step", {}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def many_regions_of_an_unknown_device(s: Served):
    regions = [("h9/9", "big", Box((0, 0), (1, 1)), 4, lambda sub, b: None)] * 10000
    code, _ = _code(lambda: s.grpc.read_boxes_to(1, regions))
    assert code == grpc.StatusCode.NOT_FOUND


def write_without_header(s: Served):
    chunk = pb.WriteShardRequest(chunk=pb.Chunk(box=pb.Box(offsets=[0], lengths=[1]), data=b"1234"))
    code, _ = _code(lambda: s.call("WriteShard", None, pb.WriteShardReply, "su")(iter([chunk]), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def _header(version: int, part: str, lengths, dtype: str = "float32", tensor: str = "w") -> pb.WriteShardRequest:
    return pb.WriteShardRequest(header=pb.ShardHeader(version=version, part=part, device="h0/0", tensor=tensor,
                                                      box=wire.to_pb_box(Box((0,) * len(lengths), lengths)),
                                                      dtype=dtype))


def _chunk(box: Box, data: bytes, digest: int | None = None) -> pb.WriteShardRequest:
    return pb.WriteShardRequest(chunk=pb.Chunk(box=wire.to_pb_box(box), data=data,
                                               xxh3=xxhash.xxh3_64_intdigest(data) if digest is None else digest))


def write_chunk_outside_the_box(s: Served):
    messages = [_header(501, "p", (4,)), _chunk(Box((8,), (4,)), b"\0" * 16)]
    code, _ = _code(lambda: s.call("WriteShard", None, pb.WriteShardReply, "su")(iter(messages), timeout=10))
    assert code == grpc.StatusCode.OUT_OF_RANGE
    s.grpc.abort(501)


def write_corrupted_chunk(s: Served):
    messages = [_header(502, "p", (4,)), _chunk(Box((0,), (4,)), b"\1" * 16, digest=7)]
    code, details = _code(lambda: s.call("WriteShard", None, pb.WriteShardReply, "su")(iter(messages), timeout=10))
    assert "corrupted" in details
    s.grpc.abort(502)


def write_short_stream(s: Served):
    messages = [_header(503, "p", (8,)), _chunk(Box((0,), (4,)), b"\1" * 16)]
    code, details = _code(lambda: s.call("WriteShard", None, pb.WriteShardReply, "su")(iter(messages), timeout=10))
    assert "received 16 of 32 bytes" in details
    s.grpc.abort(503)


def write_one_tebibyte_header(s: Served):
    code, details = _code(lambda: s.call("WriteShard", None, pb.WriteShardReply, "su")(
        iter([_header(504, "p", (1 << 38,))]), timeout=10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "free" in details
    s.grpc.abort(504)


def write_unknown_dtype(s: Served):
    code, _ = _code(lambda: s.call("WriteShard", None, pb.WriteShardReply, "su")(
        iter([_header(505, "p", (4,), dtype="float128x")]), timeout=10))
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    s.grpc.abort(505)


def stalled_writers(s: Served):
    release = threading.Event()

    def stalled(i: int):
        yield _header(506, "p", (4,), tensor=f"t{i}")
        release.wait()

    write = s.call("WriteShard", None, pb.WriteShardReply, "su")
    calls = [write.future(stalled(i), timeout=60) for i in range(12)]
    try:
        assert s.grpc.health()["host"] == "h0"
        codes = {c.exception().code() for c in calls}
        assert codes <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}, codes
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    finally:
        release.set()
    s.grpc.abort(506)


def invalid_json_document(s: Served):
    request = pb.PutJsonRequest(version=507, part="p", name="step", json="{nope")
    code, _ = _code(lambda: s.call("PutJson", request, pb.PutJsonReply)(request, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    s.grpc.abort(507)


def prepare_unknown_part(s: Served):
    code, _ = _code(lambda: s.grpc.prepare(508, "nobody"))
    assert code == grpc.StatusCode.NOT_FOUND


def commit_nothing_prepared(s: Served):
    code, details = _code(lambda: s.grpc.commit(509))
    assert "nothing was prepared" in details


def commit_a_committed_version(s: Served):
    code, details = _code(lambda: s.grpc.commit(1))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "already committed" in details


def write_into_a_committed_version(s: Served):
    code, details = _code(lambda: s.grpc.write_shard(2, "p", "h0/5", "w", Box((0,), (1,)), np.ones(1, np.float32),
                                                     "float32"))
    assert code == grpc.StatusCode.ALREADY_EXISTS


def delete_unknown_version(s: Served):
    assert s.grpc.delete(4242) is False


def gc_keep_zero(s: Served):
    code, details = _code(lambda: s.grpc.gc(0))
    assert "at least one" in details


def read_file_traversal(s: Served):
    for path in ("../versions/1/manifest.json", "/etc/passwd", "d/../../.lock"):
        code, _ = _code(lambda path=path: s.grpc.read_file(path))
        assert code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


def read_file_negative_offset(s: Served):
    code, _ = _code(lambda: s.grpc.read_file("d/f.bin", offset=-5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def stat_missing_file(s: Served):
    code, _ = _code(lambda: s.grpc.stat_file("d/none"))
    assert code == grpc.StatusCode.NOT_FOUND


def _raw_transform(s: Served, request: pb.TransformRequest) -> list:
    """The Transform RPC with a hand-made message (StoreClient.transform only sends well-formed requests)."""
    return list(s.call("Transform", request, pb.TransformProgress, "us")(request, timeout=30))


def transform_with_a_malformed_plan(s: Served):
    request = pb.TransformRequest(host="h0", old_version=1, new_version=510, plan_json="{", old_layout_json="{}",
                                  new_layout_json="{}")
    code, _ = _code(lambda: _raw_transform(s, request))
    assert 510 not in s.grpc.versions()


def transform_for_another_host(s: Served):
    request = pb.TransformRequest(host="h7", old_version=1, new_version=511, plan_json="{}", old_layout_json="{}",
                                  new_layout_json="{}")
    code, details = _code(lambda: _raw_transform(s, request))
    assert "h7" in details


def transform_to_a_committed_version(s: Served):
    request = pb.TransformRequest(host="h0", old_version=1, new_version=2, plan_json="{}", old_layout_json="{}",
                                  new_layout_json="{}")
    code, _ = _code(lambda: _raw_transform(s, request))
    assert code == grpc.StatusCode.ALREADY_EXISTS


def unknown_method(s: Served):
    request = pb.HealthRequest()
    code, _ = _code(lambda: s.channel.unary_unary("/tenplex.v1.Store/Explode")(request.SerializeToString(),
                                                                                timeout=10))
    assert code == grpc.StatusCode.UNIMPLEMENTED


def garbage_on_the_grpc_port(s: Served):
    with socket.create_connection(("127.0.0.1", s.proc.port), timeout=10) as sock:
        sock.sendall(os.urandom(4096))
        try:
            sock.recv(100)
        except OSError:
            pass


def _data_socket(s: Served) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", s.data_port), timeout=20)
    (n,) = struct.unpack("<I", sock.recv(4))
    sock.recv(n)  # the hello
    return sock


def _data_reply(sock: socket.socket) -> dict:
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return {}
        head += chunk
    (n,) = struct.unpack("<I", head)
    body = b""
    while len(body) < n:
        body += sock.recv(n - len(body))
    return json.loads(body)


def data_plane_garbage(s: Served):
    with _data_socket(s) as sock:
        sock.sendall(struct.pack("<I", 20) + b"\xff" * 20)
        reply = _data_reply(sock)
        assert reply.get("code") == "INVALID_ARGUMENT"


def data_plane_huge_length(s: Served):
    with _data_socket(s) as sock:
        sock.sendall(struct.pack("<I", 0xFFFFFFFF))
        reply = _data_reply(sock)
        assert reply.get("code") == "INVALID_ARGUMENT"


def data_plane_wrong_protocol(s: Served):
    with _data_socket(s) as sock:
        body = json.dumps({"v": 99}).encode()
        sock.sendall(struct.pack("<I", len(body)) + body)
        assert "version" in _data_reply(sock).get("message", "")


def data_plane_bad_request_fields(s: Served):
    with _data_socket(s) as sock:
        body = json.dumps({"v": 1, "version": "x", "device": 3, "tensor": None, "box": {}}).encode()
        sock.sendall(struct.pack("<I", len(body)) + body)
        assert _data_reply(sock).get("code") == "INVALID_ARGUMENT"


def data_plane_silent_connections(s: Served):
    socks = [socket.create_connection(("127.0.0.1", s.data_port), timeout=20) for _ in range(50)]
    for sock in socks:
        sock.close()


def data_plane_half_read(s: Served):
    with _data_socket(s) as sock:
        body = json.dumps({"v": 1, "version": 1, "device": "h0/0", "tensor": "big",
                           "box": {"offsets": [0, 0], "lengths": list(BIG)}, "frame_bytes": 65536}).encode()
        sock.sendall(struct.pack("<I", len(body)) + body)
        sock.recv(1000)  # then hang up mid-reply


CASES = [flipped_bit, flipped_bit_in_small_shard, truncated_shard, shard_truncated_to_nothing, huge_safetensors_header,
         garbage_safetensors_header, shard_file_deleted, truncated_manifest, manifest_with_bad_block_list,
         deleted_manifest, damaged_json_document, local_delete_and_recommit, local_gc_under_the_server,
         killed_local_writer, unknown_version, box_outside_the_shard, negative_box, wrong_rank_box, very_long_names,
         negative_version, many_regions_of_an_unknown_device, write_without_header, write_chunk_outside_the_box,
         write_corrupted_chunk, write_short_stream, write_one_tebibyte_header, write_unknown_dtype, stalled_writers,
         invalid_json_document, prepare_unknown_part, commit_nothing_prepared, commit_a_committed_version,
         write_into_a_committed_version, delete_unknown_version, gc_keep_zero, read_file_traversal,
         read_file_negative_offset, stat_missing_file, transform_with_a_malformed_plan, transform_for_another_host,
         transform_to_a_committed_version, unknown_method, garbage_on_the_grpc_port, data_plane_garbage,
         data_plane_huge_length, data_plane_wrong_protocol, data_plane_bad_request_fields,
         data_plane_silent_connections, data_plane_half_read]


def test_the_suite_has_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_fault(served, case):
    try:
        case(served)
    finally:
        for version in [v for v in served.store.versions() if v not in served.good]:
            shutil.rmtree(served.root / "versions" / str(version), ignore_errors=True)
            served.store.delete(version)
    served.check()
