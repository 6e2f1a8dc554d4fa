"""Read throughput through the FUSE view versus reading the record files directly, in the same run.

May import: ``tenplex.dataset``, ``fuse_vfs`` (lazily), numpy and the standard library.

Packs a synthetic dataset of random bytes into a temporary directory, mounts it
with dp=1 (rank 0 then sees every sample, in the epoch's shuffled order) and
reads it. The record files are always in the page cache (the baseline is the
fastest read there is). A view is read either on a *first pass* (a fresh
generation: new paths, so nothing of it is in the kernel's cache and every byte
goes through the FUSE server) or *warm* (read again: the kernel serves it from
its cache). Each measurement is the best of ``--repeat`` runs; every first-pass
run switches the mount to a new generation first.

- ``vfs_seq_gbps``: first pass of ``rank0/data``, front to back in ``--chunk`` reads;
- ``vfs_seq_warm_gbps``: the same file read again;
- ``vfs_seq_odirect_gbps``: a first pass like ``vfs_seq`` by a reader that opens ``data`` with
  ``O_DIRECT``: each read goes to the server and straight into the reader's buffer (one copy, as
  the baseline's), and nothing of the view is cached. Buffered first passes copy twice (record
  pages into freshly allocated view pages, then those into the reader's buffer) and pay the
  allocation of every view page: that is where their time goes (``perf``: the server's copy, the
  reader's page allocation and its copy; the server's Python is ~10%);
- ``direct_seq_gbps``: the record files front to back the same way (the baseline);
- ``direct_view_gbps``: the view's bytes in view order, one pread per sample from the
  record files (what the in-process fallback reader does);
- ``vfs_random_samples_per_s``: single samples at random positions, one pread each,
  first pass through a fresh view; ``vfs_random_warm_samples_per_s``: repeated;
- ``direct_random_samples_per_s``: the same samples from the record files;
- ``*_ratio``: mount / direct (``seq_ratio``, ``seq_odirect_ratio`` and ``random_ratio`` for first passes);
- ``load``: the 1-minute load average before and after the run (the ratios fall with load).
"""

from __future__ import annotations

import argparse
import mmap
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
    parser.add_argument("--libfuse", choices=("auto", "3", "2"),
                        help="libfuse the mount serves with (default: $TENPLEX_LIBFUSE, else auto)")


def _seq(paths: list[Path], chunk: int, flags: int = 0) -> tuple[int, float]:
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT readers use; the same buffer for every reader
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            while n := os.readv(fd, [view]):
                total += n
        finally:
            os.close(fd)
    seconds = time.perf_counter() - t0
    view.release()
    buf.close()
    return total, seconds


def _preads(fds: list[int], rows: np.ndarray) -> float:
    """Seconds to pread each (fd index, offset, length) row."""
    t0 = time.perf_counter()
    for f, off, n in rows.tolist():
        os.pread(fds[f], n, off)
    return time.perf_counter() - t0


def _view_preads(path: Path, rows: np.ndarray) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        return _preads([fd], rows)
    finally:
        os.close(fd)


