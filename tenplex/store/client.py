"""Client of a remote store server (``tenplex.v1.Store``).

May import: grpc, numpy, xxhash, this package, ``tenplex.box``, ``tenplex.dtypes``,
``tenplex.errors`` and the standard library.

Every call has a deadline (``timeout`` seconds, or one scaled to the bytes
moved for reads), and every received chunk is verified: a checksum mismatch
re-fetches that chunk's sub-box (up to ``retries`` times) and never returns
corrupted data. gRPC failures surface as :class:`RemoteStoreError`, which
carries the status code and names the store address.

Box reads of at least ``data_plane_min_bytes`` go over the server's bulk data
plane (``dataplane``: plain TCP, whole stored blocks sent from the file unread
and checked here against their committed digests, other frames verified on the
server, recv_into the destination here) when the server advertises one and TLS
is off; everything else, every box read of a TLS client, and a read for which
no data connection could be opened (refused, or dropped by a flooded server)
uses gRPC. Both paths verify every frame or chunk and re-fetch corrupted pieces
the same way; a data-plane re-fetch (and every read of a client with
``retries=0``) asks the server to verify what it sends. A store whose stored
bytes fail their block checksums answers DATA_LOSS (over the data plane, for a
whole block, on the verified re-fetch), which is never retried here: read
another replica. A read that fails may leave part of its destination written.

With ``stall_timeout`` a peer that delivers nothing for that many seconds counts
as dead (a partitioned peer sends no reset, so connections just hang): unary
calls get it as their deadline, streams are cancelled when no message arrives
for that long, data-plane sockets time out, and the channel's keepalive pings
a silent peer at that scale.

``peer_host``: the host this client reads for, declared on every call (gRPC
metadata, a data-plane request field) so that the server counts the bytes it
sends per reading host; servers that predate it ignore it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Generator, Iterator

import grpc
import numpy as np
import xxhash

from ..box import Box
from ..dtypes import numpy_storage
from ..errors import RETRYABLE_STATUS, StoreError
from . import wire
from .dataplane import DataPlaneError, DataPlaneUnreachable, DataPool
from ._proto import store_pb2 as pb
from ._proto import store_pb2_grpc as pb_grpc
from .transformer import TransformProgress, TransformRequest


log = logging.getLogger(__name__)
DATA_PLANE_MIN_BYTES = 1 << 20  # smaller reads stay on gRPC, where a call costs less than a new connection


class RemoteStoreError(StoreError):
    """A call to a store server failed; ``code`` is the gRPC status code."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, address: str = ""):
        super().__init__(message)
        self.code = code
        self.address = address

    @property
    def retryable(self) -> bool:  # type: ignore[override]  # computed from the status
        return self.code is not None and self.code.name in RETRYABLE_STATUS


class ChecksumError(StoreError):
    """Data kept arriving corrupted after every allowed re-fetch."""


