"""The store addresses a save records, and which recorded stores still answer.

May import: ``tenplex.store`` (client), ``tenplex.errors`` and the standard library.

Every saved version carries the JSON document ``tenplex.stores``
(:data:`STORES_FORMAT`)::

    {"format": "tenplex.stores/1", "version": 7, "stores": {"h0": "10.0.0.5:7070", "h1": null},
     "replicas": 1, "ring": ["h0", "h1"]}

``version`` is the version the save wrote; ``stores`` maps every host of it
to its store server's address as its ranks knew it (``null``: unknown);
``replicas`` is the number of copies the replication rule asked for (0: none)
and ``ring`` its host order. A version a restore made (transformed, or put
together from copies) carries the document of the saved version it came from,
so its ``version`` differs: such versions are not copied. A
restore reaches a host that left the job through this record, after checking
that the address still answers as that host's store and still holds the version.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

STORES_DOC = "tenplex.stores"
STORES_FORMAT = "tenplex.stores/1"
PROBE_TIMEOUT_S = 3.0


def stores_doc(version: int, addresses: Mapping[str, str | None], replicas: int, ring: list[str]) -> dict:
    return {"format": STORES_FORMAT, "version": int(version),
            "stores": {h: addresses.get(h) for h in sorted(addresses)},
            "replicas": int(replicas), "ring": list(ring)}


def replicas_of(doc: dict | None, version: int) -> int | None:
    """Copies the rule asked for when ``version`` was saved (0 without a record); None: a restore made it."""
    if doc is None:
        return 0
    return int(doc["replicas"]) if doc.get("version") == version else None


def answering(candidates: Mapping[str, str], version: int, token: str | None = None,
              timeout: float = PROBE_TIMEOUT_S) -> dict[str, str]:
    """The hosts among ``candidates`` (host -> address) whose store answers as that host and holds ``version``."""
    return {h: a for h, (a, versions) in held_by(candidates, token, timeout).items() if version in versions}


def held_by(candidates: Mapping[str, str], token: str | None = None,
            timeout: float = PROBE_TIMEOUT_S) -> dict[str, tuple[str, list[int]]]:
    """host -> (address, its versions) of the ``candidates`` (host -> address) whose store answers as that host."""
    from ..store.client import StoreClient  # grpc: loaded only when some host of a version left the job

    def probe(item: tuple[str, str]) -> tuple[str, tuple[str, list[int]]] | None:
        host, address = item
        try:
            with StoreClient(address, token=token, timeout=timeout) as client:
                health = client.health(timeout=timeout)
        except Exception:  # noqa: BLE001 - a store that does not answer is simply not a source
            return None
        return (host, (address, [int(v) for v in health["versions"]])) if health["host"] == host else None

    items = sorted((h, a) for h, a in candidates.items() if a)
    if not items:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
        return dict(found for found in pool.map(probe, items) if found is not None)
