"""Shared-token authentication of store calls: ``authorization: Bearer TOKEN`` metadata on every call.

May import: grpc and the standard library.
"""

from __future__ import annotations

import hmac

import grpc

# A kubelet gRPC probe sends no metadata: the standard health check answers without the token (it tells
# only SERVING or NOT_SERVING).
PUBLIC_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


class TokenCheck(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        presented = dict(details.invocation_metadata or ()).get("authorization", "")
        if handler is None or details.method in PUBLIC_METHODS \
                or hmac.compare_digest(str(presented).encode(), self._expected):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong store token (send metadata 'authorization: Bearer TOKEN')")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
