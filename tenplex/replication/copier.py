"""Replica copies on one host: pull them from their origin stores in the background, list and read them.

May import: ``tenplex.store`` (the local store and its client), ``tenplex.layout``,
``tenplex.box``, ``tenplex.errors``, this package's ``plan`` and the standard library.
Never torch: the copies are plain store data.

Format. The copies a host keeps of origin host ``X``'s regions live in their
own store, nested in the host's store directory: ``<root>/replicas/X/``, with
the layout of a store (``versions/<N>/manifest.json`` and shard files,
``staging/``, ``trash/``). A
copy of version ``N`` is committed there like any store version: staged, made
durable, and renamed into ``versions/<N>`` (atomic), so it exists whole or not
at all; the committed directory is the marker that says so. Its manifest lists
every copied region under its *origin* device id and its ``layout`` document
records the same (:func:`tenplex.replication.plan.copy_layout`). The origin's
committed version is never touched.

Pulling. :class:`Replicator` runs in a daemon thread of the host's first rank
after a save committed. It reads each region from the origin host's store
server (``StoreClient.read_box_to``: verified gRPC chunks or data-plane
frames) and writes each chunk straight into the copy's shard file, so its
memory stays at about one chunk (``CHUNK_BYTES``) whatever the state's size.
``cancel()`` stops it between chunks and drops the staged copy.

POSIX. :func:`replica_store` and :func:`held_versions` are the only code that
knows where the copies live (a directory per origin under the host's store
root); everything else reads and writes them through the store's contract
(``versions``, ``open``, ``begin``, ``commit``, ``abort``, ``gc``). The copies
sit on the host store's file system by design: ``promote`` hard-links them
into a version of the host's store. Another backend would give those two
functions a nested store of its own kind (for example a key prefix).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from ..errors import TenplexError
from ..layout import Layout, from_dict as layout_from_dict
from ..store import LAYOUT_DOC, Store, TensorStore, wire
from ..store.manifest import REPLICA_PART
from .plan import Copy, copies, copy_layout

log = logging.getLogger(__name__)

REPLICAS_DIR = "replicas"
CHUNK_BYTES = 4 << 20    # one chunk in flight: the copier's memory bound
PIECE_BYTES = 64 << 20   # one read call


class ReplicationCancelled(TenplexError):
    """The copier was cancelled (a newer save, or the process is exiting)."""


def replica_store(root: str | os.PathLike, origin: str, host: str) -> Store:
    """The store directory in which ``host`` (rooted at ``root``) keeps copies of ``origin``'s regions."""
    return Store(Path(root) / REPLICAS_DIR / origin, host)


def held_versions(root: str | os.PathLike, host: str) -> dict[str, list[int]]:
    """origin host -> versions of which the store of ``host`` (rooted at ``root``) holds committed copies."""
    base = Path(root) / REPLICAS_DIR
    if not base.is_dir():
        return {}
    found = {}
    for entry in sorted(e for e in base.iterdir() if e.is_dir()):
        versions = replica_store(root, entry.name, host).versions()
        if versions:
            found[entry.name] = versions
    return found


def held_layout(root: str | os.PathLike, host: str, origin: str, version: int) -> Layout:
    """The layout of the committed copies of ``origin``'s regions of ``version`` kept here."""
    reader = replica_store(root, origin, host).open(version)
    return layout_from_dict(reader.get_json(LAYOUT_DOC), source=f"copies of {origin}'s version {version}")


