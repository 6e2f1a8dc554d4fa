"""Random-sample read rate of each in-place source, next to the format's own reader on the same files.

May import: ``tenplex.dataset``, numpy, the standard library, and (on use) pyarrow, datasets and webdataset.

Writes a synthetic dataset of ``--samples`` samples of about ``--sample-bytes`` bytes in each format
(Hugging Face ``save_to_disk`` and Parquet with pyarrow, WebDataset shards with the standard library's
tarfile, a Megatron ``.bin``/``.idx`` with numpy) and reads ``--reads`` samples at random positions:

- ``tenplex_random_samples_per_s``: ``read_verified`` + ``decode_sample`` (what ``RankDataset``, the
  fallback reader and ``job.loader()`` workers do per sample: crc check and decode included);
- ``library_random_samples_per_s``: the same samples with the format's own reader: ``datasets``'
  ``ds[i]`` (hf), pyarrow ``read_row_group`` + row slice (parquet, no cache), numpy on the memory-mapped
  ``.bin`` (megatron). webdataset has no random access: for it, ``library_sequential_samples_per_s`` is
  its own iterator's rate over all shards;
- ``scan_s``: the first open (digests and index, cached afterwards), ``open_s``: a later open.

Each rate is the best of ``--repeat`` runs. One object per source.
"""

from __future__ import annotations

import argparse
import io
import os
import struct
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

DESCRIPTION = "random-sample reads of each in-place source (hf, parquet, webdataset, megatron) vs its own library"
SOURCES = ("hf", "parquet", "webdataset", "megatron")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=int, default=20000, help="samples per source")
    parser.add_argument("--sample-bytes", type=int, default=1024, help="approximate bytes per sample")
    parser.add_argument("--reads", type=int, default=3000, help="random sample reads per run")
    parser.add_argument("--row-group", type=int, default=1000, help="Parquet rows per row group")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is reported)")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--dir", help="work directory (default: a temporary directory)")


def _rate(fn: Callable[[], int], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        n = fn()
        best = min(best, (time.perf_counter() - t0) / max(n, 1))
    return 1.0 / best


def _write_megatron(out: Path, n: int, tokens: int) -> Path:
    """An MMIDIDX version-1 dataset of ``n`` uint16 documents of ``tokens`` tokens each (Megatron's layout)."""
    out.mkdir()
    lengths = np.full(n, tokens, dtype=np.int32)
    pointers = (np.arange(n, dtype=np.int64) * tokens * 2)
    np.random.default_rng(0).integers(0, 60000, n * tokens, dtype=np.uint16).tofile(out / "c.bin")
    with open(out / "c.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, n, n + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(n + 1, dtype=np.int64).tobytes())
    return out


def _write_shards(out: Path, n: int, size: int, per_shard: int = 5000) -> Path:
    out.mkdir()
    payload = os.urandom(size)
    for first in range(0, n, per_shard):
        with tarfile.open(out / f"s-{first // per_shard:05d}.tar", "w") as tar:
            for i in range(first, min(n, first + per_shard)):
                for field, data in (("bin", payload), ("cls", str(i).encode())):
                    member = tarfile.TarInfo(f"k{i:08d}.{field}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
    return out


def _table(n: int, size: int):
    import pyarrow as pa
    blob = os.urandom(size)
    return pa.table({"id": np.arange(n), "payload": [blob] * n})


def _library_reader(source: str, path: Path, args: argparse.Namespace) -> tuple[str, Callable[[int], Any]]:
    if source == "hf":
        import datasets
        ds = datasets.load_from_disk(str(path))
        return f"datasets {datasets.__version__}: ds[i]", ds.__getitem__
    if source == "parquet":
        import pyarrow.parquet as pq
        pf = pq.ParquetFile(str(path / "p.parquet"))
        return "pyarrow: read_row_group + slice", lambda i: pf.read_row_group(i // args.row_group).slice(
            i % args.row_group, 1).to_pylist()[0]
    from ..dataset.megatron import read_index
    _, lengths, pointers, _ = read_index(path / "c.idx")
    data = np.memmap(path / "c.bin", dtype=np.uint16, mode="r")
    return "numpy: memmap of .bin, .idx pointers", lambda i: np.array(
        data[pointers[i] // 2:pointers[i] // 2 + lengths[i]])


def _make(source: str, root: Path, args: argparse.Namespace) -> Path:
    n, size = args.samples, args.sample_bytes
    if source == "hf":
        import datasets
        datasets.Dataset(_table(n, size)).save_to_disk(str(root / "hf"))
        return root / "hf"
    if source == "parquet":
        import pyarrow.parquet as pq
        (root / "pq").mkdir()
        pq.write_table(_table(n, size), root / "pq" / "p.parquet", row_group_size=args.row_group)
        return root / "pq"
    if source == "webdataset":
        return _write_shards(root / "wds", n, size)
    return _write_megatron(root / "mg", n, max(1, size // 2))


def _measure(source: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    from ..dataset import decode_sample, open_dataset
    from ..dataset.inplace import open_records
    from ..dataset.source import read_verified

    path = _make(source, root, args)
    t0 = time.perf_counter()
    info = open_dataset(path)
    scan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    open_dataset(path)
    open_s = time.perf_counter() - t0
    picks = np.random.default_rng(1).integers(0, info.num_samples, args.reads).tolist()
    records, decode = open_records(info), info.decode_info()

    def tenplex_reads() -> int:
        for i in picks:
            decode_sample(read_verified(records, info, i), decode)
        return len(picks)
    out: dict[str, Any] = {"source": source, "samples": info.num_samples, "sample_bytes": args.sample_bytes,
                           "scan_s": round(scan_s, 3), "open_s": round(open_s, 4),
                           "tenplex_random_samples_per_s": _rate(tenplex_reads, args.repeat)}
    if source == "webdataset":
        import webdataset as wds
        urls = [str(p) for p in sorted(path.glob("*.tar"))]
        out["library"] = f"webdataset {getattr(wds, '__version__', '')}: its iterator (no random access)".strip()
        out["library_sequential_samples_per_s"] = _rate(
            lambda: sum(1 for _ in wds.WebDataset(urls, shardshuffle=False)), args.repeat)
        out["ratio"] = out["tenplex_random_samples_per_s"] / out["library_sequential_samples_per_s"]
    else:
        out["library"], read = _library_reader(source, path, args)
        out["library_random_samples_per_s"] = _rate(lambda: sum(1 for i in picks if read(i) is not None),
                                                    args.repeat)
        out["ratio"] = out["tenplex_random_samples_per_s"] / out["library_random_samples_per_s"]
    records.close()
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="tenplex-bench-data-") as tmp:
        previous = os.environ.get("TENPLEX_CACHE_DIR")
        os.environ["TENPLEX_CACHE_DIR"] = str(Path(tmp) / "cache")  # scan_s is a first open
        try:
            return [_measure(source, Path(tmp), args) for source in args.sources]
        finally:
            if previous is None:
                os.environ.pop("TENPLEX_CACHE_DIR", None)
            else:
                os.environ["TENPLEX_CACHE_DIR"] = previous
