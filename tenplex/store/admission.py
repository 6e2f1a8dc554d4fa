"""How the store server receives requests: one message-size limit per method, and bounded request reads.

May import: grpc, protobuf, this package's ``streams`` and ``wire``, and the standard library.

gRPC Python reads the request of a unary method, whole, on a server thread
before it calls the handler: a client that trickles its request, or many of
them, would hold every thread. So every handler is registered
request-streaming (the wire format is the same: a unary request is a stream
of one message) and reads its one message here, in a slot (``streams``):
bulk methods in a bulk-stream slot, every other one in one of
``CONTROL_THREADS // 2`` request slots (waiting up to ``SLOT_WAIT_S`` for
one), so half the control threads always stay free. A request that does not
arrive within the idle limit is cancelled.

gRPC's own size limit is one for all methods (the largest, a Transform
request's, 1 GiB), and gRPC buffers a request whole before the handler sees
it: a request beyond its method's limit (:data:`LIMITS`) is refused
(RESOURCE_EXHAUSTED) before it is parsed, not before it is buffered. Only
callers with the token get that far (``auth`` refuses the others unread).
"""

from __future__ import annotations

from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from . import wire
from .streams import Busy, StreamLimits

# A request usually arrives with its call: a slot is held for microseconds, but a burst of calls (hundreds at once)
# finds them all taken for a moment. Waiting this long for one keeps the burst from being refused; a request
# that stalls holds its slot until the idle limit, so beyond the slots stalled calls are refused after it.
SLOT_WAIT_S = 1.0
_SMALL = 1 << 20  # names, a box, a path: a control or read request is a few hundred bytes
# The largest serialized request each method accepts. Transform carries both whole layouts, PutJson may carry a
# whole layout document (put_layout): up to wire.MAX_MESSAGE_BYTES, gRPC's limit for all. A WriteShard message
# is one chunk and its box. A ReadBoxes request names at most MAX_READ_REGIONS regions.
LIMITS = {
    "Transform": wire.MAX_MESSAGE_BYTES,
    "PutJson": wire.MAX_MESSAGE_BYTES,
    "WriteShard": wire.MAX_CHUNK_BYTES + _SMALL,
    "ReadBoxes": 16 << 20,
}


def limit_of(method: str) -> int:
    return LIMITS.get(method, _SMALL)


def too_large(method: str, nbytes: int) -> str | None:
    """Why a request of ``nbytes`` serialized bytes is refused for ``method``, or None."""
    limit = limit_of(method)
    if nbytes <= limit:
        return None
    return f"{method} request of {nbytes} bytes refused: this method accepts at most {limit}"


def parse(method: str, message_type, raw: bytes, context):
    """``raw`` parsed as ``message_type``; the call aborted when it is too large or not a valid message."""
    problem = too_large(method, len(raw))
    if problem is not None:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, problem)
    try:
        return message_type.FromString(raw)
    except DecodeError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: not a valid request message ({e})")


def read_one(method: str, message_type, requests, context, slots: StreamLimits):
    """The one request message of a unary method, read in a slot of ``slots`` (cancelled after its idle limit)."""
    try:
        with slots.slot(context, f"reading a {method} request", wait_s=SLOT_WAIT_S):
            raw = next(requests, None)
    except Busy as e:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    if raw is None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method} requires exactly one request message")
    assert raw is not None  # context.abort raised
    return parse(method, message_type, raw, context)


def unary_request(method: str, message_type, behaviour: Callable, slots: StreamLimits, streaming: bool):
    """A request-streaming handler function that reads one message, then runs ``behaviour(request, context)``."""
    if streaming:
        def stream(requests, context):
            yield from behaviour(read_one(method, message_type, requests, context, slots), context)
        return stream

    def unary(requests, context):
        return behaviour(read_one(method, message_type, requests, context, slots), context)
    return unary


def stream_request(method: str, message_type, behaviour: Callable):
    """A request-streaming handler function that runs ``behaviour(messages, context)`` on the parsed messages,
    each checked against ``method``'s limit (the stream's own slot bounds how long it may take)."""
    def handle(requests, context):
        return behaviour((parse(method, message_type, raw, context) for raw in requests), context)
    return handle
