"""Build a dataset in the record format from common inputs.

May import: numpy, tqdm, the standard library, ``tenplex.dataset`` (format, inplace, source) and
``tenplex.files`` (atomic JSON writes).

Inputs: a directory of ``.npy``/``.npz`` files (one sample per file, stored
verbatim so ``np.load`` decodes it), a JSONL file (one sample per non-empty
line), or a tokenised ``.bin`` of fixed-length sequences (``seq_len`` tokens of
``dtype`` per sample), or any source read in place (:func:`pack_source`: Hugging Face, Parquet,
WebDataset, Megatron; its samples keep their encoding, see ``inplace``). ``dataset.json`` is
written last, so a pack that was interrupted is never mistaken for a dataset.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

import numpy as np
from tqdm import tqdm

from ..files import write_json_atomic
from .format import FORMAT, INDEX_NAME, METADATA_NAME, DatasetError, DatasetInfo, index_bytes, open_packed

DEFAULT_FILE_BYTES = 256 << 20


class _RecordWriter:
    """Appends records to numbered record files, starting a new file past ``file_bytes``."""

    def __init__(self, out: Path, file_bytes: int):
        self.out, self.file_bytes = out, file_bytes
        self.rows: list[tuple[int, int, int, int]] = []
        self.files: list[dict[str, Any]] = []
        self._f: BinaryIO | None = None

    def _roll(self) -> BinaryIO:
        self.close()
        name = f"records-{len(self.files):05d}.bin"
        self.files.append({"name": name, "bytes": 0})
        self._f = open(self.out / name, "wb")
        return self._f

    def add(self, record: bytes) -> None:
        f = self._f
        if f is None or (self.files[-1]["bytes"] and self.files[-1]["bytes"] + len(record) > self.file_bytes):
            f = self._roll()
        entry = self.files[-1]
        self.rows.append((len(self.files) - 1, entry["bytes"], len(record), zlib.crc32(record)))
        f.write(record)
        entry["bytes"] += len(record)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def write_dataset(records: Iterable[bytes], out: str | os.PathLike, kind: str, *,
                  extra: dict[str, Any] | None = None, file_bytes: int = DEFAULT_FILE_BYTES) -> DatasetInfo:
    """Write ``records`` as a dataset into the new or empty directory ``out`` and return it, validated."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise DatasetError(f"{out}: output directory is not empty; choose a new directory")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    writer = _RecordWriter(out, file_bytes)
    try:
        try:
            for record in records:
                writer.add(record)
        finally:
            writer.close()
        if not writer.rows:
            raise DatasetError(f"{out}: the input holds no samples")
        raw_index = index_bytes(np.array(writer.rows, dtype=np.int64).reshape(-1, 4))
        (out / INDEX_NAME).write_bytes(raw_index)
        meta = {"format": FORMAT, "num_samples": len(writer.rows), "kind": kind, **(extra or {}),
                "files": writer.files,
                "index": {"name": INDEX_NAME, "bytes": len(raw_index),
                          "sha256": hashlib.sha256(raw_index).hexdigest()}}
        write_json_atomic(out / METADATA_NAME, meta)
        return open_packed(out)
    except BaseException:
        _remove_partial(out, created, [f["name"] for f in writer.files] + [INDEX_NAME, METADATA_NAME])
        raise


