"""Issue 31, weaker spots of the store server: what one request may ask, and errors that say what happened."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from tenplex.box import Box
from tenplex.store import Store, wire
from tenplex.store._proto import store_pb2 as pb
from tenplex.store.client import RemoteStoreError, StoreClient
from tenplex.store.server import serve
from tenplex.store.shardfile import ShardFile

ROWS, COLS = 768, 1024  # float32: 3 MiB, three 1 MiB blocks


@pytest.fixture
def served(tmp_path):
    """An in-process server (no data plane) of a store holding version 1: w, ROWS x COLS float32 on h0/0."""
    store = Store(tmp_path / "h0", "h0")
    w = np.random.default_rng(2).random((ROWS, COLS), dtype=np.float32)
    with store.begin(1) as writer:
        writer.put("h0/0", "w", Box((0, 0), w.shape), w, "float32", shape=w.shape)
        writer.commit()
    server, port = serve(store, port=0, data_plane=False)
    yield f"127.0.0.1:{port}", w
    server.stop(grace=None)


def test_deeply_nested_json_is_an_invalid_argument(served):
    address, _ = served
    with StoreClient(address, timeout=60) as client, pytest.raises(RemoteStoreError) as info:
        client._call("PutJson", pb.PutJsonRequest(version=2, name="doc", json="[" * 200_000 + "]" * 200_000), "PutJson")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "nested deeper than the JSON parser can read" in str(info.value)


def test_a_version_deleted_during_a_read_says_so(served):
    address, _ = served
    channel = grpc.insecure_channel(address, options=wire.channel_options())
    read = channel.unary_stream("/tenplex.v1.Store/ReadBox", request_serializer=pb.ReadBoxRequest.SerializeToString,
                                response_deserializer=lambda raw: raw)
    # 4 KiB chunks: the 3 MiB reply is far larger than what the transport sends ahead of the reader
    call = read(pb.ReadBoxRequest(version=1, device="h0/0", tensor="w", box=wire.to_pb_box(Box((0, 0), (ROWS, COLS))),
                                  chunk_bytes=4096), timeout=60)
    next(call)
    with StoreClient(address, timeout=60) as client:
        assert client.delete(1)
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
    assert "version 1 on host h0 was deleted (or replaced by a new commit) while it was being read" in \
        info.value.details()
    channel.close()


def test_a_closed_reader_of_a_deleted_version_says_so(served, tmp_path):
    from tenplex.store.manifest import NotFound

    reader = Store(tmp_path / "h0", "h0").open(1)
    reader.close(deleted=True)  # what the server does to its cached reader when the version is deleted
    with pytest.raises(NotFound, match="version 1 on host h0 was deleted"):
        reader.read("h0/0", "w", Box((0, 0), (1, 1)))


def test_a_read_boxes_request_checks_each_block_once(served, monkeypatch):
    """768 one-element regions spread over three 1 MiB blocks: the server reads each block once (it used to read
    a whole block per region: 768 MiB here; 20,000 regions cost 75 s)."""
    address, w = served
    read = []
    pread = ShardFile._pread
    monkeypatch.setattr(ShardFile, "_pread", lambda self, fd, view, offset: (read.append(view.nbytes),
                                                                             pread(self, fd, view, offset))[1])
    boxes = [Box((row, col), (1, 1)) for row in range(0, ROWS, 8) for col in (0, 500, 1000, 1001, 1023, 7, 9, 11)]
    got = {}
    with StoreClient(address, timeout=60) as client:
        client.read_boxes_to(1, [("h0/0", "w", box, 4, lambda sub, data, box=box: got.__setitem__(box, bytes(data)))
                                 for box in boxes])
    assert all(got[box] == w[box.slices()].tobytes() for box in boxes)
    assert sum(read) <= ROWS * COLS * 4 + len(boxes) * 4  # each block once, plus each region's own bytes


def test_read_boxes_refuses_more_regions_than_a_request_may_name_and_the_client_splits(served):
    address, w = served
    assert wire.MAX_READ_REGIONS == 4096
    many = [pb.BoxRef(device="h0/0", tensor="w", box=wire.to_pb_box(Box((0, 0), (1, 1))))] * 4097
    channel = grpc.insecure_channel(address, options=wire.channel_options())
    with pytest.raises(grpc.RpcError) as info:
        list(channel.unary_stream("/tenplex.v1.Store/ReadBoxes",
                                  request_serializer=pb.ReadBoxesRequest.SerializeToString,
                                  response_deserializer=lambda raw: raw)(pb.ReadBoxesRequest(version=1, boxes=many),
                                                                         timeout=60))
    channel.close()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "ValueError: ReadBoxes names 4097 regions; a request may name at most 4096: split it"
    with StoreClient(address, timeout=60) as client:
        got = []
        nbytes = client.read_boxes_to(1, [("h0/0", "w", Box((i % ROWS, 0), (1, 1)), 4,
                                           lambda sub, data: got.append(bytes(data))) for i in range(4097)])
    assert nbytes == 4097 * 4 and len(got) == 4097