class StoreClient:
    """Talks to one store server. Thread-safe: share one per address between threads."""

    def __init__(self, address: str, token: str | None = None, root_certificates: bytes | None = None,
                 timeout: float = 60.0, chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES, retries: int = 3,
                 min_read_gbps: float = 0.02, own_connection: bool = False, data_plane: bool = True,
                 data_plane_min_bytes: int = DATA_PLANE_MIN_BYTES, stall_timeout: float | None = None,
                 peer_host: str | None = None):
        self.address = address
        self.peer_host = peer_host  # declared to the server, which counts the bytes it sends us under it
        self.stall_timeout = stall_timeout
        # Large box reads use the server's data plane when it runs one (asked once, through Health);
        # never with TLS, since the data plane is not encrypted.
        self._data_wanted = data_plane and root_certificates is None
        self.data_plane_min_bytes = data_plane_min_bytes
        self._data_pool: DataPool | None = None
        self._data_checked = False
        self._data_lock = threading.Lock()
        self._token = token
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.retries = retries
        self.min_read_gbps = min_read_gbps  # deadline of a read = timeout + bytes / this rate
        wire.keep_freed_chunk_memory()
        options = wire.channel_options()
        if own_connection:
            # By default channels to one address share a connection; parallel pulls want their own.
            options.append(("grpc.use_local_subchannel_pool", 1))
        if stall_timeout is not None:  # ping a silent peer after half the limit; no answer in the other half: dead
            half_ms = max(1000, int(stall_timeout * 500))
            options = [o for o in options if o[0] not in ("grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms")]
            options += [("grpc.keepalive_time_ms", half_ms), ("grpc.keepalive_timeout_ms", half_ms)]
        if root_certificates is not None:
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates), options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._metadata = ((("authorization", f"Bearer {token}"),) if token else ()) + \
            (((wire.PEER_HOST_METADATA, peer_host),) if peer_host else ())
        self._stub = pb_grpc.StoreStub(self._channel)
        self._read_box = self._channel.unary_stream(
            "/tenplex.v1.Store/ReadBox", request_serializer=pb.ReadBoxRequest.SerializeToString,
            response_deserializer=wire.decode_chunk)
        self._read_boxes = self._channel.unary_stream(
            "/tenplex.v1.Store/ReadBoxes", request_serializer=pb.ReadBoxesRequest.SerializeToString,
            response_deserializer=wire.decode_chunk)
        self._read_file = self._channel.unary_stream(
            "/tenplex.v1.Store/ReadFile", request_serializer=pb.ReadFileRequest.SerializeToString,
            response_deserializer=wire.decode_file_chunk)

    def close(self) -> None:
        if self._data_pool is not None:
            self._data_pool.close()
        self._channel.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _error(self, e: grpc.RpcError, what: str) -> RemoteStoreError:
        code = e.code() if hasattr(e, "code") else None
        detail = e.details() if hasattr(e, "details") else str(e)
        name = code.name if code is not None else "UNKNOWN"
        return RemoteStoreError(f"store {self.address}: {what} failed with {name}: {detail}", code, self.address)

    def _call(self, method: str, request, what: str, timeout: float | None = None):
        try:
            deadline = timeout or min(self.timeout, self.stall_timeout or self.timeout)
            return getattr(self._stub, method)(request, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e, what) from None

    def _watched(self, call, what: str) -> Generator:
        """The messages of a streaming ``call``; with ``stall_timeout``, the call is cancelled and fails as
        UNAVAILABLE when no message arrives for that long (progress-based, unlike its overall deadline)."""
        stall_timeout = self.stall_timeout
        if stall_timeout is None:
            yield from call
            return
        last = [time.monotonic()]
        stalled, finished = threading.Event(), threading.Event()

        def watch() -> None:
            while not finished.wait(min(0.5, stall_timeout / 4)):
                if time.monotonic() - last[0] > stall_timeout:
                    stalled.set()
                    call.cancel()
                    return

        threading.Thread(target=watch, name="stall-watch", daemon=True).start()
        try:
            for message in call:
                last[0] = time.monotonic()
                yield message
                last[0] = time.monotonic()  # the consumer's own time is not the peer's silence
        except grpc.RpcError:
            if stalled.is_set():
                raise RemoteStoreError(f"store {self.address}: {what} delivered nothing for {self.stall_timeout}s; "
                                       f"the store is dead or cut off", grpc.StatusCode.UNAVAILABLE,
                                       self.address) from None
            raise
        finally:
            finished.set()

    # ---- metadata ------------------------------------------------------
    def health(self, timeout: float | None = None) -> dict:
        reply = self._call("Health", pb.HealthRequest(), "Health", timeout)
        return {"host": reply.host, "root": reply.root, "versions": list(reply.versions), "pid": reply.pid,
                "data_port": reply.data_port}

    def data_pool(self) -> DataPool | None:
        """The server's data plane (connections made on demand), or None when box reads go over gRPC."""
        if not self._data_wanted:
            return None
        with self._data_lock:
            if not self._data_checked:
                port = self.health()["data_port"]
                if port:
                    host = self.address.rsplit(":", 1)[0].strip("[]")
                    self._data_pool = DataPool(host, port, self._token, self.stall_timeout or self.timeout,
                                               peer_host=self.peer_host)
                self._data_checked = True
            return self._data_pool

    def wait_ready(self, timeout: float = 30.0) -> dict:
        """Block until the server answers (e.g. right after starting it)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise RemoteStoreError(f"store {self.address} did not become reachable within {timeout}s",
                                   grpc.StatusCode.UNAVAILABLE, self.address) from None
        return self.health()

    def versions(self) -> list[int]:
        return list(self._call("ListVersions", pb.ListVersionsRequest(), "ListVersions").versions)

    def manifest(self, version: int) -> dict:
        reply = self._call("GetManifest", pb.GetManifestRequest(version=version), f"GetManifest({version})")
        return json.loads(reply.manifest_json)

    def get_json(self, version: int, name: str):
        reply = self._call("GetJson", pb.GetJsonRequest(version=version, name=name), f"GetJson({version}, {name!r})")
        return json.loads(reply.json)

    # ---- reading -------------------------------------------------------
    def _read_deadline(self, nbytes: int) -> float:
        return self.timeout + nbytes / (self.min_read_gbps * 1e9)

    def read_box_to(self, version: int, device: str, tensor: str, box: Box, itemsize: int, sink: Callable,
                    *, digests: bool = False) -> int:
        """Stream the region ``box`` of ``device``'s shard: ``sink(sub_box, c_order_bytes)`` receives every
        verified chunk (global coordinates). Corrupted chunks are fetched again. Returns the bytes delivered.
        With ``digests``, the sink takes a third argument, the chunk's xxh3_64 (an int) checked on arrival: a
        writer whose checksum blocks coincide with chunks need not hash those bytes again."""
        return self._read_region(version, device, tensor, box, itemsize, _digest_sink(sink, digests), None, box)

    def _read_region(self, version, device, tensor, box: Box, itemsize: int, sink, out: np.ndarray | None,
                     out_box: Box) -> int:
        pool = self.data_pool() if box.volume * itemsize >= self.data_plane_min_bytes else None
        pending = [box]
        attempts = 0
        total = 0
        while pending:
            bad: list[Box] = []
            for region in pending:
                got = None
                if pool is not None:  # a re-fetch, or a read that will not re-fetch, asks the server to verify:
                    # damage on its disk is then named (DATA_LOSS) rather than sent unread to fail here
                    got = self._data_box(pool, version, device, tensor, region, itemsize, sink, out, out_box, bad,
                                         verify=attempts > 0 or self.retries == 0)
                if got is None:  # no data plane, or it could not be reached: gRPC
                    got = self._stream_box(version, device, tensor, region, itemsize, sink, bad)
                total += got
            if bad:
                attempts += 1
                if attempts > self.retries:
                    raise ChecksumError(f"store {self.address}: {len(bad)} chunk(s) of tensor {tensor!r} on {device} "
                                        f"(first {bad[0]}) arrived corrupted {attempts} times; giving up")
                log.warning("store %s: %d piece(s) of tensor %r on %s (first %s) arrived corrupted; fetching them "
                            "again%s", self.address, len(bad), tensor, device, bad[0],
                            ", verified by the store" if pool is not None else "")
            pending = bad
        return total

    def read_box_into(self, version: int, device: str, tensor: str, box: Box, out: np.ndarray) -> int:
        """Fill ``out`` (shape ``box.lengths``) with the region ``box`` of ``device``'s shard; return bytes read.
        When it raises, ``out`` may hold part of the region, or bytes that failed their check: discard it."""
        if tuple(out.shape) != tuple(box.lengths):
            raise StoreError(f"output shape {list(out.shape)} differs from box lengths {list(box.lengths)}")

        def sink(sub: Box, data: memoryview, _digest: int) -> None:
            out[sub.local(box).slices()] = np.frombuffer(data, out.dtype).reshape(sub.lengths)

        return self._read_region(version, device, tensor, box, out.itemsize, sink, out, box)

    def _data_box(self, pool: DataPool, version, device, tensor, region: Box, itemsize: int, sink,
                  out: np.ndarray | None, out_box: Box, bad: list, verify: bool = False) -> int | None:
        """Read ``region`` over the data plane: frames land in ``out`` directly when given, else go to ``sink``.
        None when no data connection could be opened (a flooded or restarted data plane): read over gRPC."""
        try:
            got, corrupted = pool.read(version, device, tensor, region, itemsize, self.chunk_bytes, sink=sink,
                                       out=out, out_box=out_box, verify=verify)
        except DataPlaneUnreachable:
            return None
        except DataPlaneError as e:
            code = getattr(grpc.StatusCode, e.code, grpc.StatusCode.UNKNOWN)
            raise RemoteStoreError(f"store {self.address}: data-plane read ({version}, {device}, {tensor!r}, "
                                   f"{region}) failed with {code.name}: {e}", code, self.address) from None
        bad.extend(corrupted)
        return got

    def _stream_box(self, version, device, tensor, region: Box, itemsize: int, sink, bad: list) -> int:
        request = pb.ReadBoxRequest(version=version, device=device, tensor=tensor, box=wire.to_pb_box(region),
                                    chunk_bytes=self.chunk_bytes)
        got = 0
        try:
            call = self._read_box(request, timeout=self._read_deadline(region.volume * itemsize),
                                  metadata=self._metadata)
            for sub, digest, data, _ in self._watched(call, f"ReadBox({version}, {device}, {tensor!r}, {region})"):
                if not region.contains(sub) or sub.volume * itemsize != len(data):
                    raise StoreError(f"store {self.address} sent chunk {sub} ({len(data)} bytes) that does not "
                                     f"fit the requested region {region}")
                if xxhash.xxh3_64_intdigest(data) != digest:
                    bad.append(sub)
                    continue
                sink(sub, data, digest)
                got += len(data)
        except grpc.RpcError as e:
            raise self._error(e, f"ReadBox({version}, {device}, {tensor!r}, {region})") from None
        return got

    def read_boxes_to(self, version: int, regions: list[tuple[str, str, Box, int, Callable]], *,
                      digests: bool = False) -> int:
        """Read many (usually small) regions in one call: ``regions`` holds (device, tensor, box, itemsize,
        sink) and each sink receives its region's verified chunks (with their digests when ``digests``: see
        :meth:`read_box_to`). Corrupted chunks are fetched again one by one. Returns the bytes delivered.
        More regions than a request may name (``wire.MAX_READ_REGIONS``) go in several calls."""
        if len(regions) > wire.MAX_READ_REGIONS:
            return sum(self.read_boxes_to(version, regions[i:i + wire.MAX_READ_REGIONS], digests=digests)
                       for i in range(0, len(regions), wire.MAX_READ_REGIONS))
        request = pb.ReadBoxesRequest(version=version, chunk_bytes=self.chunk_bytes, boxes=[
            pb.BoxRef(device=device, tensor=tensor, box=wire.to_pb_box(box)) for device, tensor, box, _, _ in regions])
        nbytes = sum(box.volume * itemsize for _, _, box, itemsize, _ in regions)
        sinks = [_digest_sink(sink, digests) for *_, sink in regions]
        got = 0
        bad: list[tuple[int, Box]] = []
        try:
            call = self._read_boxes(request, timeout=self._read_deadline(nbytes), metadata=self._metadata)
            for sub, digest, data, index in self._watched(call, f"ReadBoxes({version}, {len(regions)} regions)"):
                if not 0 <= index < len(regions):
                    raise StoreError(f"store {self.address} sent a chunk for region #{index} of {len(regions)}")
                _, tensor, box, itemsize, _ = regions[index]
                if not box.contains(sub) or sub.volume * itemsize != len(data):
                    raise StoreError(f"store {self.address} sent chunk {sub} ({len(data)} bytes) that does not "
                                     f"fit the requested region {box} of {tensor!r}")
                if xxhash.xxh3_64_intdigest(data) != digest:
                    bad.append((index, sub))
                    continue
                sinks[index](sub, data, digest)
                got += len(data)
        except grpc.RpcError as e:
            raise self._error(e, f"ReadBoxes({version}, {len(regions)} regions)") from None
        for index, sub in bad:
            device, tensor, _, itemsize, _ = regions[index]
            got += self.read_box_to(version, device, tensor, sub, itemsize, sinks[index], digests=True)
        return got

    def read_box(self, version: int, device: str, tensor: str, box: Box, dtype: str) -> np.ndarray:
        out = np.empty(box.lengths, dtype=numpy_storage(dtype))
        self.read_box_into(version, device, tensor, box, out)
        return out

    # ---- writing -------------------------------------------------------
    def write_shard(self, version: int, part: str, device: str, tensor: str, box: Box, array: np.ndarray,
                    dtype: str, shape: tuple[int, ...] | None = None) -> int:
        """Stage ``array`` as ``device``'s box of ``tensor`` in part ``part`` of ``version`` on the server."""
        array = np.ascontiguousarray(array)
        if tuple(array.shape) != tuple(box.lengths):
            raise StoreError(f"array shape {list(array.shape)} differs from box lengths {list(box.lengths)}")

        def messages() -> Iterator[pb.WriteShardRequest]:
            yield pb.WriteShardRequest(header=pb.ShardHeader(version=version, part=part, device=device, tensor=tensor,
                                                             box=wire.to_pb_box(box), dtype=dtype,
                                                             shape=list(shape or ())))
            for sub in wire.split_box(box, array.itemsize, self.chunk_bytes):
                data = np.ascontiguousarray(array[sub.local(box).slices()]).tobytes()
                yield pb.WriteShardRequest(chunk=pb.Chunk(box=wire.to_pb_box(sub), xxh3=xxhash.xxh3_64_intdigest(data),
                                                          data=data))

        try:
            reply = self._stub.WriteShard(messages(), timeout=self._read_deadline(array.nbytes),
                                          metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e, f"WriteShard({version}, {device}, {tensor!r}, {box})") from None
        return reply.bytes

    def put_json(self, version: int, part: str, name: str, doc) -> None:
        self._call("PutJson", pb.PutJsonRequest(version=version, part=part, name=name, json=json.dumps(doc)),
                   f"PutJson({version}, {name!r})")

    def prepare(self, version: int, part: str) -> None:
        self._call("Prepare", pb.PrepareRequest(version=version, part=part), f"Prepare({version}, {part!r})")

    def commit(self, version: int) -> None:
        self._call("Commit", pb.CommitRequest(version=version), f"Commit({version})")

    def abort(self, version: int) -> None:
        self._call("Abort", pb.AbortRequest(version=version), f"Abort({version})")

    def delete(self, version: int) -> bool:
        return self._call("Delete", pb.DeleteRequest(version=version), f"Delete({version})").deleted

    def gc(self, keep: int) -> list[int]:
        return list(self._call("Gc", pb.GcRequest(keep=keep), f"Gc({keep})").deleted)

    # ---- transformation --------------------------------------------------
    def transform(self, request: TransformRequest, timeout: float) -> Generator[TransformProgress, None, None]:
        """Run this host's part of a transformation; yields progress, the last message has ``done``.
        Closing the generator drops the call, which cancels the part on the store."""
        what = f"Transform({request.old_version} -> {request.new_version})"
        messages = self._watched(self._stub.Transform(wire.to_pb_transform_request(request), timeout=timeout,
                                                      metadata=self._metadata), what)
        try:
            for message in messages:
                yield wire.from_pb_transform_progress(message)
        except grpc.RpcError as e:
            raise self._error(e, what) from None
        finally:
            messages.close()

    # ---- dataset files ---------------------------------------------------
    def stat_file(self, path: str) -> dict:
        reply = self._call("StatFile", pb.StatFileRequest(path=path), f"StatFile({path!r})")
        return {"size": reply.size, "mtime": reply.mtime}

    def read_file(self, path: str, offset: int = 0, length: int = -1) -> bytes:
        """Bytes [offset, offset+length) of ``<root>/datasets/<path>`` (length -1: to the end), verified."""
        for _attempt in range(self.retries + 1):
            parts = []
            expected = offset
            corrupted = False
            request = pb.ReadFileRequest(path=path, offset=offset, length=length, chunk_bytes=self.chunk_bytes)
            try:
                for chunk_offset, digest, data in self._read_file(request, timeout=self._read_deadline(
                        max(length, 0)), metadata=self._metadata):
                    if chunk_offset != expected:
                        raise StoreError(f"store {self.address}: ReadFile({path!r}) chunk at {chunk_offset}, "
                                         f"expected {expected}")
                    if xxhash.xxh3_64_intdigest(data) != digest:
                        corrupted = True
                        break
                    parts.append(data)
                    expected += len(data)
            except grpc.RpcError as e:
                raise self._error(e, f"ReadFile({path!r}, {offset}, {length})") from None
            if not corrupted:
                return b"".join(parts)
        raise ChecksumError(f"store {self.address}: ReadFile({path!r}) data arrived corrupted {self.retries + 1} times")


def _digest_sink(sink: Callable, digests: bool) -> Callable[[Box, memoryview, int], None]:
    """The reading paths hand every sink (sub box, bytes, verified xxh3_64); a caller's two-argument sink
    does without the digest."""
    return sink if digests else (lambda sub, data, _digest: sink(sub, data))
