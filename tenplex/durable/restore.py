"""Restoring a durable version from the bucket into this host's store, in any layout.

May import: numpy, xxhash, ``tenplex.store`` (its local store, manifest rows and errors),
``tenplex.share_planner``, ``tenplex.layout``, ``tenplex.box``, ``tenplex.devices``, ``tenplex.dtypes``,
this package's ``bucket`` and ``flush``, and the standard library.

The bucket is one more source for the planner: its manifest is a layout in which device ``durable/0``
(on host ``durable``) holds every region of the version. Each host plans only its own share of the change
from that layout to the new one (``share_planner.plan_for`` with its devices: time and memory grow with the
host's share, not with the job): each region crosses to the host once and fans out there (``"from":
"new"``). Each host fetches the transfers of its share, by ranged reads
of the blocks that hold them (``Bucket.get_ranges``, concurrently), checks every block against the
manifest's digest before a byte of it is used (``CorruptShard`` otherwise: a damaged object is never
restored), and commits the new shards as the same version number in its store, with the version's
JSON documents and the new layout. A restore then reads them as it reads any local version.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from ..box import Box
from ..devices import host_of
from ..dtypes import itemsize, numpy_storage
from ..layout import Layout, Shard, from_dict as layout_from_dict
from ..share_planner import plan_for
from ..store import Store
from ..store.manifest import LAYOUT_DOC, MANIFEST_FORMAT, CorruptShard, ShardEntry
from .bucket import Bucket, DurableError
from .flush import DURABLE_DEVICE, version_key

DURABLE_DOC = "tenplex.durable"   # in a restored version: where it came from
RESTORE_PART = "durable"          # the store part a host's restored shards are staged in
SKIP_DOCS = {LAYOUT_DOC, "tenplex.stores"}  # replaced by the new layout; the old job's store addresses


class DurableVersion:
    """One durable version in the bucket: its manifest, layout on ``durable/0`` and verified region reads."""

    def __init__(self, bucket: Bucket, version: int):
        self.bucket, self.version = bucket, int(version)
        key = version_key(version, "manifest.json")
        try:
            doc = json.loads(bucket.get(key))
            if doc.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
            self.entries = [(ShardEntry.from_dict(row), int(row["data_offset"])) for row in doc["shards"]]
            self.json = dict(doc["json"])
        except (ValueError, KeyError, TypeError) as e:
            raise DurableError(f"{bucket.url}: {key} is damaged ({type(e).__name__}: {e})") from None
        self.saved_layout = layout_from_dict(self.get_json(LAYOUT_DOC), source=f"durable version {version}")
        self.layout = Layout.build(self.saved_layout.tensors,
                                   {DURABLE_DEVICE: [Shard(e.tensor, e.box) for e, _ in self.entries]})

    def get_json(self, name: str):
        if name not in self.json:
            raise DurableError(f"{self.bucket.url}: durable version {self.version} has no JSON document {name!r}")
        return json.loads(self.bucket.get(version_key(self.version, self.json[name])))

    def _entry(self, tensor: str, box: Box) -> tuple[ShardEntry, int]:
        for entry, offset in self.entries:
            if entry.tensor == tensor and entry.box.contains(box):
                return entry, offset
        raise DurableError(f"{self.bucket.url}: durable version {self.version} holds no object with region {box} "
                           f"of tensor {tensor!r}")

    def read(self, tensor: str, box: Box) -> np.ndarray:
        """Region ``box`` of ``tensor``: the object's blocks that hold its rows (dim 0), fetched by ranged
        reads and each checked against its digest before use."""
        entry, data_offset = self._entry(tensor, box)
        item = itemsize(entry.dtype)
        row = item * int(np.prod(entry.box.lengths[1:], dtype=np.int64))
        local = box.local(entry.box)
        first, rows = (local.offsets[0], local.lengths[0]) if entry.box.lengths else (0, 1)
        start, end = first * row, (first + rows) * row
        size = entry.block_bytes
        assert entry.blocks is not None  # every durable row has block digests (flush writes them)
        lo, hi = start // size, -(-end // size)
        ranges = [(data_offset + i * size, data_offset + min((i + 1) * size, entry.nbytes)) for i in range(lo, hi)]
        where = f"{self.bucket.url}: durable version {self.version}, tensor {entry.tensor!r}, object {entry.file}"
        got = self.bucket.get_ranges(version_key(self.version, entry.file), ranges)
        for i, data in zip(range(lo, hi), got):
            actual = f"{xxhash.xxh3_64_intdigest(data):016x}"
            if data.nbytes != ranges[i - lo][1] - ranges[i - lo][0] or actual != entry.blocks[i]:
                raise CorruptShard(f"{where}: block {i} has xxh3 {actual} ({data.nbytes} bytes), the manifest "
                                   f"{entry.blocks[i]}; the object is damaged and nothing of it is restored")
        span = b"".join(got)[start - lo * size:end - lo * size]
        rows_array = np.frombuffer(span, numpy_storage(entry.dtype)).reshape((rows,) + tuple(entry.box.lengths[1:]))
        if not entry.box.lengths:  # a scalar: its one row is the value
            return rows_array.reshape(())
        return rows_array[(slice(None),) + local.slices()[1:]]


def restore_host(bucket: Bucket, version: int, new: Layout, store: Store, *, concurrency: int = 8) -> int:
    """Commit durable ``version`` as version ``version`` of ``store`` with this host's shards of ``new``;
    returns the bytes fetched from the bucket. Every host of ``new`` calls it (any world size)."""
    source = DurableVersion(bucket, version)
    host = store.host
    the_plan = plan_for(source.layout, new, [d for d in new.devices if host_of(d) == host])  # this host's share
    fetched = 0
    with store.begin(version, part=RESTORE_PART) as writer:
        shards: dict[tuple[str, str], list[tuple[Box, np.ndarray]]] = {}
        for device, shard in new.iter_shards():
            if host_of(device) == host:
                spec = new.tensors[shard.tensor]
                shards.setdefault((device, shard.tensor), []).append(
                    (shard.box, writer.allocate(device, shard.tensor, shard.box, spec.dtype, tuple(spec.shape))))

        def region_of(device: str, tensor: str, box: Box) -> np.ndarray:
            """The view of ``box`` inside ``device``'s new shard of ``tensor`` that contains it."""
            held, array = next((b, a) for b, a in shards[(device, tensor)] if b.contains(box))
            return array[box.local(held).slices() + (...,)]  # a view, also of a 0-d shard

        mine = the_plan.transfers

        def fetch(t) -> int:
            region_of(t.dst, t.tensor, t.box)[...] = source.read(t.tensor, t.box)
            return t.box.volume * itemsize(new.tensors[t.tensor].dtype)

        with ThreadPoolExecutor(concurrency) as pool:
            fetched = sum(pool.map(fetch, [t for t in mine if t.source == "old"]))
        for t in mine:  # the planner's local fan-out, in plan order: its sources are filled above
            if t.source == "new":
                region_of(t.dst, t.tensor, t.box)[...] = region_of(t.src, t.tensor, t.box)
        writer.put_layout(new)  # every host's store holds the layout and the state, as after a save
        for name in sorted(set(source.json) - SKIP_DOCS):
            writer.put_json(name, source.get_json(name))
        writer.put_json(DURABLE_DOC, {"from": bucket.url, "version": int(version)})
        writer.commit()
    return fetched
