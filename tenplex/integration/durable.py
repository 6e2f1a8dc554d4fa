"""The checkpointer's durable tier: background flushes after saves, and a restore from the bucket when the bucket
holds a newer version than any of the job's hosts.

May import: ``tenplex.durable``, ``tenplex.layout``, ``tenplex.errors``, ``tenplex.store``, this package's
:mod:`.exchange`, :mod:`.layouts`, :mod:`.pieces` and :mod:`.versions`, torch.distributed and the standard
library.

Configured by ``Checkpointer(durable=...)`` or the environment (``tenplex run --durable``, the operator's
``spec.durable``): ``TENPLEX_DURABLE`` = ``s3://BUCKET/PREFIX``; ``TENPLEX_DURABLE_EVERY`` = flush every N-th
version (default 1); ``TENPLEX_DURABLE_EVERY_S`` = or every T seconds; ``TENPLEX_DURABLE_MBPS`` = upload cap
per host in MB/s (default none). The first rank of each host runs its store's :class:`~tenplex.durable.
uploader.Flusher`.

Restore: before the job's hosts look for a version, rank 0 asks the bucket for its newest durable version. When
it is newer than every version the job's hosts hold (all of them lost, or older), the first rank of each host
fetches that host's regions of the new layout into its store as the same version number
(:func:`~tenplex.durable.restore_host`); the restore then goes on as from any local version. A failure on any
host takes the version back on every host. A bucket that does not answer is logged and skipped.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Mapping

import torch.distributed as dist

from ..durable import Bucket, DurableError, DurableVersion, RateLimit, durable_versions, restore_host
from ..durable.uploader import Flusher
from ..errors import ConfigError
from ..layout import Layout, from_dict as layout_from_dict
from ..store import Store
from .exchange import agree, all_gather_json, broadcast_json
from .layouts import check_and_build, specs_of
from .pieces import Piece
from .versions import STATE_DOC

log = logging.getLogger(__name__)


class DurableTier:
    """One rank's view of the job's bucket: starts its host's flusher after saves, restores from the bucket."""

    def __init__(self, url: str, store: Store, every_versions: int = 1, every_s: float | None = None,
                 mbps: float | None = None):
        if every_versions < 0:
            raise ConfigError(f"durable: flush every N versions needs N >= 0 (0: by time only), got {every_versions}")
        self.store = store
        self.bucket = Bucket(url, limit=RateLimit(None if mbps is None else mbps * 1e6))
        self.every_versions, self.every_s = every_versions, every_s
        self.flusher: Flusher | None = None

    @classmethod
    def from_env(cls, url: str | None, store: Store) -> "DurableTier | None":
        env = os.environ
        url = url or env.get("TENPLEX_DURABLE")
        if not url:
            return None
        try:
            every = int(env.get("TENPLEX_DURABLE_EVERY", "1"))
            every_s = float(env["TENPLEX_DURABLE_EVERY_S"]) if env.get("TENPLEX_DURABLE_EVERY_S") else None
            mbps = float(env["TENPLEX_DURABLE_MBPS"]) if env.get("TENPLEX_DURABLE_MBPS") else None
        except ValueError as e:
            raise ConfigError(f"durable tier settings (TENPLEX_DURABLE_EVERY, _EVERY_S, _MBPS): {e}") from None
        return cls(url, store, every, every_s, mbps)

    def saved(self) -> None:
        """A version was committed on this host (called on the host's first rank)."""
        if self.flusher is None:
            self.flusher = Flusher(self.store, self.bucket, every_versions=self.every_versions,
                                   every_s=self.every_s).start()
        self.flusher.notify()

    def wait(self, version: int, timeout: float | None = None) -> bool:
        """Wait until this host's share of ``version`` (or a newer one) is in the bucket; True when it is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.flusher is not None and self.flusher.done < version and self.flusher.state != "stopped":
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return self.flusher is not None and self.flusher.done >= version

    def close(self) -> None:
        if self.flusher is not None:
            self.flusher.close()

    def restore_if_newer(self, host: str, device: str, pieces_for: Callable[[Mapping, dict], list[Piece]],
                         layout: Layout | None, with_optimizer: bool, group) -> int | None:
        """Bring the bucket's newest durable version into the job's stores when no host holds one as new. Collective;
        returns that version, or None when the hosts' own state wins (or the bucket has none). ``pieces_for(saved
        tensors, saved optimizer scalars)`` maps this rank's state to pieces for that version (optimizer state for
        the parameters that had some when saved)."""
        rank = dist.get_rank(group)
        held = all_gather_json({"device": device, "host": host, "versions": self.store.versions()}, group)
        newest_here = max((v for d in held for v in d["versions"]), default=0)
        payload: dict = {"version": None}
        if rank == 0:
            try:
                known = durable_versions(self.bucket)
                if known and known[-1] > newest_here:
                    durable = DurableVersion(self.bucket, known[-1])
                    payload = {"version": known[-1], "layout": durable.saved_layout.to_dict(),
                               "scalars": durable.get_json(STATE_DOC)["scalars"]}
            except DurableError as e:
                log.warning("durable tier: not restoring from the bucket: %s", e)
        src = 0 if group is None else dist.get_global_rank(group, 0)
        payload = broadcast_json(payload, src=src, group=group)
        version = payload["version"]
        if version is None:
            return None
        saved = layout_from_dict(payload["layout"], source=f"durable version {version}")
        pieces = agree("restore: map the state to tensors", lambda: pieces_for(saved.tensors, payload["scalars"]),
                       group)
        boxes = all_gather_json({"tensors": specs_of(pieces), "boxes": [[p.name, list(p.box.offsets),
                                                                         list(p.box.lengths)] for p in pieces]}, group)
        docs = [{**d, **b} for d, b in zip(held, boxes)]
        new = agree("restore: check the new layout",
                    lambda: check_and_build(saved, docs, layout, device, pieces, with_optimizer=with_optimizer), group)
        leader = rank == min(r for r, d in enumerate(docs) if d["host"] == host)
        try:
            agree(f"restore: fetching durable version {version} from {self.bucket.url}",
                  lambda: restore_host(self.bucket, version, new, self.store) if leader else None, group)
        except Exception:
            if leader:  # committed here but not everywhere: take it back, as a failed save does
                self.store.abort(version)
                self.store.delete(version)
            raise
        log.info("restored durable version %d from %s", version, self.bucket.url)
        return version