def _remove_partial(out: Path, created: bool, names: list[str]) -> None:
    """Undo a failed pack so a retry into ``out`` works: only what this pack wrote is removed."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()


def _progress(items, total: int | None, desc: str, quiet: bool, unit: str = "sample"):
    return tqdm(items, total=total, desc=desc, unit=unit, disable=quiet, leave=False)


def npy_dir_records(src: Path, quiet: bool = True) -> tuple[str, Iterator[bytes]]:
    """One record per ``.npy`` or ``.npz`` file (sorted by name); all files must be of one kind."""
    paths = sorted(p for p in src.iterdir() if p.suffix in (".npy", ".npz") and p.is_file())
    if not paths:
        raise DatasetError(f"{src}: no .npy or .npz files")
    suffixes = {p.suffix for p in paths}
    if len(suffixes) > 1:
        raise DatasetError(f"{src}: mixes .npy and .npz files; pack them into separate datasets")

    def gen():
        for p in _progress(paths, len(paths), f"pack {src.name}", quiet):
            data = p.read_bytes()
            _check_loads(p, data)
            yield data
    return suffixes.pop()[1:], gen()


def _check_loads(path: Path, data: bytes) -> None:
    """Refuse an input numpy cannot read back, so the dataset never holds a sample nobody can decode."""
    try:
        loaded = np.load(io.BytesIO(data), allow_pickle=False)
        if hasattr(loaded, "close"):  # an NpzFile: touch every member, then release it
            [loaded[k] for k in loaded.files]
            loaded.close()
    except Exception as e:
        raise DatasetError(f"{path}: not a readable {path.suffix} file ({e})") from None


def jsonl_records(src: Path, quiet: bool = True) -> Iterator[bytes]:
    """One record per non-empty line, validated as JSON and stored as its UTF-8 bytes."""
    total = src.stat().st_size
    with open(src, "rb") as f, tqdm(total=total, desc=f"pack {src.name}", unit="B", unit_scale=True,
                                    disable=quiet, leave=False) as bar:
        for lineno, line in enumerate(f, 1):
            bar.update(len(line))
            line = line.rstrip(b"\r\n")
            if not line.strip():
                continue
            try:
                json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DatasetError(f"{src}: line {lineno} is not valid JSON ({e})") from None
            yield line


def token_bin_records(src: Path, seq_len: int, dtype: str, quiet: bool = True) -> Iterator[bytes]:
    """Fixed-length sequences of ``seq_len`` tokens of ``dtype``; a trailing partial sequence is refused."""
    item = np.dtype(dtype).itemsize
    record = seq_len * item
    size = src.stat().st_size
    if seq_len <= 0 or size % record:
        raise DatasetError(f"{src}: {size} bytes is not a whole number of sequences of {seq_len} × {dtype} "
                           f"({record} bytes); check --seq-len and --dtype")
    chunk = max(1, (16 << 20) // record)  # read ~16 MiB at a time
    with open(src, "rb") as f, tqdm(total=size, desc=f"pack {src.name}", unit="B", unit_scale=True,
                                    disable=quiet, leave=False) as bar:
        while block := f.read(chunk * record):
            bar.update(len(block))
            view = memoryview(block)
            for start in range(0, len(block), record):
                yield bytes(view[start:start + record])


def pack(src: str | os.PathLike, out: str | os.PathLike, *, seq_len: int | None = None,
         dtype: str | None = None, file_bytes: int = DEFAULT_FILE_BYTES, quiet: bool = True) -> DatasetInfo:
    """Pack ``src`` (directory of arrays, ``.jsonl``, or token ``.bin`` with ``seq_len``/``dtype``)."""
    src = Path(src)
    if src.is_dir():
        kind, records = npy_dir_records(src, quiet)
        return write_dataset(records, out, kind, file_bytes=file_bytes)
    if not src.is_file():
        raise DatasetError(f"{src}: no such file or directory")
    if src.suffix == ".jsonl":
        return write_dataset(jsonl_records(src, quiet), out, "json", file_bytes=file_bytes)
    if src.suffix == ".bin":
        if seq_len is None or dtype is None:
            raise DatasetError(f"{src}: a token .bin needs --seq-len and --dtype")
        np.dtype(dtype)  # fail early on a bad dtype name
        return write_dataset(token_bin_records(src, seq_len, dtype, quiet), out, "tensor",
                             extra={"dtype": np.dtype(dtype).str, "shape": [seq_len]}, file_bytes=file_bytes)
    raise DatasetError(f"{src}: unsupported input; give a directory of .npy/.npz, a .jsonl or a token .bin")


def pack_source(src: str | os.PathLike, out: str | os.PathLike, source: str, *, seq_len: int | None = None,
                file_bytes: int = DEFAULT_FILE_BYTES, quiet: bool = True) -> DatasetInfo:
    """Copy an in-place source (``hf``, ``parquet``, ``webdataset``, ``megatron``) into the record format.

    Each sample's record is its bytes in the source's encoding (``inplace``), so it decodes to the same
    value; ``seq_len`` makes Megatron training sequences instead of documents.
    """
    from .inplace import open_records, open_source
    from .source import read_verified

    info = open_source(src, source, seq_len=seq_len)
    records = open_records(info)

    def gen() -> Iterator[bytes]:
        try:
            for i in _progress(range(info.num_samples), info.num_samples, f"pack {info.root.name}", quiet):
                yield read_verified(records, info, i)
        finally:
            records.close()
    extra = {k: v for k, v in info.decode_info().items() if k != "kind"}
    return write_dataset(gen(), out, info.kind, extra=extra, file_bytes=file_bytes)
