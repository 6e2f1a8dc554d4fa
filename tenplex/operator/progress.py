"""The last committed step of a job, as ``status.step`` shows it: read from a node's tensor store.

May import: ``tenplex.store.client``, ``tenplex.errors`` and the standard
library (not the torch integration: the operator's image need not load
torch). Every save writes the training state document, with its step, to
the store of every host of the world, so any node of the job can answer.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import StoreError

# tenplex.integration.versions.STATE_DOC (importing it would load torch); a test keeps the two equal.
STATE_DOC = "tenplex.torch_state"


def store_address(node: Mapping[str, Any], port: int) -> str | None:
    """``INTERNAL_IP:port`` of the node's store (the DaemonSet serves on the host network), or None."""
    for address in (node.get("status") or {}).get("addresses") or []:
        if address.get("type") == "InternalIP" and address.get("address"):
            host = address["address"]
            return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return None


def committed_step(address: str, token: str | None, timeout: float = 3.0) -> int | None:
    """The step of the newest committed version with a training state on the store at ``address``.

    None when nothing was saved yet or the store does not answer: the status
    then keeps the step it had (a store that is down is not the operator's
    error to report).
    """
    doc = committed_state(address, token, timeout)
    return None if doc is None else int(doc["step"])


def committed_state(address: str, token: str | None, timeout: float = 3.0) -> dict[str, Any] | None:
    """The training state document of the newest committed version that has one (see :func:`committed_step`)."""
    from ..store.client import StoreClient

    try:
        with StoreClient(address, token=token, timeout=timeout, retries=0, data_plane=False) as client:
            for version in sorted(client.versions(), reverse=True):
                try:
                    return dict(client.get_json(version, STATE_DOC))
                except StoreError:
                    continue  # a version without a training state (a transform's output): look further back
    except (StoreError, OSError):
        return None
    return None
