"""The store's contract: what every store backend offers, in which order it is called, and what it promises.

May import: numpy, ``tenplex.box``, ``tenplex.layout``, this package's ``manifest`` and ``target`` (for
types) and the standard library.

The transform host and the integration's shard I/O need only these protocols;
``local.Store``, one directory of safetensors files per host, is the one
implementation today. The store server and replication rely on it being POSIX
on purpose (the server serves its host's files; replication hard-links copies
kept in nested store directories): their module docstrings say what they use
beyond the contract. The order of calls follows DCP's
``StorageWriter``/``StorageReader``:

Writing one version (several writers, e.g. one per worker, may stage parts of it)::

    w = store.begin(version, part)        # StoreWriter; nothing is visible to readers
    w.put(...) / w.create(...).write(...) / w.allocate(...)    # any number of shards
    w.put_json(name, doc); w.put_layout(layout)                # version-level documents
    w.prepare()                           # the part is durable; anyone may now commit it
    store.commit(version, parts)          # atomic: exactly the named prepared parts, or nothing
    # before commit, w.abort() drops one part and store.abort(version) every staged part
    # (w.commit() is prepare() + store.commit(version) for a version's only writer)

Reading a committed version::

    store.versions() / store.latest()
    r = store.open(version)               # StoreReader of exactly that version, NotFound if there is none
    r.find / r.read / r.readinto(device, tensor, box, buffer)  # every byte verified against its checksums
    r.get_json(name) / r.json_names() / r.layout() / r.verify(); r.close()
    store.delete(version); store.gc(keep)

Promises every backend keeps: a version is visible whole or not at all (a
crash at any moment leaves every committed version complete); a reader reads
only the version it opened, never a mix; every read is verified and raises
``CorruptShard`` rather than return wrong bytes; committing a version number
twice raises ``AlreadyCommitted`` (of processes committing one version at once,
exactly one wins); no process waits for another, so one stopped or hung in the
middle of an operation blocks no other's commit, delete or gc.

``local.Store`` commits by renaming a complete, fsynced directory (hard links
to the staged files and the manifest) into ``versions/`` only if the version is
not there (one atomic ``renameat2(RENAME_NOREPLACE)``). A backend without atomic rename, such as an
object store, keeps the same promise as orbax does with a commit marker:
``prepare`` uploads the part's shard objects and then its part document;
``commit`` merges the part documents into the version's manifest and writes
that manifest *last*, as one small object (a single PUT is atomic), and the
manifest is the marker; ``versions()`` lists, and ``open`` accepts, only
versions whose manifest exists, so a commit that crashed halfway leaves
objects that no reader sees and that ``gc`` deletes; ``delete`` removes the
manifest first. Such a backend lacks the optional capabilities below; the
transform host then copies kept shards instead of linking them, and the data
plane (``dataplane``) is not offered, so remote reads travel over gRPC.

Optional capabilities (check with ``isinstance``; all are ``runtime_checkable``):

- :class:`LinkingWriter`: ``link`` makes a committed shard of the same store, or
  a contiguous run of its bytes (a slice row), a shard of the new version
  without copying a byte (POSIX hard links).
- :class:`FileBackedReader`: shards are local files, so a region is read as
  runs of bytes of its file (the data plane and the server's ``ReadBox``
  verify each run and send it without an intermediate array) and a file can
  be hard-linked.
- :class:`SpaceReportingStore`: ``free_bytes()``, the room left for new shards
  (a file system's free space), so that the server can refuse a shard that
  cannot fit before any of its data arrives. A store without a fixed capacity
  (an object store) does not offer it; its writes fail on their own.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from ..box import Box
from ..layout import Layout
from .manifest import ShardEntry
from .target import ShardTarget


@runtime_checkable
class StoreReader(Protocol):
    """One committed version on one host: its shards (read with verification) and its JSON documents."""

    @property
    def version(self) -> int: ...

    @property
    def host(self) -> str: ...

    @property
    def entries(self) -> Sequence[ShardEntry]:
        """Every stored shard of the version, in manifest order."""

    def devices(self) -> list[str]: ...

    def entries_of(self, device: str) -> list[ShardEntry]: ...

    def layout_shards(self, device: str) -> list[tuple[str, Box, str]]:
        """(tensor, box, dtype) of every shard ``device`` stores."""

    def find(self, device: str, tensor: str, box: Box) -> ShardEntry:
        """The stored shard of ``device`` whose box contains ``box`` (``NotFound``/``OutOfRange`` otherwise)."""

    def region(self, entry: ShardEntry, box: Box) -> np.ndarray:
        """Region ``box`` (global coordinates, inside ``entry.box``) of a stored shard, verified."""

    def read(self, device: str, tensor: str, box: Box) -> np.ndarray:
        """Region ``box`` of ``device``'s shard of ``tensor``, verified."""

    def readinto(self, device: str, tensor: str, box: Box, dest: Any) -> None:
        """The same region written into ``dest``: a writable buffer of its C-order bytes, or a writable numpy
        array of ``box``'s shape and the stored item size with any strides (say a column block of a larger
        tensor: ``shardio`` restores into parameters in place this way)."""

    def verify(self) -> list[str]:
        """Check every stored byte; describe each shard that does not match (empty: all good)."""

    def json_names(self) -> list[str]: ...

    def get_json(self, name: str) -> Any: ...

    def layout(self) -> Layout:
        """The whole layout recorded with ``StoreWriter.put_layout``."""

    def close(self) -> None: ...


