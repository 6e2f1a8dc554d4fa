"""Hugging Face ``save_to_disk`` directories and Parquet directories, read in place with pyarrow.

May import: pyarrow, numpy, the standard library, ``tenplex.files`` and ``tenplex.dataset`` (format, source,
encodings).

A sample is one row. Its bytes (what a rank's ``data`` in the FUSE view holds) are an Arrow IPC
*stream*: the schema (without its metadata) and one record batch of one row; ``encodings.decode_arrow`` (or
``pyarrow.ipc.open_stream(b).read_all().to_pylist()[0]``) gives the row as a dict of columns, as
``datasets``' ``ds[i]`` gives it for plain features (numbers, strings, lists; no Image/Audio decoding).

Rows are encoded on demand. Each Arrow/Parquet file is a *virtual record file*: its rows' encodings
laid end to end. The index (built once by :func:`scan`, cached by ``inplace``) holds each row's
virtual offset, length and crc32, so the view and the readers treat it like any record file; only
:class:`ArrowRecords` knows that a read encodes rows.

Cost of random access:

- ``hf``: the Arrow files (IPC stream format, as ``save_to_disk`` writes them) are memory-mapped once
  per process; a row is a zero-copy slice plus its encoding (tens of microseconds). The OS pages in
  what a row touches.
- ``parquet``: Parquet has no row-level random access. A row's whole row group is read and decoded
  (all columns), then kept in a small cache (:data:`ROW_GROUPS_CACHED` per file and process). A
  shuffled epoch over many row groups decodes about one row group per sample: keep row groups small
  (``row_group_size`` of a few thousand rows) or convert once with ``tenplex data pack --from parquet``.
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from .encodings import encode_row, pyarrow
from .format import FILE, OFFSET, DatasetError, DatasetInfo
from .source import LocalRecords

ROW_GROUPS_CACHED = 4


def _encoder_version() -> str:
    try:
        import pyarrow
        return f"1/pyarrow-{pyarrow.__version__}"
    except ImportError:
        return "1"


ENCODER_VERSION = _encoder_version()


def layout(spec: dict[str, Any]) -> tuple[Path, list[str], dict[str, Any]]:
    """The directory, the data files (first) and metadata files, and the options of an hf/parquet spec."""
    root = Path(spec["path"])
    if spec["source"] == "parquet":
        # every *.parquet below root, in path order; hive partition values in folder names are not columns here
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*.parquet"))
        if not files:
            raise DatasetError(f"{root}: no *.parquet files")
        return root, files, {}
    from ..files import read_json
    state = read_json(root / "state.json", DatasetError)
    data = [entry.get("filename") for entry in state.get("_data_files", [])] if isinstance(state, dict) else []
    if not data or not all(isinstance(n, str) and "/" not in n and n.endswith(".arrow") for n in data):
        raise DatasetError(f"{root}/state.json: no '_data_files' of .arrow files (not a save_to_disk directory?)")
    if state.get("_indices_data_files"):
        raise DatasetError(f"{root}: the dataset has an indices mapping; save it with flatten_indices() first")
    return root, [*data, "state.json", "dataset_info.json"], {}


class _File:
    """One Arrow or Parquet file of a source: its rows as tables, loaded lazily, row groups cached."""

    def __init__(self, path: Path, parquet: bool):
        pa = pyarrow()
        self.path, self.parquet = path, parquet
        try:
            if parquet:
                self.pf = pa.parquet.ParquetFile(str(path), memory_map=True)
                sizes = [self.pf.metadata.row_group(g).num_rows for g in range(self.pf.num_row_groups)]
                self.num_rows = int(self.pf.metadata.num_rows)
            else:
                self.table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
                sizes, self.num_rows = [self.table.num_rows], self.table.num_rows
        except (pa.ArrowInvalid, OSError) as e:
            raise DatasetError(f"{path}: not a readable {'Parquet' if parquet else 'Arrow'} file ({e})") from None
        self.group_starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        self._groups: OrderedDict[int, Any] = OrderedDict()

    def group(self, g: int) -> Any:
        if not self.parquet:
            return self.table
        table = self._groups.pop(g, None)
        if table is None:
            table = self.pf.read_row_group(g)
            while len(self._groups) >= ROW_GROUPS_CACHED:
                self._groups.popitem(last=False)
        self._groups[g] = table  # most recently used last
        return table

    def encode(self, row: int) -> bytes:
        g = int(np.searchsorted(self.group_starts, row, side="right")) - 1
        return encode_row(self.group(g), row - int(self.group_starts[g]))


def scan(root: Path, files: list[str], options: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray, list[int]]:
    parquet = files[0].endswith(".parquet")
    rows: list[tuple[int, int, int, int]] = []
    virtual = []
    for file_no, name in enumerate(files):
        if not name.endswith((".parquet", ".arrow")):
            virtual.append(0)  # a metadata file: digested, never read as records
            continue
        f, offset = _File(root / name, parquet), 0
        for row in range(f.num_rows):
            data = f.encode(row)
            rows.append((file_no, offset, len(data), zlib.crc32(data)))
            offset += len(data)
        virtual.append(offset)
    meta = {"kind": "arrow"}
    if not parquet:
        info = json.loads((root / "dataset_info.json").read_bytes() or b"{}")
        meta["features"] = info.get("features")
    return meta, np.array(rows, dtype=np.int64).reshape(-1, 4), virtual


class ArrowRecords(LocalRecords):
    """The RecordSource of an hf/parquet source: reads of virtual record files encode the rows they cover.

    Like :class:`LocalRecords` (whose change detection it keeps) it is picklable: tables and row-group
    caches are opened again in each process.
    """

    def __init__(self, info: DatasetInfo):
        super().__init__(info)
        self._parquet = info.metadata["source"] == "parquet"
        self._tables: dict[int, tuple[_File, np.ndarray]] = {}

    def _file(self, file_no: int) -> tuple[_File, np.ndarray]:
        with self._lock:
            if file_no not in self._tables:
                index = self.info.index
                starts = np.ascontiguousarray(index[index[:, FILE] == file_no][:, OFFSET])  # rows in file order
                self._tables[file_no] = (_File(self.info.record_path(file_no), self._parquet), starts)
            return self._tables[file_no]

    def fileno(self, file_no: int) -> None:  # type: ignore[override]
        return None  # nothing to splice from: the FUSE view gathers reads through read()

    def read(self, file_no: int, offset: int, length: int) -> bytes:
        f, starts = self._file(file_no)
        row = int(np.searchsorted(starts, offset, side="right")) - 1
        if row < 0 or length <= 0:
            return b""
        first = int(starts[row])
        pieces, at, end = [], first, offset + length
        with self._lock:  # the row-group cache is shared by the FUSE server's threads
            while at < end and row < f.num_rows:
                data = f.encode(row)
                pieces.append(data)
                at, row = at + len(data), row + 1
        return b"".join(pieces)[offset - first:offset - first + length]

    def close(self) -> None:
        with self._lock:
            self._tables.clear()

    def __setstate__(self, state):
        super().__setstate__(state)
        self._parquet = self.info.metadata["source"] == "parquet"
        self._tables = {}
