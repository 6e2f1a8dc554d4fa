"""The gRPC store server of one host (``tenplex.v1.Store``): :func:`serve` registers the handlers of
``service`` (thin handlers over ``tenplex.store.local``; ``statuses`` turns their errors into gRPC statuses)
and starts the server, its health services and its data plane.

May import: grpc, this package, ``tenplex.errors``, ``tenplex.ops.health`` and the standard library. Neither it
nor ``service`` imports ``tenplex.transform``: the
``Transform`` RPC calls the ``transformer`` given to :func:`serve` (a
``transformer.Transformer``; the CLI passes
``tenplex.transform.host.run_host_part``) with a ``TransformRequest`` decoded
from the message, keeping the store below the transformer in the layering.

Security: :func:`serve` binds 127.0.0.1 unless told otherwise; any other
address requires a shared token, which every call must then present as
``authorization: Bearer TOKEN`` metadata (else UNAUTHENTICATED). TLS is on
when a certificate and key are given. Without TLS that metadata, the token
itself, crosses the network in plaintext; serve() warns about it at start-up.

Bulk data plane: unless TLS is configured (or ``data_plane=False``),
:func:`serve` also starts ``tenplex.store.dataplane.DataServer`` on the same
bind address and advertises its port in ``Health.data_port``; clients read
large boxes there (plain TCP, checksummed frames, same token) instead of
through ``ReadBox``. With TLS the data plane stays off, since it is not
encrypted, and every box travels over gRPC.

POSIX. The service serves a local ``Store`` (``tenplex.store.local``), not any
``contract.TensorStore``, and this is by design: it serves files of the host it
runs on. Beyond the contract it uses
- the store's root, which ``Health`` reports (``tenplex run`` checks by it
  that a running server serves the root it was given);
- ``Store.datasets_dir``, a local directory whose files ``ReadFile`` and
  ``StatFile`` serve;
- ``VersionReader.current`` (a cached reader notices that its version
  directory was deleted or replaced) and ``VersionReader.manifest``
  (``GetManifest`` sends the stored manifest document);
- file-backed reads (``FileBackedReader``: ``_chunks`` and the data plane
  send verified runs of a shard file; the data plane sends whole stored
  blocks from the file unread, for the client to check).
The free-space check before ``WriteShard`` goes through the contract
(``SpaceReportingStore.free_bytes``). A server for an object-storage backend
would keep these handlers and replace those uses, or keep a POSIX store as a
cache beside the objects.

Test hooks (fault injection, used by the test suite only) are described in
``_hooks``: ``TENPLEX_STORE_TEST_HOOKS`` with ``exit_after_chunks=N`` and
``corrupt_chunks=N`` act on gRPC chunks and data-plane frames alike.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Callable, Sequence

import grpc

from ..errors import StoreError
from ..ops.health import StoreHealth
from . import admission, wire
from ._proto import store_pb2 as pb
from .auth import TokenCheck
from .dataplane import DataServer
from .local import Store
from .service import DEFAULT_PART_IDLE_S, DEFAULT_STREAM_IDLE_S, StoreService
from .statuses import describe
from .streams import StreamLimits
from .transformer import Transformer

log = logging.getLogger(__name__)
SERVICE = "tenplex.v1.Store"
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
CONTROL_THREADS = 16            # server threads that bulk streams can never take (Health, Commit, ...)


# ---------------------------------------------------------------- server --
_RAW = {"ReadBox", "ReadBoxes", "ReadFile"}  # handlers that yield pre-encoded bytes (see wire.py)
_METHODS = {
    "Health": ("uu", pb.HealthRequest, pb.HealthReply),
    "ListVersions": ("uu", pb.ListVersionsRequest, pb.ListVersionsReply),
    "GetManifest": ("uu", pb.GetManifestRequest, pb.GetManifestReply),
    "GetJson": ("uu", pb.GetJsonRequest, pb.GetJsonReply),
    "ReadBox": ("us", pb.ReadBoxRequest, pb.Chunk),
    "ReadBoxes": ("us", pb.ReadBoxesRequest, pb.Chunk),
    "WriteShard": ("su", pb.WriteShardRequest, pb.WriteShardReply),
    "PutJson": ("uu", pb.PutJsonRequest, pb.PutJsonReply),
    "Prepare": ("uu", pb.PrepareRequest, pb.PrepareReply),
    "Commit": ("uu", pb.CommitRequest, pb.CommitReply),
    "Abort": ("uu", pb.AbortRequest, pb.AbortReply),
    "Delete": ("uu", pb.DeleteRequest, pb.DeleteReply),
    "Gc": ("uu", pb.GcRequest, pb.GcReply),
    "Transform": ("us", pb.TransformRequest, pb.TransformProgress),
    "ReadFile": ("us", pb.ReadFileRequest, pb.FileChunk),
    "StatFile": ("uu", pb.StatFileRequest, pb.StatFileReply),
}


def _handlers(service: StoreService) -> grpc.GenericRpcHandler:
    """Every method registered request-streaming: requests are read, size-checked and parsed in ``admission``."""
    requests = StreamLimits(CONTROL_THREADS // 2, service.limits.idle_s)  # reads of non-bulk requests
    table = {}
    for name, (kind, request, reply) in _METHODS.items():
        serializer = (lambda raw: raw) if name in _RAW else reply.SerializeToString
        behaviour = getattr(service, name)
        if kind == "su":
            handler = grpc.stream_unary_rpc_method_handler(admission.stream_request(name, request, behaviour),
                                                           response_serializer=serializer)
        else:
            slots = service.limits if name in _RAW else requests
            function = admission.unary_request(name, request, behaviour, slots, streaming=kind == "us")
            make = grpc.stream_stream_rpc_method_handler if kind == "us" else grpc.stream_unary_rpc_method_handler
            handler = make(function, response_serializer=serializer)
        table[name] = handler
    return grpc.method_handlers_generic_handler(SERVICE, table)


def serve(store: Store, bind: str = "127.0.0.1", port: int = 0, token: str | None = None,
          tls_cert: bytes | None = None, tls_key: bytes | None = None, transformer: Transformer | None = None,
          peer_root_certificates: bytes | None = None, max_workers: int = 64,
          data_plane: bool = True, max_streams: int | None = None,
          stream_idle_s: float = DEFAULT_STREAM_IDLE_S,
          part_idle_s: float = DEFAULT_PART_IDLE_S,
          interceptors: Sequence[grpc.ServerInterceptor] = (),
          probe_port: int | None = None,
          on_sent: Callable[[str, int], None] | None = None) -> tuple[grpc.Server, int]:
    """Start serving ``store``; return (server, bound port). Non-loopback binds need ``token``.

    ``data_plane``: also serve large box reads on a plain TCP port of the same
    address (see ``dataplane``); never with TLS, whose clients use ReadBox.

    ``transformer(store, request, progress, cancelled=, token=, root_certificates=)`` (a
    :class:`~tenplex.store.transformer.Transformer`) runs the Transform RPC; it pulls from peers with this
    server's token and ``peer_root_certificates`` (TLS when given).

    At most ``max_streams`` bulk streams (default: all but 16 of the ``max_workers`` threads) run at once,
    and one that makes no progress for ``stream_idle_s`` seconds is cancelled (see ``streams``). A remote
    part (WriteShard/PutJson) unused for ``part_idle_s`` seconds without Prepare or Abort is aborted.

    ``interceptors`` (metrics) see every call before the token check. The server also answers
    ``grpc.health.v1`` and reflection (``server.health``: ``tenplex.ops.health.StoreHealth``), with the token
    like every call; ``probe_port`` (0: any free port) answers ``grpc.health.v1`` alone without a token, for
    kubelet probes, on the same address (``server.probe_port``; ``server.health.close()`` stops it).

    ``on_sent(peer_host, nbytes)`` (metrics) is called as box data goes out (ReadBox and ReadBoxes chunks,
    data-plane frames: the tensor bytes, not their framing), from the serving threads, with the host the
    reader declared (``StoreClient(peer_host=)``; "" when it declared none)."""
    max_streams = _check_options(store, bind, port, token, tls_cert, tls_key, max_workers, max_streams, probe_port)
    wire.keep_freed_chunk_memory()
    service = StoreService(store, transformer=transformer, token=token,
                           peer_root_certificates=peer_root_certificates,
                           limits=StreamLimits(max_streams, stream_idle_s), part_idle_s=part_idle_s,
                           on_sent=on_sent)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="store"),
                         interceptors=[*interceptors, *([TokenCheck(token)] if token else [])],
                         # never share a port with another server (clients would be split between them)
                         options=[*wire.channel_options(), ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((_handlers(service),))
    server.health = StoreHealth(server, store.root, SERVICE)
    bound = _bind(server, bind, port, tls_cert, tls_key)
    server.probe_port = None if probe_port is None else _serve_probes(server, bind, probe_port)
    if data_plane and tls_cert is None:
        data = DataServer(bind, service._reader, _describe_data_error, token=token, on_sent=on_sent)
        service.data_port = data.port
        server.data_server = data  # kept alive with the gRPC server; its threads are daemons
    server.start()
    if bind not in LOOPBACK and tls_cert is None:
        log.warning("serving on %s without TLS: the store token travels in plaintext in the metadata of every gRPC "
                    "call, readable by anyone on the network path (the data plane sends only an HMAC of it); "
                    "use --tls-cert/--tls-key off trusted networks", bind)
    log.info("store %s (host %s) serving on %s:%d (data plane port %d)", store.root, store.host, bind, bound,
             service.data_port)
    return server, bound


def _serve_probes(server: grpc.Server, bind: str, probe_port: int) -> int:
    """Answer token-less health probes on ``probe_port`` of ``bind``; the port bound (a StoreError if none)."""
    address = _address(bind, probe_port)
    bound = server.health.serve_probes(address)
    if not bound:
        raise StoreError(f"could not bind the health probe port {address}: it is in use, or {bind} is not an "
                         f"address of this machine")
    return bound


def _describe_data_error(exc: BaseException) -> tuple[str, str]:
    status, message = describe(exc, "data-plane read")
    return status.name, message


def _check_options(store: Store, bind: str, port: int, token: str | None, tls_cert: bytes | None,
                   tls_key: bytes | None, max_workers: int, max_streams: int | None,
                   probe_port: int | None = None) -> int:
    """Refuse what :func:`serve` must not run with; return the number of bulk streams allowed at once."""
    if bind not in LOOPBACK and not token:
        raise StoreError(f"refusing to serve store {store.root} on {bind} without a token: anything that reaches "
                         f"the port could read and overwrite state. Pass a token (--token-file) or bind 127.0.0.1")
    if (tls_cert is None) != (tls_key is None):
        raise StoreError("TLS needs both a certificate and its private key")
    for name, value in (("port", port), ("probe port", probe_port)):
        if value is not None and not 0 <= int(value) <= 65535:
            raise StoreError(f"{name} {value} is not a TCP port: use 0-65535 (0: any free port)")
    if max_streams is None:
        max_streams = max(1, max_workers - CONTROL_THREADS)
    if max_streams > max_workers - 1:
        raise StoreError(f"max_streams ({max_streams}) must leave threads of the {max_workers} for control calls")
    return max_streams


def _address(bind: str, port: int) -> str:
    return f"[{bind.strip('[]')}]:{port}" if ":" in bind.strip("[]") else f"{bind}:{port}"


def _bind(server: grpc.Server, bind: str, port: int, tls_cert: bytes | None, tls_key: bytes | None) -> int:
    """Add the server's port (TLS when a certificate is given); return the port bound, or raise a StoreError."""
    address = _address(bind, port)
    try:
        if tls_cert is not None:
            bound = server.add_secure_port(address, grpc.ssl_server_credentials([(tls_key, tls_cert)]))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind to address"
        bound = 0
    if not bound:
        raise StoreError(f"could not bind the store server to {address}: port {port} is in use, or {bind} is not "
                         f"an address of this machine; choose another port (0: any free port)")
    return bound
