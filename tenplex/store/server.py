"""The gRPC store service of one host (``tenplex.v1.Store``): thin handlers over ``tenplex.store.local``.

May import: grpc, numpy, xxhash, this package, ``tenplex.box``, ``tenplex.dtypes``, ``tenplex.errors``,
``tenplex.ops.health`` and the standard library. It never imports ``tenplex.transform``: the
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

import errno
import functools
import inspect
import json
import logging
import os
import queue
import sys
import threading
import time
from concurrent import futures
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import grpc
import numpy as np
import xxhash

from ..box import Box
from ..dtypes import itemsize
from ..errors import StoreError, TenplexError
from ..ops.health import StoreHealth
from . import _hooks, admission, wire
from ._proto import store_pb2 as pb
from .datasets import resolve_dataset_path
from .manifest import RPC_PART, AlreadyCommitted, Conflict, CorruptShard, NotFound, OutOfRange
from .auth import TokenCheck
from .contract import SpaceReportingStore, TensorStore
from .dataplane import DataServer
from .local import Store
from .reader import VersionReader
from .streams import Busy, StreamLimits
from .transformer import Transformer
from .writer import VersionWriter

log = logging.getLogger(__name__)
SERVICE = "tenplex.v1.Store"
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
CONTROL_THREADS = 16            # server threads that bulk streams can never take (Health, Commit, ...)
DEFAULT_MAX_STREAMS = 48
DEFAULT_STREAM_IDLE_S = 60.0    # a bulk stream with no progress for this long is cancelled
DEFAULT_PART_IDLE_S = 3600.0    # a remote part nobody used for this long is aborted


# ---------------------------------------------------------------- errors --
def _status_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, CorruptShard):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(exc, Busy):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, AlreadyCommitted):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(exc, Conflict):
        return grpc.StatusCode.ABORTED
    if isinstance(exc, IndexError):  # before LookupError, its base class
        return grpc.StatusCode.OUT_OF_RANGE
    if isinstance(exc, LookupError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, PermissionError):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, TenplexError):  # a retryable one stays retryable for the client (tenplex.errors)
        return grpc.StatusCode.UNAVAILABLE if exc.retryable else grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


def _message(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, TenplexError) else f"{type(exc).__name__}: {text}"


def describe(exc: BaseException, call: str) -> tuple[grpc.StatusCode, str]:
    """(status, message) of a failed ``call``. An INTERNAL one is a bug or an unexpected system error (say
    EBADF): the caller sees only its message, so its traceback goes to this server's log."""
    status = _status_of(exc)
    if status == grpc.StatusCode.INTERNAL:
        log.error("%s failed with INTERNAL: %s", call, _message(exc), exc_info=exc)
    return status, _message(exc)


def _guard(method):
    """Turn exceptions into gRPC statuses with the error's message; the server keeps serving."""
    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Exception as e:  # noqa: BLE001 - every failure must become a status, not a dead stream
            if context.code() is None:
                context.abort(*describe(e, method.__name__))
            raise

    @functools.wraps(method)
    def streaming(self, request, context):
        try:
            yield from method(self, request, context)
        except Exception as e:  # noqa: BLE001
            if context.code() is None:
                context.abort(*describe(e, method.__name__))
            raise

    return streaming if inspect.isgeneratorfunction(method) else unary


