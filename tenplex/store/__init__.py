"""Tensor stores: one per host, versioned shard files, served to other hosts over gRPC.

May import: numpy, xxhash, grpc, protobuf, ``tenplex.box``, ``tenplex.layout``,
``tenplex.transfer_plan``, ``tenplex.dtypes``, ``tenplex.devices``, ``tenplex.errors``,
``tenplex.files``. Never torch. The gRPC schema is ``proto/tenplex/v1/store.proto``;
its generated code lives in ``_proto`` (``make proto`` regenerates it).

The contract every store backend keeps, its order of calls and its optional
capabilities (hard links, file-backed zero-copy reads, free space) are the protocols in
``contract`` (``TensorStore``, ``StoreWriter``, ``StoreReader``); code above the
store should need no more. ``Store`` is the POSIX implementation.

Local API (workers on the same host; no network)::

    store = Store(root, host)                 # one directory per host, created if missing
    store.versions() -> [int]; store.latest() -> int | None
    with store.begin(version) as w:           # VersionWriter; an exception inside aborts (nothing visible)
        w.put(device, tensor, box, array, dtype, shape=None)   # array.shape == box.lengths; bf16 as uint16 bits
        t = w.create(device, tensor, box, dtype, shape=None)   # ShardTarget: t.write(sub_box, bytes_or_array)
        m = w.allocate(device, tensor, box, dtype, shape=None) # or a writable memory map to fill in place
        w.put_json(name, doc); w.put_layout(layout)
        w.commit()                            # atomic; visible only after this
    # several writers (e.g. one per worker) may stage parts of one version:
    w = store.begin(version, part="rank3"); ...; w.prepare()   # then, once: store.commit(version)
    r = store.open(version)                   # VersionReader; NotFound for an unknown version
    r.devices(); r.layout_shards(device) -> [(tensor, Box, dtype)]
    r.read(device, tensor, box) -> np.ndarray # that region, read with its blocks verified
    r.readinto(device, tensor, box, buffer)   # the same, straight into a buffer (what restore uses)
    r.get_json(name); r.json_names(); r.layout(); r.verify()
    store.abort(version); store.delete(version); store.gc(keep) -> deleted versions
    layout_from_manifests([manifest of every host]) -> Layout   # when no layout was recorded

Every shard file is a standard single-tensor safetensors file; the manifest
(``tenplex.store.manifest/1``) lists device, tensor, box, dtype, global
shape, file and checksums per shard (an xxh3 per 1 MiB block, see
``blocks``), and the version's JSON documents. A slice row (optional
``slice``: ``start``, ``file_nbytes``) is a contiguous run of the data of a
linked file that holds more (``VersionWriter.link`` with a box); a reader
that predates slices fails such a row as damaged (its file's header declares
``file_nbytes``), never reads wrong bytes. Every read verifies the blocks
it touches (``shardfile``): damaged or truncated data raises
:class:`CorruptShard` (gRPC DATA_LOSS), never wrong bytes.
Commit renames the fsynced staging directory into ``versions/``: atomic, so a
crash at any moment leaves every committed version whole (see ``local``).

Remote API (imports grpc, so not loaded by ``import tenplex.store``):
``tenplex.store.server.serve(store, bind="127.0.0.1", port=0, token=None)``
starts the gRPC service (``tenplex store serve`` runs it as a process) and
``tenplex.store.client.StoreClient(address, token=None)`` talks to it: ``versions``, ``manifest``,
``get_json``, ``read_box`` (verified chunks, re-fetched on a checksum
mismatch), ``read_box_into``, ``write_shard``/``put_json``/``prepare``/``commit``/
``abort``/``delete``/``gc``, ``health``, ``read_file``/``stat_file`` (files
under ``<root>/datasets/``) and ``transform`` (this host's part of a plan).
``wire`` holds the chunking, chunk framing and channel options both ends use.
``dataplane`` is the bulk data plane beside gRPC: each server also listens on a
plain TCP port (advertised in ``Health.data_port``) where large box reads
travel as checksummed frames, read and verified from the shard file and received
straight into the destination; same token (HMAC of a nonce), off with TLS.
"""

from ..errors import StoreError
from .contract import FileBackedReader, LinkingWriter, SpaceReportingStore, StoreReader, StoreWriter, TensorStore
from .local import Store
from .manifest import (LAYOUT_DOC, MANIFEST_FORMAT, AlreadyCommitted, Conflict, CorruptShard, NotFound, OutOfRange,
                       ShardEntry)
from .reader import VersionReader, layout_from_manifests
from .target import ShardTarget, checksum
from .writer import VersionWriter

__all__ = ["TensorStore", "StoreReader", "StoreWriter", "LinkingWriter", "FileBackedReader", "SpaceReportingStore",
           "Store", "VersionWriter", "VersionReader", "ShardEntry", "ShardTarget", "StoreError", "NotFound",
           "OutOfRange", "CorruptShard", "AlreadyCommitted", "Conflict", "checksum",
           "layout_from_manifests", "MANIFEST_FORMAT", "LAYOUT_DOC"]
