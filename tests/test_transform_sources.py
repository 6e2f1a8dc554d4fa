"""Where a host part reads old regions from (``tenplex.transform.sources``): after its planned source fails, the
replicas on this host first (no network), then the others in layout order."""

from __future__ import annotations

import numpy as np

from tenplex.box import Box
from tenplex.store import Store, wire
from tenplex.transform.sources import Sources

from store_helpers import Cluster, tiny_layout

SHAPE = (64, 32)
WHOLE = Box((0, 0), SHAPE)


def _put(root, host: str, device: str, value: float) -> None:
    with Store(root, host).begin(1) as w:
        w.put(device, "m", WHOLE, np.full(SHAPE, value, np.float32), "float32", shape=SHAPE)
        w.commit()


def test_after_a_failed_source_the_replica_on_this_host_is_read_before_one_on_another_host(tmp_path):
    """Three replicas of ``m``: the planned source's host h0 is gone (no address), h1's store serves one, and
    h2 (this host, last in layout order) holds one. This host's replica holds 1.0 and h1's 2.0 (replicas hold
    the same bytes; different ones tell which was read): the region comes from this host's own disk."""
    old = tiny_layout({"m": (SHAPE, "float32")}, {d: [("m", (0, 0), SHAPE)] for d in ("h0/0", "h1/0", "h2/0")})
    _put(tmp_path / "h2", "h2", "h2/0", 1.0)
    with Cluster(tmp_path / "servers", ["h1"]) as cluster:
        _put(cluster.roots["h1"], "h1", "h1/0", 2.0)
        store = Store(tmp_path / "h2", "h2")
        sources = Sources("h2", old, 1, store.open(1), cluster.addresses, None, None, 1, wire.DEFAULT_CHUNK_BYTES,
                          5.0)
        writer = store.begin(2)
        try:
            target = writer.create("h2/1", "m", WHOLE, "float32", SHAPE)
            refetched = sources.read_with_fallback("h0/0", "m", WHOLE, target)
            got = np.array(target.read(WHOLE))
        finally:
            writer.abort()
            sources.close()
    assert refetched == WHOLE.volume * 4
    assert set(sources.failed) == {"h0"}
    assert np.all(got == 1.0), "read h1's replica over the network although this host holds one"
