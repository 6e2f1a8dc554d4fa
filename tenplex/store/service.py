"""The store service's handlers (``tenplex.v1.Store``): thin handlers over ``tenplex.store.local``.

May import: grpc, numpy, xxhash, this package, ``tenplex.box``, ``tenplex.dtypes``, ``tenplex.errors``, and the
standard library. ``server`` registers the handlers and serves them (its docstring says what the service relies
on beyond the store's contract, and why).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import queue
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import xxhash

import grpc

from ..box import Box
from ..dtypes import itemsize
from ..errors import StoreError
from . import _hooks, wire
from ._proto import store_pb2 as pb
from .contract import SpaceReportingStore, TensorStore
from .datasets import resolve_dataset_path
from .local import Store
from .manifest import RPC_PART, AlreadyCommitted, Conflict, NotFound, OutOfRange
from .reader import VersionReader
from .statuses import guard as _guard, message_of, status_of
from .streams import StreamLimits
from .transformer import Transformer
from .writer import VersionWriter

log = logging.getLogger("tenplex.store.server")
DEFAULT_MAX_STREAMS = 48
DEFAULT_STREAM_IDLE_S = 60.0    # a bulk stream with no progress for this long is cancelled
DEFAULT_PART_IDLE_S = 3600.0    # a remote part nobody used for this long is aborted


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
        opened = self.store.open(version)
        spare: VersionReader | None
        with self._lock:
            cached = self._readers.get(version)
            if cached is not None and cached.identity == opened.identity:
                spare, reader = opened, cached  # another call opened it meanwhile: one reader per version
            else:
                spare, reader = cached, opened
                self._readers[version] = opened
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
                if status_of(e) != grpc.StatusCode.INTERNAL:  # INTERNAL: the guard logs it with its traceback
                    log.warning("transformation to version %d on host %s failed: %s", version, self.store.host,
                                message_of(e))
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
