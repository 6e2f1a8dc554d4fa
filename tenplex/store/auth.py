"""Shared-token authentication of store calls: ``authorization: Bearer TOKEN`` metadata on every call.

May import: grpc and the standard library.

The check runs on the call's metadata, before any byte of its request is read:
gRPC Python reads (and buffers whole) the request of a unary method before it
calls the handler, so a refused call is answered by a request-streaming handler
that never reads. A client cannot tell: on the wire a unary request is a
stream of one message.
"""

from __future__ import annotations

import hmac

import grpc

_DENIED = "missing or wrong store token (send metadata 'authorization: Bearer TOKEN')"


def _deny(request_iterator, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)


class TokenCheck(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        presented = dict(details.invocation_metadata or ()).get("authorization", "")
        if handler is None or hmac.compare_digest(str(presented).encode(), self._expected):
            return handler
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_deny)
        return grpc.stream_unary_rpc_method_handler(_deny)