@runtime_checkable
class StoreWriter(Protocol):
    """One part of a version being staged. A context manager: an exception inside aborts the part, and
    leaving the block without ``prepare`` or ``commit`` aborts it too."""

    @property
    def version(self) -> int: ...

    @property
    def part(self) -> str: ...

    def __enter__(self) -> StoreWriter: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...

    def put(self, device: str, tensor: str, box: Box, array: np.ndarray, dtype: str,
            shape: tuple[int, ...] | None = None) -> None:
        """Store a complete shard: ``array.shape == box.lengths`` (bfloat16 as its uint16 bits)."""

    def create(self, device: str, tensor: str, box: Box, dtype: str, shape: tuple[int, ...] | None = None,
               reserve: bool = True) -> ShardTarget:
        """A new zero-filled shard to fill region by region (from any thread) before ``prepare``."""

    def allocate(self, device: str, tensor: str, box: Box, dtype: str,
                 shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A new zero-filled shard as a writable array, filled in place before ``prepare``."""

    def discard(self, target: ShardTarget) -> None:
        """Forget a shard from ``create`` that could not be filled; its box may be written again."""

    def put_json(self, name: str, doc: Any) -> None: ...

    def put_layout(self, layout: Layout) -> None: ...

    def prepare(self) -> None:
        """Make the part durable; from then on ``TensorStore.commit`` may publish it."""

    def commit(self) -> None:
        """``prepare`` and publish the version with every prepared part (for a version's only writer)."""

    def abort(self) -> None:
        """Forget this part; the version's other parts are untouched."""


@runtime_checkable
class FileBackedReader(StoreReader, Protocol):
    """A reader whose shards are local files: byte spans to read as runs of a file, files to hard-link."""

    @staticmethod
    def byte_span(entry: ShardEntry, box: Box) -> tuple[int, int, tuple[int, ...]]:
        """(first data byte, bytes up to the last element, byte strides) of region ``box`` in the shard file."""

    def shard_file(self, entry: ShardEntry) -> Any:
        """The verified reader of one shard file (``shardfile.ShardFile``), for callers that stream its bytes."""

    def link_file(self, entry: ShardEntry, dest: Path) -> None:
        """Hard-link the shard file of ``entry`` to ``dest`` (same file system)."""


@runtime_checkable
class LinkingWriter(StoreWriter, Protocol):
    """A writer that can reuse a committed shard of the same store without copying it."""

    def link(self, device: str, reader: FileBackedReader, entry: ShardEntry, box: Box | None = None) -> None:
        """Make ``entry`` (a shard of ``reader``'s version, in this store) ``device``'s shard of this part; with
        ``box``, only that region of it, which must be one contiguous run of its bytes (a slice row)."""


@runtime_checkable
class TensorStore(Protocol):
    """One host's versioned tensor store (see the module docstring for the order of calls)."""

    @property
    def host(self) -> str: ...

    def versions(self) -> list[int]:
        """Committed versions, ascending."""

    def latest(self) -> int | None: ...

    def open(self, version: int) -> StoreReader: ...

    def begin(self, version: int, part: str | None = None) -> StoreWriter: ...

    def staged_parts(self, version: int) -> list[str]:
        """Names of the prepared parts of a staged version."""

    def commit(self, version: int, parts: list[str] | None = None) -> None:
        """Publish ``version`` atomically from its prepared parts (all of them, or exactly ``parts``)."""

    def abort(self, version: int) -> None:
        """Drop everything staged for ``version``; committed versions are untouched."""

    def delete(self, version: int) -> bool: ...

    def gc(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` versions and every leftover of interrupted writes."""


@runtime_checkable
class SpaceReportingStore(TensorStore, Protocol):
    """A store of bounded capacity that can say how many bytes new shards may still take."""

    def free_bytes(self) -> int:
        """Bytes that new shards may still take (for the POSIX store: free space on its file system)."""
