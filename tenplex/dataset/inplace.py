"""Datasets read where they lie: Hugging Face ``save_to_disk``, Parquet, WebDataset tar shards, Megatron indexed data.

May import: numpy, the standard library, ``tenplex.files`` and ``tenplex.dataset`` (format, scanning,
source, megatron, tarshards, arrowsrc; pyarrow only through ``arrowsrc``, when an Arrow or Parquet
source is opened).

An in-place source becomes the same :class:`~tenplex.dataset.format.DatasetInfo` as a packed dataset:
an index of ``(file, offset, length, crc32)`` per sample over the source's own files, and an identity.
Everything above (the dataset state, ``Job.batch()``, the in-process reader, the FUSE view) works on
that, unchanged. What a sample's bytes are depends on the source (the *encoding*, also what a rank's
``data`` file in the FUSE view holds):

==============  =============================================================  ======================
source          a sample's bytes                                               decoded (``kind``)
==============  =============================================================  ======================
``megatron``    the tokens of one document, or of one training sequence        ``tensor``: 1-D array
``webdataset``  the tar members of one key, as a tar stream (headers kept)     ``tar``: dict by ext
``hf``          one row as an Arrow IPC stream (schema + a 1-row batch)        ``arrow``: dict of cols
``parquet``     one row as an Arrow IPC stream (schema + a 1-row batch)        ``arrow``: dict of cols
==============  =============================================================  ======================

Megatron documents and sequences and tar samples are byte ranges of the source's files: the FUSE view
serves them without a copy through Python. Arrow and Parquet rows are encoded on demand
(``arrowsrc``): their index offsets are positions in a *virtual* record file per Arrow/Parquet file,
the encoded rows laid end to end.

**Identity.** Every file of the source is digested (sha256 of its whole content) together with the
source kind and its options; a saved position names that identity, so a job never resumes on data that
changed. **Scan once.** Digests and the per-sample index need one pass over the data; the result is
cached under ``$TENPLEX_CACHE_DIR`` (default ``~/.cache/tenplex/sources``), keyed by the files' paths,
sizes, modification times and inodes, so later opens (each rank, the FUSE server) cost a few stats.

**Options.** A directory is recognised by its contents. Options (Megatron's sequence length, a prefix
among several) go into a *source file*: JSON ``{"format": "tenplex.source/1", "source": "megatron",
"path": "DIR/PREFIX", "seq_len": 2048}`` (a relative path is relative to the file); ``open_dataset``
and everything that takes a dataset directory take this file too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..files import read_json, write_json_atomic
from .format import METADATA_NAME, DatasetError, DatasetInfo, RecordFile, dataset_identity, index_bytes, open_packed
from .scanning import cache_dir, file_sha256
from .source import LocalRecords, RecordSource

SOURCE_FORMAT = "tenplex.source/1"
SOURCES = ("hf", "parquet", "webdataset", "megatron")
_CACHE_FORMAT = "tenplex.source-scan/1"


def open_dataset(root: str | os.PathLike, **remote: Any) -> DatasetInfo:
    """Open a dataset: a packed one (``dataset.json``; ``remote``: ``format.open_packed``'s readers for one on
    a store), or a source read in place (a Hugging Face, Parquet, WebDataset or Megatron directory, or a
    source file)."""
    if remote or (Path(root) / METADATA_NAME).exists():
        return open_packed(root, **remote)
    return open_source(root)


def open_records(info: DatasetInfo) -> RecordSource:
    """The local RecordSource of ``info``: record files (packed, Megatron, tar shards) or encoded Arrow rows."""
    if info.source in ("hf", "parquet"):
        from .arrowsrc import ArrowRecords
        return ArrowRecords(info)
    return LocalRecords(info)


def detect(path: Path) -> dict[str, Any]:
    """The source spec of ``path``: a source file's contents, or what a directory's files say it is."""
    if path.is_file() and path.suffix == ".json":
        spec = read_json(path, DatasetError)
        if not isinstance(spec, dict) or spec.get("format") != SOURCE_FORMAT:
            raise DatasetError(f"{path}: not a source file (format {SOURCE_FORMAT!r}) nor a tenplex dataset")
        if spec.get("source") not in SOURCES:
            raise DatasetError(f"{path}: \"source\" is {spec.get('source')!r}, expected one of {SOURCES}")
        target = Path(str(spec.get("path", ".")))
        return {**spec, "path": str((path.parent / target).absolute())}
    if not path.is_dir():
        raise DatasetError(f"{path}: no such dataset directory or source file")
    names = {p.name for p in path.iterdir()}
    if "dataset_dict.json" in names:
        raise DatasetError(f"{path}: a Hugging Face DatasetDict; give one split's directory (e.g. {path}/train)")
    if "state.json" in names and "dataset_info.json" in names:
        return {"source": "hf", "path": str(path.absolute())}
    for source, suffix in (("parquet", ".parquet"), ("webdataset", ".tar"), ("megatron", ".idx")):
        if any(n.endswith(suffix) for n in names):
            return {"source": source, "path": str(path.absolute())}
    raise DatasetError(f"{path}: not a tenplex dataset (no dataset.json; build one with `tenplex data pack`) nor a "
                       "source read in place: no state.json + dataset_info.json (Hugging Face save_to_disk), "
                       "*.parquet, *.tar (WebDataset) or *.idx + *.bin (Megatron)")


def _stat_key(paths: list[Path]) -> list[list[Any]]:
    out = []
    for p in paths:
        try:
            st = p.stat()
        except FileNotFoundError:
            raise DatasetError(f"{p}: file of the dataset is missing") from None
        out.append([str(p), st.st_size, st.st_mtime_ns, st.st_ino])
    return out


def _backend(source: str):
    if source == "megatron":
        from . import megatron
        return megatron
    if source == "webdataset":
        from . import tarshards
        return tarshards
    from . import arrowsrc
    return arrowsrc


def open_source(path: str | os.PathLike, source: str | None = None, **options: Any) -> DatasetInfo:
    """Open an in-place source (a directory, or a source file with options) as a validated DatasetInfo.

    ``source``: the kind the caller expects (refused if the directory is another); ``options``: as in a
    source file (``seq_len``, ``extra_token``), overriding it.
    """
    spec = detect(Path(path))
    if source is not None and spec["source"] != source:
        raise DatasetError(f"{path}: is a {spec['source']} source, not {source}")
    spec.update({k: v for k, v in options.items() if v is not None})
    backend = _backend(spec["source"])
    root, files, options = backend.layout(spec)  # the data directory, its files (relative names), options
    paths = [root / name for name in files]
    key_doc = {"source": spec["source"], "options": options, "stat": _stat_key(paths),
               "encoder": backend.ENCODER_VERSION}
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()[:32]
    cached = _load_cached(key, len(files))
    if cached is None:
        meta, index, virtual = backend.scan(root, files, options)
        meta = {"format": SOURCE_FORMAT, "source": spec["source"], **options, **meta,
                "files": [{"name": n, "bytes": p.stat().st_size, "sha256": file_sha256(p)}
                          for n, p in zip(files, paths)],
                "num_samples": int(len(index))}
        _store_cached(key, meta, index, virtual)
    else:
        meta, index, virtual = cached
    if not len(index):
        raise DatasetError(f"{root}: the {spec['source']} source holds no samples")
    sizes = virtual if virtual is not None else [f["bytes"] for f in meta["files"]]
    record_files = tuple(RecordFile(f["name"], int(size)) for f, size in zip(meta["files"], sizes))
    identity = dataset_identity(meta)
    return DatasetInfo(root, meta, index, record_files, identity)


def _load_cached(key: str, n_files: int) -> tuple[dict, np.ndarray, list[int] | None] | None:
    base = cache_dir() / key
    try:
        doc = json.loads((base.with_suffix(".json")).read_bytes())
        raw = (base.with_suffix(".npy")).read_bytes()
    except (OSError, ValueError):
        return None
    if doc.get("format") != _CACHE_FORMAT or hashlib.sha256(raw).hexdigest() != doc.get("index_sha256"):
        return None  # written by another version or damaged: scan again
    import io
    index = np.load(io.BytesIO(raw), allow_pickle=False)
    meta = doc["metadata"]
    if index.ndim != 2 or index.shape[1] != 4 or len(meta.get("files", ())) != n_files:
        return None
    return meta, index, doc.get("virtual_bytes")


def _store_cached(key: str, meta: dict, index: np.ndarray, virtual: list[int] | None) -> None:
    base = cache_dir() / key
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        raw = index_bytes(index)
        tmp = base.with_suffix(f".npy.{os.getpid()}")
        tmp.write_bytes(raw)
        os.replace(tmp, base.with_suffix(".npy"))
        # The JSON names the index's digest and is written last: a half-written pair is never used.
        write_json_atomic(base.with_suffix(".json"), {"format": _CACHE_FORMAT, "metadata": meta,
                                                      "index_sha256": hashlib.sha256(raw).hexdigest(),
                                                      "virtual_bytes": virtual})
    except OSError:
        pass  # a read-only home: every open scans
