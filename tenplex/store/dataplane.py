"""The bulk data plane: large box reads between hosts over plain TCP, beside gRPC.

May import: numpy, xxhash, ``tenplex.box``, ``tenplex.dtypes``, ``tenplex.errors``, this package's
``_buffers``, ``_hooks``, ``manifest`` and ``wire``, and the standard library. No grpc: the
store server hands in what it needs (a reader lookup and an error describer).

Why: Python gRPC copies every byte about three times per side, which caps a
pull near 0.4-0.6 GB/s where one TCP socket moves about 2 GB/s. Here a frame
(at most one 1 MiB checksum block) that is exactly one stored block goes from
the shard file to the socket with ``os.sendfile``, unread by the server, under
the block's digest from the manifest: the client checks the bytes against what
was committed (end to end: damage on the server's disk and on the way look the
same to it), and a store writing the frame as one whole block of its new shard
takes that checked digest as the block's, so those bytes are hashed once in
all. Any other frame is read into a reused buffer, its stored blocks verified
and the frame checksum computed in the same pass while the bytes are in the
CPU cache (``tenplex.store.shardfile``), then sent; the client ``recv_into``s
straight into the destination memory (or a reused buffer). Clients ask for
frames cut on the shard's block grid (``align``), so a run of the file that
starts inside a block still travels mostly as whole blocks. A re-fetch of
frames that arrived corrupted asks the server to ``verify``: every frame is
then read and checked there, and damage on its disk fails with ``DATA_LOSS``
naming the block, where the client would otherwise only see "corrupted" again.
(Measured on loopback, 2026-12-04: in changes where a host serves several
peers, the server's saved read and hash outweigh the client's copy from pages
that are not in its CPU cache.)

Protocol (version 1; every message is [u32 length][UTF-8 JSON], never pickle):

1. server -> client, on connect: ``{"tenplex_data": 1, "nonce": HEX, "auth": bool}``.
2. client -> server, per read: ``{"v": 1, "auth": HMAC, "version": N, "device": D,
   "tensor": T, "box": {"offsets": [...], "lengths": [...]}, "frame_bytes": F,
   "align": bool, "verify": bool, "peer_host": H}`` (the last three optional: false, false, and
   none declared when absent). ``peer_host`` is the host the client reads for: the server counts the
   payload bytes it sends under it (``on_sent``); a server that predates it ignores it.
   ``auth`` is hex HMAC-SHA256(token, nonce) when the server has a token (the
   token itself never crosses the wire); a wrong one closes the connection.
3. server -> client: ``{"ok": true, "itemsize": S, "frame_bytes": F, "lead": L}``
   (F is the request's, capped at 1 MiB; L is 0 unless the client asked to
   ``align``, then where the box starts in the shard's grid of F-byte blocks
   when the box is one run of the file and F is the block size) then one
   frame per sub-box of ``wire.split_box(box, S, F, L)`` in that order, each
   [u64 payload length][u64 xxh3_64 of payload][payload: C-order bytes]; or
   ``{"ok": false, "code": STATUS, "message": ...}`` (unknown version, box
   outside the tensor...; the connection stays usable unless the error was
   about the protocol or the token). A stored block found corrupted after
   "ok" ends the reply with an error frame: length 2^64-1, checksum 0, then
   the same ``{"ok": false, ...}`` message (``DATA_LOSS``). A file cut short
   while a frame is sent from it ends the connection (the frame's header is
   out): the client's read fails (UNAVAILABLE), the next one gets the error.

The client verifies every frame and reports corrupted sub-boxes, which the
caller fetches again (``StoreClient.read_box_to``): never silent corruption.
A peer that dies closes the socket (UNAVAILABLE); one that hangs or is cut
off delivers nothing until the socket timeout (the client's stall limit:
DEADLINE_EXCEEDED); both surface like gRPC failures so the transformer falls
back to another replica. Both ends also set TCP keepalive and
``TCP_USER_TIMEOUT``, so a partitioned peer (no reset ever arrives) fails the
connection in seconds instead of hanging a thread. The data plane is not encrypted:
servers with TLS do not start it and TLS clients never use it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import xxhash

from ..box import Box
from ..errors import RETRYABLE_STATUS, StoreError
from ._buffers import thread_buffer
from ..dtypes import itemsize
from . import _hooks, wire
from .blocks import BLOCK_BYTES
from .manifest import CorruptShard

log = logging.getLogger(__name__)
PROTOCOL = 1
_LEN = struct.Struct("<I")
_FRAME = struct.Struct("<QQ")  # payload length, xxh3_64
_ERROR_FRAME = (1 << 64) - 1  # a frame "length" announcing an error message instead of a payload
_MAX_JSON = 1 << 20
_IDLE_S = 600.0  # a pooled connection waiting for its next request (dropped sooner when connections run out)
HANDSHAKE_S = 10.0  # a new connection must send its first (authenticated) request within this
MAX_CONNECTIONS = 256
_SEND_TIMEOUT_S = 300.0  # a client that stops reading
_DEAD_PEER_S = 10.0  # server side: sent data unacknowledged (or idle probes unanswered) this long
_CLOSE_WAIT_S = 5.0  # close() waits this long for the accept thread to close the listening socket


class DataPlaneError(StoreError):
    """A data-plane read failed; ``code`` names the equivalent gRPC status (e.g. ``UNAVAILABLE``)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code

    @property
    def retryable(self) -> bool:  # type: ignore[override]  # computed from the status, as RemoteStoreError's
        return self.code in RETRYABLE_STATUS


