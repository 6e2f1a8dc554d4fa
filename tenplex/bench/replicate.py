"""``tenplex bench replicate``: the cost of copying a saved version's host-unique state to another host.

May import: every tenplex layer, numpy and the standard library.

Host h0 holds one saved version of ``--bytes`` that no other host has (a tensor
split by rows across hosts, as under tensor or pipeline parallelism). Host h1's
copier (``tenplex.replication.copier.Replicator``, what a save starts in the
background) pulls it from h0's store process (``tenplex store serve``) into
h1's replica store and commits it. From the same run:

* ``replicate_s`` / ``replicate_gbps`` / ``bytes``: the copier end to end
  (pull, write, fsync, checksum, commit);
* ``replicate_rss_growth_bytes``: the largest growth of this process's
  anonymous resident memory (heap and buffers, ``RssAnon``) while copying,
  sampled every 5 ms (the copier holds about one chunk, ``chunk_bytes``,
  whatever the size);
* ``baseline_read_s`` / ``baseline_rss_growth_bytes``: the same bytes read
  from h0's store into one in-memory array (``StoreClient.read_box_into``),
  which is what a copier that held a whole version would pay.

Stores live on tmpfs (/dev/shm) when it exists, so the disk is not measured.
``load`` is the 1-minute load average at the end (shared machines are noisy).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ..box import Box

DESCRIPTION = "background replication of a saved version to another host: seconds, bytes, memory vs holding it"
ROW = 1 << 20  # bytes per row of the benchmark tensor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bytes", type=int, default=256 << 20, help="state unique to h0 (default 256 MiB)")
    parser.add_argument("--dir", type=Path, help="directory for the two stores (default: a tmpfs directory)")


class _PeakRss:
    """Largest growth of this process's resident memory over the with-block."""

    def __enter__(self) -> "_PeakRss":
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def _rss() -> int:
    """Anonymous resident memory (RssAnon): heap and buffers, not the shard files' pages that the checksum
    maps, which are page cache the kernel can drop."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


def run(args: argparse.Namespace) -> dict:
    from ..layout import Layout, Shard, TensorSpec
    from ..replication.copier import CHUNK_BYTES, Replicator
    from ..runtime.hosts import Hosts
    from ..store import Store
    from ..store.client import StoreClient

    rows = max(1, args.bytes // ROW)
    cols = ROW // 4
    tensors = {"w": TensorSpec((rows, cols), "float32"), "v": TensorSpec((1,), "float32")}
    whole = Box((0, 0), (rows, cols))
    # h1 holds a tiny tensor of its own, so that the version spans both hosts; all of w is unique to h0.
    layout = Layout.build(tensors, {"h0/0": [Shard("w", whole)], "h1/0": [Shard("v", Box((0,), (1,)))]})
    base = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    with tempfile.TemporaryDirectory(prefix="tenplex-bench-replicate-", dir=base) as tmp, Hosts(tmp) as hosts:
        hosts.start("h0")
        _write_source(Store(hosts.root("h0"), "h0"), layout, whole)
        replicator = Replicator(Store(hosts.root("h1"), "h1"), 1, layout, 1, {"h0": hosts.addresses["h0"]})
        started = time.perf_counter()
        with _PeakRss() as copying:
            ok = replicator.start().wait()
        replicate_s = time.perf_counter() - started
        if not ok:
            raise RuntimeError(f"replication failed: {replicator.status()}")
        with StoreClient(hosts.addresses["h0"]) as client, _PeakRss() as holding:
            started = time.perf_counter()
            out = np.empty((rows, cols), dtype=np.float32)
            client.read_box_into(1, "h0/0", "w", whole, out)
            baseline_s = time.perf_counter() - started
            del out
    nbytes = replicator.status()["bytes"]
    return {"benchmark": "replicate", "bytes": nbytes, "chunk_bytes": CHUNK_BYTES,
            "replicate_s": round(replicate_s, 3), "replicate_gbps": round(nbytes / replicate_s / 1e9, 3),
            "replicate_rss_growth_bytes": copying.growth,
            "baseline_read_s": round(baseline_s, 3), "baseline_rss_growth_bytes": holding.growth,
            "load": round(os.getloadavg()[0], 2)}


def _write_source(store, layout, whole) -> None:
    """Version 1 of h0, written piece by piece (this process never holds it whole)."""
    rng = np.random.default_rng(0)
    piece_rows = max(1, (16 << 20) // ROW)
    with store.begin(1) as writer:
        target = writer.create("h0/0", "w", whole, "float32", layout.tensors["w"].shape)
        for start in range(0, whole.lengths[0], piece_rows):
            n = min(piece_rows, whole.lengths[0] - start)
            target.write(Box((start, 0), (n, whole.lengths[1])),
                         rng.integers(0, 255, size=n * ROW, dtype=np.uint8).tobytes())
        writer.put_layout(layout)
        writer.commit()
