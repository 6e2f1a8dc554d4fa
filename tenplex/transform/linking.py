"""Which old shard of this host a new shard can be hard-linked to: whole, or as a slice (a contiguous run of its
bytes), preferring files that other slices of the same change already use.

May import: ``tenplex.store`` (its contract), ``tenplex.transfer_plan``, ``tenplex.layout``, ``tenplex.box``,
``tenplex.devices``, ``tenplex.errors`` and the standard library.
"""

from __future__ import annotations

from ..box import Box
from ..devices import host_of
from ..errors import StoreError
from ..layout import Layout
from ..store import FileBackedReader, ShardEntry
from ..transfer_plan import Transfer


def linkable(host: str, fills: list[Transfer], box: Box, reader: FileBackedReader, old: Layout,
              sliced: set[str]) -> ShardEntry | None:
    """The old shard to hard-link when one old-version transfer from this host fills the whole new ``box``: an old
    shard of this host whose box is ``box`` (the planned source's first); else, for a slice, an old shard of this
    host with block checksums of which ``box`` is one contiguous run of bytes. Any replica on this host holds the
    same bytes: one whose file other slices already use (``sliced``) comes first, then the planned source's, so
    that a change which shards replicas (ZeRO, FSDP) keeps one file per region and the old version's other files
    are freed with it. None otherwise."""
    if len(fills) != 1:
        return None
    t = fills[0]
    if t.source != "old" or host_of(t.src) != host or t.box != box or box.is_empty():
        return None
    try:
        planned = reader.find(t.src, t.tensor, box)
    except StoreError:
        return None

    def sliceable(entry: ShardEntry) -> bool:  # block checksums, and ``box`` one contiguous run of its bytes
        return entry.blocks is not None and box.is_run_of(entry.box)

    if planned.box == box or (planned.file in sliced and sliceable(planned)):
        return planned  # without looking for replicas
    replicas = [planned] + _replicas_here(host, reader, old, t.src, t.tensor, box)
    whole = next((e for e in replicas if e.box == box), None)
    if whole is not None:
        return whole
    runs = [e for e in replicas if sliceable(e)]
    return next((e for e in runs if e.file in sliced), runs[0] if runs else None)


def _replicas_here(host: str, reader: FileBackedReader, old: Layout, device: str, tensor: str,
                   box: Box) -> list[ShardEntry]:
    """The stored old shards of ``tensor`` containing ``box`` on this host's devices other than ``device``: the
    old layout's index of the tensor says which devices hold one (as for replica fallback), the reader finds them."""
    found = []
    for other, held in old.shards_of(tensor):
        if other != device and host_of(other) == host and held.contains(box):
            try:
                found.append(reader.find(other, tensor, box))
            except StoreError:
                pass
    return found