def _best(fn, repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def _records(count: int, size: int, rng: np.random.Generator):
    for _ in range(count):
        yield rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import fuse_vfs
    from fuse_vfs.mount import write_state_file

    load_before = os.getloadavg()[0]
    sample = args.sample_kb << 10
    count = max(1, (args.size_mb << 20) // sample)
    chunk = args.chunk_kb << 10
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tenplex-bench-vfs-") as tmp_name:
        tmp = Path(tmp_name)
        info = write_dataset(_records(count, sample, np.random.default_rng(0)), tmp / "ds", "bytes",
                             file_bytes=64 << 20)
        state = DatasetState(info.identity, info.num_samples, seed=0, position=0, global_batch=1)
        write_state_file(tmp / "state.json", state, dp=1)
        (tmp / "mnt").mkdir()
        handle = fuse_vfs.mount(info.root, tmp / "mnt", tmp / "state.json", log_path=tmp / "vfs.log",
                                libfuse=args.libfuse)
        try:
            libfuse = fuse_vfs.read_root(tmp / "mnt")["libfuse"]
            seconds = {**_sequential(info, tmp / "mnt", chunk, args.repeat),
                       **_random(info, tmp / "mnt", count, args.random_reads, args.repeat)}
        finally:
            handle.unmount(lazy=True)
    total = sum(f.bytes for f in info.files)
    return {**_summary(args, seconds, total, count, sample, chunk, libfuse),
            "load": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def _fresh_view(mount: Path) -> Path:
    """rank 0's data file in a new generation: new paths, hence a cold kernel cache for the view's files."""
    import fuse_vfs

    fuse_vfs.switch(mount, position=0)
    return Path(os.path.realpath(mount / "rank0" / "data"))


def _sequential(info, mount: Path, chunk: int, repeat: int) -> dict[str, float]:
    """Seconds to read everything in ``chunk`` pieces: the record files; the view first pass, warm, O_DIRECT."""
    records = [info.record_path(i) for i in range(len(info.files))]
    _seq(records, chunk)  # warm the record files' page cache
    return {"direct_seq": _best(lambda: _seq(records, chunk)[1], repeat),
            "vfs_seq": _best(lambda: _seq([_fresh_view(mount)], chunk)[1], repeat),
            "vfs_seq_warm": _best(lambda: _seq([mount / "rank0" / "data"], chunk)[1], repeat),
            "vfs_seq_odirect": _best(lambda: _seq([_fresh_view(mount)], chunk, os.O_DIRECT)[1], repeat)}


def _random(info, mount: Path, count: int, random_reads: int, repeat: int) -> dict[str, float]:
    """Seconds to pread samples: the whole view in order from the record files; random ones each way."""
    from ..dataset.reader import open_mounted

    reader = open_mounted(mount, 0)
    rows = info.index[reader.sample_ids][:, [FILE, OFFSET, LENGTH]]   # (n, 3) in view order
    picks = np.random.default_rng(1).integers(0, count, random_reads)
    view_rows = np.stack([np.zeros_like(picks), reader.index[picks, 1], reader.index[picks, 2]], 1)
    reader.close()
    fds = [os.open(info.record_path(i), os.O_RDONLY) for i in range(len(info.files))]
    try:
        return {"direct_view": _best(lambda: _preads(fds, rows), repeat),
                "direct_rand": _best(lambda: _preads(fds, rows[picks]), repeat),
                "vfs_rand": _best(lambda: _view_preads(_fresh_view(mount), view_rows), repeat),
                "vfs_rand_warm": _best(lambda: _view_preads(mount / "rank0" / "data", view_rows), repeat)}
    finally:
        for fd in fds:
            os.close(fd)


def _summary(args: argparse.Namespace, seconds: dict[str, float], total: int, count: int, sample: int, chunk: int,
             libfuse: str) -> dict[str, Any]:
    gb, reads = total / 1e9, args.random_reads
    result = {
        "bytes": total, "samples": count, "sample_bytes": sample, "chunk_bytes": chunk, "libfuse": libfuse,
        "repeat": args.repeat,
        "vfs_seq_gbps": gb / seconds["vfs_seq"], "vfs_seq_warm_gbps": gb / seconds["vfs_seq_warm"],
        "vfs_seq_odirect_gbps": gb / seconds["vfs_seq_odirect"],
        "direct_seq_gbps": gb / seconds["direct_seq"], "direct_view_gbps": gb / seconds["direct_view"],
        "vfs_random_samples_per_s": reads / seconds["vfs_rand"],
        "vfs_random_warm_samples_per_s": reads / seconds["vfs_rand_warm"],
        "direct_random_samples_per_s": reads / seconds["direct_rand"],
    }
    result["seq_ratio"] = result["vfs_seq_gbps"] / result["direct_seq_gbps"]
    result["seq_warm_ratio"] = result["vfs_seq_warm_gbps"] / result["direct_seq_gbps"]
    result["seq_odirect_ratio"] = result["vfs_seq_odirect_gbps"] / result["direct_seq_gbps"]
    result["random_ratio"] = result["vfs_random_samples_per_s"] / result["direct_random_samples_per_s"]
    result["random_warm_ratio"] = result["vfs_random_warm_samples_per_s"] / result["direct_random_samples_per_s"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
