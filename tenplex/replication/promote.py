"""Stage a version that puts a saved version's surviving shards and the copies of lost hosts' regions together.

May import: ``tenplex.store``, ``tenplex.layout``, ``tenplex.devices``, this package's
``copier`` and the standard library.

When a host of a saved version N is lost, each surviving host stages version
M (newer than every version of the job) from hard links only: its own shards
of N under their device ids, and the copies it holds of the lost hosts'
regions of N under the copy devices of the source layout
(:func:`tenplex.replication.plan.assemble`). M carries N's JSON documents and
the source layout, and is committed on every surviving host or on none, like a
save. No byte is copied and N and the copies stay as they were; M is then read
or transformed like any version, so a restore never mixes versions.

POSIX: this needs the local ``Store``. Its writers link (the contract's
``LinkingWriter``, reading through a ``FileBackedReader``), and the copies
are a store nested in the host's store directory (``copier.replica_store``),
on the same file system, so that they can be linked. A backend without links
would copy each shard here instead (``StoreReader.region`` into
``StoreWriter.put``), as the transform host does for kept shards.
"""

from __future__ import annotations

from ..devices import host_of
from ..layout import Layout
from ..store import LAYOUT_DOC, Store
from ..store.manifest import PROMOTE_PART
from .copier import replica_store


def stage(store: Store, saved_version: int, new_version: int, source: Layout,
          replica_devices: dict[str, tuple[str, str]]) -> None:
    """Stage and prepare this host's part of ``new_version`` (commit with
    ``store.commit(new_version, [PROMOTE_PART])``)."""
    reader = store.open(saved_version)
    store.abort(new_version)  # leftovers of an interrupted earlier attempt
    with store.begin(new_version, part=PROMOTE_PART) as writer:
        for entry in reader.entries:
            if entry.device in source.devices:
                writer.link(entry.device, reader, entry)
        for device, (holder, origin_device) in sorted(replica_devices.items()):
            if holder != store.host:
                continue
            copies = replica_store(store.root, host_of(origin_device), store.host).open(saved_version)
            for entry in copies.entries_of(origin_device):
                writer.link(device, copies, entry)
        for name in reader.json_names():
            if name != LAYOUT_DOC:
                writer.put_json(name, reader.get_json(name))
        writer.put_layout(source)
        writer.prepare()
