"""Fault injection for the test suite: ``TENPLEX_STORE_TEST_HOOKS`` of a store *server process*.

May import: the standard library only.

Comma-separated ``exit_after_chunks=N`` (the process exits abruptly once it
has sent N chunks, simulating a host dying mid-transfer) and
``corrupt_chunks=N`` (the first N chunks get one payload byte flipped after
their checksum was computed, simulating corruption in flight). "Chunks" are
gRPC ReadBox/ReadBoxes/ReadFile chunks and data-plane frames alike, so the
fault tests exercise whichever path carries the bytes. Unset, it costs nothing.
"""

from __future__ import annotations

import os
import threading

ENV = "TENPLEX_STORE_TEST_HOOKS"


class FaultHooks:
    def __init__(self, spec: str):
        values = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
        self.exit_after = int(values.get("exit_after_chunks", 0))
        self.corrupt = int(values.get("corrupt_chunks", 0))
        self.sent = 0
        self.lock = threading.Lock()

    def next_chunk(self) -> bool:
        """Count one chunk about to be sent; exit if the host is due to die; True if it must be corrupted."""
        with self.lock:
            self.sent += 1
            sent = self.sent
        if self.exit_after and sent > self.exit_after:
            os._exit(137)  # a host dying mid-transfer: no cleanup, no goodbye
        return sent <= self.corrupt

    def before_send(self, payload: bytes) -> bytes:
        """A gRPC chunk's encoded bytes, damaged when due (the last byte is payload, so the checksum fails)."""
        return damaged(payload) if self.next_chunk() else payload


def damaged(payload) -> bytes:
    copy = bytearray(payload)
    copy[-1] ^= 0xFF
    return bytes(copy)


def from_environment() -> FaultHooks | None:
    spec = os.environ.get(ENV, "")
    return FaultHooks(spec) if spec else None
