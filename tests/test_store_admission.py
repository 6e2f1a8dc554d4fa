"""Issue 31 items 11 and 12: a store server refuses unauthenticated calls before reading their requests, gives
each method its own request-size limit, and bounds the threads that requests still on their way may hold."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from tenplex.box import Box
from tenplex.store import Store, admission, wire
from tenplex.store._proto import store_pb2 as pb
from tenplex.store.server import CONTROL_THREADS, serve

from store_helpers import StoreProcess

HEALTH = "/tenplex.v1.Store/Health"
TOKEN = (("authorization", "Bearer secret"),)


def _peak_rss_kib(pid: int) -> int:
    """The process's peak resident memory (VmHWM): what it ever held, whatever the timing."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _raw_unary(channel: grpc.Channel, method: str):
    return channel.unary_unary(method, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)


def test_limits_per_method_are_pinned():
    assert admission.limit_of("Transform") == admission.limit_of("PutJson") == wire.MAX_MESSAGE_BYTES == 1 << 30
    assert admission.limit_of("WriteShard") == wire.MAX_CHUNK_BYTES + (1 << 20) == 65 << 20
    assert admission.limit_of("ReadBoxes") == 16 << 20
    for method in ("Health", "ReadBox", "GetJson", "Commit", "ReadFile", "StatFile"):
        assert admission.limit_of(method) == 1 << 20
    assert (CONTROL_THREADS // 2, admission.SLOT_WAIT_S) == (8, 1.0)  # request slots, and the wait for one


def test_a_burst_of_calls_is_served_not_refused(served):
    """200 callers at once (a slot is held only while a request arrives): none refused for want of a slot."""
    channel = served()
    health = _raw_unary(channel, HEALTH)
    codes = []

    def call() -> None:
        for _ in range(5):
            try:
                health(b"", timeout=120)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)

    threads = [threading.Thread(target=call) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    channel.close()
    assert codes == ["OK"] * 1000


def test_an_unauthenticated_large_request_is_refused_unread(tmp_path):
    """A 128 MiB PutJson without the token: refused from its metadata, before gRPC buffers it (it used to cost the
    server three times its size)."""
    token = tmp_path / "token"
    token.write_text("secret")
    server = StoreProcess(tmp_path / "h0", "h0", token_file=token)
    channel = grpc.insecure_channel(server.address, options=wire.channel_options())
    try:
        before = _peak_rss_kib(server.proc.pid)
        body = pb.PutJsonRequest(version=1, name="x", json=" " * (128 << 20)).SerializeToString()
        with pytest.raises(grpc.RpcError) as refused:
            _raw_unary(channel, "/tenplex.v1.Store/PutJson")(body, timeout=120)
        del body
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _peak_rss_kib(server.proc.pid) - before < 32 << 10  # KiB: far below the 128 MiB sent
    finally:
        channel.close()
        server.stop()


@pytest.fixture
def served(tmp_path):
    """An in-process server of a store with version 1 (token "secret" when the test asks for it)."""
    servers = []

    def start(token: str | None = None, **options):
        store = Store(tmp_path / "h0", "h0")
        if not store.versions():
            with store.begin(1) as writer:
                writer.put("h0/0", "w", Box((0, 0), (4, 4)), np.ones((4, 4), np.float32), "float32")
                writer.commit()
        server, port = serve(store, port=0, token=token, data_plane=False, **options)
        servers.append(server)
        return grpc.insecure_channel(f"127.0.0.1:{port}", options=wire.channel_options())

    yield start
    for server in servers:
        server.stop(grace=None)


def _stalled_calls(channel: grpc.Channel, method: str, count: int, metadata=()):
    """``count`` calls of a unary ``method`` whose request never arrives (the stream stays open, no message):
    what a request trickling in over minutes does to the server. Returns the calls and the event that ends them."""
    never = threading.Event()

    def nothing():
        never.wait()
        return
        yield  # a generator that sends no message until ``never`` is set

    call = channel.stream_unary(method, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
    return [call.future(nothing(), metadata=metadata, timeout=120) for _ in range(count)], never


def _settled(futures, count: int) -> list:
    """Wait until ``count`` of the futures have ended (each has its own deadline); return those that ended."""
    done = threading.Semaphore(0)
    for f in futures:
        f.add_done_callback(lambda _: done.release())
    for _ in range(count):
        assert done.acquire(timeout=120)
    return [f for f in futures if f.done()]


def test_unauthenticated_stalled_requests_hold_no_thread(served):
    """70 unauthenticated calls whose requests never arrive are refused at once; Health with the token works
    (it used to wait behind them for a free thread, the whole pool of 64 being held)."""
    channel = served(token="secret")
    calls, release = _stalled_calls(channel, HEALTH, 70)
    try:
        ended = _settled(calls, 70)
        assert {f.exception().code() for f in ended} == {grpc.StatusCode.UNAUTHENTICATED}
        reply = pb.HealthReply.FromString(_raw_unary(channel, HEALTH)(b"", metadata=TOKEN, timeout=60))
        assert reply.host == "h0"
    finally:
        release.set()
        channel.close()


def test_stalled_requests_take_a_bounded_number_of_threads(served):
    """Requests still on their way hold at most CONTROL_THREADS // 2 threads; more are refused at once with
    RESOURCE_EXHAUSTED, and the rest of the pool keeps serving bulk reads."""
    channel = served()
    slots = CONTROL_THREADS // 2
    calls, release = _stalled_calls(channel, HEALTH, slots + 12)
    try:
        refused = _settled(calls, 12)
        assert len(refused) == 12
        for f in refused:
            assert f.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "reading a Health request" in f.exception().details()
        chunks = list(channel.unary_stream("/tenplex.v1.Store/ReadBox", request_serializer=lambda r: r,
                                           response_deserializer=lambda r: r)(
            pb.ReadBoxRequest(version=1, device="h0/0", tensor="w", box=wire.to_pb_box(Box((0, 0), (4, 4))))
            .SerializeToString(), timeout=60))
        assert len(chunks) == 1
    finally:
        release.set()
        channel.close()


def test_a_request_that_does_not_arrive_is_cancelled_after_the_idle_limit(served):
    channel = served(stream_idle_s=0.5)
    calls, release = _stalled_calls(channel, HEALTH, 1)
    try:
        assert _settled(calls, 1)[0].exception().code() == grpc.StatusCode.CANCELLED
    finally:
        release.set()
        channel.close()


def test_each_method_refuses_requests_beyond_its_limit(served):
    channel = served(token="secret")
    padded = pb.PutJsonRequest(version=7, name="doc", json='"' + "x" * (2 << 20) + '"').SerializeToString()
    with pytest.raises(grpc.RpcError) as refused:
        _raw_unary(channel, HEALTH)(padded, metadata=TOKEN, timeout=60)  # unknown fields: parses, but too large
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.details() == f"Health request of {len(padded)} bytes refused: this method accepts at most " \
                                      f"{1 << 20}"
    _raw_unary(channel, "/tenplex.v1.Store/PutJson")(padded, metadata=TOKEN, timeout=60)  # PutJson's limit is larger
    with pytest.raises(grpc.RpcError) as garbage:
        _raw_unary(channel, HEALTH)(b"\xff\xff\xff", metadata=TOKEN, timeout=60)
    assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()
