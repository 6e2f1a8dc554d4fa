"""One reused buffer per thread and purpose, never zero-filled.

May import: numpy and the standard library.

A fresh ``bytearray`` is zero-filled, and on a machine that backs memory on
first touch it is page-faulted as well: one per shard file, block or region
cost more than hashing the data it held. Each purpose keeps its own slot (a
``threading.local``), because one thread can hold several at once: a local
copy's slab while the shard file reads through its piece buffer and a tally
reads a block back.
"""

from __future__ import annotations

import threading

import numpy as np


def thread_buffer(slot: threading.local, nbytes: int, minimum: int = 0) -> memoryview:
    """The first ``nbytes`` of this thread's buffer in ``slot`` (grown to at least ``max(nbytes, minimum)``)."""
    buffer = getattr(slot, "buffer", None)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = slot.buffer = memoryview(np.empty(max(nbytes, minimum), np.uint8))
    return buffer[:nbytes]
