"""Flushing one committed version from a host's store to the bucket, and the marker that makes it durable.

May import: numpy, ``tenplex.store`` (its local store, manifest rows, block digests and safetensors
header), ``tenplex.planner``, ``tenplex.layout``, ``tenplex.box``, ``tenplex.devices``, this package's
``bucket`` and the standard library.

Who uploads what: the planner moves the version's layout into a layout with every tensor whole on one
device of its own host (``durable/0``); each transfer of that plan is one object, uploaded by the host
of its source. So every region is uploaded once, by one of the hosts that hold it, with the load spread
over the replicas as the planner spreads senders; a shard that no other host holds is uploaded whole.

Keys under the job's prefix (``s3://BUCKET/PREFIX``)::

    versions/<N>/objects/<host>-<i>.safetensors   one region: a safetensors file (the official reader opens it)
    versions/<N>/json/<name>.json                 the version's JSON documents (layout, state, …)
    versions/<N>/parts/<host>.json                a host's manifest rows, written after its objects
    versions/<N>/manifest.json                    the marker: written last, once every part is there

The manifest is a ``tenplex.store.manifest/1`` document whose rows all belong to device ``durable/0``
(each with its 1 MiB block digests and ``data_offset``, the object offset of its first data byte). Its
``durable`` entry lists the parts it merged. Objects of one version go up in parallel; the part document
follows them and the manifest follows every part (each is one PUT, atomic), so a flush killed at any
moment leaves a version with no manifest: no reader sees it and :func:`gc` deletes it.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ..box import Box
from ..devices import host_of
from ..layout import Layout, Shard
from ..planner import plan as make_plan
from ..store import Store
from ..store._safetensors import header_bytes
from ..store.blocks import BLOCK_BYTES, block_digests, root_digest
from ..store.manifest import MANIFEST_FORMAT, ShardEntry
from .bucket import Bucket, DurableError

log = logging.getLogger(__name__)

DURABLE_DEVICE = "durable/0"
PART_FORMAT = "tenplex.durable.part/1"
PIECE_BYTES = 8 << 20  # objects go up in multipart pieces of this size


def version_key(version: int, rest: str) -> str:
    return f"versions/{int(version)}/{rest}"


def whole_layout(layout: Layout) -> Layout:
    """Every tensor of ``layout`` whole on ``durable/0`` (the planner's target for a flush)."""
    return Layout.build(layout.tensors, {DURABLE_DEVICE: [
        Shard(name, Box((0,) * len(spec.shape), tuple(spec.shape))) for name, spec in sorted(layout.tensors.items())
        if all(spec.shape)]})


def assignment(layout: Layout) -> dict[str, list[tuple[str, str, Box]]]:
    """host -> the (device, tensor, region) objects it uploads: the transfers of the plan to ``whole_layout``."""
    out: dict[str, list[tuple[str, str, Box]]] = {}
    for t in make_plan(layout, whole_layout(layout)).transfers:
        out.setdefault(host_of(t.src), []).append((t.src, t.tensor, t.box))
    return out


def parts_expected(layout: Layout) -> list[str]:
    """The hosts whose part documents a durable version needs: every uploading host and the first host of the
    layout, which uploads the JSON documents."""
    return sorted(set(assignment(layout)) | {min(layout.hosts())})


@dataclass
class FlushResult:
    version: int
    host: str
    objects: int
    bytes: int
    durable: bool  # this host's part completed the version (it wrote the manifest), or it already was


class Superseded(DurableError):
    """A newer version replaced the one being uploaded; the rest of its upload was dropped."""


def flush_host(store: Store, version: int, bucket: Bucket, *, concurrency: int = 4,
               cancelled: Callable[[], bool] = lambda: False) -> FlushResult:
    """Upload this host's share of committed ``version`` and its part document; write the manifest when every
    part is there. Idempotent: a part already in the bucket is not uploaded again."""
    host = store.host
    if bucket.exists(version_key(version, "manifest.json")):
        return FlushResult(version, host, 0, 0, True)
    reader = store.open(version)
    try:
        layout = reader.layout()
        mine = assignment(layout).get(host, [])
        leader = host == min(layout.hosts())
        part_key = version_key(version, f"parts/{host}.json")
        sent = 0
        if (mine or leader) and not bucket.exists(part_key):

            def upload(item: tuple[int, tuple[str, str, Box]]) -> dict:
                index, (device, tensor, box) = item
                if cancelled():
                    raise Superseded(f"version {version}: a newer version superseded its upload")
                spec = layout.tensors[tensor]
                data = memoryview(reader.read(device, tensor, box)).cast("B")  # verified against the store's digests
                head = header_bytes(tensor, spec.dtype, box.lengths, {"tenplex.version": str(version),
                                                                      "tenplex.offsets": json.dumps(box.offsets)})
                rel = f"objects/{host}-{index}.safetensors"
                bucket.put_chunks(version_key(version, rel), _pieces(head, data), concurrency=1)
                blocks = block_digests(data)
                row = ShardEntry(DURABLE_DEVICE, tensor, box, spec.dtype, tuple(spec.shape), rel, root_digest(blocks),
                                 data.nbytes, BLOCK_BYTES, tuple(blocks)).to_dict()
                row["data_offset"] = len(head)
                return row

            with ThreadPoolExecutor(concurrency) as pool:
                rows = list(pool.map(upload, enumerate(mine)))
            sent = sum(row["nbytes"] for row in rows)
            docs: dict[str, str] = {}
            if leader:
                for name in reader.json_names():
                    docs[name] = f"json/{name}.json"
                    bucket.put(version_key(version, docs[name]), json.dumps(reader.get_json(name)).encode())
            bucket.put(part_key, json.dumps({"format": PART_FORMAT, "version": version, "host": host,
                                             "shards": rows, "json": docs}).encode())
        expected = parts_expected(layout)
    finally:
        reader.close()
    return FlushResult(version, host, len(mine), sent, commit_if_complete(bucket, version, expected))


def _pieces(head: bytes, data: memoryview):
    yield head
    for at in range(0, data.nbytes, PIECE_BYTES):
        yield data[at:at + PIECE_BYTES]


def commit_if_complete(bucket: Bucket, version: int, expected: list[str]) -> bool:
    """Write ``version``'s manifest when the part of every ``expected`` host is in the bucket. Every host calls
    this after writing its part, so the last one to finish sees them all (S3 lists what it wrote); two hosts
    finishing together write the same manifest."""
    have = {key.rsplit("/", 1)[-1][:-len(".json")] for key in bucket.keys(version_key(version, "parts/"))}
    if not set(expected) <= have:
        return False
    manifest: dict = {"format": MANIFEST_FORMAT, "version": int(version), "host": host_of(DURABLE_DEVICE),
                      "shards": [], "json": {}, "durable": {"parts": expected}}
    for host in expected:
        part = json.loads(bucket.get(version_key(version, f"parts/{host}.json")))
        manifest["shards"] += part["shards"]
        manifest["json"].update(part["json"])
    bucket.put(version_key(version, "manifest.json"), json.dumps(manifest).encode())
    log.info("version %d is durable in %s (%d objects)", version, bucket.url, len(manifest["shards"]))
    return True


def durable_versions(bucket: Bucket) -> list[int]:
    """Versions whose manifest is in the bucket, ascending."""
    found = []
    for key in bucket.keys("versions/"):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "manifest.json" and parts[1].isdigit():
            found.append(int(parts[1]))
    return sorted(found)


def gc(bucket: Bucket, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` durable versions (their manifest first) and every version left
    without a manifest that is older than the newest durable one (an interrupted or superseded flush)."""
    keys = bucket.keys("versions/")
    by_version: dict[int, list[str]] = {}
    for key in keys:
        number = key.split("/")[1]
        if number.isdigit():
            by_version.setdefault(int(number), []).append(key)
    durable = durable_versions(bucket)
    doomed = durable[:-keep] if keep > 0 else durable
    newest = durable[-1] if durable else None
    stale = [v for v in by_version if v not in durable and newest is not None and v < newest]
    for v in doomed:
        marker = version_key(v, "manifest.json")
        bucket.delete([marker])
        bucket.delete([k for k in by_version[v] if k != marker])
    for v in stale:
        bucket.delete(by_version[v])
    return doomed
