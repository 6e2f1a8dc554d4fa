"""WebDataset tar shards read in place: an index of member offsets, built once; a sample is a key's members.

May import: the standard library, numpy and ``tenplex.dataset`` (format, encodings, scanning).

Shards are the directory's ``*.tar`` files in name order. Members are grouped as ``webdataset`` groups
them: the key is the member name up to the first ``.`` of its last path component, the rest (lower
case) is the field; consecutive members with one key form a sample. Directories, links and
``__meta__``-style members are skipped, as webdataset skips them. A sample's bytes are the tar bytes
from its first member's header to its last member's padded end: a tar stream of its own (without the
end-of-archive blocks), which ``encodings.decode_tar`` (and ``tarfile``, and any tar tool) reads. Decoded, a
sample is ``{"__key__": key, FIELD: bytes, ...}``: webdataset's raw sample without ``__url__``.
"""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from .encodings import split_name, wanted
from .format import DatasetError
from .scanning import range_crcs

ENCODER_VERSION = "1"
BLOCK = 512


def layout(spec: dict[str, Any]) -> tuple[Path, list[str], dict[str, Any]]:
    root = Path(spec["path"])
    shards = sorted(p.name for p in root.glob("*.tar"))
    if not shards:
        raise DatasetError(f"{root}: no *.tar shards")
    return root, shards, {}


def _shard_samples(path: Path, file_no: int) -> list[tuple[int, int, int]]:
    """(file, start, length) of each sample of one shard; a key split by another key is refused."""
    rows: list[tuple[int, int, int]] = []
    seen: set[str] = set()
    key, start, end = None, 0, 0
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if not wanted(member):
                    continue
                name_key = split_name(member.name)[0]
                if name_key != key:
                    if key is not None:
                        rows.append((file_no, start, end - start))
                    if name_key in seen:
                        raise DatasetError(f"{path}: members of key {name_key!r} are not adjacent (at byte "
                                           f"{member.offset}); webdataset would read them as two samples")
                    seen.add(name_key)  # type: ignore[arg-type]
                    key, start = name_key, member.offset
                end = member.offset_data + -(-member.size // BLOCK) * BLOCK
    except tarfile.TarError as e:
        raise DatasetError(f"{path}: not a readable tar shard ({e})") from None
    if key is not None:
        rows.append((file_no, start, end - start))
    return rows


def scan(root: Path, files: list[str], options: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray, None]:
    parts = []
    for file_no, name in enumerate(files):
        rows = np.array(_shard_samples(root / name, file_no), dtype=np.int64).reshape(-1, 3)
        crcs = range_crcs(root / name, rows[:, 1], rows[:, 2])
        parts.append(np.concatenate([rows, crcs[:, None]], axis=1))
    return {"kind": "tar"}, np.concatenate(parts).astype(np.int64).reshape(-1, 4), None