# --------------------------------------------------------------- service --
class StoreService:
    def __init__(self, store: Store, transformer: Transformer | None = None, token: str | None = None,
                 peer_root_certificates: bytes | None = None, limits: StreamLimits | None = None,
                 part_idle_s: float = DEFAULT_PART_IDLE_S, on_sent: Callable[[str, int], None] | None = None):
        self.store = store
        self.on_sent = on_sent
        self.part_idle_s = part_idle_s
        self.limits = limits or StreamLimits(DEFAULT_MAX_STREAMS, DEFAULT_STREAM_IDLE_S)
        self.transformer = transformer
        self.token = token
        self.peer_root_certificates = peer_root_certificates
        self._readers: dict[int, VersionReader] = {}
        self._writers: dict[tuple[int, str], VersionWriter] = {}
        self._writer_use: dict[tuple[int, str], list] = {}  # key -> [calls in flight, last used]
        self._transforming: set[int] = set()  # new versions whose transformation runs here now
        self._lock = threading.Lock()
        self._hooks = _hooks.from_environment()
        self.data_port = 0  # set by serve() when the data plane runs
        threading.Thread(target=self._housekeeping, name="store-housekeeping", daemon=True).start()

    # -- helpers
    def _reader(self, version: int) -> VersionReader:
        """The cached reader of ``version``, re-opened when the version was deleted or re-committed since
        (by anyone: this server, a local writer, a gc), so a reader never serves replaced data."""
        with self._lock:
            reader = self._readers.get(version)
        if reader is not None and reader.current():
            return reader
        self._sweep()
        reader = self.store.open(version)
        with self._lock:
            cached = self._readers.get(version)
            if cached is not None and cached is not reader and cached.identity == reader.identity:
                spare, reader = reader, cached  # another call opened it meanwhile: one reader per version
            else:
                spare, self._readers[version] = cached, reader
        if spare is not None:
            spare.close(deleted=spare.identity != reader.identity)  # not left to the garbage collector
        return reader

    def _sweep(self) -> None:
        """Forget cached readers whose version directory is gone or replaced."""
        with self._lock:
            stale = [v for v, r in self._readers.items() if not r.current()]
        self._forget_readers(stale)

    @contextmanager
    def _writer(self, version: int, part: str) -> Iterator[VersionWriter]:
        """The open remote part (version, part), created on first use; marked in use while the block runs."""
        key = (int(version), part or RPC_PART)
        with self._lock:
            writer = self._writers.get(key)
            if writer is None:
                writer = self.store.begin(key[0], key[1])
                self._writers[key] = writer
                self._writer_use[key] = [0, time.monotonic()]
            use = self._writer_use[key]
            use[0] += 1
        try:
            yield writer
        finally:
            with self._lock:
                use[0] -= 1
                use[1] = time.monotonic()

    def _housekeeping(self) -> None:
        while True:
            time.sleep(min(5.0, self.part_idle_s / 4))
            try:
                self._expire_parts()
                self._sweep()
            except Exception as e:  # noqa: BLE001 - housekeeping must go on
                log.warning("store housekeeping failed: %s", e)

    def _expire_parts(self) -> None:
        """Abort remote parts that nobody wrote, prepared or aborted for ``part_idle_s`` (a writer that went
        away): their staged files and descriptors would stay until an Abort."""
        now = time.monotonic()
        with self._lock:
            expired = [k for k, (busy, last) in self._writer_use.items() if not busy and now - last > self.part_idle_s]
            writers = [self._writers.pop(k) for k in expired]
            for key in expired:
                del self._writer_use[key]
        for key, writer in zip(expired, writers):
            log.warning("aborting part %r of version %d: unused for %.0f s", key[1], key[0], self.part_idle_s)
            writer.abort()

    # -- metadata
    @_guard
    def Health(self, request, context):
        self._sweep()
        return pb.HealthReply(host=self.store.host, root=str(self.store.root), versions=self.store.versions(),
                              pid=os.getpid(), data_port=self.data_port)

    @_guard
    def ListVersions(self, request, context):
        self._sweep()
        return pb.ListVersionsReply(versions=self.store.versions())

    @_guard
    def GetManifest(self, request, context):
        return pb.GetManifestReply(manifest_json=json.dumps(self._reader(request.version).manifest))

    @_guard
    def GetJson(self, request, context):
        return pb.GetJsonReply(json=json.dumps(self._reader(request.version).get_json(request.name)))

    # -- data
    @_guard
    def ReadBox(self, request, context):
        box = wire.from_pb_box(request.box)
        reader = self._reader(request.version)
        entry = reader.find(request.device, request.tensor, box)
        sent = self._sent_to(context)
        with self.limits.slot(context, f"ReadBox({request.version}, {request.tensor!r})") as progress:
            for chunk in self._chunks(reader, entry, box, _chunk_bytes(request.chunk_bytes), {}, sent=sent):
                yield chunk
                progress()

    @_guard
    def ReadBoxes(self, request, context):
        if len(request.boxes) > wire.MAX_READ_REGIONS:
            raise ValueError(f"ReadBoxes names {len(request.boxes)} regions; a request may name at most "
                             f"{wire.MAX_READ_REGIONS}: split it")
        reader = self._reader(request.version)
        regions = []
        for ref in request.boxes:  # all checked before any data is sent
            box = wire.from_pb_box(ref.box)
            regions.append((box, reader.find(ref.device, ref.tensor, box)))
        chunk_bytes = _chunk_bytes(request.chunk_bytes)
        verified: dict[str, set] = {}  # blocks checked by this request, per file: each is checked once
        sent = self._sent_to(context)
        with self.limits.slot(context, f"ReadBoxes({request.version}, {len(regions)} regions)") as progress:
            for index, (box, entry) in enumerate(regions):
                for chunk in self._chunks(reader, entry, box, chunk_bytes, verified, index, sent):
                    yield chunk
                    progress()

    def _sent_to(self, context) -> Callable[[int], None] | None:
        """What counts the box data bytes a read call sends (``on_sent`` with the reader's declared host), or
        None when nothing counts them."""
        if self.on_sent is None:
            return None
        return functools.partial(self.on_sent, wire.peer_of(context.invocation_metadata()))

    def _chunks(self, reader: VersionReader, entry, box: Box, chunk_bytes: int, checked: dict[str, set],
                index: int = 0, sent: Callable[[int], None] | None = None):
        """Chunks of region ``box`` of a stored shard; every block they come from is verified first, and a
        chunk that is one run of the file gets its checksum in the same pass. ``checked``: the blocks this
        request checked so far, per file (later chunks and regions do not check them again). ``sent(nbytes)``
        counts each chunk's data as it is handed to gRPC: a reader that received it finds it counted."""
        verified = checked.setdefault(entry.file, set())
        buffer = None  # one buffer for every chunk: encode_with_data copies each out of it
        for sub in wire.split_box(box, itemsize(entry.dtype), chunk_bytes):
            start, span, _ = reader.byte_span(entry, sub)
            if span == sub.volume * itemsize(entry.dtype) and sub.volume:
                if buffer is None or buffer.nbytes < span:
                    buffer = memoryview(np.empty(span, np.uint8))
                view = buffer[:span]
                hasher = xxhash.xxh3_64()
                reader.shard_file(entry).read_into(start, view, verified=verified, digest=hasher)
                digest = hasher.intdigest()
            else:
                data = np.ascontiguousarray(reader.region(entry, sub, verified))
                view = memoryview(data.reshape(-1)).cast("B")
                digest = xxhash.xxh3_64_intdigest(view)
            head = pb.Chunk(box=wire.to_pb_box(sub), xxh3=digest, index=index)
            payload = wire.encode_with_data(head.SerializeToString(), view)
            if sent is not None:
                sent(view.nbytes)
            yield self._hooks.before_send(payload) if self._hooks else payload

    @_guard
    def WriteShard(self, request_iterator, context):
        with self.limits.slot(context, "WriteShard") as progress:
            return self._write_shard(_progressing(request_iterator, progress))

    def _write_shard(self, request_iterator) -> pb.WriteShardReply:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("item") != "header":
            raise ValueError("WriteShard: the first message must carry the shard header")
        h = first.header
        box = wire.from_pb_box(h.box)
        with self._writer(h.version, h.part) as writer:
            return self._fill_shard(writer, h, box, request_iterator)

    def _fill_shard(self, writer: VersionWriter, h, box: Box, request_iterator) -> pb.WriteShardReply:
        target = None
        try:
            # No space is reserved up front: a header alone (a stalled or lying client) holds none. The
            # file's blocks are allocated as data arrives; a header larger than the free space fails here.
            _check_free_space(self.store, box.volume * itemsize(h.dtype), f"shard {h.tensor!r} {box}")
            target = writer.create(h.device, h.tensor, box, h.dtype, tuple(h.shape) or None, reserve=False)
            received = self._fill(target, request_iterator, h)
        except BaseException:
            # A broken stream or a short shard must not stay in the part: Prepare would publish it partly zero.
            if target is not None:
                try:
                    writer.discard(target)
                except StoreError as e:  # the part was aborted or prepared meanwhile; the stream's error matters
                    log.warning("WriteShard of %r could not discard its partial shard: %s", h.tensor, e)
            raise
        target.release()  # filled: no descriptor held until Prepare
        return pb.WriteShardReply(bytes=received)

    @staticmethod
    def _fill(target, chunks, h) -> int:
        """Write every chunk of a WriteShard stream into ``target``; return the bytes received (all of them)."""
        box = target.box
        received = 0
        for message in chunks:
            if message.WhichOneof("item") != "chunk":
                raise ValueError("WriteShard: only chunks may follow the header")
            sub = wire.from_pb_box(message.chunk.box)
            if not box.contains(sub):
                raise OutOfRange(f"chunk box {sub} lies outside the shard box {box}")
            if xxhash.xxh3_64_intdigest(message.chunk.data) != message.chunk.xxh3:
                raise StoreError(f"chunk {sub} of {h.tensor!r} arrived corrupted (checksum mismatch); "
                                 f"abort version {h.version} and write it again")
            target.write(sub, message.chunk.data)
            received += len(message.chunk.data)
        expected = box.volume * target.itemsize
        if received != expected:
            raise StoreError(f"shard {h.tensor!r} {box} on {h.device}: received {received} of {expected} bytes")
        return received

    @_guard
    def PutJson(self, request, context):
        try:
            doc = json.loads(request.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"PutJson {request.name!r}: not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError(f"PutJson {request.name!r}: nested deeper than the JSON parser can read (about "
                             f"{sys.getrecursionlimit()} levels)") from None
        with self._writer(request.version, request.part) as writer:
            writer.put_json(request.name, doc)
        return pb.PutJsonReply()

    @_guard
    def Prepare(self, request, context):
        key = (int(request.version), request.part or RPC_PART)
        with self._lock:
            writer = self._writers.pop(key, None)
            self._writer_use.pop(key, None)
        if writer is None:
            raise NotFound(f"no open part {key[1]!r} of version {key[0]} on host {self.store.host}")
        try:
            writer.prepare()
        except BaseException:
            writer.abort()  # it left the table: close its shard files here, or their descriptors leak
            raise
        return pb.PrepareReply()

    @_guard
    def Commit(self, request, context):
        self.store.commit(request.version)
        return pb.CommitReply()

    @_guard
    def Abort(self, request, context):
        with self._lock:
            for key in [k for k in self._writers if k[0] == request.version]:
                self._writer_use.pop(key, None)
                self._writers.pop(key).abort()
        self.store.abort(request.version)
        return pb.AbortReply()

    def _forget_readers(self, versions) -> None:
        """Drop cached readers of deleted (or replaced) versions so that their directories can be freed; a read
        still under way then fails saying so."""
        with self._lock:
            for version in versions:
                reader = self._readers.pop(int(version), None)
                if reader is not None:
                    reader.close(deleted=True)

    @_guard
    def Delete(self, request, context):
        deleted = self.store.delete(request.version)
        self._forget_readers([request.version])
        return pb.DeleteReply(deleted=deleted)

    @_guard
    def Gc(self, request, context):
        deleted = self.store.gc(request.keep)
        self._forget_readers(deleted)
        return pb.GcReply(deleted=deleted)

    @_guard
    def Transform(self, request, context):
        if self.transformer is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this store server was started without a transformer")
        version = request.new_version
        self._claim(version)
        updates: queue.Queue = queue.Queue()
        cancelled = threading.Event()
        context.add_callback(cancelled.set)  # the coordinator went away: stop pulling

        def work():
            try:
                if request.host and request.host != self.store.host:
                    raise StoreError(f"transform request for host {request.host} reached the store of host "
                                     f"{self.store.host}")
                result = self.transformer(self.store, wire.from_pb_transform_request(request, self.store.host),
                                          lambda p: updates.put(("progress", wire.to_pb_transform_progress(p))),
                                          cancelled=cancelled, token=self.token,
                                          root_certificates=self.peer_root_certificates)
                updates.put(("done", wire.to_pb_transform_progress(result)))
            except BaseException as e:  # noqa: BLE001 - reported to the coordinator below
                updates.put(("error", e))
            finally:
                with self._lock:
                    self._transforming.discard(version)

        threading.Thread(target=work, name=f"transform-{request.new_version}", daemon=True).start()
        while True:
            kind, value = updates.get()
            if kind == "progress":
                yield value
            elif kind == "done":
                value.done = True
                yield value
                return
            else:
                raise value

    def _claim(self, version: int) -> None:
        """Mark ``version`` as being made here by a transformation; refuse a second one, or a committed version."""
        with self._lock:
            if version in self._transforming:
                raise Conflict(f"another transformation to version {version} is running on host {self.store.host} "
                               f"right now (a second coordinator?); this one changed nothing here")
            if version in self.store.versions():
                raise AlreadyCommitted(f"version {version} is already committed on host {self.store.host} (by "
                                       f"another transformation or writer); this one changed nothing here")
            self._transforming.add(version)

    # -- dataset files
    @_guard
    def StatFile(self, request, context):
        st = resolve_dataset_path(self.store.datasets_dir, request.path, self.store.host).stat()
        return pb.StatFileReply(size=st.st_size, mtime=st.st_mtime)

    @_guard
    def ReadFile(self, request, context):
        if request.offset < 0 or request.length < -1:
            raise ValueError(f"ReadFile {request.path!r}: offset {request.offset} and length {request.length} "
                             f"must be >= 0 (length -1 = to the end)")
        path = resolve_dataset_path(self.store.datasets_dir, request.path, self.store.host)
        chunk_bytes = _chunk_bytes(request.chunk_bytes)
        with open(path, "rb") as f, self.limits.slot(context, f"ReadFile({request.path!r})") as progress:
            size = os.fstat(f.fileno()).st_size
            end = size if request.length == -1 else min(size, request.offset + request.length)
            offset = request.offset
            while offset < end:
                data = os.pread(f.fileno(), min(chunk_bytes, end - offset), offset)
                if not data:
                    break
                head = pb.FileChunk(offset=offset, xxh3=xxhash.xxh3_64_intdigest(data)).SerializeToString()
                payload = wire.encode_with_data(head, data)
                yield self._hooks.before_send(payload) if self._hooks else payload
                progress()
                offset += len(data)


def _progressing(messages, progress):
    """The request messages, marking progress as each arrives."""
    for message in messages:
        progress()
        yield message


def _check_free_space(store: TensorStore, nbytes: int, what: str) -> None:
    """ENOSPC when ``store`` reports less free space than ``nbytes``; a store that cannot tell is not checked."""
    if not isinstance(store, SpaceReportingStore):
        return
    free = store.free_bytes()
    if nbytes > free:
        raise OSError(errno.ENOSPC, f"{what} needs {nbytes} bytes, but only {free} are free in {store!r}")


def _chunk_bytes(requested: int) -> int:
    if requested <= 0:
        return wire.DEFAULT_CHUNK_BYTES
    return max(4096, min(int(requested), wire.MAX_CHUNK_BYTES))


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
    server.probe_port = None
    if probe_port is not None:
        address = _address(bind, probe_port)
        server.probe_port = server.health.serve_probes(address)
        if not server.probe_port:
            raise StoreError(f"could not bind the health probe port {address}: it is in use, or {bind} is not an "
                             f"address of this machine")
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
