"""Every error says whether retrying can help (tenplex.errors), including causes that crossed gRPC."""

from __future__ import annotations

import grpc
import pytest

from tenplex.errors import (BoxError, ConfigError, LayoutError, PermanentError, PlanError, StoreError, TemporaryError,
                            TenplexError, TransformError, is_retryable)
from tenplex.integration.nontensor import StateMismatchError
from tenplex.store.client import RemoteStoreError
from tenplex.store.dataplane import DataPlaneError
from tenplex.store.statuses import status_of as _status_of


@pytest.mark.parametrize("error", [BoxError, ConfigError, LayoutError, PlanError, StateMismatchError])
def test_errors_in_the_input_are_permanent(error):
    assert issubclass(error, PermanentError) and not is_retryable(error("x"))


def test_builtins_keep_their_meaning():
    assert is_retryable(ConnectionResetError()) and is_retryable(TimeoutError())
    assert not is_retryable(KeyError("bug")) and not is_retryable(StoreError("missing shard"))
    assert is_retryable(TemporaryError("store not up yet"))
    assert issubclass(ConfigError, ValueError) and issubclass(StoreError, RuntimeError)


@pytest.mark.parametrize("code, retryable", [("UNAVAILABLE", True), ("DEADLINE_EXCEEDED", True),
                                             ("RESOURCE_EXHAUSTED", True), ("ABORTED", True),
                                             ("NOT_FOUND", False), ("FAILED_PRECONDITION", False),
                                             ("INTERNAL", False), ("INVALID_ARGUMENT", False)])
def test_store_errors_are_retryable_by_status(code, retryable):
    assert RemoteStoreError("x", getattr(grpc.StatusCode, code)).retryable is retryable
    assert DataPlaneError("x", code).retryable is retryable
    assert is_retryable(RemoteStoreError("x", None)) is False


def test_a_transformation_is_retryable_only_when_every_cause_is():
    down = RemoteStoreError("store down", grpc.StatusCode.UNAVAILABLE)
    lost = TransformError("no surviving replica")
    assert TransformError("t", {"h0": down, "h1": ConnectionResetError()}).retryable
    assert not TransformError("t", {"h0": down, "h1": lost}).retryable
    assert not TransformError("t").retryable
    assert isinstance(TransformError("t", {"h0": down}).failures["h0"], RemoteStoreError)


def test_the_server_keeps_the_retry_meaning_in_its_status():
    class Restarting(TemporaryError):
        pass

    assert _status_of(Restarting("peer restarting")) == grpc.StatusCode.UNAVAILABLE
    assert _status_of(TransformError("no surviving replica")) == grpc.StatusCode.FAILED_PRECONDITION
    assert _status_of(TenplexError("x")) == grpc.StatusCode.FAILED_PRECONDITION
