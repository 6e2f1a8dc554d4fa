"""Chunk framing, chunk splitting, channel options and message conversions shared by the store server and client.

May import: grpc, xxhash, ``tenplex.box``, ``tenplex.layout``, ``tenplex.transfer_plan``, ``tenplex.files``
(its JSON codec: orjson when installed), ``tenplex._gc``, this package's generated ``_proto``, ``manifest`` and
``transformer``, and the standard library.

Chunks (``Chunk``, ``FileChunk``) carry up to ``chunk_bytes`` of payload. To
avoid two extra copies of every payload inside protobuf, the server encodes
them by hand: the message without ``data`` serialised by protobuf, followed by
the ``data`` field (tag, length, bytes). The client cuts the ``data`` field out
of the received bytes as a zero-copy memoryview and parses only the rest with
protobuf. Both are the standard protobuf wire format, so generated stubs in any
language read and write the same messages.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading
from typing import Iterator

from .._gc import paused_gc
from ..box import Box
from ..files import dumps as json_bytes, loads as parse_json
from ..layout import Layout, from_dict as layout_from_dict
from ..transfer_plan import plan_from_dict
from ._proto import store_pb2 as pb
from .manifest import NAME_PATTERN
from .transformer import TransformProgress, TransformRequest

DEFAULT_CHUNK_BYTES = 8 << 20
MAX_CHUNK_BYTES = 64 << 20
# A Transform request carries the old and the new layout whole: 75 MB of JSON for GPT-3 175B with Adam on
# 1,024 devices, about four times that on 4,096. Messages up to this size pass (protobuf's own limit is 2 GiB).
MAX_MESSAGE_BYTES = 1 << 30
# Regions one ReadBoxes request may name (a transforming host batches at most 512): the server's work per request
# stays bounded (it checks each region's blocks once per request, whatever the regions' number).
MAX_READ_REGIONS = 4096
_DATA_FIELD = 3  # the ``bytes data = 3`` field of Chunk and FileChunk
# A reader declares its host (the host it reads for) so that the serving store can count the bytes it sends per
# peer host: as this gRPC metadata key, and as this field of a data-plane request. Servers that predate it ignore
# both; a reader that declares none is counted under "" (``declared_peer``).
PEER_HOST_METADATA = "tenplex-peer-host"
PEER_HOST_FIELD = "peer_host"


def declared_peer(value) -> str:
    """The host a reader declared, or "" when it declared none or something that is no host name (a simple
    identifier, as store names are): a metrics label takes only such names."""
    return value if isinstance(value, str) and NAME_PATTERN.match(value) else ""


def peer_of(metadata) -> str:
    """The reader's declared host in a call's invocation metadata (``declared_peer``)."""
    return declared_peer(next((value for key, value in metadata or () if key == PEER_HOST_METADATA), None))


def channel_options(chunk_bytes: int = MAX_CHUNK_BYTES) -> list[tuple[str, int]]:
    """gRPC options for both ends: message limits fit the largest chunk (plus headers) and a large cluster's
    Transform request (``MAX_MESSAGE_BYTES``), keepalive on."""
    limit = max(int(chunk_bytes) + (1 << 20), MAX_MESSAGE_BYTES)
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        # Detect a dead peer on an idle connection within ~40 s.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Servers accept pings every second: clients with a stall limit (StoreClient) ping a silent peer often.
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
        # Larger HTTP/2 windows keep a fast loopback or datacenter link busy.
        ("grpc.http2.lookahead_bytes", 16 << 20),
        ("grpc.http2.bdp_probe", 1),
    ]


def split_box(box: Box, itemsize: int, max_bytes: int, lead: int = 0) -> Iterator[Box]:
    """Cut ``box`` into sub-boxes of at most ``max_bytes`` (C order, slabs along the outermost split dimension).

    Finds the outermost dimension d whose inner block (dims d.. at full length)
    is too big, then emits, for every index of the dims before d, slabs of as
    many rows of d as fit. A single element larger than max_bytes still forms one chunk.

    ``lead``: the box's first byte lies ``lead`` bytes into a grid of ``max_bytes`` cells (a source shard's
    checksum blocks, for a box that is one contiguous run of it). When the box is a single run of slabs (every
    dimension before d has length 1) and ``lead`` and ``max_bytes`` are whole numbers of slab rows, the first
    slab ends on the next grid line and every later one fills a cell: each whole cell is one sub-box. Otherwise
    ``lead`` changes nothing.
    """
    inner = itemsize
    split = None
    for d in reversed(range(box.ndim)):
        if inner * box.lengths[d] > max_bytes:
            split = d
            break
        inner *= box.lengths[d]
    if split is None or box.is_empty():
        yield box
        return
    step = max(1, max_bytes // inner)
    lead %= max_bytes
    on_grid = lead and not (lead % inner or max_bytes % inner) and all(n == 1 for n in box.lengths[:split])
    first = (max_bytes - lead) // inner if on_grid else step
    starts = [0, *range(first, box.lengths[split], step)] if first < box.lengths[split] else [0]
    outer = box.lengths[:split]
    index = [0] * split
    while True:
        for start, end in zip(starts, [*starts[1:], box.lengths[split]]):
            offsets = tuple(o + i for o, i in zip(box.offsets[:split], index)) + \
                (box.offsets[split] + start,) + box.offsets[split + 1:]
            lengths = (1,) * split + (end - start,) + box.lengths[split + 1:]
            yield Box(offsets, lengths)
        # advance the odometer over the outer dimensions
        d = split - 1
        while d >= 0:
            index[d] += 1
            if index[d] < outer[d]:
                break
            index[d] = 0
            d -= 1
        if d < 0:
            return


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_with_data(head: bytes, data) -> bytes:
    """``head`` (a serialised Chunk/FileChunk without data) followed by the ``data`` field."""
    view = memoryview(data).cast("B")
    return b"".join((head, _varint((_DATA_FIELD << 3) | 2), _varint(view.nbytes), view))


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def split_data(raw: bytes) -> tuple[bytes, memoryview]:
    """Separate the ``data`` field from a serialised Chunk/FileChunk: (the other fields, data as a view)."""
    buf = memoryview(raw)
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _read_varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            if field == _DATA_FIELD:
                end = pos + n
                if end > len(buf):
                    raise ValueError("truncated data field")
                return bytes(buf[:start]) + bytes(buf[end:]), buf[pos:end]
            pos += n
        else:
            raise ValueError(f"unexpected wire type {wire}")
    return bytes(raw), memoryview(b"")


def decode_chunk(raw: bytes) -> tuple[Box, int, memoryview, int]:
    """(box, xxh3, data view, index) of a serialised Chunk."""
    rest, data = split_data(raw)
    msg = pb.Chunk.FromString(rest)
    return Box(tuple(msg.box.offsets), tuple(msg.box.lengths)), msg.xxh3, data, msg.index


def decode_file_chunk(raw: bytes) -> tuple[int, int, memoryview]:
    """(offset, xxh3, data view) of a serialised FileChunk."""
    rest, data = split_data(raw)
    msg = pb.FileChunk.FromString(rest)
    return msg.offset, msg.xxh3, data


def to_pb_box(box: Box) -> pb.Box:
    return pb.Box(offsets=list(box.offsets), lengths=list(box.lengths))


def from_pb_box(msg: pb.Box) -> Box:
    return Box(tuple(msg.offsets), tuple(msg.lengths))


# The Transform RPC: only this module and the generated code know its messages; a 0 or "" in a
# message means "the transformer's default" (None in the request).
def to_pb_transform_request(request: TransformRequest) -> pb.TransformRequest:
    return pb.TransformRequest(
        host=request.host, old_version=request.old_version, new_version=request.new_version,
        plan_json=json_bytes(request.plan.to_dict()), old_layout_json=_layout_json(request.old_layout),
        new_layout_json=_layout_json(request.new_layout), peers=dict(request.peers),
        streams=request.streams or 0, chunk_bytes=request.chunk_bytes or 0,
        json_from_host=request.json_from_host or "", timeout_s=request.stall_timeout_s or 0.0)


_recent_layouts: list[tuple[Layout, bytes]] = []  # the last few layouts encoded, held so that their ids stay theirs
_recent_lock = threading.Lock()


def _layout_json(layout: Layout) -> bytes:
    """The JSON of ``layout``, encoded once for all the requests that carry it: a coordinator sends the same two
    layouts to every host, and a 1,024-device layout takes seconds to encode. The look-up and the encoding
    share one hold of the lock: the per-host requests are encoded by threads that start together, and each
    would otherwise miss and encode the same layout again."""
    with _recent_lock:
        for known, data in _recent_layouts:
            if known is layout:
                return data
        with paused_gc():  # millions of small objects: the collector would walk them again and again
            data = json_bytes(layout.to_dict())
        _recent_layouts.append((layout, data))
        del _recent_layouts[:-4]
        return data


def from_pb_transform_request(msg: pb.TransformRequest, host: str) -> TransformRequest:
    """The request a Transform call carries (``host``: this store's, when the message names none); malformed
    JSON documents raise errors that name them. Every destination host decodes both whole layouts before its
    first pull: 80 MB of JSON for GPT-3 175B on 1,024 devices, so the collector is paused meanwhile."""
    with paused_gc():
        return TransformRequest(
            host=msg.host or host, old_version=msg.old_version, new_version=msg.new_version,
            plan=plan_from_dict(parse_json(msg.plan_json), source="transform request plan"),
            old_layout=layout_from_dict(parse_json(msg.old_layout_json), source="transform request old layout"),
            new_layout=layout_from_dict(parse_json(msg.new_layout_json), source="transform request new layout"),
            peers=dict(msg.peers), streams=msg.streams or None, chunk_bytes=msg.chunk_bytes or None,
            json_from_host=msg.json_from_host or None, stall_timeout_s=msg.timeout_s or None)


def to_pb_transform_progress(progress: TransformProgress) -> pb.TransformProgress:
    return pb.TransformProgress(**{f.name: getattr(progress, f.name) for f in dataclasses.fields(progress)})


def from_pb_transform_progress(msg: pb.TransformProgress) -> TransformProgress:
    return TransformProgress(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(TransformProgress)})


@functools.cache
def keep_freed_chunk_memory() -> None:
    """Ask glibc to recycle freed multi-MiB buffers instead of returning them to the kernel.

    Every received or sent chunk is a fresh multi-MiB bytes object. By default
    glibc maps each one anew and unmaps it when freed, so every chunk costs a
    page fault (and a page of zeroing) per 4 KiB; measured here, raising the
    thresholds cuts the pulling process's page faults about 20-fold and its
    kernel time about in half. Process-wide and done once; servers and
    clients both call it. Not glibc: nothing to do.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, MAX_CHUNK_BYTES * 4)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pass


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
