"""The on-disk record format of a tenplex dataset, and its validated reader.

May import: numpy, the standard library, ``tenplex.errors``, ``tenplex.files`` (reading JSON) and
``tenplex.dataset.encodings`` (decoding the samples of in-place sources).

A dataset is a directory::

    dataset.json        metadata (format, sample kind, record files, index digest)
    index.npy           int64 array of shape (num_samples, 4): file, offset, length, crc32
    records-00000.bin   concatenated sample records, no headers, no padding
    records-00001.bin   ...

Sample ``i`` is ``records-{index[i,0]:05d}.bin``-style file ``files[index[i,0]]``,
bytes ``[index[i,1], index[i,1] + index[i,2])``; ``zlib.crc32`` of those bytes
is ``index[i,3]``. Random access is O(1): one index row, one ``pread``. Only
numpy is needed to read it (``np.load`` of the index, then plain file reads).

Validation happens at open, in O(files) plus one hash of the index: the index
must match the digest and size in ``dataset.json`` (a truncated or edited index
is refused), and every record file must have exactly the recorded size (a
truncated record file is refused naming the file and the offset where it ends).
Each sample read is verified against its crc32, so a corrupted byte is reported
with the file and offset instead of being returned as a sample.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import TenplexError
from ..files import read_json
from . import encodings

FORMAT = "tenplex.dataset/1"
METADATA_NAME = "dataset.json"
INDEX_NAME = "index.npy"
# Columns of the index array.
FILE, OFFSET, LENGTH, CRC = 0, 1, 2, 3
KINDS = ("npy", "npz", "json", "tensor", "bytes", "arrow", "tar")  # arrow, tar: in-place sources (inplace.py)
# A record file name is a plain name inside the dataset directory: no separators, no "..".
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


class DatasetError(TenplexError, ValueError):
    """A dataset that is missing, malformed, truncated or corrupt (names the file and offset)."""


def safe_name(name: str, what: str = "file name") -> str:
    """Return ``name`` if it is a plain file name; raise DatasetError for paths or traversal."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", ".."):
        raise DatasetError(f"{what} {name!r} is not a plain file name inside the dataset directory "
                           "(no '/', no '..', no leading '.')")
    return name


