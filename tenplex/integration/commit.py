"""Stage a version on every rank, then commit it on every host or on none (blocking saves and restores).

May import: ``tenplex.store``, this package's :mod:`.exchange`, and the standard library.
"""

from __future__ import annotations

from typing import Callable

from ..store import Store
from .exchange import agree


def stage_and_commit(store: Store, group, what: str, version: int, stage: Callable[[], None], parts: list[str],
                     leader: bool) -> None:
    """Every rank runs ``stage``, then the ranks with ``leader`` set (one per host) commit their host's
    ``parts``; a failure anywhere takes the version back on every host and raises on every rank. Collective."""
    try:
        agree(f"{what} (staging version {version})", stage, group)
        agree(f"{what} (committing version {version})",
              lambda: store.commit(version, parts=parts) if leader else None, group)
    except Exception:
        if leader:
            store.abort(version)
            # Committed here but not on every host: take it back, so that no later restore can pick a
            # version that some host lacks (the version number is new, so nothing older is touched).
            store.delete(version)
        raise