class DataPlaneUnreachable(DataPlaneError):
    """No data connection could be opened (refused, or closed before the hello): the client reads over gRPC."""

    def __init__(self, message: str):
        super().__init__(message, "UNAVAILABLE")


class _ClosedBeforeReply(DataPlaneError):
    """The server closed the connection before answering a request (a pooled connection it dropped)."""

    def __init__(self, message: str):
        super().__init__(f"connection closed before the reply: {message}", "UNAVAILABLE")


def auth_digest(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), bytes.fromhex(nonce), hashlib.sha256).hexdigest()


def _send_json(sock: socket.socket, doc: dict) -> None:
    body = json.dumps(doc, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def _detect_dead_peer(sock: socket.socket, seconds: float) -> None:
    """Fail ``sock`` when its sent data stays unacknowledged, or an idle peer stops answering keepalive
    probes, for about ``seconds``: a partitioned peer never sends a reset."""
    limit = max(1, int(seconds))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, limit // 2))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, limit - limit // 2))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, limit * 1000)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {view.nbytes} bytes")
        got += n


def _recv_json(sock: socket.socket) -> dict:
    head = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > _MAX_JSON:
        raise ValueError(f"data-plane message of {n} bytes exceeds {_MAX_JSON}")
    body = bytearray(n)
    _recv_exact(sock, memoryview(body))
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError("data-plane message is not a JSON object")
    return doc


# ---------------------------------------------------------------- server --
class DataServer:
    """Serves boxes of committed versions on a plain TCP port; one thread per connection.

    ``reader_of(version)`` returns the VersionReader; ``describe(exc)`` returns
    (status code name, message) for an error frame; ``on_sent(peer_host, nbytes)``, when given, is called
    as each frame's payload is sent, with the host the request declared ("" when none).

    Hostile clients: a connection must send its first request (which carries
    the token's HMAC) within ``handshake_s`` seconds or it is closed. At most
    ``max_connections`` are open at once; a new one then replaces the oldest
    idle connection (one waiting for a request), or is closed at once when
    every connection is busy sending. The accept loop survives its own errors
    (e.g. no thread can be started: that connection is closed, the client
    falls back to gRPC)."""

    def __init__(self, bind: str, reader_of: Callable, describe: Callable[[BaseException], tuple[str, str]],
                 token: str | None = None, port: int = 0, handshake_s: float = HANDSHAKE_S,
                 max_connections: int = MAX_CONNECTIONS, on_sent: Callable[[str, int], None] | None = None):
        self._reader_of, self._describe, self._token = reader_of, describe, token
        self._on_sent = on_sent
        self._handshake_s, self._max_connections = handshake_s, max_connections
        self._hooks = _hooks.from_environment()
        host = bind.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._conns: dict[socket.socket, list] = {}  # connection -> [idle since, or None while busy]
        self._idle = threading.Condition()  # guards _conns; notified when a connection turns idle
        self._accepting = threading.Thread(target=self._accept, name="data-accept", daemon=True)
        self._accepting.start()

    def close(self) -> None:
        """Stop accepting. The accept thread owns the listening socket and closes it as it ends: closed here,
        its number could be reused before that thread's ``accept`` reads it."""
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        if self._accepting is not threading.current_thread():
            self._accepting.join(_CLOSE_WAIT_S)

    def _accept(self) -> None:
        with self._listener:
            while not self._closed:
                try:
                    conn, peer = self._listener.accept()
                except OSError:
                    if self._closed:
                        return
                    time.sleep(0.05)  # e.g. EMFILE: out of descriptors; try again
                    continue
                try:
                    self._admit(conn, peer)
                except Exception as e:  # noqa: BLE001 - e.g. "can't start new thread": drop this one, go on
                    log.warning("data connection from %s dropped: %s", peer[0], e)
                    self._close_connection(conn)

    def _admit(self, conn: socket.socket, peer) -> None:
        with self._idle:
            if len(self._conns) >= self._max_connections:
                # a connection that just sent its last frame turns idle a moment later: wait for it briefly
                self._idle.wait_for(lambda: any(since is not None for since, in self._conns.values()), 0.5)
                idle = [(since, c) for c, (since,) in self._conns.items() if since is not None]
                if not idle:
                    log.warning("data connection from %s refused: %d connections, all busy", peer[0],
                                len(self._conns))
                    conn.close()
                    return
                victim = min(idle, key=lambda item: item[0])[1]
                del self._conns[victim]
                try:
                    victim.shutdown(socket.SHUT_RDWR)  # its thread sees the end of the stream and exits
                except OSError:
                    pass
            self._conns[conn] = [time.monotonic()]
        log.info("data connection from %s:%s", peer[0], peer[1])
        threading.Thread(target=self._serve, args=(conn,), name="data-conn", daemon=True).start()

    def _close_connection(self, conn: socket.socket) -> None:
        """Forget and close ``conn`` under the lock that ``_admit`` holds while it shuts down an idle connection
        to make room: it never acts on a number closed here (and perhaps reused by then)."""
        with self._idle:
            self._conns.pop(conn, None)
            conn.close()

    def _mark(self, conn: socket.socket, idle: bool) -> None:
        with self._idle:
            state = self._conns.get(conn)
            if state is not None:
                state[0] = time.monotonic() if idle else None
                if idle:
                    self._idle.notify_all()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._converse(conn)
        finally:
            self._close_connection(conn)

    def _converse(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _detect_dead_peer(conn, _DEAD_PEER_S)
        nonce = secrets.token_hex(16)
        expected = auth_digest(self._token, nonce) if self._token else None
        try:
            conn.settimeout(_SEND_TIMEOUT_S)
            _send_json(conn, {"tenplex_data": PROTOCOL, "nonce": nonce, "auth": expected is not None})
            wait = self._handshake_s  # the first request (and its token) must come soon
            while True:
                conn.settimeout(wait)
                try:
                    request = _recv_json(conn)
                except ConnectionError:
                    return  # the client is done with this connection
                except ValueError as e:
                    _send_json(conn, {"ok": False, "code": "INVALID_ARGUMENT",
                                      "message": f"malformed data-plane request: {e}"})
                    return
                self._mark(conn, idle=False)
                conn.settimeout(_SEND_TIMEOUT_S)
                if request.get("v") != PROTOCOL:
                    _send_json(conn, {"ok": False, "code": "INVALID_ARGUMENT",
                                      "message": f"data-plane protocol version {request.get('v')!r} is not "
                                                 f"supported; this store speaks version {PROTOCOL}"})
                    return
                if expected is not None and not hmac.compare_digest(str(request.get("auth", "")), expected):
                    _send_json(conn, {"ok": False, "code": "UNAUTHENTICATED",
                                      "message": "missing or wrong store token on the data connection"})
                    return
                self._answer(conn, request)
                self._mark(conn, idle=True)
                wait = _IDLE_S
        except OSError as e:  # client gone, stalled or silent: nothing to report to
            log.debug("data connection ended: %s", e)

    def _answer(self, conn: socket.socket, request: dict) -> None:
        try:
            reply = self._prepare(request)
        except Exception as e:  # noqa: BLE001 - reported to the client, the connection stays usable
            if isinstance(e, (KeyError, TypeError)):
                e = ValueError(f"malformed data-plane request ({type(e).__name__}: {e}); expected version, "
                               f"device, tensor and box with offsets and lengths")
            code, message = self._describe(e)
            _send_json(conn, {"ok": False, "code": code, "message": message})
            return
        try:
            self._send(conn, request, reply)
        finally:
            if reply.fd >= 0:
                os.close(reply.fd)  # this reply's own descriptor, closed once here

    def _prepare(self, request: dict) -> "_Reply":
        """Find the requested region and cut its frames; read the first one (unless it goes unread) and open the
        file for the frames that go unread, so that most failures get a plain error reply, before "ok"."""
        box = Box(tuple(int(x) for x in request["box"]["offsets"]), tuple(int(x) for x in request["box"]["lengths"]))
        reader = self._reader_of(int(request["version"]))
        entry = reader.find(str(request["device"]), str(request["tensor"]), box)
        size = itemsize(entry.dtype)
        # Frames of at most one checksum block: the client receives the first bytes while the rest is still on
        # its way, and each frame is sent while it is in the CPU cache (when it is read at all: see below).
        frame_bytes = max(4096, min(int(request.get("frame_bytes") or wire.DEFAULT_CHUNK_BYTES), BLOCK_BYTES))
        shard = reader.shard_file(entry)
        lead = _grid_lead(reader, entry, box, size, frame_bytes) if request.get("align") else 0
        # a frame that is one whole stored block goes from the file to the socket unread (os.sendfile), with
        # its stored digest: the client checks it against what was committed. Only for a client that knows it
        # (it asks to align; one from before would re-fetch damaged bytes until it gave up, where this server
        # used to name the damage). Asked to verify (a re-fetch of frames that arrived damaged), every frame is
        # read and checked here, so that damage on this host is told apart from damage on the way, and named.
        unread = self._hooks is None and bool(request.get("align")) and not request.get("verify")
        frames = []
        for sub in wire.split_box(box, size, frame_bytes, lead):
            start, span, _ = reader.byte_span(entry, sub)
            whole = unread and span == sub.volume * size
            frames.append((sub, start, span, shard.block_digest(start, span) if whole else None))
        reply = _Reply(reader, entry, shard, size, frame_bytes, lead, frames)
        first, start, span, stored = frames[0]
        if stored is None:
            # read, verified and given its checksum before answering "ok": most damage gets a plain error
            # reply, and the frame then goes out from memory without being read a second time
            reply.ready = self._frame(reader, entry, shard, first, start, span, size, reply.verified)
        if any(frame[3] is not None for frame in frames):
            reply.fd, reply.data_offset = shard.open_checked()  # a missing or truncated file: a plain error reply
        return reply

    def _send(self, conn: socket.socket, request: dict, reply: "_Reply") -> None:
        """Answer "ok", then send the frames: unread ones from the file, the others read and verified (a damaged
        block further on ends the reply with an error frame)."""
        sent = self._on_sent
        peer = wire.declared_peer(request.get(wire.PEER_HOST_FIELD)) if sent is not None else ""
        _send_json(conn, {"ok": True, "itemsize": reply.size, "frame_bytes": reply.frame_bytes, "lead": reply.lead})
        for index, (sub, start, span, stored) in enumerate(reply.frames):
            if stored is not None:
                if sent is not None:  # counted before it goes: a client that received it finds it counted
                    sent(peer, span)
                conn.sendall(_FRAME.pack(span, stored), socket.MSG_MORE)
                _send_file(conn, reply.fd, reply.data_offset + start, span, reply.shard.where)
                continue
            try:
                header, payload = reply.ready if index == 0 and reply.ready is not None else \
                    self._frame(reply.reader, reply.entry, reply.shard, sub, start, span, reply.size, reply.verified)
            except CorruptShard as e:  # e.g. a damaged block further on: an error frame
                code, message = self._describe(e)
                conn.sendall(_FRAME.pack(_ERROR_FRAME, 0))
                _send_json(conn, {"ok": False, "code": code, "message": message})
                return
            if sent is not None:
                sent(peer, payload.nbytes)
            _send_parts(conn, header, payload)

    def _frame(self, reader, entry, shard, sub: Box, start: int, span: int, size: int,
               verified: set) -> tuple[bytes, memoryview]:
        """A frame's header and payload, read and verified. A run of the shard file is read, verified and
        checksummed in one pass through this thread's buffer (sent before the next frame is read); a frame that
        is one whole stored block carries the block's stored digest (nothing more to hash, and the client checks
        the bytes against what was committed). Anything else is gathered into an array and hashed."""
        if span == sub.volume * size and sub.volume and self._hooks is None:
            buffer = _frame_buffer(span)
            stored = shard.block_digest(start, span)
            digest = xxhash.xxh3_64() if stored is None else None
            shard.read_into(start, buffer, verified=verified, digest=digest)
            return _FRAME.pack(span, stored if digest is None else digest.intdigest()), buffer
        data = np.ascontiguousarray(reader.region(entry, sub, verified))
        payload = memoryview(data.reshape(-1)).cast("B") if data.size else memoryview(b"")
        header = _FRAME.pack(payload.nbytes, xxhash.xxh3_64_intdigest(payload))
        if self._hooks is not None and self._hooks.next_chunk():
            payload = memoryview(_hooks.damaged(payload))
        return header, payload


@dataclass(eq=False)
class _Reply:
    """What the data plane sends for one request: the stored shard, its frames (sub-box, data start, span, and
    the stored digest of a frame sent unread), the first frame when it was read ahead, the file opened for the
    frames sent unread (``fd``: the reply's own, closed once by ``_answer``)."""

    reader: Any
    entry: Any
    shard: Any
    size: int
    frame_bytes: int
    lead: int
    frames: list[tuple[Box, int, int, int | None]]
    ready: tuple[bytes, memoryview] | None = None
    verified: set = field(default_factory=set)  # blocks checked by this reply: frames do not check them again
    fd: int = -1
    data_offset: int = 0


def _send_parts(conn: socket.socket, header: bytes, payload: memoryview) -> None:
    """Send a frame's header and payload with one system call where the socket takes it all: with TCP_NODELAY
    a header sent alone leaves as a packet of its own, one more wake-up of the receiver per frame (measured:
    about 8 % of a 1 GiB transfer's throughput on loopback)."""
    sent = conn.sendmsg([header, payload])
    if sent < len(header):
        conn.sendall(memoryview(header)[sent:])
        sent = len(header)
    if sent - len(header) < payload.nbytes:
        conn.sendall(payload[sent - len(header):])


def _grid_lead(reader, entry, box: Box, size: int, frame_bytes: int) -> int:
    """Where ``box`` starts in its shard's grid of checksum blocks, when frames cut on that grid are whole stored
    blocks (``wire.split_box``'s ``lead``): the box is one contiguous run of the file and the blocks are as large
    as the frames. Else 0 (frames cut from the box's start)."""
    start, span, _ = reader.byte_span(entry, box)
    if entry.blocks is None or entry.block_bytes != frame_bytes or span != box.volume * size:
        return 0
    return start % frame_bytes


def _send_file(conn: socket.socket, fd: int, offset: int, count: int, where: str) -> None:
    """Send ``count`` bytes of the file ``fd`` from ``offset`` with ``os.sendfile`` (the kernel hands page-cache
    pages to the socket: no copy through this process), waiting for room as long as the socket's timeout. A file
    that ends early ends the connection: the frame's header is out, and the client sees the stream end."""
    waiter = None
    timeout = conn.gettimeout()
    while count:
        try:
            sent = os.sendfile(conn.fileno(), fd, offset, count)
        except BlockingIOError:  # a socket with a timeout is non-blocking underneath
            if waiter is None:
                waiter = select.poll()
                waiter.register(conn.fileno(), select.POLLOUT)
            if not waiter.poll(None if timeout is None else int(timeout * 1000)):
                raise socket.timeout(f"the data-plane client stopped reading for {timeout}s") from None
            continue
        if sent == 0:
            log.warning("%s: the file ended %d bytes short while being sent; the stored shard is damaged "
                        "(truncated)", where, count)
            raise ConnectionAbortedError(f"{where}: truncated while sending")
        offset, count = offset + sent, count - sent


_buffers = threading.local()


def _frame_buffer(nbytes: int) -> memoryview:
    """A reused buffer of this thread for one frame (frames are at most one block)."""
    return thread_buffer(_buffers, nbytes, BLOCK_BYTES)


# ---------------------------------------------------------------- client --
class DataConnection:
    """One client connection to a data server; not thread-safe (see ``DataPool``)."""

    def __init__(self, host: str, port: int, token: str | None, timeout: float, peer_host: str | None = None):
        self.where = f"{host}:{port}"
        self._declared = {wire.PEER_HOST_FIELD: peer_host} if peer_host else {}
        sock = None
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _detect_dead_peer(sock, timeout)
            hello = _recv_json(sock)
        except BaseException as e:
            if sock is not None:
                sock.close()  # connected, but no usable hello: do not leak the socket
            if isinstance(e, socket.timeout):
                raise DataPlaneError(f"data plane {self.where} did not answer within {timeout}s",
                                     "DEADLINE_EXCEEDED") from None
            if isinstance(e, (OSError, ValueError)):
                raise DataPlaneUnreachable(f"data plane {self.where} unreachable: {e}") from None
            raise
        self._sock = sock
        if hello.get("tenplex_data") != PROTOCOL:
            self.close()
            raise DataPlaneError(f"{self.where} speaks data-plane protocol {hello.get('tenplex_data')!r}, "
                                 f"not {PROTOCOL}", "FAILED_PRECONDITION")
        self._auth = auth_digest(token, hello["nonce"]) if token and hello.get("auth") else ""
        self._scratch = bytearray()

    def close(self) -> None:
        self._sock.close()

    def read(self, version: int, device: str, tensor: str, region: Box, itemsize: int, frame_bytes: int,
             sink: Callable[[Box, memoryview, int], None] | None = None, out: np.ndarray | None = None,
             out_box: Box | None = None, verify: bool = False) -> tuple[int, list[Box]]:
        """Read ``region``; each verified frame goes into ``out`` (an array of ``out_box``, which contains
        the region) or to ``sink(sub_box, bytes, xxh3_64)``. Returns (bytes delivered, corrupted sub-boxes).
        ``verify``: the server reads and checks every frame before sending it (for a re-fetch of frames that
        arrived corrupted: damage on the server's disk then fails the read with ``DATA_LOSS``, by name)."""
        _send_json(self._sock, {"v": PROTOCOL, "auth": self._auth, "version": version, "device": device,
                                "tensor": tensor, "box": {"offsets": list(region.offsets),
                                                          "lengths": list(region.lengths)},
                                "frame_bytes": frame_bytes, "align": True, "verify": verify, **self._declared})
        try:
            reply = _recv_json(self._sock)
        except (ConnectionError, BrokenPipeError) as e:  # e.g. the server dropped this connection while idle
            raise _ClosedBeforeReply(str(e)) from None
        if not reply.get("ok"):
            raise DataPlaneError(str(reply.get("message", "unknown error")), str(reply.get("code", "UNKNOWN")))
        if reply.get("itemsize") != itemsize:
            raise DataPlaneError(f"{tensor!r} on {device} has itemsize {reply.get('itemsize')}, the reader "
                                 f"expected {itemsize}", "FAILED_PRECONDITION")
        head = bytearray(_FRAME.size)
        got, bad = 0, []
        for sub in wire.split_box(region, itemsize, int(reply["frame_bytes"]), int(reply.get("lead", 0))):
            _recv_exact(self._sock, memoryview(head))
            nbytes, digest = _FRAME.unpack(head)
            if nbytes == _ERROR_FRAME:
                reply = _recv_json(self._sock)
                raise DataPlaneError(str(reply.get("message", "unknown error")), str(reply.get("code", "UNKNOWN")))
            if nbytes != sub.volume * itemsize:
                raise DataPlaneError(f"data plane {self.where} sent a {nbytes}-byte frame for {sub} "
                                     f"({sub.volume * itemsize} bytes)", "INTERNAL")
            dest = out[sub.local(out_box).slices()] if out is not None and out_box is not None else None
            if dest is not None and dest.flags.c_contiguous:
                view = memoryview(dest.reshape(-1)).cast("B") if nbytes else memoryview(b"")
                direct = True
            else:
                if len(self._scratch) < nbytes:
                    self._scratch = bytearray(nbytes)
                view, direct = memoryview(self._scratch)[:nbytes], False
            _recv_exact(self._sock, view)
            if xxhash.xxh3_64_intdigest(view) != digest:
                bad.append(sub)
                continue
            if not direct:
                if dest is not None:
                    dest[...] = np.frombuffer(view, dest.dtype).reshape(sub.lengths)
                elif sink is not None:
                    sink(sub, view, digest)
                else:
                    raise ValueError("a data-plane read needs out and out_box, or sink")
            got += nbytes
        return got, bad


class DataPool:
    """Idle connections to one data server, shared by a client's threads: a thread takes one per read."""

    def __init__(self, host: str, port: int, token: str | None, timeout: float, peer_host: str | None = None):
        self.host, self.port, self._token, self._timeout = host, port, token, timeout
        self._peer_host = peer_host  # declared in every request (``DataConnection``)
        self._idle: list[DataConnection] = []
        self._lock = threading.Lock()

    def read(self, *args, **kwargs) -> tuple[int, list[Box]]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is not None:
            try:
                return self._read_on(conn, *args, **kwargs)
            except _ClosedBeforeReply:
                pass  # the server had closed this idle connection (idle too long, or replaced): a new one
        return self._read_on(DataConnection(self.host, self.port, self._token, self._timeout, self._peer_host),
                             *args, **kwargs)

    def _read_on(self, conn: DataConnection, *args, **kwargs) -> tuple[int, list[Box]]:
        try:
            result = conn.read(*args, **kwargs)
        except _ClosedBeforeReply:
            conn.close()
            raise
        except DataPlaneError:
            conn.close()  # errors are rare; a fresh connection avoids reasoning about what the server closed
            raise
        except socket.timeout:
            conn.close()
            raise DataPlaneError(f"data plane {conn.where} stalled for more than {self._timeout}s",
                                 "DEADLINE_EXCEEDED") from None
        except (OSError, ValueError) as e:
            conn.close()
            raise DataPlaneError(f"data plane {conn.where} failed mid-transfer: {e}", "UNAVAILABLE") from None
        with self._lock:
            self._idle.append(conn)
        return result

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
