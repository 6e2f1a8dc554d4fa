"""Read throughput through the FUSE view versus reading the record files directly, in the same run.

May import: ``tenplex.dataset``, ``fuse_vfs`` (lazily), numpy and the standard library.

Packs a synthetic dataset of random bytes into a temporary directory, mounts it
with dp=1 (rank 0 then sees every sample, in the epoch's shuffled order) and
measures, each as the best of ``--repeat`` runs with warm page cache (the record
files' cache, and for the mount also its own: a view's files are cached by the
kernel per generation):

- ``vfs_seq_first_pass_gbps``: the first read of ``rank0/data``, front to back in
  ``--chunk`` reads; every byte goes through the FUSE server (cold mount cache);
- ``vfs_seq_gbps``: the same, repeated (warm mount cache);
- ``direct_seq_gbps``: reading the record files front to back the same way (the baseline);
- ``direct_view_gbps``: the same bytes as the view, in view order, with one pread
  per sample from the record files (what the in-process fallback reader does);
- ``vfs_random_samples_per_s`` / ``direct_random_samples_per_s``: single samples
  at random positions, one pread each, through the mount / from the record files;
  ``vfs_random_first_pass_samples_per_s`` is the first such pass after switching
  the mount to a new generation (cold mount cache).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..dataset.format import FILE, LENGTH, OFFSET
from ..dataset.pack import write_dataset
from ..dataset.state import DatasetState

DESCRIPTION = "FUSE dataset view read throughput (sequential and random) vs direct record-file reads"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mb", type=int, default=256, help="dataset size in MiB")
    parser.add_argument("--sample-kb", type=int, default=64, help="sample size in KiB")
    parser.add_argument("--chunk-kb", type=int, default=1024, help="sequential read size in KiB")
    parser.add_argument("--random-reads", type=int, default=5000, help="random sample reads per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is reported)")
    parser.add_argument("--dir", help="work directory (default: a temporary directory)")


def _seq(paths: list[Path], chunk: int) -> tuple[int, float]:
    buf = bytearray(chunk)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.readv(fd, [view]):
                total += n
        finally:
            os.close(fd)
    return total, time.perf_counter() - t0


def _preads(fds: list[int], rows: np.ndarray) -> float:
    """Seconds to pread each (fd index, offset, length) row."""
    t0 = time.perf_counter()
    for f, off, n in rows.tolist():
        os.pread(fds[f], n, off)
    return time.perf_counter() - t0


def _best(fn, repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def _records(count: int, size: int, rng: np.random.Generator):
    for _ in range(count):
        yield rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import fuse_vfs
    from fuse_vfs.mount import write_state_file
    from ..dataset.reader import open_mounted

    sample = args.sample_kb << 10
    count = max(1, (args.size_mb << 20) // sample)
    chunk = args.chunk_kb << 10
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tenplex-bench-vfs-") as tmp:
        tmp = Path(tmp)
        info = write_dataset(_records(count, sample, np.random.default_rng(0)), tmp / "ds", "bytes",
                             file_bytes=64 << 20)
        state = DatasetState(info.identity, info.num_samples, seed=0, position=0, global_batch=1)
        write_state_file(tmp / "state.json", state, dp=1)
        (tmp / "mnt").mkdir()
        handle = fuse_vfs.mount(info.root, tmp / "mnt", tmp / "state.json", log_path=tmp / "vfs.log")
        try:
            data = tmp / "mnt" / "rank0" / "data"
            records = [info.record_path(i) for i in range(len(info.files))]
            total = sum(f.bytes for f in info.files)
            _seq(records, chunk)  # warm the record files' page cache
            vfs_seq_first = _seq([data], chunk)[1]     # every byte through the FUSE server
            vfs_seq = _best(lambda: _seq([data], chunk)[1], args.repeat)
            direct_seq = _best(lambda: _seq(records, chunk)[1], args.repeat)

            # A new generation has new paths, hence a cold kernel cache for the mount's files.
            fuse_vfs.switch(tmp / "mnt", position=0)
            reader = open_mounted(tmp / "mnt", 0)
            rows = info.index[reader.sample_ids][:, [FILE, OFFSET, LENGTH]]   # (n, 3) in view order
            fds = [os.open(p, os.O_RDONLY) for p in records]
            view_fd = os.open(data, os.O_RDONLY)
            try:
                direct_view = _best(lambda: _preads(fds, rows), args.repeat)
                picks = np.random.default_rng(1).integers(0, count, args.random_reads)
                view_rows = np.stack([np.zeros_like(picks), reader.index[picks, 1], reader.index[picks, 2]], 1)
                vfs_rand_first = _preads([view_fd], view_rows)
                vfs_rand = _best(lambda: _preads([view_fd], view_rows), args.repeat)
                direct_rand = _best(lambda: _preads(fds, rows[picks]), args.repeat)
            finally:
                for fd in fds + [view_fd]:
                    os.close(fd)
                reader.close()
        finally:
            handle.unmount(lazy=True)
    gb = total / 1e9
    result = {
        "bytes": total, "samples": count, "sample_bytes": sample, "chunk_bytes": chunk,
        "vfs_seq_gbps": gb / vfs_seq, "direct_seq_gbps": gb / direct_seq, "direct_view_gbps": gb / direct_view,
        "vfs_seq_first_pass_gbps": gb / vfs_seq_first,
        "vfs_random_samples_per_s": args.random_reads / vfs_rand,
        "vfs_random_first_pass_samples_per_s": args.random_reads / vfs_rand_first,
        "direct_random_samples_per_s": args.random_reads / direct_rand,
    }
    result["seq_ratio"] = result["vfs_seq_gbps"] / result["direct_seq_gbps"]
    result["random_ratio"] = result["vfs_random_samples_per_s"] / result["direct_random_samples_per_s"]
    result["seq_first_pass_ratio"] = result["vfs_seq_first_pass_gbps"] / result["direct_seq_gbps"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
