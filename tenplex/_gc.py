"""Pause Python's cyclic garbage collector around allocation-heavy pure computations.

May import: the standard library only. Planning a 1,024-device layout creates
hundreds of thousands of small, acyclic objects; every generation-2 pass walks
all of them, which costs about 40 % of the run time. Reference counting still
frees everything; only cycle detection waits until the block ends.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_pauses = 0  # blocks inside paused_gc now, in any thread
_was_enabled = False  # whether the collector ran before the first of them


@contextmanager
def paused_gc() -> Iterator[None]:
    """The collector is off inside; on again when the last block of any thread ends, if it was on before the
    first began (gc.disable is process-wide: a store decodes requests in several threads at once)."""
    global _pauses, _was_enabled
    with _lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()
