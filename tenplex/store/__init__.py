"""Tensor stores: one per host, versioned shard files, served to other hosts over gRPC.

May import: numpy, xxhash, grpc, protobuf, ``tenplex.box``, ``tenplex.layout``,
``tenplex.plan``, ``tenplex.dtypes``, ``tenplex.devices``, ``tenplex.errors``,
``tenplex.files``. Never torch. The gRPC schema is ``proto/tenplex/v1/store.proto``;
its generated code lives in ``_proto`` (``make proto`` regenerates it).

Local API (workers on the same host; no network)::

    store = Store(root, host)                 # one directory per host, created if missing
    store.versions() -> [int]; store.latest() -> int | None
    with store.begin(version) as w:           # VersionWriter; an exception inside aborts (nothing visible)
        w.put(device, tensor, box, array, dtype, shape=None)   # array.shape == box.lengths; bf16 as uint16 bits
        m = w.allocate(device, tensor, box, dtype, shape=None) # writable memory map, fill in place
        w.put_json(name, doc); w.put_layout(layout)
        w.commit()                            # atomic; visible only after this
    # several writers (e.g. one per worker) may stage parts of one version:
    w = store.begin(version, part="rank3"); ...; w.prepare()   # then, once: store.commit(version)
    r = store.open(version)                   # VersionReader; StoreError for an unknown version
    r.devices(); r.layout_shards(device) -> [(tensor, Box, dtype)]
    r.read(device, tensor, box) -> np.ndarray # read-only memory-mapped view of only that region
    r.get_json(name); r.json_names(); r.layout(); r.verify()
    store.abort(version); store.delete(version); store.gc(keep) -> deleted versions

Remote API: ``serve(store, bind="127.0.0.1", port=0, token=None)`` starts the
gRPC service (``tenplex store serve`` runs it as a process) and
``StoreClient(address, token=None)`` talks to it: ``versions``, ``manifest``,
``get_json``, ``read_box`` (verified chunks, re-fetched on a checksum
mismatch), ``read_box_into``, ``write_shard``/``put_json``/``prepare``/``commit``/
``abort``/``delete``/``gc``, ``health``, ``read_file``/``stat_file`` (files
under ``<root>/datasets/``) and ``transform`` (this host's part of a plan).
"""

from ..errors import StoreError
from .local import (LAYOUT_DOC, MANIFEST_FORMAT, ShardEntry, Store, VersionReader, VersionWriter, checksum,
                    layout_from_manifests)

__all__ = ["Store", "VersionWriter", "VersionReader", "ShardEntry", "StoreError", "checksum",
           "layout_from_manifests", "MANIFEST_FORMAT", "LAYOUT_DOC"]
