"""Errors as gRPC statuses: which status code a failure of the store service becomes, with what message.

May import: grpc, ``tenplex.errors``, this package's ``manifest`` and ``streams`` (their error types), and the
standard library.

An INTERNAL status is a bug or an unexpected system error (an EBADF, say): the caller sees only its message,
so :func:`describe` logs it with its traceback in the server's log.
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging

import grpc

from ..errors import TenplexError
from .manifest import AlreadyCommitted, Conflict, CorruptShard
from .streams import Busy

log = logging.getLogger("tenplex.store.server")  # the server's log, where its operators look

def status_of(exc: BaseException) -> grpc.StatusCode:
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


def message_of(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, TenplexError) else f"{type(exc).__name__}: {text}"


def describe(exc: BaseException, call: str) -> tuple[grpc.StatusCode, str]:
    """(status, message) of a failed ``call``. An INTERNAL one is a bug or an unexpected system error (say
    EBADF): the caller sees only its message, so its traceback goes to this server's log."""
    status = status_of(exc)
    if status == grpc.StatusCode.INTERNAL:
        log.error("%s failed with INTERNAL: %s", call, message_of(exc), exc_info=exc)
    return status, message_of(exc)


def guard(method):
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
