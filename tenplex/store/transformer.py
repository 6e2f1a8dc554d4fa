"""What the store's ``Transform`` RPC hands its transformer, and what the transformer reports back.

May import: ``tenplex.layout``, ``tenplex.transfer_plan``, ``tenplex.errors``, this package's ``contract``
(for types) and the standard library. No protobuf:
``wire`` converts these values to and from the gRPC messages, on the server
and on the client, and nothing else sees the messages.

The store sits below the transform layer, so the contract lives here: the
server (``server.serve(transformer=...)``) runs any :class:`Transformer`, and
``tenplex.transform.host.run_host_part`` is the one the CLI passes. The
coordinator sends a :class:`TransformRequest` per destination host through
``StoreClient.transform`` and receives that host's :class:`TransformProgress`
stream; the last message, with ``done`` set, is the host's result.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from ..errors import ConfigError
from ..layout import Layout
from ..transfer_plan import Plan

if TYPE_CHECKING:
    from .contract import TensorStore

COUNTERS = ("bytes_total", "kept_bytes", "linked_bytes", "sliced_bytes", "local_bytes", "remote_bytes",
            "refetched_bytes")


@dataclass(frozen=True)
class TransformRequest:
    """One destination host's part of a transformation.

    ``plan`` may hold only this host's transfers. ``old_layout`` says where the
    replicas of the old version live (for re-fetches), ``new_layout`` which
    shards to create. ``peers`` maps every host to its store address. ``None``
    means the transformer's default: ``streams`` (concurrent pulls),
    ``chunk_bytes`` (gRPC chunk size), ``json_from_host`` (the host whose old
    JSON documents to carry over; this host) and ``stall_timeout_s`` (seconds a
    pull may deliver nothing before its source counts as failed).
    """

    host: str
    old_version: int
    new_version: int
    plan: Plan
    old_layout: Layout
    new_layout: Layout
    peers: Mapping[str, str] = field(default_factory=dict)
    streams: int | None = None
    chunk_bytes: int | None = None
    json_from_host: str | None = None
    stall_timeout_s: float | None = None

    def __post_init__(self) -> None:
        # Checked here, where the API and the Transform RPC meet: a count below 1 (streams -2 divided by zero
        # deep in the host's schedule) or a timeout that is not positive.
        for name in ("streams", "chunk_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"transform request for host {self.host}: {name} must be an integer >= 1 "
                                  f"(or unset: the default), got {value!r}")
        if self.stall_timeout_s is not None and not self.stall_timeout_s > 0:
            raise ConfigError(f"transform request for host {self.host}: stall_timeout_s must be > 0 seconds (or "
                              f"unset: the default), got {self.stall_timeout_s!r}")


@dataclass(frozen=True)
class TransformProgress:
    """Bytes of one host's part so far: done of total, and how they got there (kept in place, hard-linked,
    copied within the host, pulled from other hosts, pulled again from a replica after a failure).
    ``sliced_bytes`` are the part of ``linked_bytes`` linked as slices of a file (read once to verify them,
    never written). ``done`` marks the final message: the part is prepared."""

    bytes_done: int = 0
    bytes_total: int = 0
    kept_bytes: int = 0
    linked_bytes: int = 0
    sliced_bytes: int = 0
    local_bytes: int = 0
    remote_bytes: int = 0
    refetched_bytes: int = 0
    done: bool = False

    def counts(self) -> dict[str, int]:
        """The byte counts of a host in the coordinator's report."""
        return {name: getattr(self, name) for name in COUNTERS}


class Transformer(Protocol):
    """Runs one host's part on that host's store: stages ``request.new_version`` and prepares it (the
    coordinator commits). Calls ``progress`` from any thread, at least every second while it works (the
    coordinator's heartbeat); stops early when ``cancelled`` is set; pulls from peers with ``token`` and
    ``root_certificates``. Returns the final counters."""

    def __call__(self, store: TensorStore, request: TransformRequest, progress: Callable[[TransformProgress], None],
                 cancelled: threading.Event | None = None, token: str | None = None,
                 root_certificates: bytes | None = None) -> TransformProgress: ...
