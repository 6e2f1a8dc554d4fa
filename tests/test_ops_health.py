"""The store server's standard gRPC health (as a kubelet ``grpc`` probe asks it) and reflection (as a generic
client such as grpcurl uses it), against real store servers."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tenplex.ports import free_port
from tenplex.store import Store, wire
from tenplex.store.server import serve

from store_helpers import StoreProcess

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _probe(address: str, service: str = "") -> int:
    """What a kubelet gRPC probe does: Health/Check with no metadata."""
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def _await_status(address: str, status: int, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while _probe(address) != status:
        assert time.monotonic() < deadline, f"the health check never reported {status}"
        time.sleep(0.1)


def test_probe_without_token_sees_serving_then_not_serving_when_the_root_is_unusable(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    probe_port = free_port()
    store = StoreProcess(tmp_path / "h0", "h0", token_file=token, full_cli=True,
                         extra_args=("--probe-port", str(probe_port)))
    probes = f"127.0.0.1:{probe_port}"
    try:
        assert _probe(probes) == SERVING
        assert _probe(probes, "tenplex.v1.Store") == SERVING
        with grpc.insecure_channel(store.address) as channel:  # the store's own port wants the token, health too
            for method in ("/tenplex.v1.Store/Health", "/grpc.health.v1.Health/Check"):
                with pytest.raises(grpc.RpcError) as refused:
                    channel.unary_unary(method)(b"", timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        (tmp_path / "h0").rename(tmp_path / "h0.gone")  # the volume went away
        _await_status(probes, NOT_SERVING)
        (tmp_path / "h0.gone").rename(tmp_path / "h0")
        _await_status(probes, SERVING)
    finally:
        store.stop()


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_a_large_health_request_without_the_token_is_read_on_neither_port(tmp_path):
    """Health answers without a token only on the probe port, which reads at most 1 KiB: a 128 MiB request
    (it used to cost the server over 500 MiB on the store's port) is refused on both, unread."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    probe_port = free_port()
    store = StoreProcess(tmp_path / "h0", "h0", token_file=token, extra_args=("--probe-port", str(probe_port)))
    body = health_pb2.HealthCheckRequest(service="x" * (128 << 20)).SerializeToString()
    try:
        for address, code in ((store.address, grpc.StatusCode.UNAUTHENTICATED),
                              (f"127.0.0.1:{probe_port}", grpc.StatusCode.RESOURCE_EXHAUSTED)):
            before = _peak_rss_kib(store.proc.pid)
            with grpc.insecure_channel(address, options=wire.channel_options()) as channel:
                check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda raw: raw,
                                            response_deserializer=lambda raw: raw)
                with pytest.raises(grpc.RpcError) as refused:
                    check(body, timeout=120)
            assert refused.value.code() == code, address
            assert _peak_rss_kib(store.proc.pid) - before < 32 << 10, address  # KiB: far below the 128 MiB sent
    finally:
        store.stop()


def test_a_draining_server_is_not_serving(tmp_path):
    server, port = serve(Store(tmp_path / "h0", "h0"), data_plane=False)
    try:
        assert _probe(f"127.0.0.1:{port}") == SERVING
        server.health.drain()
        assert _probe(f"127.0.0.1:{port}") == NOT_SERVING
        assert _probe(f"127.0.0.1:{port}", "tenplex.v1.Store") == NOT_SERVING
    finally:
        server.stop(None)


def test_a_generic_reflection_client_lists_the_service_and_calls_health(tmp_path):
    store = StoreProcess(tmp_path / "h0", "h0")
    try:
        with grpc.insecure_channel(store.address) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            assert "tenplex.v1.Store" in database.get_services()
            # Only what reflection sent: a fresh pool, messages built from its descriptors.
            pool = descriptor_pool.DescriptorPool(database)
            method = pool.FindServiceByName("tenplex.v1.Store").methods_by_name["Health"]
            request_class = message_factory.GetMessageClass(method.input_type)
            reply_class = message_factory.GetMessageClass(method.output_type)
            call = channel.unary_unary("/tenplex.v1.Store/Health", request_serializer=request_class.SerializeToString,
                                       response_deserializer=reply_class.FromString)
            reply = call(request_class(), timeout=10)
        assert reply.host == "h0" and reply.root == str(tmp_path / "h0")
    finally:
        store.stop()
