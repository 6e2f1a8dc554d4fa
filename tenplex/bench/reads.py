"""``tenplex bench reads``: verified local store reads against unverified copies of the same bytes, in one run.

May import: ``tenplex.store``, ``tenplex.box``, numpy and the standard library.

One version holds a ``--mib`` MiB float32 matrix (rows of 16 KiB) in a store on
tmpfs (/dev/shm when it exists). Each case reads one region of it into a
destination, as a restore does (``VersionReader.readinto``: every block the
read touches is checked against its xxh3):

* ``whole``: the whole shard into a contiguous tensor;
* ``whole_into_columns``: the whole shard into a column block of a tensor twice
  as wide (a tp shard restored under dp);
* ``half_columns``: the left half of the columns into a contiguous tensor (a
  tp=2 shard read by tp=4);
* ``half_rows``: the upper half of the rows (one contiguous run of the file).

Baselines, timed on the same destinations in the same run:

* ``mmap_s``: numpy copies the region out of a fresh read-only memory map of
  the shard file, with no verification: what restore did before block
  checksums (a new map per read, as each restore opened the version anew);
* ``memcpy_s``: numpy copies the region from an array already in memory: the
  floor for any read.

Each time is the best of ``--repeat``; ``verified_over_mmap`` is
``verified_s / mmap_s`` (issue 12 allows at most 1.1). ``load`` is the 1-minute
load average at the end: shared machines are noisy.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from functools import partial
from typing import Callable

import numpy as np

from ..box import Box

DESCRIPTION = "verified store reads (restore's path) vs unverified mmap and memcpy copies of the same regions"
COLS = 4096  # float32 columns: 16 KiB rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=int, default=256, help="size of the stored matrix in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions per measurement; the best counts")
    parser.add_argument("--dir", type=Path, help="directory for the store (default: a tmpfs directory)")


def _best(repeat: int, work: Callable[[], None]) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def _copy_mapped(path: Path, offset: int, shape: tuple[int, int], region: tuple[slice, ...],
                 dest: np.ndarray) -> None:
    """The unverified baseline: copy ``region`` out of a fresh read-only map of the file's float32 data."""
    np.copyto(dest, np.memmap(path, np.float32, "r", offset=offset, shape=shape)[region])


def run(args: argparse.Namespace) -> dict:
    from ..store import Store

    if args.mib < 1 or args.repeat < 1:
        raise SystemExit("tenplex bench reads: --mib and --repeat must be at least 1")
    rows = max(2, (args.mib << 20) // (COLS * 4))
    data = np.random.default_rng(0).random((rows, COLS), dtype=np.float32)
    whole = Box((0, 0), data.shape)
    half_columns, half_rows = Box((0, 0), (rows, COLS // 2)), Box((0, 0), (rows // 2, COLS))
    base = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    with tempfile.TemporaryDirectory(prefix="tenplex-bench-reads-", dir=base) as tmp:
        store = Store(tmp, "h0")
        with store.begin(1) as writer:
            writer.put("h0/0", "w", whole, data, "float32", shape=data.shape)
            writer.commit()
        reader = store.open(1)
        entry = reader.find("h0/0", "w", whole)
        path = Path(reader.path) / entry.file
        reader.readinto("h0/0", "w", whole, np.empty(data.shape, np.float32))  # checks the header: data_offset
        offset = reader.shard_file(entry).data_offset
        assert offset is not None
        wide = np.empty((rows, 2 * COLS), np.float32)
        cases = {"whole": (whole, np.empty(data.shape, np.float32)),
                 "whole_into_columns": (whole, wide[:, COLS // 2:COLS // 2 + COLS]),
                 "half_columns": (half_columns, np.empty(half_columns.lengths, np.float32)),
                 "half_rows": (half_rows, np.empty(half_rows.lengths, np.float32))}
        result: dict = {"bytes": data.nbytes, "cols": COLS, "rows": rows, "repeat": args.repeat}
        for name, (box, dest) in cases.items():
            region = box.slices()
            verified_s = _best(args.repeat, partial(reader.readinto, "h0/0", "w", box, dest))
            if not np.array_equal(dest, data[region]):
                raise RuntimeError(f"bench reads: case {name} read wrong values")
            mmap_s = _best(args.repeat, partial(_copy_mapped, path, offset, data.shape, region, dest))
            memcpy_s = _best(args.repeat, partial(np.copyto, dest, data[region]))
            nbytes = dest.nbytes
            result[name] = {"bytes": nbytes, "verified_s": round(verified_s, 6), "mmap_s": round(mmap_s, 6),
                            "memcpy_s": round(memcpy_s, 6), "verified_gbps": round(nbytes / verified_s / 1e9, 2),
                            "verified_over_mmap": round(verified_s / mmap_s, 2),
                            "verified_over_memcpy": round(verified_s / memcpy_s, 2)}
        reader.close()
    result["load"] = round(os.getloadavg()[0], 2)
    return result
