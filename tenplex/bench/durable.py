"""``tenplex bench durable``: flush a version from two hosts' stores to an S3 bucket and restore it into three, vs
the client's own raw upload and download of the same bytes, measured in the same run.

May import: every tenplex layer, numpy and the standard library.

Without ``--endpoint`` it starts moto's S3 server (``moto[server]``, the test extra) on a loopback port, with
throwaway credentials. The state: ``--mib`` MiB of float32 in eight tensors, split by rows over two devices
per host on two hosts (no replicas). ``flush_s``: both hosts' :func:`~tenplex.durable.flush_host` one after
the other (as one host's uploader would run them concurrently, the rate is a lower bound), marker included;
``restore_s``: :func:`~tenplex.durable.restore_host` for three hosts of a layout split by columns (each
fetches only its own regions, with verified ranged reads) one after the other, commits included.
``raw_upload_s``/``raw_download_s``: one object of the same size through the same client
(multipart upload; ranged reads of 8 MiB, concurrently), no verification or store.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ..box import Box
from ..durable import Bucket, flush_host, restore_host
from ..durable.testserver import S3ServerError, create_bucket, start_s3_server, stop
from ..errors import UsageError
from ..layout import Layout, Shard, TensorSpec
from ..store import Store

DESCRIPTION = "flush to an S3 bucket from 2 hosts and restore into 3, vs raw upload/download of the same bytes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=int, default=64, help="state size in MiB (default 64)")
    parser.add_argument("--endpoint", help="an S3 endpoint URL (default: start moto's server on loopback)")
    parser.add_argument("--bucket", default="tenplex-bench", help="bucket name (created on the moto server)")


def _layouts(mib: int) -> tuple[Layout, Layout]:
    rows, cols = max(12, (mib << 20) // (8 * 4 * 1024) // 12 * 12), 1024
    tensors = {f"t{i}": TensorSpec((rows, cols), "float32") for i in range(8)}
    third = cols // 3
    old = Layout.build(tensors, {f"h{h}/{d}": [Shard(t, Box(((2 * h + d) * rows // 4, 0), (rows // 4, cols)))
                                               for t in tensors] for h in range(2) for d in range(2)})
    widths = [third, third, cols - 2 * third]
    new = Layout.build(tensors, {f"n{h}/0": [Shard(t, Box((0, h * third), (rows, widths[h]))) for t in tensors]
                                 for h in range(3)})
    return old, new


def run(args: argparse.Namespace) -> dict:
    if args.mib < 1:
        raise UsageError(f"--mib must be at least 1, got {args.mib}")
    proc = None
    if args.endpoint is None:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        try:
            proc, endpoint = start_s3_server()
        except S3ServerError as e:
            raise UsageError(f"{e}: pip install 'moto[server]'") from None
        create_bucket(endpoint, args.bucket)
    else:
        endpoint = args.endpoint
    root = Path(tempfile.mkdtemp(prefix="tenplex-bench-durable-"))
    try:
        old, new = _layouts(args.mib)
        rng = np.random.default_rng(0)
        for host in old.hosts():
            store = Store(root / host, host)
            with store.begin(1, part="bench") as writer:
                for device, shard in old.iter_shards():
                    if device.startswith(host + "/"):
                        writer.put(device, shard.tensor, shard.box,
                                   rng.standard_normal(shard.box.lengths, dtype=np.float32), "float32")
                writer.put_layout(old)
                writer.put_json("tenplex.torch_state", {"step": 1})
                writer.commit()
        nbytes = old.total_bytes()
        bucket = Bucket(f"s3://{args.bucket}/bench-{os.getpid()}", endpoint=endpoint)
        t0 = time.perf_counter()
        for host in old.hosts():
            flush_host(Store(root / host, host), 1, bucket)
        flush_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for host in new.hosts():
            restore_host(bucket, 1, new, Store(root / "new" / host, host))
        restore_s = time.perf_counter() - t0
        data = memoryview(np.random.default_rng(1).bytes(nbytes))
        t0 = time.perf_counter()
        bucket.put_chunks("raw/object", (data[i:i + (8 << 20)] for i in range(0, nbytes, 8 << 20)))
        raw_upload_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = bucket.get_ranges("raw/object", [(i, min(i + (8 << 20), nbytes)) for i in range(0, nbytes, 8 << 20)])
        raw_download_s = time.perf_counter() - t0
        assert sum(g.nbytes for g in got) == nbytes
        mb = nbytes / 1e6
        return {"benchmark": "durable", "endpoint": "moto (loopback)" if proc else endpoint, "state_bytes": nbytes,
                "flush_s": round(flush_s, 3), "restore_s": round(restore_s, 3),
                "raw_upload_s": round(raw_upload_s, 3), "raw_download_s": round(raw_download_s, 3),
                # rates and ratios keep three significant digits (fixed decimals rounded a slow restore to 0.0)
                "flush_MBps": _digits3(mb / flush_s), "restore_MBps": _digits3(mb / restore_s),
                "raw_upload_MBps": _digits3(mb / raw_upload_s), "raw_download_MBps": _digits3(mb / raw_download_s),
                "flush_vs_raw": _digits3(raw_upload_s / flush_s),
                "restore_vs_raw": _digits3(raw_download_s / restore_s)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if proc is not None:
            stop(proc)


def _digits3(value: float) -> float:
    """``value`` to three significant digits."""
    return float(f"{value:.3g}")