def index_bytes(index: np.ndarray) -> bytes:
    """Serialise an index array exactly as ``index.npy`` stores it (the digest is over these bytes)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(index, dtype="<i8"), allow_pickle=False)
    return buf.getvalue()


def dataset_identity(metadata: dict[str, Any]) -> str:
    """Content identity of a dataset: sha256 of its canonical metadata, which includes the index digest
    and every record file's size, so any change to the samples' layout changes the identity."""
    canonical = json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


@dataclass(frozen=True)
class RecordFile:
    name: str
    bytes: int


@dataclass(frozen=True)
class DatasetInfo:
    """What a reader needs to know about a dataset, without holding any file open."""
    root: Path
    metadata: dict[str, Any]
    index: np.ndarray          # (num_samples, 4) int64: file, offset, length, crc32
    files: tuple[RecordFile, ...]
    identity: str

    @property
    def num_samples(self) -> int:
        return int(self.index.shape[0])

    @property
    def kind(self) -> str:
        return self.metadata["kind"]

    def record_path(self, file_no: int) -> Path:
        return self.root / self.files[file_no].name

    @property
    def source(self) -> str:
        """"records" for a packed dataset, else the in-place source: hf, parquet, webdataset or megatron."""
        return self.metadata.get("source", "records")

    def decode_info(self) -> dict[str, Any]:
        """The metadata a decoder needs (kind, and dtype/shape for tensors)."""
        return {k: self.metadata[k] for k in ("kind", "dtype", "shape") if k in self.metadata}

    def metadata_paths(self) -> list[Path]:
        """Files whose rewrite changes what the dataset is (a mount watches them besides the record files)."""
        if self.source == "records":
            return [self.root / METADATA_NAME, self.root / self.metadata["index"]["name"]]
        return [self.root / f["name"] for f in self.metadata["files"]]


def _local_bytes(path: Path) -> bytes:
    return path.read_bytes()


def _local_size(path: Path) -> int:
    return path.stat().st_size


def _load_metadata(root: Path, read_bytes: Callable[[Path], bytes]) -> dict[str, Any]:
    path = root / METADATA_NAME
    meta = read_json(path, DatasetError, read_bytes=read_bytes,
                     missing=f"not a tenplex dataset (no {METADATA_NAME}); build one with `tenplex data pack`")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DatasetError(f"{path}: format is {meta.get('format') if isinstance(meta, dict) else None!r}, "
                           f"expected {FORMAT!r}")
    for key, typ in (("num_samples", int), ("kind", str), ("files", list), ("index", dict)):
        if not isinstance(meta.get(key), typ):
            raise DatasetError(f"{path}: field {key!r} is missing or not a {typ.__name__}")
    if meta["kind"] not in KINDS:
        raise DatasetError(f"{path}: kind {meta['kind']!r} is not one of {KINDS}")
    return meta


def _load_index(root: Path, meta: dict[str, Any], read_bytes: Callable[[Path], bytes]) -> np.ndarray:
    entry = meta["index"]
    name = safe_name(entry.get("name", ""), "index file name")
    path = root / name
    try:
        raw = read_bytes(path)
    except FileNotFoundError:
        raise DatasetError(f"{path}: index file is missing") from None
    if len(raw) != entry.get("bytes"):
        raise DatasetError(f"{path}: {len(raw)} bytes, but {METADATA_NAME} records {entry.get('bytes')} "
                           f"(truncated or replaced at offset {min(len(raw), entry.get('bytes') or 0)}); "
                           "re-pack the dataset")
    if hashlib.sha256(raw).hexdigest() != entry.get("sha256"):
        raise DatasetError(f"{path}: sha256 differs from {METADATA_NAME}; the index is corrupt or was "
                           "changed after packing; re-pack the dataset")
    index = np.load(io.BytesIO(raw), allow_pickle=False)
    n = meta["num_samples"]
    if index.dtype != np.int64 or index.shape != (n, 4):
        raise DatasetError(f"{path}: index has dtype {index.dtype} shape {index.shape}, "
                           f"expected int64 ({n}, 4)")
    return index


def open_packed(root: str | os.PathLike, read_bytes: Callable[[Path], bytes] = _local_bytes,
                file_size: Callable[[Path], int] = _local_size) -> DatasetInfo:
    """Load and validate a packed dataset directory (metadata, index digest, record file sizes and bounds).

    ``tenplex.dataset.open_dataset`` opens this and the sources read in place (``inplace``).

    ``read_bytes`` and ``file_size`` fetch a whole file and stat one; they default to the local
    filesystem and are replaced for a dataset that lives on a remote store (FileNotFoundError: missing).
    """
    # Absolute: a FUSE server (libfuse3) changes its working directory to "/" once mounted.
    root = Path(root).absolute() if read_bytes is _local_bytes else Path(root)
    meta = _load_metadata(root, read_bytes)
    files = []
    for number, entry in enumerate(meta["files"]):
        name = safe_name(entry.get("name", "") if isinstance(entry, dict) else "", "record file name")
        size = entry.get("bytes")
        if type(size) is not int or size < 0:
            raise DatasetError(f"{root / METADATA_NAME}: files[{number}] ({name}) has \"bytes\": {size!r}, expected "
                               f"a size in bytes (a whole number >= 0); the file was edited by hand: re-pack the "
                               f"dataset")
        files.append(RecordFile(name, size))
    index = _load_index(root, meta, read_bytes)
    for f in files:
        path = root / f.name
        try:
            size = file_size(path)
        except FileNotFoundError:
            raise DatasetError(f"{path}: record file is missing") from None
        if size != f.bytes:
            raise DatasetError(f"{path}: {size} bytes, expected {f.bytes} (truncated or grown at offset "
                               f"{min(size, f.bytes)}); re-pack the dataset")
    if len(index):
        # Every row must lie inside its record file: checked once here, so reads never run past an end.
        file_no = index[:, FILE]
        if file_no.min() < 0 or file_no.max() >= len(files):
            raise DatasetError(f"{root / INDEX_NAME}: file numbers outside 0..{len(files) - 1}")
        sizes = np.array([f.bytes for f in files], dtype=np.int64)
        bad = np.nonzero((index[:, OFFSET] < 0) | (index[:, LENGTH] < 0)
                         | (index[:, OFFSET] + index[:, LENGTH] > sizes[file_no]))[0]
        if len(bad):
            i = int(bad[0])
            raise DatasetError(f"{root / files[int(file_no[i])].name}: sample {i} at offset {index[i, OFFSET]} "
                               f"length {index[i, LENGTH]} runs past the end of the file")
    return DatasetInfo(root, meta, index, tuple(files), dataset_identity(meta))


def check_record(data: bytes | memoryview, row: np.ndarray, file_name: str, sample: int) -> None:
    """Raise DatasetError unless ``data`` is sample ``sample`` described by index ``row``."""
    offset, length, crc = int(row[OFFSET]), int(row[LENGTH]), int(row[CRC])
    if len(data) != length:
        raise DatasetError(f"{file_name}: sample {sample} at offset {offset}: read {len(data)} of "
                           f"{length} bytes (file truncated?)")
    if zlib.crc32(data) != crc:
        raise DatasetError(f"{file_name}: sample {sample} at offset {offset} length {length}: "
                           "checksum mismatch (corrupt record file)")


def decode_sample(data: bytes, info: dict[str, Any]) -> Any:
    """Turn one record into a Python/numpy value according to the dataset's kind."""
    kind = info["kind"]
    if kind == "npy":
        return np.load(io.BytesIO(data), allow_pickle=False)
    if kind == "npz":
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    if kind == "json":
        return json.loads(data)
    if kind == "tensor":
        return np.frombuffer(data, dtype=np.dtype(info["dtype"])).reshape(info["shape"])
    if kind == "arrow":
        return encodings.decode_arrow(data)
    if kind == "tar":
        return encodings.decode_tar(data)
    return bytes(data)