class Replicator:
    """Pulls the copies that ``store``'s host keeps of version ``version`` (laid out as ``saved``) in a daemon thread.

    ``replicas`` and ``saved`` give the copies (:func:`tenplex.replication.plan.copies`);
    ``addresses`` maps the origin hosts to their store servers.
    """

    def __init__(self, store: Store, version: int, saved: Layout, replicas: int, addresses: dict[str, str],
                 token: str | None = None, keep: int = 2, timeout: float = 60.0):
        self.store, self.version, self.saved, self.replicas, self.keep = store, version, saved, replicas, keep
        self.addresses, self.token, self.timeout = addresses, token, timeout
        self.copies: list[Copy] = []
        self.state = "pending"
        self.error: str | None = None
        self.bytes = 0
        self.seconds = 0.0
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Replicator":
        self._thread = threading.Thread(target=self._run, name=f"tenplex-replicate-{self.version}", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until done; True when every copy is committed."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.state == "replicated"

    def cancel(self, timeout: float | None = 30.0) -> None:
        """Stop pulling (between chunks) and drop what was staged; returns once the thread ended."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def status(self) -> dict:
        return {"version": self.version, "state": self.state, "copies": len(self.copies), "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "error": self.error}

    def _run(self) -> None:
        started = time.monotonic()
        self.state = "running"
        try:
            # Computed here, not in save(): on a large layout it takes a while.
            self.copies = [c for c in copies(self.saved, self.replicas) if c.holder == self.store.host]
            for origin in sorted({c.origin for c in self.copies}):
                self._pull(origin, [c for c in self.copies if c.origin == origin])
            self.state = "replicated"
        except ReplicationCancelled:
            self.state = "cancelled"
        except Exception as e:  # noqa: BLE001 - reported through status() and wait_replicated()
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            log.warning("replication of version %d to host %s failed: %s", self.version, self.store.host, self.error)
        finally:
            self.seconds = time.monotonic() - started

    def _pull(self, origin: str, mine: list[Copy]) -> None:
        address = self.addresses.get(origin)
        if not address:
            raise TenplexError(f"no store address recorded for host {origin}; cannot copy its regions")
        target_store = replica_store(self.store.root, origin, self.store.host)
        if self.version in target_store.versions():
            return  # committed by an earlier attempt: copies are immutable
        target_store.abort(self.version)  # leftovers of an interrupted earlier attempt
        try:
            self._fill(target_store, address, mine)
        except BaseException:
            target_store.abort(self.version)  # nothing of a failed or cancelled copy stays
            raise
        target_store.gc(self.keep)

    def _fill(self, target_store: TensorStore, address: str, mine: list[Copy]) -> None:
        from ..store.client import StoreClient  # grpc: loaded only where copies are pulled

        with StoreClient(address, token=self.token, timeout=self.timeout, chunk_bytes=CHUNK_BYTES,
                         peer_host=self.store.host) as client, \
                target_store.begin(self.version, part=REPLICA_PART) as writer:
            for c in mine:
                try:
                    self._copy(client, writer, c)
                except OSError as e:
                    if e.filename is not None or e.errno is None:
                        raise
                    # a full disk says only "No space left on device": name the copy and where it goes
                    raise OSError(e.errno, f"{e.strerror} while copying {c.tensor!r} {c.box} of {c.device} "
                                           f"(version {self.version} of host {c.origin}) into",
                                  str(getattr(target_store, "root", target_store))) from e
            if self._cancel.is_set():
                raise ReplicationCancelled(f"replication of version {self.version} was cancelled")
            writer.put_layout(copy_layout(self.saved, mine))
            writer.commit()

    def _copy(self, client, writer, c: Copy) -> None:
        """Pull region copy ``c`` into a new shard of ``writer``, chunk by chunk."""
        spec = self.saved.tensors[c.tensor]
        target = writer.create(c.device, c.tensor, c.box, spec.dtype, spec.shape)

        def sink(sub, data, digest):
            if self._cancel.is_set():
                raise ReplicationCancelled(f"replication of version {self.version} was cancelled")
            target.write(sub, data, digest)

        for piece in wire.split_box(c.box, spec.itemsize, PIECE_BYTES):
            self.bytes += client.read_box_to(self.version, c.device, c.tensor, piece, spec.itemsize, sink,
                                             digests=True)
